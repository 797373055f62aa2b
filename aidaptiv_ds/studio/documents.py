"""Documents to records: the text of an uploaded file, cleaned and cut into passages for continued training
(``{"text": ...}`` records), or the records of a data file as they are.

Text comes from .txt/.md (UTF-8), .pdf (pypdf: the text layer; a scanned PDF without one is refused, OCR is
not ours), .docx (python-docx: paragraphs and table cells in order), .html/.htm (the standard library's
parser: visible text, without scripts, styles and navigation). Records come from .jsonl/.json/.csv/.parquet
through the training job's own reader and record check, so what the studio accepts the job trains on.

Cleaning, for text extracted from layout formats: Windows line ends, soft hyphens and words hyphenated
across a line break are mended; lines repeated on most pages of a PDF (running headers and footers) and
lines holding only a page number are dropped; the lines of one paragraph are joined; runs of spaces become
one. Passages are whole paragraphs packed up to a token limit (a longer paragraph is cut at sentence ends,
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
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise StudioError(f"{path.name} is not UTF-8 text (byte at offset {e.start}): save it as UTF-8") from None
    elif suffix == ".pdf":
        pages = _pdf_pages(path)
        raw = "\n\n".join(pages)
    elif suffix == ".docx":
        raw = _docx_text(path)
    else:
        raw = _html_text(path.read_bytes().decode("utf-8", errors="replace"))
    out = Extracted(path.name, "document", pages=len(pages) if pages else 0)
    out.text = clean(raw, pages=pages, notes=out.notes)
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
            raise StudioError(f"{path.name} is an encrypted PDF: save a copy without a password first")
        return [page.extract_text() or "" for page in reader.pages]
    except PdfReadError as e:
        raise StudioError(f"{path.name} is not a readable PDF ({e})") from None


def _docx_text(path: Path) -> str:
    import zipfile

    import docx

    try:
        document = docx.Document(str(path))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise StudioError(f"{path.name} is not a readable .docx file ({e})") from None
    parts = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            parts.append(" | ".join(cell.text for cell in row.cells))
    return "\n\n".join(parts)


class _VisibleText(HTMLParser):
    SKIP = {"script", "style", "nav", "header", "footer", "noscript", "template", "svg"}
    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article", "pre", "table"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skipping = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def _html_text(html: str) -> str:
    parser = _VisibleText()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)


_PAGE_NUMBER = re.compile(r"^\s*(page\s*)?\d{1,4}(\s*(/|of)\s*\d{1,4})?\s*$", re.IGNORECASE)


def clean(text: str, pages: list[str] | None = None, notes: list | None = None) -> str:
    """Paragraphs separated by one blank line; see the module's docstring for what is mended and dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00ad", "").replace("\x0c", "\n\n")
    repeated = set()
    if pages and len(pages) >= 3:
        # A line on most pages is a running header or footer, not content.
        counts = Counter(line.strip() for page in pages for line in set(page.splitlines()) if line.strip())
        repeated = {line for line, n in counts.items() if n >= max(3, (len(pages) + 1) // 2)}
        if repeated and notes is not None:
            notes.append(f"dropped {len(repeated)} line(s) repeated on most pages (headers, footers)")
    paragraphs, current = [], []
    for line in text.split("\n"):
        s = line.strip()
        if s in repeated or (_PAGE_NUMBER.match(s) and s):
            continue
        if not s:
            if current:
                paragraphs.append(current)
                current = []
            continue
        current.append(s)
    if current:
        paragraphs.append(current)
    out = []
    for lines in paragraphs:
        joined = lines[0]
        for nxt in lines[1:]:
            # "exam-" + "ple" was one word broken by the layout; "well-" + "Known" keeps its hyphen.
            if re.search(r"[a-z]-$", joined) and nxt[:1].islower():
                joined = joined[:-1] + nxt
            else:
                joined += " " + nxt
        out.append(re.sub(r"[ \t]+", " ", joined).strip())
    return "\n\n".join(p for p in out if p)


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
