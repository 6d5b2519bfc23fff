"""`bench --support-path` (runs/benchmarks/support_path.py), small: support
runs of the sample tickets through the real agent path, mailing and
updating the real local receivers the benchmark starts, counted by the
server on the test database.

The statistics wait is cut here: what the run's own connection did is
reported at once (pg_stat_force_next_flush), the rest may come late, so
the counts are held to a floor only."""

from __future__ import annotations

import functools

import pytest
from django.conf import settings
from django.core.management.base import CommandError

from runs.agents.receivers import Helpdesk, Mailbox
from runs.benchmarks import steps, support_path
from runs.models import Receipt, Run, RunStatus

pytestmark = pytest.mark.django_db(transaction=True)

# A ticket, the four articles of the sample knowledge base, the draft, the
# mail and the ticket update.
STEPS_PER_RUN = 1 + 4 + 3
SUPPORT_SETTINGS = ("RUNDESK_SUPPORT_DIR", "RUNDESK_SMTP_URL", "RUNDESK_HELPDESK_URL")


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "STATS_SETTLE", 0.2)


def support_settings() -> list[object]:
    return [getattr(settings, name) for name in SUPPORT_SETTINGS]


def test_every_support_run_is_counted_and_sent_one_mail_and_one_ticket_update():
    before = support_settings()

    report = support_path.report(runs=5)

    assert (report["runs"], report["tickets"]) == (5, 4)
    assert report["steps"] == 5 * STEPS_PER_RUN
    assert report["mails"] == report["ticket_updates"] == 5
    # Each step commits at least its boundary, or its receipt with the next.
    assert report["commits_per_step"] >= 1 and report["wal_syncs_per_step"] > 0
    assert report["noise_wal_syncs_per_step"] >= 0
    runs = Run.objects.filter(agent="support").order_by("pk")
    assert [run.status for run in runs] == [RunStatus.COMPLETED] * 5
    # The sample tickets in turn.
    assert [run.input["ticket"] for run in runs] == [
        "T-1042",
        "T-1043",
        "T-1044",
        "T-1045",
        "T-1042",
    ]
    for step_key in ("send", "update"):
        assert Receipt.objects.filter(run__in=runs, step_key=step_key).count() == 5
    # The operator's receivers and tickets again once the benchmark is done.
    assert support_settings() == before


def test_a_run_that_does_not_complete_fails_the_benchmark_and_no_run_is_left_queued(
    monkeypatch,
):
    # The helpdesk keeps the second run's update (T-1043) and loses its answer.
    monkeypatch.setattr(
        support_path, "Helpdesk", functools.partial(Helpdesk, lose_answers_for={"T-1043"})
    )
    before = support_settings()

    with pytest.raises(CommandError, match=r"bench run \d+ \(support\) did not complete"):
        support_path.report(runs=3)

    runs = Run.objects.filter(agent="support").order_by("pk")
    assert [run.status for run in runs] == [
        RunStatus.COMPLETED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
    ]
    assert support_settings() == before


class KeepsEachMailTwice(Mailbox):
    async def handle_DATA(self, *args: object) -> str:
        await super().handle_DATA(*args)
        return await super().handle_DATA(*args)


def test_a_run_whose_mail_arrived_twice_fails_the_benchmark_naming_the_run(monkeypatch):
    monkeypatch.setattr(support_path, "Mailbox", KeepsEachMailTwice)

    with pytest.raises(RuntimeError, match="one mail and one ticket update") as failed:
        support_path.report(runs=2)

    first, second = Run.objects.filter(agent="support").order_by("pk")
    assert str(failed.value).endswith(f"run {first.pk}: 2 mails; run {second.pk}: 2 mails")
    assert {first.status, second.status} == {RunStatus.COMPLETED}
