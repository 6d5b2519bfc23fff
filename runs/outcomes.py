"""Writes whose COMMIT got no answer, and how the runtime settles them.

Checkpoints and answer revisions announce their transaction id before they
commit (migration 0004).  If the connection is lost before the answer comes,
the outcome is unknown: `CommitUnanswered` carries the xid and the writer's
backend (pid and start time: a later backend may reuse the pid).  A receipt
does not announce (it is on every step's path): its xid is read from the
writer's old backend while that still runs, which is while it matters.
Once the database answers again, `settle()` asks it:

- pg_xact_status(xid) = committed: committed, once a probe reads the row back;
- aborted: known not written;
- in progress: the orphaned backend is still at work and may hold locks:
  wait, and ask again;
- no status (no xid was announced, or it is too old to tell): probe by the
  write's identity once the old backend is gone.  These rows are never
  deleted, so a row found is committed, and a row absent after its writer
  ended was not written;
- unknown to this server (UNKNOWN_TO_SERVER: an xid it has not reached,
  which pg_xact_status refuses with 22023): the transaction was lost with
  the WAL (a crash, a failover to a replica that had not received it) or
  the server was restored from a backup.  Waiting will not tell, and this
  server's rows are not the ones the writer saw: an operator decides, from
  what the probe by identity finds.

What is still unsettled when patience runs out stays `unknown`: an
OutcomeItem for an operator.  Nothing here ever treats unknown as not
written, and nothing writes an unknown write again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from django.conf import settings
from django.db import DatabaseError, DataError, IntegrityError, connection, transaction
from django.db.models import Exists, OuterRef
from django.db.models.functions import Now
from django.utils import timezone

from runs import alerts
from runs.models import (
    AnswerRevision,
    Checkpoint,
    CheckpointOutcome,
    OutcomeItem,
    OutcomeKind,
    Receipt,
    Run,
    RunStatus,
)
from runs.sql import Backend, CommitUnanswered, release_connection
from runs.timeline import EventKind, timeline

T = TypeVar("T")

logger = logging.getLogger(__name__)

# The status of an xid this server has not reached (pg_xact_status raises
# 22023, "transaction ID ... is in the future"), and what it means, in an
# operator's words.
UNKNOWN_TO_SERVER = "unknown to this server"
NOT_KNOWN_HERE = (
    "this server does not know that transaction: it was lost with the WAL (a crash, or a "
    "failover to a replica that had not received it) or the server was restored from a backup"
)
IN_THE_FUTURE = "22023"


class NeedsOperator(Exception):
    """The runtime cannot settle this itself: the run waits for a person
    (for the outcome item `item_id`, when one holds it)."""

    def __init__(self, reason: str, item_id: int | None = None) -> None:
        super().__init__(reason)
        self.item_id = item_id


@dataclass
class Settlement:
    outcome: Literal["committed", "not_written", "unknown"]
    evidence: dict[str, Any] = field(default_factory=dict)
    # The item opened for an operator when the outcome stayed unknown.
    item_id: int | None = None

    @property
    def last(self) -> dict[str, Any]:
        return self.evidence["checks"][-1] if self.evidence.get("checks") else {}

    @property
    def in_flight(self) -> bool:
        """Unknown for now only: its transaction is still in progress, or
        its writer still runs (the next ask may settle it)."""
        return self.last.get("xid_status") == "in progress" or bool(self.last.get("backend_alive"))

    def describe(self) -> str:
        last = self.last
        return (
            f"{self.outcome}: xid {self.evidence.get('xid')} status "
            f"{last.get('xid_status')!s}, row found: {last.get('row_found')}, "
            f"writer's backend alive: {last.get('backend_alive')}"
        )

    def unsettled(self, what: str) -> str:
        """An item's summary: why the evidence does not settle `what`."""
        summary = f"{what}: COMMIT sent, no answer, and the evidence does not settle it"
        if self.last.get("xid_status") == UNKNOWN_TO_SERVER:
            summary += f": {NOT_KNOWN_HERE}"
        return summary


def xact_status(xid: int) -> str | None:
    """committed, aborted, in progress; None when it is too old to tell;
    UNKNOWN_TO_SERVER for an xid this server has not reached.  Inside a
    caller's transaction it is asked in a savepoint, which that refusal
    rolls back alone."""
    asked = transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext()
    try:
        with asked, connection.cursor() as cursor:
            cursor.execute("SELECT pg_xact_status(%s::text::xid8)", [str(xid)])
            return cursor.fetchone()[0]
    except DataError as error:
        if getattr(error.__cause__, "sqlstate", None) != IN_THE_FUTURE:
            raise
        return UNKNOWN_TO_SERVER


# The writer's old backend, if it still runs (the same pid and start time:
# not a later backend that reuses the pid), and its open transaction's id
# widened to 64 bits (pg_stat_activity shows 32) with the current epoch.
# The backend's xid is 32 bits; its full id is the one within 2^31 of a
# snapshot's xmax (an open transaction's xid lies within that of any
# reference), on either side: xmax is one past the latest *completed*
# transaction, so a transaction still open may have a larger id than it
# (taking it for an earlier epoch's gave a negative id).
ORPHAN = """
    SELECT CASE WHEN a.backend_xid IS NULL THEN NULL ELSE
        c.full + (a.backend_xid::text::bigint - (c.full & 4294967295) + 6442450944)
            %% 4294967296 - 2147483648 END
    FROM pg_stat_activity a,
        (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS full) c
    WHERE a.pid = %(pid)s
      AND (%(started)s::timestamptz IS NULL OR a.backend_start = %(started)s::timestamptz)
"""


class Orphan(NamedTuple):
    """What became of an unanswered write's backend: whether it still runs,
    and the id of the transaction it has open (for a write that did not
    announce one)."""

    alive: bool
    open_xid: int | None


def find_orphan(backend: Backend | None) -> Orphan:
    """The writer's old backend, as it is now."""
    if backend is None:
        return Orphan(False, None)
    with connection.cursor() as cursor:
        cursor.execute(ORPHAN, {"pid": backend.pid, "started": backend.started})
        row = cursor.fetchone()
    return Orphan(row is not None, row[0] if row else None)


def settle(
    unanswered: CommitUnanswered, probe: Callable[[], bool], *, patience: float | None = None
) -> Settlement:
    """Asks the database what became of an unanswered write, waiting while
    its transaction is still in flight, for at most `patience` seconds."""
    patience = settings.RUNDESK_SETTLE_SECONDS if patience is None else patience
    xid, backend = unanswered.xid, unanswered.backend
    evidence: dict[str, Any] = {
        "xid": xid,
        "backend_pid": backend.pid if backend else None,
        "backend_start": backend.started if backend else None,
        "error": unanswered.error,
    }
    checks: list[dict[str, Any]] = []
    evidence["checks"] = checks
    deadline = time.monotonic() + patience
    delay = 0.02
    while True:
        try:
            alive, open_xid = find_orphan(backend)
            if xid is None and open_xid is not None:
                xid = evidence["xid"] = open_xid
                evidence["xid_from"] = "pg_stat_activity of the writer's backend"
            status = xact_status(xid) if xid is not None else None
            found = probe()
        except DatabaseError as error:
            if connection.in_atomic_block:
                # Asked within a caller's transaction (a page, a decision,
                # the sweep): that transaction is lost with the error; its
                # caller says why.
                raise
            # The database does not answer yet: keep asking until patience ends.
            connection.close()
            checks.append({"at": timezone.now().isoformat(), "error": str(error).strip()})
        else:
            checks.append(
                {
                    "at": timezone.now().isoformat(),
                    "xid_status": status,
                    "backend_alive": alive,
                    "row_found": found,
                }
            )
            if status == "committed" and found:
                return Settlement("committed", evidence)
            if status == "aborted":
                # It wrote nothing: a row found by identity is another
                # transaction's (a later owner's), not this write's.
                return Settlement("not_written", evidence)
            if status is None and not alive:
                return Settlement("committed" if found else "not_written", evidence)
            if status == UNKNOWN_TO_SERVER:
                # Waiting will not make this server know it: an operator's.
                return Settlement("unknown", evidence)
        if time.monotonic() >= deadline:
            return Settlement("unknown", evidence)
        release_connection()  # not held while it waits (docs/DESIGN.md)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def open_item(
    *,
    run_id: int,
    kind: OutcomeKind,
    subject: str,
    summary: str,
    evidence: dict[str, Any],
    **about: Any,
) -> OutcomeItem:
    """Records something only evidence or an operator can settle.  One item
    per subject: asking twice returns the first."""
    try:
        with transaction.atomic():
            item = OutcomeItem.objects.create(
                run_id=run_id,
                kind=kind,
                subject=subject,
                summary=summary,
                evidence=evidence,
                **about,
            )
            alerts.item_opened(item)  # its alerts commit with it, or neither does
    except IntegrityError:
        return OutcomeItem.objects.get(subject=subject)
    timeline.record(run_id, EventKind.OUTCOME_OPEN, f"{kind}: {summary}", subject=subject)
    return item


def settle_unanswered(
    unanswered: CommitUnanswered,
    probe: Callable[[], bool],
    *,
    run_id: int,
    kind: OutcomeKind,
    subject: str,
    lease_epoch: int,
    afterwards: str,
    **about: Any,
) -> Settlement:
    """Says on the timeline that a write got no answer, settles it by
    evidence, and opens an item for an operator when evidence cannot."""
    timeline.record(
        run_id,
        EventKind.COMMIT_UNANSWERED,
        f"{unanswered.what}: COMMIT sent, no answer; xid {unanswered.xid}",
        xid=unanswered.xid,
    )
    settlement = settle(unanswered, probe)
    if settlement.outcome == "unknown":
        settlement.item_id = open_item(
            run_id=run_id,
            kind=kind,
            subject=subject,
            summary=settlement.unsettled(unanswered.what),
            evidence={**settlement.evidence, "lease_epoch": lease_epoch, "afterwards": afterwards},
            xid=settlement.evidence["xid"],
            **about,
        ).pk
    else:
        timeline.record(
            run_id, EventKind.OUTCOME_SETTLED, f"{unanswered.what}: {settlement.describe()}"
        )
    return settlement


def write_settled(
    write: Callable[[], T],
    probe: Callable[[], bool],
    *,
    what: str,
    run_id: int,
    kind: OutcomeKind,
    subject: str,
    lease_epoch: int,
    afterwards: str,
    attempts: int = 2,
    **about: Any,
) -> T | None:
    """Runs a fact write.  If its COMMIT gets no answer, evidence decides:
    committed, it is there (None: an earlier attempt wrote it); known not
    written, it is written again, which is not blind, up to `attempts`
    times; unknown, an item for an operator, and NeedsOperator."""
    for _ in range(attempts):
        try:
            return write()
        except CommitUnanswered as unanswered:
            settlement = settle_unanswered(
                unanswered,
                probe,
                run_id=run_id,
                kind=kind,
                subject=subject,
                lease_epoch=lease_epoch,
                afterwards=afterwards,
                **about,
            )
        if settlement.outcome == "committed":
            return None
        if settlement.outcome == "unknown":
            raise NeedsOperator(f"whether the {what} committed is unknown", settlement.item_id)
    raise NeedsOperator(f"the {what} got no answer {attempts} times, and was not written")


def settle_checkpoint(record: Checkpoint, settlement: Settlement) -> None:
    """Writes what the evidence says on a checkpoint whose outcome was unknown."""
    if settlement.outcome == "unknown":
        return
    outcome = (
        CheckpointOutcome.SETTLED_COMMITTED
        if settlement.outcome == "committed"
        else CheckpointOutcome.SETTLED_NOT_WRITTEN
    )
    Checkpoint.objects.filter(pk=record.pk, outcome=CheckpointOutcome.UNKNOWN).update(
        outcome=outcome, resolved_at=timezone.now(), resolution=settlement.describe()
    )


def settle_left_checkpoints() -> list[int]:
    """Settles by their xid the checkpoints left unknown with no item: their
    owner recorded the unknown row, then died while it asked the evidence
    (the item comes only if the evidence cannot tell).  Not while that
    owner may still be asking (its lease held at that epoch), and without
    waiting: one still in flight is left to the next sweep; one the
    evidence will never settle (an xid this server does not know, a
    status the probe contradicts) gets its item, for an operator.  Each
    in a savepoint of its own: one that cannot be asked about holds up no
    other.  The runs whose checkpoints it settled."""
    held = Run.objects.filter(
        pk=OuterRef("run_id"),
        lease_epoch=OuterRef("epoch"),
        status=RunStatus.RUNNING,
        lease_expires_at__gte=Now(),
    )
    left = (
        Checkpoint.objects.filter(
            outcome=CheckpointOutcome.UNKNOWN, xid__isnull=False, run__imported_at__isnull=True
        )
        .exclude(Exists(OutcomeItem.objects.filter(checkpoint=OuterRef("pk"))))
        .exclude(Exists(held))
        .order_by("id")[:100]
    )
    settled = []
    for record in left:
        try:
            with transaction.atomic():
                settlement = _settle_left(record)
        except DatabaseError as error:
            logger.warning("checkpoint %s left to the next sweep: %s", record.pk, error)
            continue
        if settlement.outcome != "unknown":
            settled.append(record.run_id)
    return settled


def _settle_left(record: Checkpoint) -> Settlement:
    what = f"checkpoint {record.number}, left unknown by an owner that stopped"
    unanswered = CommitUnanswered(f"checkpoint {record.number}", record.xid, None, record.error)
    settlement = settle(
        unanswered,
        lambda: Checkpoint.objects.filter(
            run_id=record.run_id, number=record.number, state__isnull=False
        ).exists(),
        patience=0,
    )
    if settlement.outcome != "unknown":
        settle_checkpoint(record, settlement)
        timeline.record(
            record.run_id, EventKind.OUTCOME_SETTLED, f"{what}: {settlement.describe()}"
        )
    elif not settlement.in_flight:
        open_item(
            run_id=record.run_id,
            kind=OutcomeKind.CHECKPOINT,
            subject=f"checkpoint:{record.pk}",
            summary=settlement.unsettled(what),
            evidence={
                **settlement.evidence,
                "lease_epoch": record.epoch,
                "afterwards": "its owner had stopped; this checkpoint is not used to resume "
                "and is not written again",
            },
            xid=record.xid,
            checkpoint=record,
        )
    return settlement


def written(item: OutcomeItem) -> bool:
    """Probe by identity: is the write an item is about readable now?"""
    if item.kind == OutcomeKind.RECEIPT:
        return Receipt.objects.filter(action_id=item.action_id).exists()
    if item.kind == OutcomeKind.PUBLICATION:
        return AnswerRevision.objects.filter(
            run_id=item.run_id, number=item.revision_number
        ).exists()
    if item.kind == OutcomeKind.CHECKPOINT:
        return Checkpoint.objects.filter(
            run_id=item.run_id, number=item.checkpoint.number, state__isnull=False
        ).exists()
    raise ValueError(f"{item.kind} items are settled by their receiver, not by a probe")


def written_by(item: OutcomeItem) -> Backend | None:
    """The backend an item's write went through, as its evidence says
    (items recorded before start times were kept know only the pid)."""
    pid = item.evidence.get("backend_pid")
    return Backend(pid, item.evidence.get("backend_start")) if pid is not None else None
