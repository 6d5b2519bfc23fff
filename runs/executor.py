"""The executor: claims runs, runs the agent.

`claim_and_drive(run_id)` runs one run if it can be claimed (the management
command's `--run` and the Celery task).  `drive()` runs a claimed run and
decides every way it ends (`Ending`).  `Executor.serve()` is the
long-running loop of `manage.py executor`: N worker threads, each claiming
the oldest claimable run with SKIP LOCKED.  Shutdown (SIGTERM) stops at the
next step boundary and gives the run back to the queue.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum

from django.conf import settings
from django.db import DatabaseError, connection

from evidence.capture import capture
from evidence.locks import LockSampler
from runs import decisions, holds, registry, sweep
from runs.agent import ActionFailed, Agent
from runs.dispatch import Dispatcher, Stopping, effects_left_unknown, run_to_drive
from runs.leases import (
    CancelRequested,
    Held,
    Lease,
    LeaseExpired,
    LeaseLost,
    WriteRefused,
    new_owner_name,
)
from runs.models import Action, Run, RunStatus
from runs.outcomes import NeedsOperator
from runs.renewal import renewals
from runs.sql import release_connection
from runs.timeline import EventKind, timeline

logger = logging.getLogger(__name__)


class Ending(StrEnum):
    """How one ownership of a run ended (what drive() returns)."""

    # The run's status, when this ownership ended it.
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NEEDS_OPERATOR = "needs_operator"  # waits for an operator's decision
    # The run goes on, with another owner.
    REQUEUED = "requeued"  # was to wait, but its item was settled meanwhile
    RELEASED = "released"  # the executor stopped: back in the queue
    LEASE_LOST = "lease_lost"  # another owner has the run
    NOT_CLAIMABLE = "not_claimable"  # claim_and_drive: nothing to run


def drive(lease: Lease, stop: threading.Event, *, batched: bool = False) -> Ending:
    """Runs the agent under `lease` until the run completes, fails, waits for
    an operator, is cancelled, loses its lease, or the executor stops.  Every
    way a run ends is decided here, and nothing of one run escapes it but a
    database error (the lease then expires and the next owner resumes).
    Its timeline is written, and its last copies taken by capture, before
    it returns; `batched` (an executor serving many runs) leaves them to
    the writers' next batches, within their linger: one batch for many
    runs ending, where a batch per run cost a tenth of each step's CPU."""
    run_id = lease.run_id
    timeline.record(run_id, EventKind.LEASE_ACQUIRED, f"{lease.owner}", epoch=lease.epoch)
    try:
        # One read of the run serves the cancel check, the agent's and the
        # dispatcher's (a read per use cost more CPU than the run's steps).
        run = run_to_drive(run_id)
        if run.cancel_requested_at is not None:
            # Its owner died before it could stop: the claim carries it out.
            return _end(lease, RunStatus.CANCELLED, "", "cancelled: nothing new dispatched")
        with renewals.held(lease) as lost:
            declared = installed_agent(run)
            dispatcher = Dispatcher(
                lease, stop=stop, lease_lost=lost, tools=declared.tools, run=run
            )
            dispatcher.run_agent(declared)
            steps = dispatcher.progress.steps
            return _end(lease, RunStatus.COMPLETED, "", f"{steps} steps", finish=dispatcher.finish)
    except Stopping:
        return _release(lease)
    except Held as held:
        return _held(lease, held)
    except NeedsOperator as reason:
        return _end(lease, RunStatus.NEEDS_OPERATOR, str(reason), item_id=reason.item_id)
    except ActionFailed as reason:
        return _fail(lease, str(reason))
    except WriteRefused as refused:
        return _after_refused_write(lease, refused)
    except DatabaseError:
        # The database is unreachable or failed mid-write: what was written is
        # unknown here.  The lease expires and the next owner resumes from
        # the receipts, which are the facts.
        raise
    except Exception as error:
        logger.exception("run %s: internal error", run_id)
        return _fail(lease, f"internal error: {error!r}")
    finally:
        # Not waited for with a connection in hand.
        release_connection()
        if not batched:
            timeline.flush()
            # The run's last copies are saved now, not after capture's linger.
            capture.hurry()


def installed_agent(run: Run) -> type[Agent]:
    """The agent installed to drive the run, or NeedsOperator saying why
    none may: its agent is not installed here (nothing else's code ever
    runs it), or its version changed and does not declare it continues
    the run's version.  A run that has dispatched nothing yet takes the
    installed version (`run` says so too)."""
    try:
        declared = registry.agent_class(run.agent)
    except registry.NotInstalled as error:
        raise NeedsOperator(
            f"{error}: nothing else runs it; install it again to resume it, or abandon it"
        ) from None
    if declared.can_continue(run.agent_version):
        return declared
    if not Action.objects.filter(run_id=run.pk).exists():
        Run.objects.filter(pk=run.pk).update(agent_version=declared.version)
        run.agent_version = declared.version
        return declared
    raise NeedsOperator(
        f"agent {run.agent} is version {declared.version} here, which does not declare it "
        f"continues runs of version {run.agent_version}: resume it under version "
        f"{declared.version}, or abandon it"
    )


ENDED = {
    RunStatus.COMPLETED: EventKind.RUN_COMPLETED,
    RunStatus.FAILED: EventKind.RUN_FAILED,
    RunStatus.CANCELLED: EventKind.RUN_CANCELLED,
    RunStatus.NEEDS_OPERATOR: EventKind.NEEDS_OPERATOR,
}


def _end(
    lease: Lease,
    status: RunStatus,
    reason: str,
    said: str = "",
    item_id: int | None = None,
    finish: Callable[[RunStatus, str], RunStatus] | None = None,
) -> Ending:
    """Ends this ownership with `status` (through `finish`: the Dispatcher's,
    which writes the last read's receipt with it).  Fenced out at this last
    write (another owner took the run meanwhile), it ends nothing: the new
    owner decides.  A run about to wait for an operator ends as cancelled if
    a cancel was asked meanwhile, and goes back to the queue if the item it
    waits for (`item_id`) was settled meanwhile."""
    try:
        ended = (finish or lease.finish)(status, reason)
    except LeaseLost as refused:
        return _after_refused_write(lease, refused)
    if ended != status:
        timeline.record(
            lease.run_id, EventKind.RUN_CANCELLED, f"cancelled instead of waiting: {reason}"
        )
        return Ending(ended)
    timeline.record(lease.run_id, ENDED[status], said or reason)
    if item_id is not None and decisions.resume_if_settled_meanwhile(lease.run_id, item_id):
        return Ending.REQUEUED
    return Ending(status)


def _fail(lease: Lease, reason: str) -> Ending:
    """Ends the run as failed, once what it leaves unknown has its items
    (dispatch.effects_left_unknown)."""
    try:
        effects_left_unknown(lease)
    except WriteRefused as refused:
        return _after_refused_write(lease, refused)
    return _end(lease, RunStatus.FAILED, reason)


def _held(lease: Lease, held: Held) -> Ending:
    """A boundary an active hold stopped: the run waits on the hold
    (holds.wait), or, the hold released meanwhile, goes back to the queue
    at once to dispatch it."""
    try:
        waited = holds.wait(lease.run_id, held, lease.finish)
    except LeaseLost as refused:
        return _after_refused_write(lease, refused)
    if waited is None:
        return _release(lease, f"hold {held.hold_id} was released meanwhile: run requeued")
    if waited.status != RunStatus.NEEDS_OPERATOR:
        timeline.record(
            lease.run_id, EventKind.RUN_CANCELLED, f"cancelled instead of waiting: {waited.reason}"
        )
        return Ending(waited.status)
    timeline.record(
        lease.run_id, EventKind.NEEDS_OPERATOR, waited.reason, hold=held.hold_id, held=waited.named
    )
    return Ending.NEEDS_OPERATOR


def _release(lease: Lease, why: str = "executor stopping: run requeued") -> Ending:
    """The executor stops (or this owner's lease expired before it could go
    on, `why`): the run goes back to the queue, or ends if a cancel was
    asked meanwhile."""
    released = lease.release()
    if released == RunStatus.CANCELLED:
        timeline.record(
            lease.run_id, EventKind.RUN_CANCELLED, "cancelled while its executor was stopping"
        )
        return Ending.CANCELLED
    if released is None:
        timeline.record(lease.run_id, EventKind.LEASE_LOST, f"epoch {lease.epoch} stops here")
        return Ending.LEASE_LOST
    timeline.record(lease.run_id, EventKind.LEASE_RELEASED, why)
    return Ending.RELEASED


def _after_refused_write(lease: Lease, refused: WriteRefused) -> Ending:
    """A protected write changed 0 rows.  If the run was cancelled and we
    still own it, it ends as cancelled; if only the lease expired (nobody
    claimed the run yet), it goes back to the queue at once; otherwise
    another owner has it (the write was fenced out), and this one stops
    without another write."""
    if not isinstance(refused, CancelRequested):
        timeline.record(lease.run_id, EventKind.WRITE_FENCED, str(refused), epoch=lease.epoch)
    if lease.cancel_requested():
        try:
            lease.finish(RunStatus.CANCELLED)
        except LeaseLost:
            pass
        else:
            timeline.record(
                lease.run_id,
                EventKind.RUN_CANCELLED,
                f"cancelled: nothing new dispatched ({refused})",
            )
            return Ending.CANCELLED
    if isinstance(refused, LeaseExpired):
        return _release(lease, "the lease expired before this owner went on: run requeued")
    timeline.record(lease.run_id, EventKind.LEASE_LOST, f"epoch {lease.epoch} stops here")
    return Ending.LEASE_LOST


def claim_and_drive(run_id: int, *, stop: threading.Event | None = None) -> Ending:
    """Runs one run if it can be claimed; otherwise says why not.  Safe to
    call twice for the same run (a redelivered Celery task)."""
    lease = Lease.claim(run_id, new_owner_name())
    if lease is None:
        return Ending.NOT_CLAIMABLE
    return drive(lease, stop or threading.Event())


# Each run in flight is a thread that mostly waits (on its tools): a small
# stack, so that thousands fit in one process.  A thread that drove a run
# drives the next one (a new thread, and the Django connection object it
# makes, cost a quarter of a millisecond a run).
RUN_STACK_BYTES = 512 * 1024
# Runs one claim takes at most, its free slots allowing: a thousand runs
# handed over at once are in flight after twenty claims, not a thousand
# (each a transaction of the serve thread's, the runs' threads waiting).
CLAIM_AT_ONCE = 50


def run_threads(count: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that drive runs, `count` of them, all started now, while
    nothing else runs: one started as runs are handed over waits for the
    GIL among the runs already stepping, and its starter with it (a
    thousand runs handed over at once were claimed over 2.2-2.9 s, not
    0.3-0.5 s).  One the system cannot start is said here, before any run
    is taken."""
    runs = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="run")
    started = threading.Barrier(count + 1)
    previous = threading.stack_size(RUN_STACK_BYTES)
    try:
        for _ in range(count):
            runs.submit(started.wait)
        started.wait()
    except BaseException:
        started.abort()
        runs.shutdown(wait=False)
        raise
    finally:
        threading.stack_size(previous)
    return runs


class Executor:
    """Claims runs and drives each on a thread of its own, up to
    `concurrency` at once.  One thread (serve's) sweeps when due and
    claims; a run's thread drives it, then waits for the next.  No run
    holds a database connection while it waits: each takes one from the
    process's pool for its statements and gives it back before its tools
    run (docs/DESIGN.md, "The executor's model"), so `concurrency` is
    bounded by memory and CPU, not by the server's connections."""

    def __init__(
        self,
        *,
        concurrency: int = 1,
        poll_seconds: float | None = None,
        on_ending: Callable[[int, Ending], None] | None = None,
    ) -> None:
        self.concurrency = concurrency
        self.on_ending = on_ending  # told each run's ending as it comes
        self.poll_seconds = poll_seconds or settings.RUNDESK_POLL_SECONDS
        self.stop = threading.Event()
        self.results: list[tuple[int, Ending]] = []
        self.running = 0  # runs being driven now (the lock sampler samples while > 0)
        self._count = threading.Condition()
        self._sweep_due = 0.0  # monotonic time of the next sweep
        self.owner = new_owner_name()
        self._keeps_results = False

    def serve(self, *, once: bool = False) -> list[tuple[int, Ending]]:
        """Claims and runs runs until stopped (or, with once, until the queue
        is empty and every run taken has ended).  With once, returns what
        happened to each run it took; a long-running executor tells
        `on_ending` and the log instead of keeping them all."""
        self._keeps_results = once
        runs = run_threads(self.concurrency)  # first: if it fails, nothing else runs
        sampler_stop = threading.Event()
        sampler = threading.Thread(
            target=LockSampler(lambda: self.running > 0).serve,
            args=(sampler_stop,),
            name="lock-sampler",
        )
        sampler.start()
        try:
            while not self.stop.is_set():
                self._sweep_if_due()
                claimed = self._claim_while_free(runs)
                with self._count:
                    # A claim that failed (None) is tried again: the queue
                    # is not known to be empty.
                    if once and claimed is False and self.running == 0:
                        break
                    if self.running >= self.concurrency or not claimed:
                        # A run that ends wakes this up: its slot is free.
                        self._count.wait(self.poll_seconds)
        finally:
            release_connection()
            runs.shutdown()
            sampler_stop.set()
            sampler.join()
            connection.close()
            # What the runs' threads left to the writers' batches.
            timeline.flush()
            capture.hurry()
        return self.results

    def _claim_while_free(self, runs: concurrent.futures.ThreadPoolExecutor) -> bool | None:
        """Claims runs while a slot is free, each driven on a thread of
        `runs` (an idle one, or a new one); whether it found any (None: a
        claim failed, and it found none)."""
        found = False
        while not self.stop.is_set() and self.running < self.concurrency:
            try:
                leases = Lease.claim_oldest(
                    self.owner, min(CLAIM_AT_ONCE, self.concurrency - self.running)
                )
            except Exception as error:
                logger.warning("executor: cannot claim: %r", error)
                connection.close()
                return found or None
            if not leases:
                return found
            found = True
            with self._count:
                self.running += len(leases)
            for lease in leases:
                runs.submit(self._drive, lease)
        return found

    def _sweep_if_due(self) -> None:
        """The sweep (runs/sweep.py), due every RUNDESK_SWEEP_SECONDS, busy
        or idle (a backlog of runs never keeps settled runs waiting), when
        this executor takes the turn (`sweep.take_turn`).  Runs it requeues
        are claimed by the next claim, here or elsewhere.  A sweep that
        fails is logged; the executor goes on."""
        if time.monotonic() < self._sweep_due:
            return
        self._sweep_due = time.monotonic() + settings.RUNDESK_SWEEP_SECONDS
        try:
            if not sweep.take_turn(self.owner):
                return
            swept = sweep.sweep()
        except Exception as error:
            logger.warning("executor: sweep failed: %r", error)
            connection.close()
            return
        finally:
            release_connection()
        if swept.settled or swept.cancelled or swept.requeued:
            logger.info("executor: sweep: %s", swept)

    def _drive(self, lease: Lease) -> None:
        """A run's thread: drives it, says how it ended, frees its slot."""
        ending: Ending | None = None
        try:
            ending = drive(lease, self.stop, batched=True)
        except DatabaseError as error:
            logger.warning("run %s: database error, left to its lease: %s", lease.run_id, error)
        except Exception:
            # What one run raised stays with that run: the executor goes on
            # with the next (the run's lease expires and the sweep or a
            # claim takes it from there).
            logger.exception("run %s: left to its lease", lease.run_id)
        finally:
            connection.close()
            with self._count:
                self.running -= 1
                if ending is not None and self._keeps_results:
                    self.results.append((lease.run_id, ending))
                self._count.notify_all()
        if ending is not None:
            logger.info("run %s: %s", lease.run_id, ending)
            if self.on_ending is not None:
                try:
                    self.on_ending(lease.run_id, ending)
                except Exception:
                    # Its thread drives the next run: said here, or nowhere.
                    logger.exception("run %s: telling its ending failed", lease.run_id)
