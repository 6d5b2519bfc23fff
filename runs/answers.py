"""An answer revision's markdown (model output) as HTML that is safe to
show: the run page's, a bundle's report.html's, drafts and the final
answer alike."""

from __future__ import annotations

import markdown
import nh3
from django.utils.safestring import SafeString, mark_safe
from markdown.inlinepatterns import HTML_RE, HtmlInlineProcessor

# What an answer may contain: nh3's safe tags but images (and image maps),
# whose addresses the browser would fetch as it shows the answer.
ANSWER_TAGS = nh3.ALLOWED_TAGS - {"img", "map", "area"}

# The elements HTML has (WHATWG's list, with the obsolete ones browsers still
# parse), SVG and MathML's roots.  In an answer, only a tag naming one is
# markup (for nh3 to keep or drop); any other `<...>` is text to show:
# `List<String>`, `Map<K, V>`, `<T>`.
_ELEMENTS = """
a abbr acronym address applet area article aside audio b base basefont bdi bdo bgsound big
blink blockquote body br button canvas caption center cite code col colgroup data datalist dd
del details dfn dialog dir div dl dt em embed fieldset figcaption figure font footer form frame
frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html i iframe image img input ins isindex kbd
keygen label legend li link listing main map mark marquee math menu menuitem meta meter nav
nobr noembed noframes noscript object ol optgroup option output p param picture plaintext pre
progress q rb rp rt rtc ruby s samp script search section select slot small source spacer span
strike strong style sub summary sup svg table tbody td template textarea tfoot th thead time
title tr track tt u ul var video wbr xmp
"""
HTML_ELEMENTS = frozenset(_ELEMENTS.split())
_TAG_START = r"<(\/?+[a-zA-Z]"
if _TAG_START not in HTML_RE:
    raise ImportError("Python-Markdown's HTML_RE changed: review ANSWER_HTML_RE")
ANSWER_HTML_RE = HTML_RE.replace(
    _TAG_START,
    r"<(\/?+(?=(?i:" + "|".join(sorted(HTML_ELEMENTS)) + r")[\s/>])[a-zA-Z]",
    1,
)


class _ElementsOnly(markdown.Extension):
    """Inline HTML is markup only when its tag names an HTML element."""

    def extendMarkdown(self, md: markdown.Markdown) -> None:
        md.inlinePatterns.register(HtmlInlineProcessor(ANSWER_HTML_RE, md), "html", 90)


def answer_html(content: str) -> SafeString:
    """Model output, rendered from markdown and sanitised: no script, no
    event handler attribute survives, nothing is fetched as it is shown,
    and text that only looks like a tag is shown as written.  Drafts and
    the final answer alike."""
    html = markdown.markdown(content, extensions=["tables", _ElementsOnly()])
    return mark_safe(nh3.clean(html, tags=ANSWER_TAGS))  # noqa: S308 (sanitised by nh3 just above)
