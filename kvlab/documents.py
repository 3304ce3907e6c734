"""Reading user documents (plain text, Markdown, PDF) safely.

Everything a user can upload goes through :func:`read_document`, which either returns
clean text ready to be tokenised or raises :class:`DocumentError` with a message that
can be shown in the UI as is. The bundled examples are kvlab.examples.
"""

from __future__ import annotations

import io
import logging
import re
import unicodedata
from pathlib import Path

from kvlab.limits import LIMITS

__all__ = ["DocumentError", "MAX_FILE_BYTES", "SUPPORTED_SUFFIXES", "clean_text", "read_document"]

#: Largest file :func:`read_document` accepts, in bytes (``KVLAB_MAX_UPLOAD_BYTES``, kvlab.limits).
MAX_FILE_BYTES: int = LIMITS.upload_bytes

_TEXT_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".markdown", ""})
_PDF_SUFFIXES: frozenset[str] = frozenset({".pdf"})
#: Suffixes :func:`read_document` understands ("" means a file without a suffix).
SUPPORTED_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".markdown", ".pdf")

# Share of control characters (other than tab/newline/CR/form feed) above which
# decoded bytes are considered binary rather than text.
_MAX_CONTROL_RATIO: float = 0.01
_ALLOWED_CONTROLS: frozenset[str] = frozenset("\t\n\r\f\v")
_BLANK_RUN = re.compile(r"\n{4,}")  # more than two blank lines in a row
_NEWLINES = str.maketrans({"\r": "\n", "\f": "\n", "\v": "\n", "\u2028": "\n", "\u2029": "\n"})
# Unicode's control characters (category Cc: U+0000-U+001F, U+007F-U+009F) but newline and tab, and the BOM.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")


class DocumentError(ValueError):
    """A document could not be read; ``str(error)`` is a message fit for the user."""


# --------------------------------------------------------------------------- reading


def read_document(path: str | Path) -> str:
    """Read a user document and return its cleaned text.

    The reader is chosen from the (case-insensitive) suffix: ``.txt``, ``.md``,
    ``.markdown`` and files without a suffix are decoded as text; ``.pdf`` files are
    parsed with pypdf and the text of all pages is joined with blank lines. A file
    without a suffix that starts with ``%PDF-`` is read as a PDF.

    Text is decoded as UTF-8 (a UTF-8 or UTF-16 byte-order mark is honoured); if that
    fails and the bytes still look like text, Windows-1252 / Latin-1 is used instead.
    The result is passed through :func:`clean_text`.

    Args:
        path: Path of the file to read.

    Returns:
        The cleaned, non-empty text of the document.

    Raises:
        DocumentError: if the file is missing, not a regular file, of an unsupported
            type, larger than :data:`MAX_FILE_BYTES`, empty, binary, an unreadable or
            encrypted PDF, or a PDF without a text layer.
    """
    p = Path(path)
    name = p.name or str(p)
    if not p.exists():
        raise DocumentError(f"File not found: '{name}'.")
    if not p.is_file():
        raise DocumentError(f"'{name}' is not a regular file.")

    suffix = p.suffix.lower()
    if suffix not in _TEXT_SUFFIXES and suffix not in _PDF_SUFFIXES:
        raise DocumentError(
            f"Unsupported file type '{p.suffix}' for '{name}'. "
            f"Supported types: {', '.join(SUPPORTED_SUFFIXES)} (or plain text without a suffix)."
        )

    size = p.stat().st_size
    if size > MAX_FILE_BYTES:
        raise DocumentError(
            f"'{name}' is too large ({size / 1_000_000:.1f} MB); the limit is {MAX_FILE_BYTES // (1024 * 1024)} MB."
        )
    if size == 0:
        raise DocumentError(f"'{name}' is empty (0 bytes).")

    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DocumentError(f"Could not read '{name}': {exc.strerror or exc}.") from exc

    if suffix in _PDF_SUFFIXES or (suffix == "" and data.startswith(b"%PDF-")):
        text = _pdf_text(data, name)
    else:
        if data.startswith(b"%PDF-"):
            raise DocumentError(f"'{name}' looks like a PDF file, not plain text. Rename it to end in .pdf.")
        text = _decode_text(data, name)
    try:
        return clean_text(text)
    except DocumentError:
        raise DocumentError(f"'{name}' contains no readable text (the document is empty).") from None


def _control_ratio(text: str) -> float:
    """Return the share of control characters in ``text`` other than common whitespace."""
    if not text:
        return 0.0
    bad = sum(1 for ch in text if ch not in _ALLOWED_CONTROLS and unicodedata.category(ch) == "Cc")
    return bad / len(text)


def _binary_error(name: str) -> DocumentError:
    return DocumentError(
        f"'{name}' does not look like a text file (it contains binary data). Upload a .txt, .md or .pdf document."
    )


def _decode_text(data: bytes, name: str) -> str:
    """Decode the bytes of a text file, refusing content that looks binary."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16 with a byte-order mark
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise _binary_error(name) from None
    elif b"\x00" in data:
        raise _binary_error(name)
    else:
        try:
            text = data.decode("utf-8-sig")  # plain UTF-8; drops a leading BOM if any
        except UnicodeDecodeError:
            # Not UTF-8. Only fall back to a single-byte encoding when the bytes look
            # like text: few raw control bytes (bytes 0x80-0x9f are text in cp1252).
            raw_controls = sum(1 for b in data if (b < 0x20 and b not in b"\t\n\r\f\v") or b == 0x7F)
            if raw_controls / len(data) > _MAX_CONTROL_RATIO:
                raise _binary_error(name) from None
            try:
                text = data.decode("cp1252")
            except UnicodeDecodeError:
                text = data.decode("latin-1")  # never fails
    if _control_ratio(text) > _MAX_CONTROL_RATIO:
        raise _binary_error(name)
    return text


def _pdf_text(data: bytes, name: str) -> str:
    """Extract the text layer of a PDF, page by page, joined with blank lines."""
    if b"%PDF-" not in data[:1024]:
        raise DocumentError(f"'{name}' is not a valid PDF file (no PDF header found).")
    try:
        from pypdf import PdfReader
    except ImportError as exc:  # pragma: no cover - pypdf is a hard requirement
        raise DocumentError("PDF support is not installed (the 'pypdf' package is missing).") from exc

    # pypdf logs every recoverable oddity of a malformed file; keep the console quiet.
    pypdf_logger = logging.getLogger("pypdf")
    previous_level = pypdf_logger.level
    pypdf_logger.setLevel(logging.ERROR)
    try:
        try:
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted:
                try:
                    unlocked = reader.decrypt("")
                except Exception:  # noqa: BLE001 - e.g. missing AES backend
                    unlocked = 0
                if not unlocked:
                    raise DocumentError(f"'{name}' is a password-protected PDF; remove the password and try again.")
            pages = list(reader.pages)
        except DocumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - pypdf raises many exception types
            raise DocumentError(f"'{name}' could not be read as a PDF (the file may be damaged): {exc}") from exc

        if not pages:
            raise DocumentError(f"'{name}' is a PDF with no pages.")
        texts: list[str] = []
        for page in pages:
            try:
                page_text = page.extract_text() or ""
            except Exception:  # noqa: BLE001 - one bad page should not lose the rest
                page_text = ""
            if page_text.strip():
                texts.append(page_text.strip())
    finally:
        pypdf_logger.setLevel(previous_level)

    if not texts:
        raise DocumentError(
            f"'{name}' has no extractable text (scanned PDF? no text layer). "
            "Run OCR on it first or upload the text instead."
        )
    return "\n\n".join(texts)


# --------------------------------------------------------------------------- cleaning


def clean_text(text: str) -> str:
    """Normalise extracted text so it can be tokenised predictably.

    * ``\\r\\n``, ``\\r``, form feeds, vertical tabs and Unicode line/paragraph
      separators become ``\\n``;
    * NULs and other control characters (except newline and tab) and byte-order marks
      are removed;
    * trailing whitespace is removed from every line;
    * runs of more than two blank lines are reduced to two blank lines;
    * leading and trailing whitespace is stripped.

    Args:
        text: The raw text.

    Returns:
        The cleaned text.

    Raises:
        DocumentError: if nothing but whitespace is left ("the document is empty").
    """
    text = text.replace("\r\n", "\n")
    text = text.translate(_NEWLINES)
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANK_RUN.sub("\n\n\n", text).strip()
    if not text:
        raise DocumentError("The document is empty (no readable text).")
    return text
