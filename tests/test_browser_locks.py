"""The lock page in Chromium: an imported deadlock, with a wait of other
processes beside it, drawn as plotly draws it: each label on its own
arrow, no two labels over each other, the independent wait in a band of
its own, and the process PostgreSQL ended named on the page and marked on
the graph.  Screenshot: lock-graph-victim.png."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from evidence import locks, pglog
from evidence.locks import Edge, Graph, Process
from evidence.models import IncidentSource
from runs.submission import submit
from tests.test_browser import SCREENSHOTS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"

# Per wait (arrow, then its label, as lock_graph adds them): the box of the
# arrow's line and head, and of its label's background, in page pixels.
DRAWN = """() => {
  const box = (el) => { const r = el.getBoundingClientRect();
    return {x0: r.left, y0: r.top, x1: r.right, y1: r.bottom}; };
  const notes = [...document.querySelectorAll("#chart-locks g.annotation")];
  const waits = [];
  for (let i = 0; i + 1 < notes.length; i += 2) {
    const paths = [...notes[i].querySelectorAll(".annotation-arrow-g path")].map(box);
    const arrow = {x0: Math.min(...paths.map(p => p.x0)), y0: Math.min(...paths.map(p => p.y0)),
                   x1: Math.max(...paths.map(p => p.x1)), y1: Math.max(...paths.map(p => p.y1))};
    waits.push({arrow, label: box(notes[i + 1].querySelector("rect.bg")),
                text: notes[i + 1].textContent});
  }
  return waits;
}"""


def test_the_lock_graph_draws_labels_on_their_arrows_and_names_the_victim(page: Page):
    victim_run, owner_run = (submit(question=q, documents=["a.md"]) for q in "vo")
    text = (FIXTURES / "three_way.csv").read_text()
    # At once: one after the other, run-3 made run-210 and then run-2 took its start.
    ids = {"3": victim_run.pk, "2": owner_run.pk}
    text = re.sub(r"run-([23])\b", lambda match: f"run-{ids[match.group(1)]}", text)
    ((_, incident),) = pglog.import_log(text, "postgresql.csv")
    # A wait of two other processes, seen at the same time: independent.
    beside = Graph({p: Process(p, "psql") for p in (4201, 4202)}, [Edge(4201, 4202, "ShareLock")])
    locks.store(IncidentSource.SAMPLER, beside).waits.update(incident=incident)

    page.goto(f"/locks/{incident.pk}/")
    expect(page.locator("#incident-victim")).to_have_text(
        f"PostgreSQL ended process 4102 (run {victim_run.pk}) to break the cycle: it rolled "
        "back that process's transaction with the error \"deadlock detected\", and the others' "
        "waits went on."
    )
    chart = page.locator("#chart-locks")
    expect(chart.locator("svg.main-svg").first).to_be_visible()
    expect(chart.get_by_text("ended by PostgreSQL")).to_be_visible()
    expect(chart.get_by_text(f"held by process 4103 · run {owner_run.pk}")).to_be_visible()

    waits = page.evaluate(DRAWN)
    assert len(waits) == 4
    for wait in waits:
        arrow, label = wait["arrow"], wait["label"]
        centre = ((label["x0"] + label["x1"]) / 2, (label["y0"] + label["y1"]) / 2)
        # On its arrow: within the box its line and head span (3 px for the line's width).
        assert arrow["x0"] - 3 <= centre[0] <= arrow["x1"] + 3, wait
        assert arrow["y0"] - 3 <= centre[1] <= arrow["y1"] + 3, wait
    labels = [wait["label"] for wait in waits]
    for i, first in enumerate(labels):
        for second in labels[i + 1 :]:
            apart = (
                first["x1"] <= second["x0"]
                or second["x1"] <= first["x0"]
                or first["y1"] <= second["y0"]
                or second["y1"] <= first["y0"]
            )
            assert apart, (first, second)
    # The independent wait is drawn below the deadlock, not across it.
    (alone,) = [wait for wait in waits if "process 4202" in wait["text"]]
    others = [wait for wait in waits if wait is not alone]
    assert alone["arrow"]["y0"] > max(wait["arrow"]["y1"] for wait in others)

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("main").screenshot(path=str(SCREENSHOTS / "lock-graph-victim.png"))
