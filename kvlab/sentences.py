"""A document's tokens split into sentences: the units a learner picks in "Your pick" (the ``manual``
method's sentence spans, kvlab.lab.pick).

The split is made on the tokens, so that a sentence is a run of whole tokens and "keep s3" means
exactly those tokens of the cache. A sentence ends after a token that

- ends a line (its text ends with a line break: a newline or a blank line), or
- ends with ``.``, ``!`` or ``?`` (closing quotes or brackets may follow) and is followed by
  whitespace or by the end of the document; a period after one of :data:`ABBREVIATIONS`
  ("Mrs.", '"Dr.', "e.g.") ends none.

Tokens that are only whitespace join the sentence before them (a blank line belongs to the
paragraph it closes). A decimal point ("3.5") ends nothing: no whitespace follows it. This is a
rule on characters, not a parser: an abbreviation outside the list ends a sentence, and a
hard-wrapped paragraph is split at its line ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: Characters that end a sentence; quotes and brackets that may close it after them.
ENDS = ".!?"
CLOSERS = "\"')]}\u201d\u2019\u00bb"
#: Quotes and brackets that may open a word (stripped to find an abbreviation: '"Mrs.').
OPENERS = "\"'([{\u201c\u2018\u00ab"
#: Words whose period ends no sentence (compared in lower case, without the final period).
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "e.g", "i.e", "cf"})
#: Characters of the current word kept to recognise an abbreviation (the longest is 4).
_WORD_TAIL = 16


@dataclass(frozen=True)
class Sentence:
    """One sentence of a document: tokens ``start`` to ``end - 1`` (document-relative, 0-based) and their text."""

    index: int
    start: int
    end: int
    text: str

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    @property
    def label(self) -> str:
        """How a pick names it: ``s<index>``."""
        return f"s{self.index}"


def _last_word(text: str) -> str:
    """The characters after the last whitespace of ``text`` (all of it when it has none)."""
    for i in range(len(text) - 1, -1, -1):
        if text[i].isspace():
            return text[i + 1 :]
    return text


def ends_sentence(piece: str, following: str | None, word: str) -> bool:
    """Whether a sentence ends after a token whose text is ``piece``.

    following: the next token's text (None: the document ends here); word: the word the token's
    text completes, up to its last non-space character (to recognise an abbreviation).
    """
    stripped = piece.rstrip()
    if "\n" in piece[len(stripped) :]:
        return True  # a line break
    core = stripped.rstrip(CLOSERS)
    if not core or core[-1] not in ENDS:
        return False
    spaced = len(stripped) < len(piece) or following is None or following[:1].isspace()
    if not spaced:
        return False  # "3.5", "kvlab.lab": no space after the mark
    if core[-1] == ".":
        return word.rstrip(CLOSERS).rstrip(ENDS).lstrip(OPENERS).lower() not in ABBREVIATIONS
    return True


def sentence_bounds(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Each sentence's token range (start, end exclusive), in order, covering every token once.

    pieces: each token's text as it reads in the document (a leading space included). Pure: the
    rule of the module's docstring, nothing else.
    """
    bounds: list[tuple[int, int]] = []
    start, tail, i, n = 0, "", 0, len(pieces)
    while i < n:
        piece = pieces[i]
        word = _last_word(tail + piece.rstrip())
        tail = _last_word(tail + piece)[-_WORD_TAIL:]
        if ends_sentence(piece, pieces[i + 1] if i + 1 < n else None, word):
            end = i + 1
            while end < n and not pieces[end].strip():
                end += 1  # whitespace after the end joins the sentence it closes
            bounds.append((start, end))
            start, tail, i = end, "", end
        else:
            i += 1
    if start < n:
        bounds.append((start, n))
    return bounds


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds after the one before it (its leading space included).

    Token i's text is the decoded pair (i-1, i) less the decoded token i-1: decoding a token alone
    loses a leading space with the tokenizers that strip the first space of a decode (Llama 2,
    Mistral), and the space decides whether a period ends a sentence. Two batched decodes of the
    whole document. A token inside a multi-byte character reads as U+FFFD here, which the rule
    never mistakes for an end.
    """
    ids = [int(i) for i in ids]

    def decode(batch: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(batch, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    alone = decode([[i] for i in ids])
    pairs = decode([ids[k - 1 : k + 1] for k in range(1, len(ids))])
    pieces = alone[:1]
    for k in range(1, len(ids)):
        before, pair = alone[k - 1], pairs[k - 1]
        pieces.append(pair[len(before) :] if pair.startswith(before) else alone[k])
    return pieces


def split_sentences(tokenizer: Any, doc_ids: Sequence[int]) -> list[Sentence]:
    """The document's tokens (``doc_ids``, without the chat template) as sentences, in order.

    Each sentence's text is its tokens decoded together (a character split across tokens reads whole).
    """
    ids = [int(i) for i in doc_ids]
    bounds = sentence_bounds(token_pieces(tokenizer, ids))
    texts = tokenizer.batch_decode(
        [ids[a:b] for a, b in bounds], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return [Sentence(k, a, b, text) for k, ((a, b), text) in enumerate(zip(bounds, texts))]
