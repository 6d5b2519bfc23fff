"""An HTML page as the text the offline provider reads (runs/providers.py):
headings as `#`, list items as `-`, table rows as `| a | b |`, paragraphs
apart, the page's title first where no heading gives one; what a browser
does not show as text (scripts, styles, the head) left out.  Only a whole
page is read so: a markdown document's inline HTML stays as it is."""

from __future__ import annotations

import re
from html.parser import HTMLParser

# How a whole HTML page begins, after blanks and comments.
_PAGE = re.compile(r"<(?:!doctype\s+html|html|head|body)\b", re.I)
_BLANKS = re.compile(r"\s*")
# Elements whose content is no text of the page (a site's navigation neither).
HIDDEN = {"script", "style", "head", "template", "noscript", "svg", "math", "iframe", "object"}
HIDDEN |= {"nav"}
HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
# Elements that begin and end a paragraph of their own.
BLOCKS = {
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog",
    "div", "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr",
    "html", "legend", "main", "ol", "p", "pre", "section", "summary", "table", "ul",
}  # fmt: skip


def is_page(text: str) -> bool:
    at = _BLANKS.match(text).end()
    while text.startswith("<!--", at):
        end = text.find("-->", at + 4)
        if end < 0:
            return False
        at = _BLANKS.match(text, end + 3).end()
    return bool(_PAGE.match(text, at))


def page_text(page: str) -> str:
    """The text of an HTML page, one line per heading, item, row or paragraph."""
    reader = _Reader()
    reader.feed(page)
    reader.close()
    lines = [line.strip() for line in reader.lines]
    title = " ".join(reader.title.split())
    if title and not any(line.startswith("# ") for line in lines):
        lines.insert(0, f"# {title}")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines = [""]
        self.title = ""
        self.hidden = 0
        self.in_title = False
        self.cells: list[str] = []  # the tags of the table row's cells

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self.in_title = True
        elif tag in HIDDEN:
            self.hidden += 1
        elif self.hidden:
            return
        elif tag in HEADINGS:
            self._paragraph()
            self.lines[-1] = "#" * HEADINGS[tag] + " "
        elif tag == "li":
            self._line()
            self.lines[-1] = "- "
        elif tag == "tr":
            self._line()
            self.cells = []
        elif tag in ("td", "th"):
            self.cells.append(tag)
            self.lines[-1] += "| "
        elif tag == "br":
            self._line()
        elif tag in BLOCKS:
            self._paragraph()

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
        elif tag in HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif self.hidden:
            return
        elif tag in ("td", "th"):
            self.lines[-1] = self.lines[-1].rstrip() + " "
        elif tag == "tr":
            self.lines[-1] += "|"
            self._line()
            if self.cells and set(self.cells) == {"th"}:  # a header row: its rule under it
                self.lines[-1] = "|---" * len(self.cells) + "|"
                self._line()
        elif tag == "li":
            self._line()
        elif tag in HEADINGS or tag in BLOCKS:
            self._paragraph()

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title += data
        elif not self.hidden:
            words = " ".join(data.split())
            if words:
                space = " " if data[:1].isspace() and not self.lines[-1].endswith(" ") else ""
                self.lines[-1] += space + words + (" " if data[-1:].isspace() else "")

    def _line(self) -> None:
        if self.lines[-1].strip():
            self.lines.append("")

    def _paragraph(self) -> None:
        self._line()
        if self.lines[-1] == "" and len(self.lines) > 1 and self.lines[-2] != "":
            self.lines.append("")
