"""Documents to records: the text of an uploaded file, cleaned and cut into passages for continued training
(``{"text": ...}`` records), or the records of a data file as they are.

Text comes from .txt/.md (UTF-8), .pdf (pypdf: the text layer; a scanned PDF without one is refused, OCR is
not ours), .docx (python-docx: paragraphs and table cells in order), .html/.htm (the standard library's
parser: visible text, without scripts, styles and navigation). Records come from .jsonl/.json/.csv/.parquet
through the training job's own reader and record check, so what the studio accepts the job trains on.

Cleaning: Windows line ends and soft hyphens are mended everywhere; in a PDF, lines repeated at the edges of
most pages (running headers and footers) and page numbers at a page's edge are dropped, and words hyphenated
across a line break are joined; the lines of one paragraph are joined and runs of spaces become one, except in
Markdown, whose lines are its structure. Passages are whole paragraphs packed up to a token limit (a longer paragraph is cut at sentence ends,
and a longer sentence at the limit), counted with the tokenizer of the model the set is for.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

from aidaptiv_ds.studio.workspace import StudioError

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
DOCUMENT_SUFFIXES = TEXT_SUFFIXES + (".pdf", ".docx", ".html", ".htm")
RECORD_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
ACCEPTED = DOCUMENT_SUFFIXES + RECORD_SUFFIXES


@dataclass
class Extracted:
    """What one uploaded file gave: a document's cleaned text, or a data file's records."""

    name: str
    kind: str  # "document" or "records"
    text: str = ""
    records: list = field(default_factory=list)
    pages: int = 0
    notes: list = field(default_factory=list)


def extract(path: str | Path) -> Extracted:
    """The cleaned text or the records of one file; StudioError names the file and what is wrong."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in RECORD_SUFFIXES:
        return Extracted(path.name, "records", records=_records(path))
    if suffix not in DOCUMENT_SUFFIXES:
        raise StudioError(f"{path.name}: the studio reads {', '.join(ACCEPTED)} files, not {suffix or 'this file'}")
    pages = None
    if suffix in TEXT_SUFFIXES:
        try:
            raw = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not text
        except UnicodeDecodeError as e:
            raise StudioError(f"{path.name} is not UTF-8 text (byte at offset {e.start}): save it as UTF-8") from None
    elif suffix == ".pdf":
        pages = _pdf_pages(path)
        raw = "\n\n".join(pages)
    elif suffix == ".docx":
        raw = _docx_text(path)
    else:
        raw = _html_text(_html_decoded(path))
    out = Extracted(path.name, "document", pages=len(pages) if pages else 0)
    # Lines of a Markdown file are its structure (lists, tables, code): only other formats' lines are joined.
    out.text = clean(raw, pages=pages, notes=out.notes, join_lines=suffix not in (".md", ".markdown"))
    if not out.text.strip():
        hint = " (a scanned PDF has no text layer: run OCR on it first)" if suffix == ".pdf" else ""
        raise StudioError(f"{path.name} holds no text{hint}")
    return out


def _records(path: Path) -> list[dict]:
    # The job's reader and record check: a record the studio shows is one the job trains on.
    from aidaptiv_ds.job.data import format_record
    from aidaptiv_ds.job.record_files import DataError, read_records

    try:
        records = read_records(str(path))
        problems = []
        for where, rec in records:
            try:
                format_record(rec, where)
            except DataError as e:
                problems.append(str(e))
    except DataError as e:
        raise StudioError(str(e)) from None
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise StudioError(
            f"{path.name}: {len(problems)} record(s) the job cannot train on: " + "; ".join(problems[:5]) + more
        )
    return [json.loads(json.dumps(rec, default=str)) for _, rec in records]


def _pdf_pages(path: Path) -> list[str]:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(str(path))
        if reader.is_encrypted:
            try:  # permission-restricted PDFs open with an empty user password
                opened = reader.decrypt("")
            except Exception:  # pypdf's errors for an unsupported or broken encryption
                opened = 0
            if not opened:
                raise StudioError(f"{path.name} is an encrypted PDF: save a copy without a password first")
        return [page.extract_text() or "" for page in reader.pages]
    except PdfReadError as e:
        raise StudioError(f"{path.name} is not a readable PDF ({e})") from None


def _docx_text(path: Path) -> str:
    import zipfile

    import docx
    from docx.opc.exceptions import OpcError
    from docx.table import Table

    try:
        document = docx.Document(str(path))
    except (zipfile.BadZipFile, KeyError, ValueError, OpcError) as e:
        raise StudioError(f"{path.name} is not a readable .docx file ({e})") from None
    parts = []
    for block in document.iter_inner_content():  # paragraphs and tables in document order
        if isinstance(block, Table):
            parts += [" | ".join(cell.text for cell in row.cells) for row in block.rows]
        else:
            parts.append(block.text)
    return "\n\n".join(parts)


class _VisibleText(HTMLParser):
    SKIP = {"script", "style", "nav", "header", "footer", "noscript", "template", "svg"}
    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article", "pre", "table"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skipping, self.cells_in_row = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in ("td", "th"):
            if self.cells_in_row:  # cells of a row stay apart, as the .docx reader writes them
                self.parts.append(" | ")
            self.cells_in_row += 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n")
            if tag == "tr":
                self.cells_in_row = 0

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def _html_decoded(path: Path) -> str:
    """UTF-8 (a byte-order mark allowed), or the charset the page names; refused otherwise, never guessed."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        named = re.search(rb"""charset\s*=\s*["']?([A-Za-z0-9_.:-]+)""", data[:4096])
        if named:
            try:
                return data.decode(named.group(1).decode("ascii"))
            except (LookupError, UnicodeDecodeError):
                pass
        raise StudioError(
            f"{path.name} is not UTF-8 (byte at offset {e.start}) and names no charset that decodes it: save it as UTF-8"
        ) from None


def _html_text(html: str) -> str:
    parser = _VisibleText()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)


_PAGE_NUMBER = re.compile(r"^\s*(page\s*)?\d{1,4}(\s*(/|of)\s*\d{1,4})?\s*$", re.IGNORECASE)


PAGE_EDGE_LINES = 2  # running headers, footers and page numbers sit in a page's first and last lines


def clean(text: str, pages: list[str] | None = None, notes: list | None = None, join_lines: bool = True) -> str:
    """Paragraphs separated by one blank line; see the module's docstring for what is mended and dropped.
    ``pages`` (a PDF's): the text is taken from them, and a line repeated at the edges of most pages, or a page
    number there, is dropped at the edges only; words hyphenated across lines are mended. ``join_lines``
    False keeps every line of a paragraph (Markdown's lists, tables and code)."""
    if pages:
        text = "\n\n".join(_without_running_lines(pages, notes))
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00ad", "").replace("\x0c", "\n\n")
    paragraphs, current = [], []
    for line in text.split("\n"):
        if not line.strip():
            if current:
                paragraphs.append(current)
                current = []
            continue
        current.append(line.strip() if join_lines else line.rstrip())
    if current:
        paragraphs.append(current)
    out = []
    for lines in paragraphs:
        if not join_lines:
            out.append("\n".join(lines))
            continue
        joined = lines[0]
        for nxt in lines[1:]:
            # In a PDF "exam-" + "ple" was one word broken by the layout; "well-" + "Known" keeps its hyphen.
            if pages and re.search(r"[a-z]-$", joined) and nxt[:1].islower():
                joined = joined[:-1] + nxt
            else:
                joined += " " + nxt
        out.append(re.sub(r"[ \t]+", " ", joined).strip())
    return "\n\n".join(p for p in out if p)


def _without_running_lines(pages: list[str], notes: list | None) -> list[str]:
    """The pages without their running headers and footers (a line at the edges of most pages) and page
    numbers (at an edge); lines inside a page are kept whatever they say."""

    def edges(lines):
        filled = [i for i, line in enumerate(lines) if line.strip()]
        return set(filled[:PAGE_EDGE_LINES] + filled[-PAGE_EDGE_LINES:])

    split = [page.replace("\r\n", "\n").replace("\r", "\n").split("\n") for page in pages]
    repeated = set()
    if len(pages) >= 3:
        counts = Counter(line.strip() for lines in split for line in {lines[i] for i in edges(lines)})
        repeated = {line for line, n in counts.items() if n >= max(3, (len(pages) + 1) // 2)}
        if repeated and notes is not None:
            notes.append(f"dropped {len(repeated)} line(s) repeated on most pages (headers, footers)")
    out = []
    for lines in split:
        edge = edges(lines)
        kept = [
            line
            for i, line in enumerate(lines)
            if not (i in edge and (line.strip() in repeated or _PAGE_NUMBER.match(line.strip())))
        ]
        out.append("\n".join(kept))
    return out


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def passages(text: str, max_tokens: int, count: Callable[[str], int]) -> list[str]:
    """Whole paragraphs packed into passages of at most ``max_tokens`` (by ``count``); see the docstring."""
    if max_tokens < 8:
        raise StudioError(f"passage length {max_tokens} tokens is too short: give at least 8")
    pieces = []  # (text, starts a paragraph)
    for para in text.split("\n\n"):
        if count(para) <= max_tokens:
            pieces.append((para, True))
            continue
        first = True
        for sentence in _SENTENCE_END.split(para):
            while count(sentence) > max_tokens:
                cut = _cut_at(sentence, max_tokens, count)
                pieces.append((sentence[:cut].strip(), first))
                sentence, first = sentence[cut:].strip(), False
            if sentence:
                pieces.append((sentence, first))
                first = False
    out, current = [], ""
    for piece, new_paragraph in pieces:
        # Sentences of one paragraph stay one paragraph; paragraphs keep their blank line.
        joined = f"{current}{chr(10) * 2 if new_paragraph else ' '}{piece}" if current else piece
        if current and count(joined) > max_tokens:
            out.append(current)
            current = piece
        else:
            current = joined
    if current:
        out.append(current)
    return out


def _cut_at(sentence: str, max_tokens: int, count: Callable[[str], int]) -> int:
    """The longest prefix (in characters, ended at a space when there is one) within ``max_tokens``."""
    lo, hi = 1, len(sentence)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(sentence[:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    space = sentence.rfind(" ", 0, lo)
    return space if space > lo // 2 else lo
