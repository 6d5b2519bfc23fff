"""What the run page shows of a run, in an operator's words: shared by the
dashboard's run page (dashboard/views.py) and a bundle's report.html
(evidence/bundle_report.py), so both say the same thing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import markdown
import nh3
from django.db.models import Q
from django.utils.safestring import SafeString, mark_safe
from markdown.inlinepatterns import HTML_RE, HtmlInlineProcessor

from dashboard import charts
from dashboard.checkpoints import checkpoint_rows
from dashboard.context import evidence_fields, plain, status_words, words
from evidence.models import CaptureGap, CaptureStats, EvidenceCopy, GapReason, LockWait
from runs.models import (
    ActionState,
    EffectClass,
    OutcomeKind,
    OutcomeState,
    Phase,
    Run,
)


def run_facts(run: Run, redact: Callable[[str], str] = str) -> dict[str, Any]:
    """What changes while a run is active, in an operator's words.  The
    timeline's hovers are cut short: `redact` is applied to their text
    before the cut (a bundle's redaction of the page after it would find
    only part of a secret across the cut)."""
    run.status_label, run.phase_label = status_words(run), plain(Phase, run.phase)
    revisions = list(run.revisions.order_by("number"))
    for revision in revisions:
        revision.html = answer_html(revision.content)
    actions = list(run.actions.select_related("receipt").order_by("id"))
    for action in actions:
        action.state_label = plain(ActionState, action.state)
        action.class_label = plain(EffectClass, action.effect_class)
        action.kind_label = words(action.kind)
    items = list(run.outcome_items.select_related("action").order_by("id"))
    for item in items:
        item.kind_label = plain(OutcomeKind, item.kind)
        item.state_label = plain(OutcomeState, item.state)
        item.fields = evidence_fields(item.evidence)
    gaps = list(CaptureGap.objects.filter(run=run).order_by("id")[:50])
    for gap in gaps:
        gap.reason_label = plain(GapReason, gap.reason)
    checkpoints = checkpoint_rows(run.checkpoints.select_related("after_action").order_by("id"))
    return {
        "actions": actions,
        "checkpoints": checkpoints,
        "revisions": revisions,
        "items": items,
        "open_items": sum(item.state == OutcomeState.OPEN for item in items),
        "copies": EvidenceCopy.objects.filter(run=run).order_by("id")[:50],
        "gaps": gaps,
        "capture": CaptureStats.objects.filter(run=run).first(),
        "waits": LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))
        .select_related("incident")
        .order_by("-first_seen")[:50],
        "faults": json.dumps(run.faults, indent=1) if run.faults else "",
        "timeline": charts.timeline(run, actions, checkpoints, redact),
    }


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
