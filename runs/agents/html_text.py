"""An HTML page as the text the offline provider reads (runs/agents/providers.py):
headings as `#`, list items as `-`, table rows as `| a | b |`, paragraphs
apart, the page's title first where no heading gives one; what a browser
does not show as text (scripts, styles, the head, code) left out.  Only a
whole page is read so: a markdown document's inline HTML stays as it is."""

from __future__ import annotations

import re
from html.parser import HTMLParser

# How a whole HTML page begins, after blanks and comments.
_PAGE = re.compile(r"<(?:!doctype\s+html|html|head|body)\b", re.I)
_BLANKS = re.compile(r"\s*")
# Elements whose content is no text of the page: a site's navigation and
# code (as a markdown document's fenced code) neither.
HIDDEN = {"script", "style", "template", "noscript", "svg", "math", "iframe", "object"}
HIDDEN |= {"nav", "pre"}
# What a head holds; any other element begins the body (</head> and <body>
# may be left out).
HEAD = {"base", "link", "meta", "noscript", "script", "style", "template", "title"}
HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
# A page's own text that markdown would read as markup at the start of a
# line: a heading, a code fence (the rest of the page hidden), a table row, a
# line in bold (a section).  Such text is escaped with a backslash, as
# markdown escapes it.
MARKDOWN_START = re.compile(r"#|`{3}|~{3}|\||\*\*|__")
# Elements that begin and end a paragraph of their own.
BLOCKS = {
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog",
    "div", "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr",
    "html", "legend", "main", "ol", "p", "section", "summary", "table", "ul",
}  # fmt: skip


def is_page(text: str) -> bool:
    at = _BLANKS.match(text).end()
    # Comments, and an XHTML page's XML declaration, come before it.
    while text.startswith(("<!--", "<?xml"), at):
        closing = "-->" if text.startswith("<!--", at) else "?>"
        end = text.find(closing, at + 4)
        if end < 0:
            return False
        at = _BLANKS.match(text, end + len(closing)).end()
    return bool(_PAGE.match(text, at))


def page_text(page: str) -> str:
    """The text of an HTML page, one line per heading, item, row or paragraph.
    A page whose only text is preformatted (a filing, a plain-text report
    wrapped in <pre>) is read as that text, line by line."""
    lines = _read(page, HIDDEN)
    if not any(_WORDS.search(line) for line in lines[1:]):
        lines = _read(page, HIDDEN - {"pre"})
    title = lines.pop(0)
    if title and not any(line.startswith("# ") for line in lines):
        lines.insert(0, f"# {title}")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


_WORDS = re.compile(r"[^\W_]")


def _read(page: str, hidden: set[str]) -> list[str]:
    """The page's title, then its lines, with the `hidden` elements left out."""
    reader = _Reader(hidden)
    reader.feed(page)
    reader.close()
    reader.end_row()
    lines = ["".join(parts).strip() for parts in reader.lines]
    return [" ".join("".join(reader.title).split()), *lines]


class _Reader(HTMLParser):
    """Each line a list of parts, joined once at the end (a string grown
    in place is copied at each addition)."""

    def __init__(self, hidden: set[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.hidden_tags = hidden
        self.lines: list[list[str]] = [[]]
        self.title: list[str] = []
        self.in_head = self.in_title = False
        self.hidden = 0
        self.preformatted = 0
        self.cells: list[str] = []  # the tags of the open table row's cells

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "head":
            self.in_head = True
        elif self.in_head and tag not in HEAD:
            self.in_head = False
        if tag == "title" and self.in_head and not self.hidden:
            self.in_title = True
        elif tag in self.hidden_tags:
            self.hidden += 1
        elif self.hidden or self.in_head:
            return
        elif tag == "pre":
            self._paragraph()
            self.preformatted += 1
        elif tag in HEADINGS:
            self._paragraph()
            self.lines[-1].append("#" * HEADINGS[tag] + " ")
        elif tag == "li":
            self._line()
            self.lines[-1].append("- ")
        elif tag == "tr":
            self.end_row()
        elif tag in ("td", "th"):
            if self.cells:
                self._space()  # the cell before it may be left open
            self.cells.append(tag)
            self.lines[-1].append("| ")
        elif tag == "br":
            self._line()
        elif tag in BLOCKS:
            self._paragraph()

    def handle_endtag(self, tag: str) -> None:
        if tag == "head":
            self.in_head = False
        elif tag == "title":
            self.in_title = False
        elif tag in self.hidden_tags:
            self.hidden = max(0, self.hidden - 1)
        elif self.hidden or self.in_head:
            return
        elif tag == "pre":
            self.preformatted = max(0, self.preformatted - 1)
            self._paragraph()
        elif tag in ("td", "th"):
            self._space()
        elif tag in ("tr", "table"):
            self.end_row()
        elif tag == "li":
            self._line()
        if tag in HEADINGS or tag in BLOCKS:
            self._paragraph()

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title.append(data)
        elif self.preformatted and not self.hidden and not self.in_head:
            # Its own lines, a blank one between paragraphs.
            for line in data.splitlines(keepends=True):
                if words := " ".join(line.split()):
                    self.lines[-1].append(words)
                if not line.endswith(("\n", "\r")):
                    continue
                if words:
                    self._line()
                else:
                    self._paragraph()
        elif not self.hidden and not self.in_head and (words := " ".join(data.split())):
            if data[:1].isspace():
                self._space()
            if not any(part.strip() for part in self.lines[-1]) and MARKDOWN_START.match(words):
                words = "\\" + words
            self.lines[-1].append(words)
            if data[-1:].isspace():
                self.lines[-1].append(" ")

    def end_row(self) -> None:
        """Closes the open table row, if any (</td> and </tr> may be left
        out); a row of header cells gets the rule under it."""
        if not self.cells:
            return
        self._space()
        self.lines[-1].append("|")
        self._line()
        if set(self.cells) == {"th"}:
            self.lines[-1].append("|---" * len(self.cells) + "|")
            self._line()
        self.cells = []

    def _space(self) -> None:
        if self.lines[-1] and not self.lines[-1][-1].endswith(" "):
            self.lines[-1].append(" ")

    def _line(self) -> None:
        if any(part.strip() for part in self.lines[-1]):
            self.lines.append([])

    def _paragraph(self) -> None:
        self._line()
        if len(self.lines) > 1 and self.lines[-2]:
            self.lines.append([])
