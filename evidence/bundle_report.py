"""`report.html` of an investigation bundle: the run page, in one file that
opens offline in any browser.

What it shows is what the run page shows, built by the same code
(evidence.run_facts.run_facts: plain labels, evidence as labelled fields, one row
per checkpoint, answers rendered and sanitised, the plotly timeline), plus
what an investigator without the dashboard needs on the page: the decisions
on each item and on the run, and the event log.

Self-contained: the CSS, plotly.js and the script that draws the chart
(static/js/rundesk.js, which the run page uses) are inline, the chart's
figure sits in a `<script type="application/json">` block, and the page's
own Content-Security-Policy lets the browser load nothing from anywhere.
Deterministic: no clock, no random id, every list in a stable order, so an
unchanged run renders to the same bytes (an exported bundle's report is
sealed by its hash).  A run still queued or running changes as it is read,
and its timeline is drawn up to the moment of export.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nh3
from django.contrib.staticfiles import finders
from django.db.models import Q
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe

from evidence.models import CaptureGap, EvidenceCopy, LockWait
from evidence.run_facts import item_fields, run_facts
from runs.answers import answer_html
from runs.inbox import history
from runs.models import Run, RunStatus
from runs.timeline import EventKind
from runs.words import evidence_fields, left_out, plain

TEMPLATE = "bundle_report.html"
# The plotly.js bundle templates/base.html loads too; `make plotly` updates both.
PLOTLY_JS = "vendor/plotly-basic-4.1.1.min.js"
# The event log shows the oldest this many; events.jsonl holds them all.
EVENTS_SHOWN = 2000
# What the run page shows of copies, gaps and lock waits (evidence.run_facts.run_facts).
ROWS_SHOWN = 50


def report_html(
    run: Run, *, include_evidence: bool = True, redact: Callable[[str], str] = str
) -> str:
    """The run's report page, as one self-contained HTML document.  Evidence
    copies (model inputs and outputs) only when `include_evidence`.

    `redact` is applied to what the run wrote, before it is rendered: to
    the answers' markdown (rendered, a secret could come out split across
    tags: `<code>`, list items), then to the page's body.  Never to the
    page's own CSS and scripts."""
    context = run_facts(run, redact)
    for item in context["items"]:
        item.fields = item_fields(run, item, _redacted(item.evidence, redact))
    for revision in context["revisions"]:
        revision.html, revision.unlinked = _offline(answer_html(redact(revision.content)))
    decisions = history(run.decisions.all())
    by_item: dict[int | None, list[Any]] = {}
    for decision in decisions:
        decision.fields = evidence_fields(_redacted(decision.evidence, redact))
        by_item.setdefault(decision.item_id, []).append(decision)
    for item in context["items"]:
        item.decision_rows = by_item.get(item.pk, [])
    # The run page's lock waits are newest first; ties broken here, so that
    # which 50 are shown does not depend on the plan.
    waits = LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))
    # With run_id deferred, the related manager's queryset reads it back
    # one query per event (it sets each event's run): 2,000 queries.
    events = run.events.only("run", "kind", "message", "created_at").order_by("created_at", "id")
    shown = list(events[:EVENTS_SHOWN])
    total = events.count() if len(shown) == EVENTS_SHOWN else len(shown)
    for event in shown:
        event.kind_label = plain(EventKind, event.kind)
    context |= {
        "run": run,
        "run_decisions": by_item.get(None, []),
        "waits": list(waits.select_related("incident").order_by("-first_seen", "-id")[:ROWS_SHOWN]),
        "waits_total": waits.count(),
        "gaps_total": CaptureGap.objects.filter(run=run).count(),
        "include_evidence": include_evidence,
        "copies": list(context["copies"]) if include_evidence else [],
        "copies_total": EvidenceCopy.objects.filter(run=run).count(),
        "events": shown,
        "events_total": total,
        "events_left_out": total - len(shown),
        "time_zone": timezone.get_current_timezone_name(),
        # What the run page says at its top of a completed run with gaps.
        "left_out": left_out(run) if run.status == RunStatus.COMPLETED else [],
    }
    body = redact(render_to_string(f"{TEMPLATE}#body", context))
    # Only the page's own scripts run: a nonce nobody writing a question or
    # a document can know, as it is the digest of the page they are part of.
    nonce = hashlib.sha256(body.encode()).hexdigest()[:32]
    return render_to_string(
        TEMPLATE,
        {
            "run": run,
            "body": mark_safe(body),  # noqa: S308 (rendered by the template, escaped there)
            "nonce": nonce,
            "css": mark_safe(_static("css/rundesk.css")),  # noqa: S308 (our own file)
            "draw": mark_safe(_static("js/rundesk.js")),  # noqa: S308 (our own file)
            "plotly": _plotly_js(),
        },
    )


def _redacted(evidence: Any, redact: Callable[[str], str]) -> Any:
    """Evidence redacted as the JSON it is, before it becomes fields: a
    field's name and its value are shown apart (a label, a text), where no
    pattern run over the page sees them together."""
    return json.loads(redact(json.dumps(evidence)))


def _offline(html: str) -> tuple[SafeString, int]:
    """An answer as the run page renders it (runs.answers.answer_html, which
    keeps no image), without the addresses of links that point off the
    page: the report loads nothing and leads nowhere (revisions.jsonl keeps the text as
    written).  Also the number of addresses left out."""
    dropped = 0

    def in_page(element: str, attribute: str, value: str) -> str | None:
        nonlocal dropped
        if attribute == "href" and not value.startswith("#"):
            dropped += 1
            return None
        return value

    cleaned = nh3.clean(str(html), attribute_filter=in_page)
    return mark_safe(cleaned), dropped  # noqa: S308 (sanitised by nh3, twice)


def _static(name: str) -> str:
    """A file of static/, read when the report is made: the report looks
    like the dashboard of the installation that exported it."""
    found = finders.find(name)
    if not found:
        raise FileNotFoundError(f"static file {name} not found")
    return Path(found).read_text()


@functools.cache
def _plotly_js() -> SafeString:
    """The plotly.js bundle the dashboard serves (static/vendor/: only the
    trace types the charts draw, a quarter of the whole plotly.js)."""
    # Its text never closes the element early (a "</script" in a string).
    return mark_safe(_static(PLOTLY_JS).replace("</script", "<\\/script"))  # noqa: S308 (plotly's own code)
