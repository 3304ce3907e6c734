"""Where a method comes from: a :class:`Paper` (or, for an engine format, the engine's documented
source), or a :class:`Baseline`, a reference point that no paper proposes as a method."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ARXIV_ID = re.compile(r"\d{4}\.\d{4,5}")


@dataclass(frozen=True)
class Paper:
    """A method's publication.

    authors: as cited ("Li et al.", "Zweiger, Fu, Guo, Kim"); year: None when the source is not dated
    (an engine's documentation); arxiv: the identifier ("2404.14469"), None when the work is not on
    arXiv, and then ``url`` says where it is; note: what the lab's reading adds ("details from
    secondary summaries").
    """

    authors: str
    year: int | None
    title: str
    arxiv: str | None = None
    url: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.arxiv is not None and not _ARXIV_ID.fullmatch(self.arxiv):
            raise ValueError(f"{self.title}: an arXiv id reads like 2404.14469, got {self.arxiv!r}")
        if self.arxiv is None and not self.url:
            raise ValueError(f"{self.title}: a paper without an arXiv id needs a url")

    @property
    def link(self) -> str:
        """Where to read it: the arXiv abstract page, else ``url``."""
        return f"https://arxiv.org/abs/{self.arxiv}" if self.arxiv else str(self.url)

    def __str__(self) -> str:
        where = f"arXiv {self.arxiv}" if self.arxiv else str(self.url)
        dated = f"{self.authors}, {self.year}" if self.year is not None else self.authors
        return f"{dated}, {self.title} ({where}{'; ' + self.note if self.note else ''})"


@dataclass(frozen=True)
class Baseline:
    """A reference point the methods are measured against (no paper proposes it as a method)."""

    what: str

    def __str__(self) -> str:
        return f"a baseline: {self.what}"
