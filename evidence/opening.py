"""Opening an investigation bundle (evidence/bundles.py) as an imported run:
another installation's run, read-only here, its pages working as for a
local run.

A bundle is verified first (`bundles.verify`); one that fails is refused and
nothing is written.  Then it is loaded in one transaction, line by line and
in batches, so memory stays flat however large the run: a new Run row
marked with its origin (installation, original run id, export time, seal,
format) and every row of the bundle under a new id, each reference inside
the bundle mapped to the new ids.  What is loaded is what was verified:
each file is hashed again as it is read, and a file that changed since is
refused with the transaction.

An imported run keeps the status it had where it ran, but nothing here
claims, resumes, cancels, settles or decides it (Run.objects.local(), and
run_imported_never_owned in the database).  Its rows keep their original
times; the immutable tables accept them as the plain INSERTs they are.
JSON kept with a row (event data, an item's evidence, the evidence shown
with a decision and its SHA-256) stays as it was recorded: ids inside it
are the origin's.  Opening the same bundle again finds the run opened the
first time (run_import_seal_unique).

What a bundle says is another installation's, never this one's: no
row opened from it takes a column this installation keeps for itself (LOCAL: the
digest by which a log import here knows a report it stored, who a user is
here), whatever the row holds; its lock incidents belong to the imported
run (LockIncident.imported_run) and its waits name no local run.

Opening costs bounded time whatever the zip holds (Limits): what the zip's
directory declares is checked before anything is inflated (bundles.verify
inflates every file), what the manifest declares before loading, and what
is actually inflated, line by line, while loading, with the time taken;
each refusal names the limit it met.  A refusal rolls the one transaction
back: nothing half-loaded stays.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import stat
import struct
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import (
    DataError,
    IntegrityError,
    OperationalError,
    connection,
    models,
    reset_queries,
    transaction,
)
from django.utils import timezone
from psycopg.errors import QueryCanceled

from evidence import bundles
from evidence.models import (
    CaptureGap,
    CaptureStats,
    EvidenceCopy,
    LockIncident,
    LockWait,
    ModelCall,
    Source,
)
from runs.models import (
    Action,
    AnswerRevision,
    Checkpoint,
    EffectClass,
    OperatorDecision,
    OutcomeItem,
    Receipt,
    Run,
    RunEvent,
)
from runs.sql import violated

BATCH = bundles.CHUNK  # rows per INSERT at most
BATCH_BYTES = 4 << 20  # and about this much JSON: copies of model calls can be large
# No row an export writes comes near this (a receipt holds a document of at
# most 1 MB, escaped): a longer line is read no further.
MAX_ROW_BYTES = 64 << 20
UNIQUE_SEAL = "run_import_seal_unique"
READ_BYTES = 1 << 20  # inflated per read: lines are cut from it in C, not byte by byte

# What opening one bundle may cost; a setting of the name beside each
# overrides it.  The largest export measured (200,000 events, README) fits
# well within them.
MAX_BYTES = 1 << 30  # RUNDESK_OPEN_BUNDLE_MAX_BYTES: inflated, all files together
MAX_FILE_BYTES = 512 << 20  # RUNDESK_OPEN_BUNDLE_MAX_FILE_BYTES: inflated, any one file
MAX_ROWS = 1_000_000  # RUNDESK_OPEN_BUNDLE_MAX_ROWS: lines of any one file, blank ones too
MAX_SECONDS = 300.0  # RUNDESK_OPEN_BUNDLE_SECONDS: from the first look to the commit
# No row an export writes nests this deep; one that does could not be
# shown or exported again here (each level is a frame of Python's stack).
MAX_DEPTH = 100
# A bundle holds its manifest and the files bundles.MEMBERS names, and a
# zip's directory of that many entries is a few kilobytes: zipfile reads
# the whole directory before it can say anything, in time that grows with it.
MAX_MEMBERS = len(bundles.MEMBERS) + 1
MAX_DIRECTORY_BYTES = 64 << 10

# Columns this installation keeps for itself, never taken from a bundle
# whatever its rows hold (a sealed bundle is not a trusted one): what an
# export leaves out, and the digest by which a log import here knows a
# report it stored before (one taken from a bundle stopped this server's own
# log from being imported).
LOCAL = frozenset(bundles.LEFT_OUT) | {"report_digest", "user_id"}


class OpenRefused(Exception):
    """The bundle cannot be opened; `failures` names what is wrong."""

    def __init__(self, message: str, failures: list[str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or [message]


@dataclass
class Opened:
    run: Run
    # False: the bundle had been opened before, this is that run (the
    # command's JSON calls it "imported", docs/DESIGN.md, Words).
    first_time: bool

    @property
    def origin(self) -> dict[str, Any]:
        return origin_of(self.run)


def origin_of(run: Run) -> dict[str, Any]:
    """Where an imported run comes from, as the command's JSON says it."""
    manifest = run.origin_manifest or {}
    return {
        "installation": run.origin_installation,
        "run_id": run.origin_run_id,
        "exported_at": run.origin_exported_at.isoformat() if run.origin_exported_at else None,
        "seal": run.origin_seal,
        "format": run.origin_format,
        "rundesk_version": manifest.get("rundesk_version"),
        "evidence_included": manifest.get("evidence_included"),
        "signed_by": bundles.signer_of(manifest).words,
        "imported_at": run.imported_at.isoformat() if run.imported_at else None,
    }


@dataclass(frozen=True)
class Limits:
    """What opening one bundle may cost (MAX_BYTES and its neighbours)."""

    bytes: int = MAX_BYTES
    file_bytes: int = MAX_FILE_BYTES
    rows: int = MAX_ROWS
    seconds: float = MAX_SECONDS

    @classmethod
    def configured(cls) -> Limits:
        return cls(
            **{
                name: getattr(settings, setting, getattr(cls, name))
                for name, setting in LIMIT_SETTINGS.items()
            }
        )


LIMIT_SETTINGS = {
    "bytes": "RUNDESK_OPEN_BUNDLE_MAX_BYTES",
    "file_bytes": "RUNDESK_OPEN_BUNDLE_MAX_FILE_BYTES",
    "rows": "RUNDESK_OPEN_BUNDLE_MAX_ROWS",
    "seconds": "RUNDESK_OPEN_BUNDLE_SECONDS",
}


class Budget:
    """One opening's limits, its clock, and what it has inflated so far."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.inflated = 0

    def _refused(self, what: str, limit: str) -> OpenRefused:
        return OpenRefused(f"{what} (the limit, {LIMIT_SETTINGS[limit]})")

    def file(self, name: str, size: int) -> None:
        if size > self.limits.file_bytes:
            raise self._refused(
                f"{name}: more than {self.limits.file_bytes} bytes inflated", "file_bytes"
            )

    def total(self, size: int) -> None:
        if size > self.limits.bytes:
            raise self._refused(
                f"the bundle: more than {self.limits.bytes} bytes inflated in all", "bytes"
            )

    def rows(self, name: str, rows: int) -> None:
        if rows > self.limits.rows:
            raise self._refused(f"{name}: more than {self.limits.rows} rows", "rows")

    def out_of_time(self) -> OpenRefused:
        return self._refused(f"opening took more than {self.limits.seconds:g} seconds", "seconds")

    def left_ms(self) -> int:
        """What is left of the time, for the next statement; none left: refused."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.out_of_time()
        return max(1, int(left * 1000))

    def line(self, name: str, size: int, line: int, rows: int) -> None:
        """One more line of `name` read: `size` bytes of it so far, `line` bytes
        in this one, `rows` lines."""
        self.inflated += line
        self.file(name, size)
        self.total(self.inflated)
        self.rows(name, rows)
        if time.monotonic() > self.deadline:
            raise self.out_of_time()


def open_bundle(path: str | Path) -> Opened:
    """Verifies the bundle at `path` and opens it as an imported run, or
    finds the run it was opened as before.  OpenRefused says why not."""
    budget = Budget(Limits.configured())
    _check_directory(path, budget)
    checked = bundles.verify(path)
    if not checked.ok:
        raise OpenRefused("the bundle does not verify", checked.problems)
    manifest = checked.manifest
    if (earlier := Run.objects.filter(origin_seal=manifest["seal"]).first()) is not None:
        return Opened(earlier, first_time=False)
    _check_manifest(manifest, budget)
    try:
        with (
            transaction.atomic(),
            _unprepared(),
            _statement_timeout_kept(),
            zipfile.ZipFile(path) as bundle,
        ):
            run = _Loader(bundle, manifest, budget).load()
    except OperationalError as error:
        # statement_timeout, set to the time left (Budget.left_ms).
        if isinstance(error.__cause__, QueryCanceled):
            raise budget.out_of_time() from None
        raise
    except IntegrityError as error:
        # The same bundle, opened at the same moment by someone else: theirs
        # committed first and stands.
        if violated(error) == UNIQUE_SEAL:
            return Opened(Run.objects.get(origin_seal=manifest["seal"]), first_time=False)
        raise OpenRefused(f"its rows are not consistent: {_first_line(error)}") from error
    except DataError as error:
        raise OpenRefused(f"its rows are not consistent: {_first_line(error)}") from error
    except (OSError, zipfile.BadZipFile) as error:
        raise OpenRefused(f"cannot read it: {error}") from error
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        # Sealed is not the same as well-formed: anyone can seal a bundle.
        raise OpenRefused(f"not a bundle this Rundesk can open: {error!r}") from error
    return Opened(run, first_time=True)


# The zip's end of central directory record: its signature, disk numbers,
# entries on this disk and in all, the directory's size and offset, the
# comment's length.
END_RECORD = struct.Struct("<4s4H2LH")
END_SIGNATURE = b"PK\x05\x06"


def _check_directory(path: str | Path, budget: Budget) -> None:
    """What the zip declares, checked before anything is inflated: how many
    files its directory holds, and each file's size.  A file that is no
    zip is left to bundles.verify, which says why."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return  # a pipe would block here: verify refuses it unread
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            end = file.tell()
            # The record ends the file, but for a comment of up to 64 KB.
            file.seek(max(0, end - END_RECORD.size - 0xFFFF))
            tail = file.read()
        at = tail.rfind(END_SIGNATURE)
        if at >= 0 and len(tail) - at >= END_RECORD.size:
            *_, entries, directory, _, _ = END_RECORD.unpack_from(tail, at)
            if entries > MAX_MEMBERS or directory > MAX_DIRECTORY_BYTES:
                raise OpenRefused(
                    f"the zip's directory names {entries} files in {directory} bytes; "
                    f"a bundle holds at most {MAX_MEMBERS}"
                )
        with zipfile.ZipFile(path) as bundle:
            members = bundle.infolist()
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError, ValueError):
        return
    total = 0
    for member in members:
        # Stored bytes that inflate to nothing still take time to read.
        size = max(member.file_size, member.compress_size)
        budget.file(member.filename, size)
        total += size
    budget.total(total)


def _check_manifest(manifest: dict[str, Any], budget: Budget) -> None:
    """What the manifest declares, checked before loading (bundles.verify
    checked the sizes against the zip's, not the rows)."""
    total = 0
    for name, entry in manifest["files"].items():
        size, rows = entry.get("bytes"), entry.get("rows")
        if isinstance(size, int):
            budget.file(name, size)
            total += size
        if isinstance(rows, int):
            budget.rows(name, rows)
    budget.total(total)
    if time.monotonic() > budget.deadline:
        raise budget.out_of_time()


@contextmanager
def _unprepared() -> Iterator[None]:
    """Django binds parameters on the client, so each batch INSERT is a new
    statement text, megabytes long; counting it for preparation
    (prepare_threshold, dashboard/settings.py), psycopg would keep the last
    hundred of them, and memory would grow with the bundle."""
    connection.ensure_connection()
    psycopg = connection.connection
    threshold = psycopg.prepare_threshold
    psycopg.prepare_threshold = None
    try:
        yield
    finally:
        psycopg.prepare_threshold = threshold


@contextmanager
def _statement_timeout_kept() -> Iterator[None]:
    """The loader bounds each statement by the time left (SET LOCAL, gone
    with the transaction); opened inside a caller's transaction, the
    caller's own bound comes back once the bundle is in."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout')")
        (before,) = cursor.fetchone()
    yield
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('statement_timeout', %s, true)", [before])


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# -- loading --------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """How one JSON Lines file of a bundle is loaded."""

    name: str
    model: type[models.Model]
    # Column -> the kind whose new ids it takes (Ids' attribute names).
    refs: dict[str, str] = field(default_factory=dict)
    # The kind whose new ids this file's rows are (the others are not
    # referred to from inside the bundle, so their ids are not kept).
    keeps: str | None = None
    # The many-to-many sources of the row (its `source_ids`).
    sources: type[models.Model] | None = None


@dataclass
class Ids:
    """Original id -> new id, per kind that other rows refer to."""

    actions: dict[int, int] = field(default_factory=dict)
    checkpoints: dict[int, int] = field(default_factory=dict)
    items: dict[int, int] = field(default_factory=dict)
    sources: dict[int, int] = field(default_factory=dict)
    model_calls: dict[int, int] = field(default_factory=dict)
    incidents: dict[int, int] = field(default_factory=dict)


KINDS: list[Kind] = [
    Kind("actions.jsonl", Action, keeps="actions"),
    Kind("receipts.jsonl", Receipt, {"action_id": "actions"}),
    Kind("checkpoints.jsonl", Checkpoint, {"after_action_id": "actions"}, keeps="checkpoints"),
    Kind(
        "outcome_items.jsonl",
        OutcomeItem,
        {"action_id": "actions", "checkpoint_id": "checkpoints"},
        keeps="items",
    ),
    Kind("decisions.jsonl", OperatorDecision, {"item_id": "items", "action_id": "actions"}),
    Kind("revisions.jsonl", AnswerRevision),
    Kind("events.jsonl", RunEvent, {"action_id": "actions"}),
    Kind("sources.jsonl", Source, {"read_action_id": "actions"}, keeps="sources"),
    Kind(
        "model_calls.jsonl",
        ModelCall,
        {"action_id": "actions"},
        keeps="model_calls",
        sources=ModelCall.sources.through,
    ),
    Kind(
        "evidence_copies.jsonl",
        EvidenceCopy,
        {"model_call_id": "model_calls"},
        sources=EvidenceCopy.sources.through,
    ),
    Kind("capture_gaps.jsonl", CaptureGap, {"model_call_id": "model_calls"}),
    Kind("lock_incidents.jsonl", LockIncident, keeps="incidents"),
    Kind("lock_waits.jsonl", LockWait, {"incident_id": "incidents"}),
]
assert [kind.name for kind in KINDS] == [kind.name for kind in bundles.KINDS]


class _Loader:
    def __init__(self, bundle: zipfile.ZipFile, manifest: dict[str, Any], budget: Budget) -> None:
        self.bundle, self.manifest, self.budget = bundle, manifest, budget
        self.ids = Ids()
        self.run: Run | None = None
        self.original_run_id: int | None = None
        # Effects dispatched more than once: inserted as dispatched once, and
        # given their attempts once the decisions that authorised them are in
        # (the database counts those decisions, migration 0008).
        self.attempts: dict[int, int] = {}
        self.copies = self.lost = 0

    def load(self) -> Run:
        self.run = self._run()
        for kind in KINDS:
            if kind.name in self.manifest["files"]:
                self._rows(kind)
        for action_id, attempts in self.attempts.items():
            Action.objects.filter(pk=action_id).update(attempts=attempts)
        if self.copies or self.lost:
            CaptureStats.objects.create(run=self.run, captured=self.copies, lost=self.lost)
        return self.run

    def _run(self) -> Run:
        lines = self._lines("run.json")
        row, _ = next(lines, (None, 0))
        if row is None or next(lines, None) is not None:
            raise OpenRefused("run.json: not one row")
        if row.get("id") != self.manifest.get("run_id"):
            raise OpenRefused(
                f"run.json is run {row.get('id')}, the manifest says run "
                f"{self.manifest.get('run_id')}"
            )
        self.original_run_id = row["id"]
        manifest = self.manifest
        run = _instance(
            Run,
            row,
            # Nothing owns an imported run here (run_imported_never_owned).
            lease_owner="",
            origin_seal=manifest["seal"],
            origin_installation=str(manifest.get("installation", ""))[:200],
            origin_run_id=row["id"],
            origin_exported_at=_when(manifest["exported_at"]),
            origin_format=manifest["format"],
            origin_manifest=manifest,
            imported_at=timezone.now(),
        )
        run.save(force_insert=True)
        return run

    def _rows(self, kind: Kind) -> None:
        batch: list[tuple[dict[str, Any], models.Model]] = []
        size = 0
        for row, line_bytes in self._lines(kind.name):
            batch.append((row, self._row(kind, row)))
            size += line_bytes
            if len(batch) == BATCH or size >= BATCH_BYTES:
                self._insert(kind, batch)
                batch, size = [], 0
        self._insert(kind, batch)

    def _row(self, kind: Kind, row: dict[str, Any]) -> models.Model:
        assert self.run is not None
        values: dict[str, Any] = {"run_id": self.run.pk} if "run_id" in row else {}
        for column, refers_to in kind.refs.items():
            values[column] = self._ref(kind.name, refers_to, row.get(column))
        fix = getattr(self, f"_fix_{kind.name.split('.')[0]}", None)
        if fix is not None:
            fix(row, values)
        return _instance(kind.model, row, **values)

    # What a kind needs besides its references.

    def _fix_actions(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        if row.get("effect_class") == EffectClass.EFFECT and (row.get("attempts") or 1) > 1:
            values["attempts"] = 1
        # Keys are unique across runs, as where they were sent (a bundle of
        # before keys has none: each row gets a new one).
        if isinstance(row.get("idempotency_key"), str):
            values["idempotency_key"] = self._unique(row["idempotency_key"])

    def _fix_outcome_items(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        # Subjects are unique across runs and name the origin's ids.
        values["subject"] = self._unique(row["subject"])

    def _fix_decisions(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        # Request tokens are unique across runs; the user is the origin's
        # (decided_by names them).
        values["request_token"] = self._unique(row["request_token"])
        values["user_id"] = None

    def _fix_revisions(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        values["model_call_actions"] = [
            self._ref("revisions.jsonl", "actions", action)
            for action in row.get("model_call_actions") or []
        ]

    def _fix_capture_gaps(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        # A gap a try again saved later is no longer missing data.
        if not row.get("saved_at"):
            self.lost += int(row.get("count") or 0)

    def _fix_evidence_copies(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        self.copies += 1

    def _fix_lock_incidents(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        assert self.run is not None
        values["imported_run_id"] = self.run.pk

    def _fix_lock_waits(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        # The run's own side of a wait is the imported run; the other run is
        # another installation's, unknown here.
        assert self.run is not None
        for column in ("waiter_run_id", "blocker_run_id"):
            ran = row.get(column)
            values[column] = self.run.pk if ran == self.original_run_id and ran else None

    def _insert(self, kind: Kind, batch: list[tuple[dict[str, Any], models.Model]]) -> None:
        if not batch:
            return
        with connection.cursor() as cursor:
            # SET LOCAL: gone with the transaction, on a pooler's shared
            # connection too.
            cursor.execute(
                "SELECT set_config('statement_timeout', %s, true)", [f"{self.budget.left_ms()}ms"]
            )
        created = kind.model.objects.bulk_create([instance for _, instance in batch])
        kept = getattr(self.ids, kind.keeps) if kind.keeps else None
        links = []
        for (row, _), instance in zip(batch, created, strict=True):
            if kept is not None:
                kept[row["id"]] = instance.pk
            if kind.name == "actions.jsonl" and instance.attempts != row.get("attempts", 1):
                self.attempts[instance.pk] = row["attempts"]
            if kind.sources is not None:
                owner = f"{kind.model._meta.model_name}_id"
                links += [
                    kind.sources(**{owner: instance.pk, "source_id": source})
                    for source in (
                        self._ref(kind.name, "sources", original)
                        for original in row.get("source_ids") or []
                    )
                ]
        if links:
            kind.sources.objects.bulk_create(links, batch_size=BATCH)
        # With DEBUG, Django keeps the text of every statement (connection.queries).
        reset_queries()

    def _ref(self, name: str, refers_to: str, original: Any) -> int | None:
        if original is None:
            return None
        mapped = getattr(self.ids, refers_to).get(original)
        if mapped is None:
            raise OpenRefused(
                f"{name}: refers to {refers_to} {original}, which the bundle does not hold"
            )
        return mapped

    def _unique(self, value: str) -> str:
        """`value` (unique across runs where it was written), made unique
        here: prefixed with the imported run."""
        assert self.run is not None
        prefix = f"imported-run-{self.run.pk}:"
        if len(prefix) + len(value) <= 100:
            return prefix + value
        return prefix + "sha256-" + hashlib.sha256(value.encode()).hexdigest()

    def _lines(self, name: str) -> Iterator[tuple[dict[str, Any], int]]:
        """The rows of one file, and each one's size, hashed again as they
        are read: a file that changed since it was verified is refused (and
        the transaction with it)."""
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise OpenRefused(f"{name}: not in the manifest")
        sha256, size, rows = hashlib.sha256(), 0, 0
        # What is inflated is counted as it is read, whatever the zip declared.
        with self.bundle.open(name) as member, io.BufferedReader(member, READ_BYTES) as data:
            while line := data.readline(MAX_ROW_BYTES + 1):
                size += len(line)
                rows += 1  # a blank line costs a read too
                self.budget.line(name, size, len(line), rows)
                if size > expected.get("bytes", size):
                    raise OpenRefused(f"{name}: changed since it was verified")
                if len(line) > MAX_ROW_BYTES:
                    raise OpenRefused(f"{name}: a row of more than {MAX_ROW_BYTES} bytes")
                sha256.update(line)
                if line.strip():
                    yield _parsed(name, line), len(line)
        if sha256.hexdigest() != expected.get("sha256") or size != expected.get("bytes"):
            raise OpenRefused(f"{name}: changed since it was verified")


def _parsed(name: str, line: bytes) -> dict[str, Any]:
    too_deep = OpenRefused(f"{name}: a row nested more than {MAX_DEPTH} deep")
    try:
        row = json.loads(line)
    except RecursionError:
        raise too_deep from None
    if not isinstance(row, dict):
        raise OpenRefused(f"{name}: a row that is not a JSON object")
    if _deeper_than(row, MAX_DEPTH):
        raise too_deep
    return row


def _deeper_than(row: dict[str, Any], most: int) -> bool:
    """Whether `row` nests objects and arrays more than `most` deep (without
    recursion: the row is what may be too deep for it)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > most:
            return True
        inside = value.values() if isinstance(value, dict) else value
        stack.extend((each, depth + 1) for each in inside if isinstance(each, dict | list))
    return False


def _instance(model: type[models.Model], row: dict[str, Any], **values: Any) -> models.Model:
    """A new row of `model` from a bundle row: its own columns only, no id,
    times parsed; `values` override."""
    columns = {f.attname: f for f in model._meta.concrete_fields}
    fields: dict[str, Any] = {}
    for column, value in row.items():
        field_ = columns.get(column)
        if field_ is None or column == "id" or column in LOCAL:
            continue
        if isinstance(field_, models.DateTimeField) and isinstance(value, str):
            value = _when(value)
        fields[column] = value
    fields.update(values)
    return model(**fields)


def _when(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)
