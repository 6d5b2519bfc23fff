"""An HTML page read as the text a browser shows of it, in the shape the
offline provider reads (headings, items, table rows, paragraphs)."""

from __future__ import annotations

import pytest

from runs.agents.html_text import is_page, page_text
from runs.agents.providers import FactSheet


@pytest.mark.parametrize(
    ("text", "page"),
    [
        ("<!DOCTYPE html><p>x</p>", True),
        ("  <!-- built 2026 --> <!--x--><html lang=en>", True),
        ("<body><p>x</p>", True),
        ("# Notes\n\n<b>bold</b> in markdown", False),
        ("<!-- a comment that never closes <html>", False),
        ("<p>a fragment is markdown's inline HTML</p>", False),
    ],
)
def test_only_a_whole_page_is_read_as_html(text, page):
    assert is_page(text) is page


def test_a_head_left_open_hides_only_the_head():
    """</head> and <body> may be left out: the body began at its first element."""
    page = "<!doctype html><html><head><meta charset=utf-8><title>Fund</title><h2>Alpha</h2>"
    assert page_text(page + "<p>Text.</p>") == "# Fund\n## Alpha\n\nText.\n"


def test_the_title_is_the_heads_never_an_icons():
    page = "<html><head><title>Fund</title></head><body><svg><title>Search</title></svg><p>Hi"
    assert page_text(page) == "# Fund\nHi\n"


def test_table_cells_and_rows_left_open_are_rows_with_their_header_rule():
    page = "<html><body><table><tr><th>A<th>B<tr><td>Ticker<td>X<tr><td>Net<td>$1 bn</table>"
    assert page_text(page + "<p>after") == (
        "| A | B |\n|---|---|\n| Ticker | X |\n| Net | $1 bn |\n\nafter\n"
    )


def test_scripts_styles_navigation_and_code_are_no_text():
    page = (
        "<html><head><style>p {}</style><script>var a = '<p>no</p>';</script></head><body>"
        "<nav><a href=/>Home</a></nav><pre># not a heading\nx = 1</pre>"
        "<ul><li>one <b>two</b> three<li>four</ul><p>A &amp; B</p></body></html>"
    )
    assert page_text(page) == "- one two three\n- four\n\nA & B\n"


def test_an_xhtml_page_with_its_xml_declaration_is_a_page():
    page = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0//EN">\n'
        '<html xmlns="http://www.w3.org/1999/xhtml"><head><title>X</title>'
        "<script>secret()</script></head><body><h1>Fund X</h1><p>It holds bonds.</p></body></html>"
    )
    assert is_page(page)
    assert page_text(page) == "# Fund X\n\nIt holds bonds.\n"


def test_a_page_whose_only_text_is_preformatted_is_read_line_by_line():
    page = (
        "<html><head><title>10-K</title></head><body><pre>\nANNUAL REPORT\n\n"
        "Net sales rose 4%.\nCosts fell.\n</pre></body></html>"
    )
    assert page_text(page) == "# 10-K\nANNUAL REPORT\n\nNet sales rose 4%.\nCosts fell.\n"
    # Beside other text, code stays out, as a markdown document's does.
    assert "print" not in page_text("<html><body><p>Text.</p><pre>print(1)</pre></body></html>")


def test_a_pages_text_that_looks_like_markdown_is_read_as_text():
    """A paragraph that begins with '#', a fence, a pipe or bold markers is
    the page's text: no heading, no code block hiding what follows."""
    page = (
        "<!doctype html><head><title>Notes</title></head><h1>Notes</h1>"
        "<p># 1 choice of advisers</p><p>```</p><p>Fees fell in 2025.</p>"
        "<p>| not | a table |</p><p>**Risks**</p><p>Markets may fall.</p>"
    )
    text = page_text(page)
    assert text.splitlines()[:3] == ["# Notes", "", "\\# 1 choice of advisers"]
    sheet = FactSheet.parse(page, "notes.html")
    assert sheet.title == "Notes"
    assert sheet.points == [
        "# 1 choice of advisers",
        "Fees fell in 2025.",
        "| not | a table |",
        "**Risks**",
        "Markets may fall.",
    ]
