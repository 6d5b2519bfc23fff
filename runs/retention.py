"""Retention: removing ended runs, with every row of theirs, once they are
older than an age (`manage.py purge_runs`, beat's `runs.tasks.purge_runs`).

Which runs may go is `Run.objects.purgeable()`: ended (completed, failed,
cancelled) before the age, of this installation, with no open item and no
bundle export under way.  A run queued, running or waiting for an operator
is never one of them.

The facts of a run (receipts, answer revisions, decisions, checkpoints,
items) are refused deletion by their triggers (migrations 0002, 0004,
0008).  Migration 0027 lets them go in one case only: the transaction set
`rundesk.purge` (SET LOCAL, gone at its end) and the row's run has ended,
and an item only once it is settled.  Only this module sets it.

The work goes in batches of BATCH runs, oldest first, one short
transaction each: its runs are locked FOR UPDATE SKIP LOCKED (a run
someone holds is left for the next purge), every lock it waits for is
bounded (LOCK_WAIT: a stranger's table lock ends the purge, saying so,
rather than hold a run's step behind it), and it takes no lock a run's
step waits for: the rows it removes belong to ended runs only, and
deleting rows takes no table lock that stops an insert.  With a bundle
directory, each run's bundle is exported and verified first, outside any
transaction; a run whose bundle failed is kept, with why.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import OperationalError, transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now

from evidence import bundles
from evidence.models import ACTIVE_BUNDLE_STATES, BundleExport
from runs.durable_files import sync_folder
from runs.lifecycle import TERMINAL_STATUSES
from runs.models import OutcomeItem, OutcomeState, Run
from runs.sql import commit_asynchronously, lock_refused, server_cursor, waits_bounded

# Runs removed per transaction: a batch's rows (a few dozen a run) are gone
# in well under a second, so no lock it takes is held for long.
BATCH = 500
# The longest any statement of a batch waits for a lock: a stranger's lock
# ends the purge (the rest is left for the next one), never the reverse.
LOCK_WAIT = "1s"

# Every row of a batch's runs (%(runs)s), children before their parents:
# (what is removed, the statement).  A lock wait's link to a run is
# cleared, not removed: the incident it belongs to is the server's, and may
# involve other runs.  tests/test_purge_runs.py checks that every foreign
# key to a run, or to a row of one, is here.
REMOVALS: list[tuple[str, str]] = [
    (
        "runs_alert",
        "DELETE FROM runs_alert WHERE item_id IN"
        " (SELECT id FROM runs_outcomeitem WHERE run_id = ANY(%(runs)s))"
        " RETURNING channel, state, attempts",
    ),
    # A decided approval names its item and its decision: it goes first.
    ("runs_approval", "DELETE FROM runs_approval WHERE run_id = ANY(%(runs)s)"),
    ("runs_operatordecision", "DELETE FROM runs_operatordecision WHERE run_id = ANY(%(runs)s)"),
    # A run's waits on holds (the holds stay, their figures without it) and
    # the bulk jobs' results for it (the jobs stay, as their audit).
    ("runs_holdwait", "DELETE FROM runs_holdwait WHERE run_id = ANY(%(runs)s)"),
    ("runs_bulkjobitem", "DELETE FROM runs_bulkjobitem WHERE run_id = ANY(%(runs)s)"),
    ("runs_runevent", "DELETE FROM runs_runevent WHERE run_id = ANY(%(runs)s) RETURNING kind"),
    (
        "evidence_evidencecopy_sources",
        "DELETE FROM evidence_evidencecopy_sources WHERE evidencecopy_id IN"
        " (SELECT id FROM evidence_evidencecopy WHERE run_id = ANY(%(runs)s))",
    ),
    ("evidence_evidencecopy", "DELETE FROM evidence_evidencecopy WHERE run_id = ANY(%(runs)s)"),
    ("evidence_capturegap", "DELETE FROM evidence_capturegap WHERE run_id = ANY(%(runs)s)"),
    (
        "evidence_modelcall_sources",
        "DELETE FROM evidence_modelcall_sources WHERE modelcall_id IN"
        " (SELECT id FROM evidence_modelcall WHERE run_id = ANY(%(runs)s))",
    ),
    ("evidence_modelcall", "DELETE FROM evidence_modelcall WHERE run_id = ANY(%(runs)s)"),
    ("evidence_source", "DELETE FROM evidence_source WHERE run_id = ANY(%(runs)s)"),
    ("evidence_capturestats", "DELETE FROM evidence_capturestats WHERE run_id = ANY(%(runs)s)"),
    (
        "evidence_bundleexport",
        "DELETE FROM evidence_bundleexport WHERE run_id = ANY(%(runs)s) RETURNING file_name",
    ),
    (
        "evidence_lockwait.waiter_run",
        "UPDATE evidence_lockwait SET waiter_run_id = NULL WHERE waiter_run_id = ANY(%(runs)s)",
    ),
    (
        "evidence_lockwait.blocker_run",
        "UPDATE evidence_lockwait SET blocker_run_id = NULL WHERE blocker_run_id = ANY(%(runs)s)",
    ),
    ("runs_outcomeitem", "DELETE FROM runs_outcomeitem WHERE run_id = ANY(%(runs)s)"),
    ("runs_checkpoint", "DELETE FROM runs_checkpoint WHERE run_id = ANY(%(runs)s)"),
    ("runs_receipt", "DELETE FROM runs_receipt WHERE run_id = ANY(%(runs)s)"),
    ("runs_answerrevision", "DELETE FROM runs_answerrevision WHERE run_id = ANY(%(runs)s)"),
    ("runs_action", "DELETE FROM runs_action WHERE run_id = ANY(%(runs)s)"),
    ("runs_run", "DELETE FROM runs_run WHERE id = ANY(%(runs)s)"),
]


def also_remove(table: str, statement: str) -> None:
    """A table of a layer above (the dashboard's: its API's submissions)
    whose rows name a run: removed with the run, before it, by `statement`
    (on %(runs)s).  Called from that layer's AppConfig.ready(): this layer
    never names it."""
    if all(name != table for name, _ in REMOVALS):
        REMOVALS.insert(len(REMOVALS) - 1, (table, statement))


# After each batch the purge rests this many times as long as the batch
# took: it takes at most a quarter of a core (and of its database backend)
# from the runs executing.  Resting as long as the batch (a half) still
# added 14 % to their steps on two busy cores (bench --purge).
REST = 3.0

# What /metrics counts of the rows removed, kept in runs_purgedcount so its
# counters never go down (dashboard/metrics.py adds it back).
TALLY = """INSERT INTO runs_purgedcount (counter, label, value) VALUES (%s, %s, %s)
    ON CONFLICT (counter, label) DO UPDATE SET value = runs_purgedcount.value + EXCLUDED.value"""


@dataclass(frozen=True)
class Refused:
    """A purgeable run kept: why."""

    run_id: int
    why: str


@dataclass
class Purged:
    """What a purge removed (or, dry, would remove), and what it kept."""

    dry_run: bool
    older_than: dt.timedelta
    statuses: list[str]
    run_ids: list[int] = field(default_factory=list)
    by_status: Counter[str] = field(default_factory=Counter)
    rows: Counter[str] = field(default_factory=Counter)
    # Ended before the age but kept by a rule: how many, by why.
    kept: dict[str, int] = field(default_factory=dict)
    # Purgeable, but another transaction held the run: left for the next purge.
    skipped: list[int] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    bundles: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""  # why the purge stopped before the end ("": it did not)
    batches: int = 0
    seconds: float = 0.0

    def json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "older_than_seconds": self.older_than.total_seconds(),
            "statuses": self.statuses,
            "runs": len(self.run_ids),
            "run_ids": self.run_ids,
            "by_status": dict(sorted(self.by_status.items())),
            "rows": dict(sorted(self.rows.items())),
            "kept": self.kept,
            "skipped": self.skipped,
            "refused": [{"run_id": r.run_id, "why": r.why} for r in self.refused],
            "bundles": self.bundles,
            "stopped": self.stopped,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
        }

    def said(self) -> str:
        """In a few lines, for people."""
        verb = "would remove" if self.dry_run else "removed"
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.by_status.items()))
        lines = [f"{verb} {len(self.run_ids)} runs" + (f" ({statuses})" if statuses else "")]
        if self.rows and not self.dry_run:
            lines.append(f"{sum(self.rows.values())} rows in all, in {self.batches} batches")
        lines += [f"kept {n}: {why}" for why, n in self.kept.items() if n]
        if self.skipped:
            lines.append(f"left {len(self.skipped)} held by another transaction for next time")
        lines += [f"kept run {r.run_id}: {r.why}" for r in self.refused]
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        return "\n".join(lines)


def purge(
    older_than: dt.timedelta,
    *,
    statuses: list[str] | None = None,
    bundle_to: Path | None = None,
    dry_run: bool = False,
    batch: int = BATCH,
    rest: float = REST,
    include_evidence: bool = True,
) -> Purged:
    """Removes the runs `Run.objects.purgeable(older_than, statuses)`
    names, oldest first, BATCH at a time, each with every row of its own
    (REMOVALS); with `bundle_to`, after writing and verifying each one's
    bundle there (a run whose bundle fails is kept, with why), resting
    `rest` times as long as each batch took after it.  `dry_run` changes
    nothing and says what would go."""
    started = time.monotonic()
    chosen = [s for s in TERMINAL_STATUSES if statuses is None or s in statuses]
    purged = Purged(dry_run, older_than, [str(s) for s in chosen])
    purged.kept = _kept(older_than, chosen)
    candidates = Run.objects.purgeable(older_than, chosen).order_by("finished_at", "pk")
    if dry_run:
        for run_id, status in candidates.values_list("pk", "status").iterator(chunk_size=2000):
            purged.run_ids.append(run_id)
            purged.by_status[status] += 1
        purged.seconds = time.monotonic() - started
        return purged
    after: tuple[dt.datetime, int] | None = None
    while not purged.stopped:
        page = candidates
        if after is not None:
            finished, run_id = after
            page = page.filter(Q(finished_at__gt=finished) | Q(finished_at=finished, pk__gt=run_id))
        rows = list(page.values_list("pk", "finished_at")[:batch])
        if not rows:
            break
        after = rows[-1][1], rows[-1][0]
        ids = [run_id for run_id, _ in rows]
        if bundle_to is not None:
            ids = _bundled(ids, bundle_to, include_evidence, purged)
        if ids:
            batch_started = time.monotonic()
            _remove(ids, older_than, chosen, purged)
            time.sleep((time.monotonic() - batch_started) * rest)
    purged.seconds = time.monotonic() - started
    return purged


def _kept(older_than: dt.timedelta, statuses: list[str]) -> dict[str, int]:
    """Runs ended before the age that a rule keeps, by the rule."""
    ended = Run.objects.local().filter(status__in=statuses, finished_at__lt=Now() - older_than)
    return {
        "an open item (an operator may still decide it)": ended.filter(
            Exists(OutcomeItem.objects.filter(run=OuterRef("pk"), state=OutcomeState.OPEN))
        ).count(),
        "a bundle export under way": ended.filter(
            Exists(BundleExport.objects.filter(run=OuterRef("pk"), state__in=ACTIVE_BUNDLE_STATES))
        ).count(),
    }


def _bundled(ids: list[int], folder: Path, include_evidence: bool, purged: Purged) -> list[int]:
    """Writes and verifies the bundle of each of `ids` into `folder`
    (run-ID.zip); the runs whose bundle is whole.  The others are refused,
    with why, and kept."""
    whole = []
    for run_id in ids:
        path = folder / f"run-{run_id}.zip"
        try:
            exported = _export(run_id, path, include_evidence)
        except Exception as error:  # any failure keeps the run, and says why
            purged.refused.append(Refused(run_id, f"its bundle failed: {error}"))
            continue
        checked = bundles.verify(path)
        if not checked.ok:
            purged.refused.append(
                Refused(run_id, f"its bundle {path} does not verify: {'; '.join(checked.problems)}")
            )
            continue
        purged.bundles.append({"run_id": run_id, "path": str(path), "seal": exported.seal})
        whole.append(run_id)
    return whole


def _export(run_id: int, path: Path, include_evidence: bool) -> bundles.Exported:
    """The bundle written beside `path`, synced, then renamed to it: a file
    under its final name is always whole, and its name durable before the
    run's rows are removed."""
    fd, part = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            exported = bundles.export(run_id, out, include_evidence=include_evidence)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, path)
        sync_folder(path.parent)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
    return exported


def _remove(ids: list[int], older_than: dt.timedelta, statuses: list[str], purged: Purged) -> None:
    """One batch, one transaction: locks those of `ids` still purgeable and
    that nobody holds, and removes them with all their rows."""
    try:
        with waits_bounded(LOCK_WAIT), server_cursor() as cursor:
            # Asynchronous commit: a purge a crash loses is done again by the
            # next one, and the runs' own commits do not queue behind its WAL.
            commit_asynchronously(cursor, **{"rundesk.purge": "on"})
            locked = dict(
                Run.objects.purgeable(older_than, statuses)
                .filter(pk__in=ids)
                .select_for_update(skip_locked=True, of=("self",))
                .values_list("pk", "status")
            )
            runs = sorted(locked)
            removed: Counter[str] = Counter()
            tallies: Counter[tuple[str, str]] = Counter()
            files: list[str] = []
            for table, statement in REMOVALS if runs else []:
                cursor.execute(statement, {"runs": runs})
                removed[table] += cursor.rowcount
                if table == "runs_alert":
                    for channel, state, attempts in cursor.fetchall():
                        tallies["alerts_sent", channel] += state == "sent"
                        tallies["alert_failures", channel] += attempts - (state == "sent")
                elif table == "runs_runevent":
                    tallies["lease_takeovers", ""] += sum(k == "resumed" for (k,) in cursor)
                elif table == "evidence_bundleexport":
                    files += [name for (name,) in cursor.fetchall()]
            for (counter, label), value in tallies.items():
                if value:
                    cursor.execute(TALLY, [counter, label, value])
            transaction.on_commit(lambda: _remove_files(files))
    except OperationalError as error:
        if not lock_refused(error):
            raise
        purged.skipped += ids
        purged.stopped = (
            f"a lock was not granted within {LOCK_WAIT} ({error}): the rest is left for the "
            "next purge"
        )
        return
    purged.batches += 1
    purged.run_ids += runs
    purged.by_status.update(locked.values())
    purged.rows.update(removed)
    purged.skipped += sorted(set(ids) - set(locked))


def _remove_files(names: list[str]) -> None:
    """The files of the removed runs' bundle exports, once their rows are gone."""
    for name in names:
        (Path(settings.RUNDESK_BUNDLE_DIR) / name).unlink(missing_ok=True)
