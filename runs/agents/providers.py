"""Model providers: the offline extractive one and an OpenAI-compatible one.

The agent sends chat messages; a provider returns text.  The offline
provider is deterministic: it reads the <document> blocks of the prompt and
writes what a careful analyst would extract from fact sheets (figures, fees,
holdings, risks), and, for a comparison, puts them side by side.  Any other
document (prose, notes, an HTML page, another corpus) gives its title and
its opening sentences as key points, and a comparison of such documents
lists each one's points and the terms they all use.  A support ticket's
reply quotes the knowledge-base articles that answer it (`support_reply`).
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from email.message import Message
from typing import Protocol

from django.conf import settings

from runs.agents.html_text import is_page, page_text
from runs.agents.unredirected import NOT_REDIRECTED

SUMMARIZE_INSTRUCTIONS = (
    "You are a research assistant. Summarise the fact sheet in the document: key figures, "
    "fees, top holdings and risks, as markdown with the sections '## Key figures', '## Fees' "
    "(bullets 'Name: value'), '## Top holdings' (numbered) and '## Risks' (bullets). "
    "Only state what the document says."
)
COMPARE_INSTRUCTIONS = (
    "You are a research assistant. Compare the fund summaries in the documents and answer the "
    "question with a markdown report: a side-by-side table of figures, fees, top holdings and "
    "risks, then short observations. Only state what the documents say."
)

SUPPORT_INSTRUCTIONS = (
    "You are a customer support agent. Draft a plain-text email reply to the customer's ticket "
    "(the document named 'ticket') from the knowledge-base articles in the other documents "
    "only: answer what the customer asks, quote the sentences of each article you rely on and "
    "name it. Sign it 'The support team'. If no article answers the ticket, say a member of "
    "the team will reply in person."
)

_DOCUMENT = re.compile(r'<document name="([^"]*)">\n(.*?)\n</document>', re.S)


class ProviderError(Exception):
    pass


class Provider(Protocol):
    name: str

    def complete(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class _Entity:
    """A character that would end a document block where `context` (a
    pattern) follows it -- a name's `"`, the `<` of a text's
    `</document>` -- written as the entity `&{name};`, reversibly: an `&`
    that already begins that entity there (after any `amp;`) gains one
    more `amp;`.  Any other text is written as it is."""

    char: str
    name: str
    context: str = ""

    def _written(self) -> re.Pattern[str]:
        return re.compile(rf"&((?:amp;)*)({self.name};)(?={self.context})", re.I)

    def escape(self, text: str) -> str:
        bumped = self._written().sub(r"&amp;\1\2", text)
        return re.sub(
            rf"{re.escape(self.char)}(?={self.context})", f"&{self.name};", bumped, flags=re.I
        )

    def unescape(self, text: str) -> str:
        def read(match: re.Match[str]) -> str:
            amps, entity = match.groups()
            return f"&{amps[4:]}{entity}" if amps else self.char

        return self._written().sub(read, text)


_NAME_QUOTE = _Entity('"', "quot")
_TEXT_END = _Entity("<", "lt", r"/document\s*>")
_QUESTION_TAG = _Entity("<", "lt", r"/?document\b")


def research_prompt(question: str, documents: Iterable[tuple[str, str]]) -> str:
    """The user message of a model call: the question, then a block for
    each document (name, text).  A `<document` or `</document` the
    question holds is written as an entity: no question can pass for a
    document, nor end before its last word."""
    blocks = (document_block(name, text) for name, text in documents)
    return f"Question: {_QUESTION_TAG.escape(question)}\n\n" + "\n\n".join(blocks)


def document_block(name: str, text: str) -> str:
    """A document in a prompt.  What would end its block is written as an
    entity: a double quote in its name as &quot;, a `</document>` in its
    text as &lt;/document> (so no document can close its block early and
    pass what follows for another document); `document_blocks` reads both
    back as they were."""
    return f'<document name="{_NAME_QUOTE.escape(name)}">\n{_TEXT_END.escape(text)}\n</document>'


def document_blocks(prompt: str) -> list[tuple[str, str]]:
    """The documents of a prompt (`document_block`): name and text."""
    return [
        (_NAME_QUOTE.unescape(name), _TEXT_END.unescape(text))
        for name, text in _DOCUMENT.findall(prompt)
    ]


def support_prompt(heading: str, ticket: str, articles: Iterable[tuple[str, str]]) -> str:
    """The user message of a support reply's draft: a heading line (the
    ticket's id, customer and subject), the ticket's text as the document
    named "ticket", then a block for each knowledge-base article (name,
    text).  As in `research_prompt`, the heading cannot pass for a block."""
    blocks = [document_block("ticket", ticket)]
    blocks += (document_block(name, text) for name, text in articles)
    return " ".join(_QUESTION_TAG.escape(heading).split()) + "\n\n" + "\n\n".join(blocks)


# The opening of a document that is not a fact sheet: its key points.
KEY_POINTS = 5
POINT_CHARS = 300
TITLE_CHARS = 120
NO_TEXT = "The document holds no text."
# Observations when no figure is given by two documents, and no two
# documents' terms can be compared (a single document, say).
NOTHING_COMPARED = "- Nothing to compare: no figure is given by two or more documents."
# Ends of sentences: . ! ? before a blank; the ideographic full stop, ! and ?
# (which no blank follows).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[\u3002\uff01\uff1f])\s*")
_LIST_ITEM = re.compile(r"^(?:[-*+]|\d+[.)])\s+")
# A line's markup, or the backslash that says it has none (runs/html_text.py).
_MARKUP = re.compile(r"^(?:#+\s+|>\s*|[-*+]\s+|\d+[.)]\s+|\\(?=[#`~|*_]))")
# A markdown heading: one to six #, then a blank (`#hashtag` is text).
_HEADING = re.compile(r"#{1,6}(?:\s|$)")
# A fact sheet's section: a heading of level 2 to 6 (closing #s and a colon
# are no part of its name), or a line in bold alone.
_SECTION = re.compile(r"(#{2,6})\s+(.*)|(\*\*|__)(.+?)\3:?")
SECTIONS = ("key figures", "fees", "top holdings", "risks", "key points")
# Other names sheets give those sections, whatever follows ("Key figures
# (as of 30 June 2025)", "Fees and expenses", "Top 10 holdings", "Key risks").
_SECTION_NAMES = [
    ("key figures", re.compile(r"key (?:figures|facts)\b")),
    ("fees", re.compile(r"(?:fees|costs|charges)\b")),
    ("top holdings", re.compile(r"(?:top(?: \d+| ten)?|largest|main) holdings\b")),
    ("risks", re.compile(r"(?:(?:key|main|principal) )?risks\b|risk factors\b")),
]
# A fenced code block opens with three or more ` or ~; the same, at least as
# many, close it.
_FENCE = re.compile(r"`{3,}|~{3,}")
_EMPHASIS = re.compile(r"\*\*|__")
# Between a figure's name and its value where no colon is: a dash between blanks.
_DASH = re.compile(r"\s+[-\u2013\u2014]\s+")
_TABLE_SEPARATOR = re.compile(r":?-+:?")
_WORD = re.compile(r"[^\W_]")
_TERM = re.compile(r"[^\W\d_]{4,}")
# Words too common to say what documents share (only words of 4+ letters count).
_COMMON = """
about after also been before being between both could does each from have here into just like
more most much must only other over same should some such than that their them then there these
they this those through under very were what when where which while will with would your
"""
COMMON_WORDS = frozenset(_COMMON.split())


@dataclass
class FactSheet:
    """What the offline provider reads in a document: a fact sheet's
    sections, or, for any other document, its title and key points."""

    title: str
    name: str = ""  # the document's path
    # Said after the label when another document of a comparison has the same one.
    qualifier: str = ""
    figures: dict[str, str] = field(default_factory=dict)
    fees: dict[str, str] = field(default_factory=dict)
    holdings: list[str] = field(default_factory=list)
    risks: list[str] = field(default_factory=list)
    points: list[str] = field(default_factory=list)

    def value(self, name: str) -> str:
        """The figure or fee called `name`, in any case ("" if none)."""
        return self.named.get(name.lower(), "")

    @functools.cached_property
    def named(self) -> dict[str, str]:
        """Its figures and fees by name in lower case, the first of a name
        (a sheet may give thousands of figures: a scan per name was the
        comparison's cost).  Made once the sheet is read."""
        return {k.lower(): v for k, v in reversed([*self.figures.items(), *self.fees.items()])}

    @property
    def label(self) -> str:
        label = self.value("Ticker") or self.title
        return f"{label} ({self.qualifier})" if self.qualifier else label

    @property
    def is_fact_sheet(self) -> bool:
        return bool(self.figures or self.fees or self.holdings or self.risks)

    @classmethod
    def parse(cls, text: str, name: str = "") -> FactSheet:
        """The document `text` (named `name`, its title if it has none).
        Lists may be bulleted (- * +) or numbered, names in bold, figures
        in a table of two columns; an HTML page is read as its text."""
        if is_page(text):
            text = page_text(text)
        sheet = cls(title="", name=name)
        section = ""
        lines = _without_code(text)
        for number, raw in enumerate(lines):
            line = raw.strip()
            item = _item(line)
            if line.startswith("# ") and not sheet.title:
                sheet.title = line[2:].strip()
            elif heading := _section(line):
                level, named = heading
                # A deeper heading of another name is a part of its section.
                if level == 2 or named in SECTIONS:
                    section = named
            elif section in ("key figures", "fees"):
                if pair := _pair(item, line, lines[number + 1 : number + 2]):
                    target = sheet.figures if section == "key figures" else sheet.fees
                    target[pair[0]] = pair[1]
            elif item and section == "top holdings":
                sheet.holdings.append(item)
            elif item and section == "risks":
                sheet.risks.append(item)
            elif item and section == "key points":
                sheet.points.append(item)
        if not sheet.is_fact_sheet and not sheet.points:
            sheet.title, sheet.points = _opening(text, sheet.title)
        sheet.title = sheet.title or name
        return sheet

    def to_markdown(self, *, holdings: int = 3, risks: int = 3) -> str:
        if not self.is_fact_sheet:
            points = [f"- {point}" for point in self.points or [NO_TEXT]]
            return "\n".join([f"# {self.title}", "", "## Key points", *points])
        lines = [f"# {self.title}", "", "## Key figures"]
        lines += [f"- {k}: {v}" for k, v in self.figures.items()]
        lines += ["", "## Fees"] + [f"- {k}: {v}" for k, v in self.fees.items()]
        lines += ["", "## Top holdings"]
        lines += [f"{i}. {h}" for i, h in enumerate(self.holdings[:holdings], 1)]
        lines += ["", "## Risks"] + [f"- {r}" for r in self.risks[:risks]]
        return "\n".join(lines)


def _opening(text: str, title: str) -> tuple[str, list[str]]:
    """The title of a document that is not a fact sheet -- its first
    heading, its front matter's title, or a short first line that is no
    sentence ("" when it has none) -- and its first KEY_POINTS points, each
    cut at POINT_CHARS: a list item is a point, a paragraph gives its
    sentences; headings, rules, code blocks and other markup are left out."""
    points: list[str] = []
    paragraph: list[str] = []
    lines = _without_code(text)
    end = _front_matter_end(lines) if lines and lines[0].strip() == "---" else 0
    if end:  # front matter: its title only
        matter, lines = lines[1:end], lines[end + 1 :]
        field = next((line for line in matter if line.lower().startswith("title:")), "")
        title = title or field.partition(":")[2].strip().strip("\"'")

    def end_paragraph() -> None:
        sentences = _SENTENCE_END.split(" ".join(" ".join(paragraph).split()))
        points.extend(sentence for sentence in sentences if sentence)
        paragraph.clear()

    for number, raw in enumerate(lines):
        line = raw.strip()
        words = _MARKUP.sub("", line).strip()
        if not _WORD.search(words):  # a blank line, a rule, code
            end_paragraph()
        elif _HEADING.match(line):
            title = title or words
            end_paragraph()
        elif (cells := _table_row(line)) is not None:
            end_paragraph()  # a table's row is a point of its own, but its header
            if not _header(lines[number + 1 : number + 2]):
                points.append("; ".join(" ".join(cell.split()) for cell in cells if cell))
        elif _LIST_ITEM.match(line):
            end_paragraph()
            points.append(" ".join(words.split()))
        elif not title and not points and not paragraph and _titled(words, lines[number + 1 :]):
            title = words
        else:
            paragraph.append(words)
    end_paragraph()
    return _cut(title), [_cut(point) for point in points[:KEY_POINTS]]


def _without_code(text: str) -> list[str]:
    """The lines of `text`, those of fenced code blocks (fences included)
    blank: code is no title, heading, figure or point."""
    lines, fence = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                fence = ""
        elif opening := _FENCE.match(stripped):
            fence = opening.group()
        else:
            lines.append(line)
            continue
        lines.append("")
    return lines


def _item(line: str) -> str:
    """The text of a list item (bulleted or numbered), without bold; ""
    when `line` is none."""
    if not (marker := _LIST_ITEM.match(line)):
        return ""
    return _EMPHASIS.sub("", line[marker.end() :]).strip()


def _section(line: str) -> tuple[int, str] | None:
    """The level and name (lower case) of a section heading, or None.  A
    line in bold is one only when it names a section (**Risks**): any other
    (**Equities**) is a part of the section it is in."""
    if not (match := _SECTION.fullmatch(line)):
        return None
    level = len(match[1]) if match[1] else 2
    named = _EMPHASIS.sub("", (match[2] or match[4]).rstrip(" \t#")).strip().rstrip(":").strip()
    named = " ".join(named.lower().split())
    named = next((section for section, said in _SECTION_NAMES if said.match(named)), named)
    return None if match[3] and named not in SECTIONS else (level, named)


def _pair(item: str, line: str, following: list[str]) -> tuple[str, str] | None:
    """A figure's name and value: from a list item 'Name: value', or a row
    of a two-column table (neither its header nor its rule)."""
    if item:
        cells = item.split(":", 1) if ":" in item else _DASH.split(item, maxsplit=1)
    elif (cells := _table_row(line)) is None or _rule(cells) or _header(following):
        return None
    name, value = (_EMPHASIS.sub("", cell).strip() for cell in [*cells, "", ""][:2])
    return (name, value) if len(cells) == 2 and name and value else None


def _table_row(line: str) -> list[str] | None:
    """The cells of a markdown table row, or None."""
    if len(line) < 2 or not (line.startswith("|") and line.endswith("|")):
        return None
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line[1:-1])]


def _header(following: list[str]) -> bool:
    """Whether a table row is its table's header: the rule follows it."""
    under = _table_row(following[0].strip()) if following else None
    return under is not None and _rule(under)


def _rule(cells: list[str]) -> bool:
    """Whether a table row is the rule under its header (|---|:---:|)."""
    return all(_TABLE_SEPARATOR.fullmatch(cell) for cell in cells)


def _front_matter_end(lines: list[str]) -> int:
    """The line that closes front matter opened by the first one (0: none)."""
    return next((i for i, line in enumerate(lines[1:], 1) if line.strip() in ("---", "...")), 0)


def _titled(line: str, rest: list[str]) -> bool:
    """Whether a document's first line is its title: short, no sentence,
    and more follows."""
    return (
        len(line) <= TITLE_CHARS
        and not _SENTENCE_END.search(line + " ")
        and any(_WORD.search(other) for other in rest)
    )


def _cut(text: str) -> str:
    if len(text) <= POINT_CHARS:
        return text
    return text[:POINT_CHARS].rsplit(" ", 1)[0] + " …"


def shared_terms(sheets: list[FactSheet], limit: int = 8) -> list[str]:
    """Words of four or more letters that every document's title or points
    use, but for the commonest: the most used first."""
    counts = [Counter(_TERM.findall(" ".join([s.title, *s.points]).lower())) for s in sheets]
    shared = set.intersection(*(set(c) for c in counts)) - COMMON_WORDS
    total = sum(counts, Counter())
    return sorted(shared, key=lambda term: (-total[term], term))[:limit]


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?|\.\d+")
# 1,234 and 12,345,678 (0,450 is a decimal comma: no group begins with 0).
_THOUSANDS = re.compile(r"[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
# After the number: a scale word (plural too; French and German: Md,
# Mrd, Mio, milliard), or a Japanese unit (no word boundary after it).
_SCALE = re.compile(
    r"\s*\)?\s*(?:(trillions?|billions?|millions?|thousands?|milliards?|mrd|mds?|mio|tn|bn|mn|m|k"
    r"|b)\b|(\u5146|\u5104|\u4e07))",
    re.I,
)
SCALES = {"trillion": 1e12, "billion": 1e9, "million": 1e6, "thousand": 1e3}
SCALES |= {"milliard": 1e9, "mrd": 1e9, "md": 1e9, "mio": 1e6}
SCALES |= {"tn": 1e12, "bn": 1e9, "mn": 1e6, "m": 1e6, "k": 1e3, "b": 1e9}
SCALES |= {"\u5146": 1e12, "\u5104": 1e8, "\u4e07": 1e4}  # 兆, 億, 万
# Basis points: a hundredth of a percent.
_BASIS_POINTS = re.compile(r"\s*(?:bps?|basis points?)\b", re.I)
MINUS_SIGNS = "-\u2212\u2013"  # hyphen-minus, minus sign, en dash
# Triangles: a minus in a Japanese sheet, a rise in many others.
TRIANGLES = "\u25b2\u25b3\u25bc\u25bd"
CURRENCY = "$\u20ac\u00a3\u00a5\u5186"  # $ € £ ¥ 円
_CURRENCY = re.compile(
    r"(?<![A-Za-z])[A-Z]{1,2}\$|[$\u20ac\u00a3\u00a5\u5186]"
    r"|(?<![A-Za-z])(?:USD|EUR|GBP|JPY|CHF|CAD|AUD|CNY|HKD|SEK|NOK|DKK|INR|KRW|SGD)\b"
)
_SAME_CURRENCY = {"US$": "$", "USD": "$", "EUR": "\u20ac", "GBP": "\u00a3", "JPY": "\u00a5"}
_SAME_CURRENCY |= {"\u5186": "\u00a5"}


def figure(value: str) -> float | None:
    """'$2.84 billion' -> 2.84e9, '$1.5bn' and '$1.5B' -> 1.5e9, '0.29%' ->
    0.29, '2,914' -> 2914, '0,45 %' -> 0.45, '2,4 Md\u20ac' -> 2.4e9,
    '35 bps' -> 0.35 (a percent), '\u22124.1%', '(4.1%)' and '(4.1)%' ->
    -4.1.  None unless the value holds one number, read without doubt: a
    date, a range, 'as of 2024: $2.8 billion', '1,234 %' (a thousands or a
    decimal comma?), a triangle (a minus, or a rise?) are not compared."""
    numbers = _NUMBER.findall(value)
    if len(numbers) != 1:
        return None
    written = numbers[0].rstrip(",")
    at = value.index(numbers[0])
    end = at + len(numbers[0])
    if _THOUSANDS.fullmatch(written):
        if "." not in written and value[end:].lstrip().startswith("%"):
            return None  # 1,234 %: a German sheet's 1.234 %
        written = written.replace(",", "")
    elif written.count(",") == 1 and "." not in written:
        written = written.replace(",", ".")  # a decimal comma
    elif "," in written:
        return None
    number = float(written)
    sign = value[:at].rstrip(" " + CURRENCY).removesuffix("US$").rstrip(" $")
    if sign.endswith(tuple(TRIANGLES)):
        return None
    # An accountant's negative: the number alone in brackets, (4.1%), ($2 bn),
    # (4.1)%, ($1.2) billion.
    alone = (
        rf"\(\s*[{CURRENCY}]?\s*{re.escape(numbers[0])}\s*[a-z]{{0,8}}\s*%?\s*\)"
        rf"|\(\s*[{CURRENCY}]?\s*{re.escape(numbers[0])}\s*\)\s*(?:%|[a-z]{{1,9}})"
    )
    if sign.endswith(tuple(MINUS_SIGNS)) or re.fullmatch(alone, value.strip(), re.I):
        number = -number
    if scale := _SCALE.match(value, end):
        word = (scale[1] or scale[2]).lower()
        number *= SCALES[word.removesuffix("s") if word not in SCALES else word]
    elif _BASIS_POINTS.match(value, end):
        number /= 100
    return number


def currency(value: str) -> str:
    """The currency a figure is given in, as its symbol where it has one
    ('$', '\u20ac', 'C$', 'CHF'); '' for none."""
    found = _CURRENCY.search(value)
    return _SAME_CURRENCY.get(found[0], found[0]) if found else ""


def _cell(text: str) -> str:
    """A table cell: "—" when there is nothing to say."""
    return text.replace("|", "\\|").replace("\n", " ") or "\u2014"


def compare_report(question: str, sheets: list[FactSheet]) -> str:
    """The fact sheets side by side, with the extremes of their figures;
    any other documents with their key points, and the terms they all use."""
    sheets = _distinct(sheets)
    funds = [s for s in sheets if s.is_fact_sheet]
    others = [s for s in sheets if not s.is_fact_sheet]
    compared = (
        f"{'Documents' if others else 'Funds'} compared: {', '.join(s.label for s in sheets)}."
    )
    lines = [f"# {question}", "", compared, ""]
    if funds:
        lines += _side_by_side(funds)
    if others:
        lines += ["## Key points", ""]
        for sheet in others:
            points = [f"- {point}" for point in sheet.points or [NO_TEXT]]
            lines += [f"### {sheet.label}", "", *points, ""]
    observations = _extremes(funds)
    if len(others) >= 2:
        terms = shared_terms(others)
        observations.append(
            f"- Terms every document uses: {', '.join(terms)}."
            if terms
            else "- The documents share no term beyond the commonest words."
        )
    lines += ["## Observations", "", *(observations or [NOTHING_COMPARED])]
    return "\n".join(lines) + "\n"


def _distinct(sheets: list[FactSheet]) -> list[FactSheet]:
    """The sheets, a document listed twice once (it is not compared with
    itself), each labelled with its document's path where another
    document has the same label (two notes titled "Summary")."""
    by_name: dict[object, FactSheet] = {}
    for sheet in sheets:
        by_name.setdefault(sheet.name or id(sheet), sheet)
    sheets = list(by_name.values())
    paths: dict[str, set[str]] = {}
    for sheet in sheets:
        paths.setdefault(sheet.label, set()).add(sheet.name)
    return [
        replace(sheet, qualifier=sheet.name) if len(paths[sheet.label]) > 1 else sheet
        for sheet in sheets
    ]


def _side_by_side(sheets: list[FactSheet]) -> list[str]:
    labels = [s.label for s in sheets]
    lines = ["## Side by side", ""]
    lines += ["| | " + " | ".join(map(_cell, labels)) + " |"]
    lines += ["|---" * (len(sheets) + 1) + "|"]
    rows: dict[str, str] = {"ticker": ""}  # a figure's name in lower case: as first written
    for sheet in sheets:
        for key in [*sheet.figures, *sheet.fees]:
            rows.setdefault(key.lower(), key)
    for key in filter(None, rows.values()):
        values = [sheet.value(key) for sheet in sheets]
        lines.append(f"| {_cell(key)} | " + " | ".join(map(_cell, values)) + " |")
    lines.append(
        "| Top holdings | " + " | ".join(_cell("; ".join(s.holdings[:3])) for s in sheets) + " |"
    )
    lines.append(
        "| Risks | "
        + " | ".join(_cell("; ".join(r.rstrip(".") for r in s.risks[:3])) for s in sheets)
        + " |"
    )
    return [*lines, ""]


def _extremes(sheets: list[FactSheet]) -> list[str]:
    """For each figure two or more sheets give: the lowest and the highest,
    each naming every sheet that gives it; or that they all give one."""
    lines = []
    for key, low_word, high_word in [
        ("Expense ratio", "Lowest", "highest"),
        ("Net assets", "Smallest", "largest"),
        ("1-year return", "Weakest", "strongest"),
        ("Distribution yield", "Lowest", "highest"),
    ]:
        known = [(v, s) for s in sheets if (v := figure(s.value(key))) is not None]
        if len(known) < 2:
            continue
        # A sheet that names no currency is taken to use the others' one.
        if len(given := sorted({currency(s.value(key)) for _, s in known} - {""})) > 1:
            lines.append(f"- {key}: not compared, given in {', '.join(given)}.")
            continue
        low, high = min(v for v, _ in known), max(v for v, _ in known)
        lowest, highest = _giving(key, low, known), _giving(key, high, known)
        if low == high:
            lines.append(f"- {key}: the same for {lowest}.")
        else:
            lines.append(f"- {key}: {low_word} {lowest}, {high_word} {highest}.")
    return lines


def _giving(key: str, extreme: float, known: list[tuple[float, FactSheet]]) -> str:
    """The sheets whose `key` is `extreme`, with the value as written."""
    named = [sheet for value, sheet in known if value == extreme]
    labels = ", ".join(dict.fromkeys(sheet.label for sheet in named))
    return f"{labels} ({named[0].value(key)})"


# A support reply quotes the articles that share the most with the ticket
# (a share of at least QUOTED_TERMS, and two thirds of the largest), at
# most QUOTED_ARTICLES of them, and of each the QUOTED_SENTENCES sentences
# sharing the most.
QUOTED_TERMS = 2
QUOTED_ARTICLES = 2
QUOTED_SENTENCES = 3
# What a term of the ticket's subject adds to its weight: the subject says
# what the ticket is about.
SUBJECT_WEIGHT = 2
# Words of a ticket that say nothing of what it asks, as terms (`_terms`).
_GREETINGS = frozenset(
    word[:5] for word in ["hello", "thanks", "regards", "best", "good", "morning", "dear", "please"]
)
# "Ticket T-1042 from Ada Lovelace <ada@example.com>: Refund" (support_prompt).
_TICKET_HEADING = re.compile(r"Ticket (\S+) from (.*?) ?<[^<>]*>: (.*)")


def support_reply(prompt: str) -> str:
    """A reply to the ticket of a support prompt, quoting the sentences of
    the articles that share the most of its terms (a word of four or more
    letters, but the commonest; one of five or more by its first five, so
    "refund" meets "refunds").  A term of its subject weighs more; one
    that most of three or more articles use, not at all: it tells none
    apart.  Each article quoted is named."""
    blocks = document_blocks(prompt)
    if not blocks or blocks[0][0] != "ticket":
        raise ProviderError("the prompt holds no ticket")
    heading = _QUESTION_TAG.unescape(prompt.partition("\n\n")[0])
    match = _TICKET_HEADING.fullmatch(heading)
    name, subject = (match[2], match[3]) if match else ("", heading)
    articles = [
        (article, _terms(text), *_article_sentences(text, article)) for article, text in blocks[1:]
    ]
    used = Counter(term for _, terms, _, _ in articles for term in terms)
    common = {
        term for term, count in used.items() if len(articles) >= 3 and 2 * count > len(articles)
    }
    weight = Counter(dict.fromkeys(_terms(blocks[0][1]) - _GREETINGS - common, 1))
    for term in _terms(subject) - _GREETINGS - common:
        weight[term] += SUBJECT_WEIGHT

    def share(terms: set[str]) -> int:
        return sum(weight[term] for term in terms)

    quoted: list[tuple[int, str, str, list[str]]] = []
    for article, terms, title, sentences in articles:
        shares = [share(_terms(sentence)) for sentence in sentences]
        best = sorted(range(len(sentences)), key=lambda i: -shares[i])[:QUOTED_SENTENCES]
        chosen = [sentences[i] for i in sorted(best) if shares[i]]
        if chosen and share(terms) >= QUOTED_TERMS:
            quoted.append((share(terms), article, title, chosen))
    quoted.sort(key=lambda each: (-each[0], each[1]))
    quoted = [each for each in quoted if 3 * each[0] >= 2 * quoted[0][0]][:QUOTED_ARTICLES]
    lines = [f"Hello {name}," if name else "Hello,", ""]
    lines += [f"Thank you for writing to us about “{subject}”.", ""]
    for _, article, title, chosen in quoted:
        lines += [f"From our article “{title}” ({article}):", ""]
        lines += [*(f"> {sentence}" for sentence in chosen), ""]
    if quoted:
        lines += ["If this does not answer your question, reply to this email and we will help."]
    else:
        lines += [
            "No article of our knowledge base answers your question, so a member of our team "
            "will reply to you in person."
        ]
    return "\n".join([*lines, "", "Kind regards,", "The support team"])


def _terms(text: str) -> set[str]:
    words = {word for word in _TERM.findall(text.lower()) if word not in COMMON_WORDS}
    return {word[:5] for word in words}


def _article_sentences(text: str, name: str) -> tuple[str, list[str]]:
    """An article's title (its first heading; `name` without one) and the
    sentences of its paragraphs and list items, in their order."""
    title, sentences, paragraph = "", [], []

    def end_paragraph() -> None:
        sentences.extend(s for s in _SENTENCE_END.split(" ".join(paragraph)) if s)
        paragraph.clear()

    for raw in _without_code(text):
        line = raw.strip()
        words = " ".join(_MARKUP.sub("", line).split())
        if not words or _HEADING.match(line) or _LIST_ITEM.match(line):
            end_paragraph()
            if _HEADING.match(line):
                title = title or words
            elif words:
                sentences.append(words)
        else:
            paragraph.append(words)
    end_paragraph()
    return title or name, sentences


# Parsed once per document, not once per prompt: a run's summaries and its
# report give the provider the same documents again.  The sheets are only
# read (a qualified one is a copy, `replace`), so one serves every caller.
@functools.lru_cache(maxsize=256)
def _parsed(text: str, name: str) -> FactSheet:
    return FactSheet.parse(text, name)


class OfflineProvider:
    """Deterministic and extractive: it only repeats what the documents say."""

    name = "offline"

    def complete(self, messages: list[dict[str, str]]) -> str:
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        prompt = "\n".join(m["content"] for m in messages if m["role"] == "user")
        if system == SUPPORT_INSTRUCTIONS:
            return support_reply(prompt)
        sheets = [_parsed(text, name) for name, text in document_blocks(prompt)]
        if not sheets:
            raise ProviderError("the prompt holds no <document> block")
        if system == COMPARE_INSTRUCTIONS:
            # What precedes the documents, on one line: the report's heading.
            asked = _QUESTION_TAG.unescape(
                prompt.partition('<document name="')[0].removeprefix("Question: ")
            )
            return compare_report(" ".join(asked.split()) or "Comparison", sheets)
        return "\n\n".join(sheet.to_markdown() for sheet in sheets)


# A model's answer is a summary or a report: more than this is no answer
# (a receipt, a prompt and a page would each carry it whole).
MAX_ANSWER_BYTES = 2_000_000


# Answers a model API gives when busy, or when it failed before it
# answered: asked again after a pause (as the vendors' own clients do), up
# to MODEL_RETRIES times, within the call's time.  A model call is a read:
# asked twice, it has no effect but its cost.
RETRIED_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MODEL_RETRIES = 2
# The pause before asking again: the answer's Retry-After (seconds), at
# most MAX_RETRY_AFTER, else FIRST_PAUSE, doubled each time.
FIRST_PAUSE = 0.5
MAX_RETRY_AFTER = 30.0


class _Busy(ProviderError):
    """An answer worth asking again for, after `pause` seconds (None: as
    the backoff says)."""

    def __init__(self, message: str, pause: float | None = None) -> None:
        super().__init__(message)
        self.pause = pause


class OpenAICompatibleProvider:
    """POST {RUNDESK_MODEL_URL}/chat/completions, with a timeout for the
    whole call, its retries included."""

    name = "openai"

    def __init__(self, url: str, model: str, api_key: str, timeout: float) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout

    def complete(self, messages: list[dict[str, str]]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": 0})
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        # S310: settings.env_url allows http(s) URLs only.
        request = urllib.request.Request(self.url, body.encode(), headers, method="POST")  # noqa: S310
        deadline = time.monotonic() + self.timeout
        attempt = 1
        while True:
            try:
                return self._ask(request, deadline)
            except _Busy as busy:
                pause = FIRST_PAUSE * 2 ** (attempt - 1) if busy.pause is None else busy.pause
                if attempt > MODEL_RETRIES or time.monotonic() + pause >= deadline:
                    tries = f" ({attempt} attempts)" if attempt > 1 else ""
                    raise ProviderError(f"{busy}{tries}") from busy
                time.sleep(pause)
                attempt += 1

    def _ask(self, request: urllib.request.Request, deadline: float) -> str:
        """One request, within what is left of the call's time."""
        try:
            # A redirect is an HTTPError: the key goes nowhere else.
            left = max(deadline - time.monotonic(), 0.001)
            with NOT_REDIRECTED.open(request, timeout=left) as response:
                payload = json.loads(self._answer(response, deadline))
        except urllib.error.HTTPError as error:
            if error.code in RETRIED_STATUS:
                raise _Busy(
                    f"model API answered HTTP {error.code}", _retry_after(error.headers)
                ) from error
            raise ProviderError(f"model API answered HTTP {error.code}") from error
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as error:
            # Refused, reset or closed before an answer: nothing was answered.
            raise _Busy(f"model API unreachable or too slow: {error}") from error
        except TimeoutError as error:
            raise ProviderError(f"model API unreachable or too slow: {error}") from error
        except (ValueError, RecursionError) as error:  # not JSON (or nested too deep), not UTF-8
            raise ProviderError("model API answered with something other than JSON") from error
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ProviderError("model API answer has no choices[0].message.content") from None
        if not isinstance(content, str) or not content.strip():
            # null (a refusal, a tool call), blank or not text: nothing to report.
            raise ProviderError(f"model API answered with no text (content: {content!r:.80})")
        return content

    def _answer(self, response: http.client.HTTPResponse, deadline: float) -> bytes:
        """The answer's body, whole within the call's time and size: the
        socket's timeout bounds each read only, and a server that trickles
        would hold the run for as long as it likes."""
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(64 * 1024):
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise ProviderError(f"model API answer is larger than {MAX_ANSWER_BYTES} bytes")
            if time.monotonic() > deadline:
                raise ProviderError(f"model API too slow: no whole answer in {self.timeout:g} s")
            chunks.append(chunk)
        return b"".join(chunks)


def _retry_after(headers: Message | None) -> float | None:
    """The seconds a Retry-After header asks to wait (at most
    MAX_RETRY_AFTER); None where it gives none as a number."""
    try:
        seconds = float(headers.get("Retry-After", "") if headers else "")
    except ValueError:
        return None
    return None if math.isnan(seconds) else min(max(seconds, 0.0), MAX_RETRY_AFTER)


def get_provider() -> Provider:
    if settings.RUNDESK_MODEL_PROVIDER == "openai":
        return OpenAICompatibleProvider(
            settings.RUNDESK_MODEL_URL,
            settings.RUNDESK_MODEL,
            settings.RUNDESK_MODEL_API_KEY,
            settings.RUNDESK_MODEL_TIMEOUT,
        )
    return OfflineProvider()
