"""Tests for kvlab.documents: reading user documents and the bundled examples (no model)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from kvlab import documents, paths
from kvlab.documents import DocumentError, clean_text, read_document
from kvlab.examples import default_examples_root, load_examples


def _text_pdf(text: str) -> bytes:
    """Build a minimal one-page PDF whose content stream draws ``text`` in Helvetica."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 5 0 R >> >> /Contents 4 0 R >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    return bytes(out)


def _blank_pdf(path: Path) -> None:
    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    writer.add_blank_page(width=612, height=792)
    with path.open("wb") as fh:
        writer.write(fh)


# --------------------------------------------------------------------------- text files


def test_reads_utf8_text_and_markdown(tmp_path: Path) -> None:
    txt = tmp_path / "note.txt"
    txt.write_text("Café au lait — 3 € \n\nLine two.\n", encoding="utf-8")
    assert read_document(txt) == "Café au lait — 3 €\n\nLine two."
    md = tmp_path / "README.MD"  # suffix is case-insensitive
    md.write_text("# Title\n\n- item\n", encoding="utf-8")
    assert read_document(str(md)) == "# Title\n\n- item"


def test_reads_file_without_suffix(tmp_path: Path) -> None:
    plain = tmp_path / "NOTES"
    plain.write_text("just some text", encoding="utf-8")
    assert read_document(plain) == "just some text"


def test_utf8_bom_is_dropped(tmp_path: Path) -> None:
    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbfHello")
    assert read_document(f) == "Hello"


def test_utf16_with_bom(tmp_path: Path) -> None:
    f = tmp_path / "wide.txt"
    f.write_bytes("Grüße aus Köln".encode("utf-16"))  # includes a BOM
    assert read_document(f) == "Grüße aus Köln"


def test_latin1_fallback(tmp_path: Path) -> None:
    f = tmp_path / "old.txt"
    f.write_bytes("Le café est à côté de l'église.".encode("latin-1"))
    assert read_document(f) == "Le café est à côté de l'église."


def test_cp1252_smart_quotes_fallback(tmp_path: Path) -> None:
    f = tmp_path / "word.txt"
    f.write_bytes(b"He said \x93hello\x94 \x96 twice.")
    assert read_document(f) == "He said \u201chello\u201d \u2013 twice."


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="not found") as info:
        read_document(tmp_path / "nope.txt")
    assert "nope.txt" in str(info.value)


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="not a regular file"):
        read_document(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    with pytest.raises(DocumentError, match="empty"):
        read_document(f)


def test_whitespace_only_file(tmp_path: Path) -> None:
    f = tmp_path / "blank.md"
    f.write_text(" \n\n\t \r\n", encoding="utf-8")
    with pytest.raises(DocumentError, match="empty"):
        read_document(f)


def test_binary_with_nul_bytes(tmp_path: Path) -> None:
    f = tmp_path / "image.txt"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    with pytest.raises(DocumentError, match="binary") as info:
        read_document(f)
    assert ".pdf" in str(info.value)  # tells the user what is accepted


def test_binary_control_characters_without_nul(tmp_path: Path) -> None:
    f = tmp_path / "data.md"
    f.write_bytes(bytes([1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16]) * 50 + b"some text")
    with pytest.raises(DocumentError, match="binary"):
        read_document(f)


def test_invalid_utf8_that_is_binary(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(1, 256)) * 8)
    with pytest.raises(DocumentError, match="binary"):
        read_document(f)


def test_unsupported_suffix_lists_supported(tmp_path: Path) -> None:
    f = tmp_path / "report.docx"
    f.write_bytes(b"PK\x03\x04whatever")
    with pytest.raises(DocumentError, match="Unsupported file type") as info:
        read_document(f)
    for suffix in (".txt", ".md", ".pdf"):
        assert suffix in str(info.value)


def test_too_large(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(documents, "MAX_FILE_BYTES", 1000)
    f = tmp_path / "big.txt"
    f.write_text("a" * 1001, encoding="utf-8")
    with pytest.raises(DocumentError, match="too large"):
        read_document(f)


def test_the_size_limit_is_inclusive_and_checked_before_reading(tmp_path: Path) -> None:
    # Sparse files of NUL bytes: no disk used; read, they would be refused as binary.
    at_limit, over = tmp_path / "at.txt", tmp_path / "over.txt"
    for path, size in ((at_limit, documents.MAX_FILE_BYTES), (over, documents.MAX_FILE_BYTES + 1)):
        with path.open("wb") as fh:
            fh.truncate(size)
    with pytest.raises(DocumentError, match="binary"):
        read_document(at_limit)
    with pytest.raises(DocumentError, match="too large"):
        read_document(over)


def test_pdf_renamed_to_txt(tmp_path: Path) -> None:
    f = tmp_path / "paper.txt"
    f.write_bytes(_text_pdf("Hello"))
    with pytest.raises(DocumentError, match="looks like a PDF"):
        read_document(f)


# --------------------------------------------------------------------------- PDFs


def test_pdf_with_text_layer(tmp_path: Path) -> None:
    f = tmp_path / "hello.pdf"
    f.write_bytes(_text_pdf("The invoice total is 4217 euros."))
    assert "The invoice total is 4217 euros." in read_document(f)


def test_pdf_without_suffix_is_sniffed(tmp_path: Path) -> None:
    f = tmp_path / "download"
    f.write_bytes(_text_pdf("Sniffed PDF text"))
    assert "Sniffed PDF text" in read_document(f)


def test_pdf_pages_joined_with_blank_line(tmp_path: Path) -> None:
    from pypdf import PdfReader, PdfWriter

    first = PdfReader(_bytes_io(_text_pdf("Page one text")))
    second = PdfReader(_bytes_io(_text_pdf("Page two text")))
    writer = PdfWriter()
    writer.add_page(first.pages[0])
    writer.add_page(second.pages[0])
    f = tmp_path / "two.pdf"
    with f.open("wb") as fh:
        writer.write(fh)
    assert read_document(f) == "Page one text\n\nPage two text"


def test_pdf_without_text_layer(tmp_path: Path) -> None:
    f = tmp_path / "scan.pdf"
    _blank_pdf(f)
    with pytest.raises(DocumentError, match="no extractable text") as info:
        read_document(f)
    assert "scanned PDF?" in str(info.value)


@pytest.mark.parametrize(("user_password", "readable"), [("secret", False), ("", True)])
def test_encrypted_pdf(tmp_path: Path, user_password: str, readable: bool) -> None:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(_bytes_io(_text_pdf("Locked text"))))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    f = tmp_path / "locked.pdf"
    with f.open("wb") as fh:
        writer.write(fh)
    if readable:  # only an owner password: anyone may open and read it
        assert read_document(f) == "Locked text"
    else:
        with pytest.raises(DocumentError, match="password-protected"):
            read_document(f)


def test_pdf_that_cannot_be_parsed(tmp_path: Path) -> None:
    f = tmp_path / "broken.pdf"
    f.write_bytes(b"%PDF-1.4\n" + b"\x13garbage that is not a pdf body\xff\xfe" * 20)
    with pytest.raises(DocumentError, match="PDF") as info:
        read_document(f)
    assert "broken.pdf" in str(info.value)


def test_pdf_without_header(tmp_path: Path) -> None:
    f = tmp_path / "fake.pdf"
    f.write_text("this is plain text pretending to be a PDF", encoding="utf-8")
    with pytest.raises(DocumentError, match="not a valid PDF"):
        read_document(f)


def test_empty_pdf_file(tmp_path: Path) -> None:
    f = tmp_path / "zero.pdf"
    f.write_bytes(b"")
    with pytest.raises(DocumentError, match="empty"):
        read_document(f)


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)


# --------------------------------------------------------------------------- clean_text


def test_clean_text_newlines_and_controls() -> None:
    raw = "\ufeffa\r\nb\rc\x00d\x07e\tf\x0cg  \n"
    assert clean_text(raw) == "a\nb\ncd" + "e\tf\ng"


def test_clean_text_removes_exactly_unicodes_control_characters() -> None:
    # Every code point of the Latin-1 range but the line breaks, and a few beyond, each between two letters
    # on its own line, judged by unicodedata's category: Cc goes (but tab), as does the BOM; the rest stays.
    points = [chr(c) for c in range(0x100) if chr(c) not in "\n\r\x0b\x0c"] + ["\u061c", "\u200b", "\ufeff", "\ufffe"]
    got = clean_text("\n".join(f"a{p}b" for p in points))
    gone = {p for p in points if p != "\t" and (unicodedata.category(p) == "Cc" or p == "\ufeff")}
    assert got == "\n".join("ab" if p in gone else f"a{p}b" for p in points)


def test_clean_text_collapses_blank_runs() -> None:
    assert clean_text("a\n\n\n\n\n\nb") == "a\n\n\nb"  # at most two blank lines
    assert clean_text("a\n \n\t\n \n \nb") == "a\n\n\nb"  # whitespace-only lines count
    assert clean_text("a\n\nb\n\n\nc") == "a\n\nb\n\n\nc"  # short runs untouched


def test_clean_text_strips_and_keeps_unicode() -> None:
    assert clean_text("  \n  Grüße — 東京 🙂  \n\n") == "Grüße — 東京 🙂"


@pytest.mark.parametrize("raw", ["", "   ", "\n\n\t\n", "\x00\x01\x02", "\ufeff\r\n"])
def test_clean_text_empty_raises(raw: str) -> None:
    with pytest.raises(DocumentError, match="the document is empty|The document is empty"):
        clean_text(raw)


# --------------------------------------------------------------------------- examples


CHECKOUT_EXAMPLES = Path(__file__).resolve().parents[1] / "assets" / "examples"


def test_default_root_is_this_checkouts_examples() -> None:
    # The tests run on a checkout, installed editable or not: either way the
    # examples must be read from the checkout's own folder, not a stale copy.
    assert default_examples_root().samefile(CHECKOUT_EXAMPLES)


def test_default_root_without_an_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(paths.resources, "files", not_installed)
    assert default_examples_root().samefile(CHECKOUT_EXAMPLES)


def test_bundled_examples_load_and_answers_are_in_text() -> None:
    examples = load_examples()
    assert len(examples) >= 3
    assert len({ex.id for ex in examples}) == len(examples)
    assert len({ex.kind for ex in examples}) >= 3
    for ex in examples:
        text = ex.text()
        assert text.strip(), ex.id
        assert 3 <= len(ex.questions) <= 5, ex.id
        assert len(ex.questions) == len(ex.answers), ex.id
        assert isinstance(ex.tokens, int) and ex.tokens > 0, ex.id
        words = len(text.split())
        # The examples any model reads fit the embedded model's window; a long one names its model and
        # where its text comes from (issue #58: 12k-20k tokens, a public-domain text).
        if ex.model is None:
            assert 1200 <= words <= 2000, (ex.id, words)
        else:
            assert 12_000 <= ex.tokens <= 20_000, (ex.id, ex.tokens)
            assert ex.source and "public domain" in ex.source, ex.id
        assert len(ex.aliases) == len(ex.questions), ex.id
        for answer, aliases in zip(ex.answers, ex.aliases):
            assert answer == aliases[0], ex.id
            for alias in aliases:  # every accepted form is grounded in the document
                assert alias.lower() in text.lower(), (ex.id, alias)


def test_bundled_examples_include_a_2k_token_story() -> None:
    by_id = {ex.id: ex for ex in load_examples()}
    story = by_id["story"]
    assert story.path.suffix == ".txt"
    assert story.tokens is not None and 1800 <= story.tokens <= 2200


def _write_manifest(root: Path, entries: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "examples.json").write_text(json.dumps(entries), encoding="utf-8")


def test_load_examples_custom_root(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("Anna lives in Oslo.", encoding="utf-8")
    _write_manifest(
        tmp_path,
        [
            {
                "id": "a",
                "title": "A",
                "file": "doc.txt",
                "kind": "note",
                "questions": ["Where does Anna live?"],
                "answers": ["Oslo"],
                "tokens": 6,
            }
        ],
    )
    [ex] = load_examples(tmp_path)
    assert ex.path == (tmp_path / "doc.txt").resolve()
    assert ex.questions == ("Where does Anna live?",)
    assert ex.answers == ("Oslo",)
    assert ex.aliases == (("Oslo",),)
    assert ex.tokens == 6
    assert ex.text() == "Anna lives in Oslo."
    assert ex.model is None and ex.source is None  # read by any model, written for kvlab


def test_answers_may_list_aliases(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("Anna Berg, 34, lives in Oslo.", encoding="utf-8")
    _write_manifest(
        tmp_path,
        [
            {
                "id": "a",
                "title": "A",
                "file": "doc.txt",
                "kind": "note",
                "questions": ["Who lives in Oslo?", "How old is she?"],
                "answers": [["Anna Berg", "Anna"], "34"],
            }
        ],
    )
    [ex] = load_examples(tmp_path)
    assert ex.answers == ("Anna Berg", "34")  # the first alias is the answer shown
    assert ex.aliases == (("Anna Berg", "Anna"), ("34",))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"questions": ["q1", "q2"], "answers": ["a1"]}, "2 questions but 1 answers"),
        ({"file": "missing.txt"}, "not found"),
        ({"file": "../outside.txt"}, "outside"),
        ({"title": ""}, "'title'"),
        ({"answers": "a1"}, "'answers'"),
        ({"answers": [[]]}, "'answers'"),
        ({"answers": [["a1", " "]]}, "'answers'"),
        ({"answers": [["a1", 2]]}, "'answers'"),
        ({"tokens": "many"}, "'tokens'"),
        ({"model": ""}, "'model'"),
        ({"source": 3}, "'source'"),
    ],
)
def test_load_examples_rejects_bad_entries(tmp_path: Path, entry: dict, message: str) -> None:
    root = tmp_path / "examples"
    root.mkdir()
    (root / "doc.txt").write_text("text", encoding="utf-8")
    (tmp_path / "outside.txt").write_text("text", encoding="utf-8")
    base = {
        "id": "a",
        "title": "A",
        "file": "doc.txt",
        "kind": "note",
        "questions": ["q1"],
        "answers": ["a1"],
        "tokens": 1,
    }
    _write_manifest(root, [{**base, **entry}])
    with pytest.raises(DocumentError, match=message):
        load_examples(root)


def test_load_examples_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="No examples manifest"):
        load_examples(tmp_path)


def test_load_examples_duplicate_ids(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("text", encoding="utf-8")
    entry = {"id": "a", "title": "A", "file": "doc.txt", "kind": "note", "questions": ["q"], "answers": ["a"]}
    _write_manifest(tmp_path, [entry, entry])
    with pytest.raises(DocumentError, match="duplicate id"):
        load_examples(tmp_path)
