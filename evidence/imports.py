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
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import DataError, IntegrityError, connection, models, reset_queries, transaction
from django.utils import timezone

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

BATCH = bundles.CHUNK  # rows per INSERT at most
BATCH_BYTES = 4 << 20  # and about this much JSON: evidence copies can be large
# No row an export writes comes near this (a receipt holds a document of at
# most 1 MB, escaped): a longer line is read no further.
MAX_ROW_BYTES = 64 << 20
UNIQUE_SEAL = "run_import_seal_unique"


class ImportRefused(Exception):
    """The bundle cannot be opened; `failures` names what is wrong."""

    def __init__(self, message: str, failures: list[str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or [message]


@dataclass
class Opened:
    run: Run
    imported: bool  # False: the bundle had been opened before, this is that run

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
        "imported_at": run.imported_at.isoformat() if run.imported_at else None,
    }


def open_bundle(path: str | Path) -> Opened:
    """Verifies the bundle at `path` and opens it as an imported run, or
    finds the run it was opened as before.  ImportRefused says why not."""
    checked = bundles.verify(path)
    if not checked.ok:
        raise ImportRefused("the bundle does not verify", checked.failures)
    manifest = checked.manifest
    if (earlier := Run.objects.filter(origin_seal=manifest["seal"]).first()) is not None:
        return Opened(earlier, imported=False)
    try:
        with transaction.atomic(), _unprepared(), zipfile.ZipFile(path) as bundle:
            run = _Loader(bundle, manifest).load()
    except IntegrityError as error:
        # The same bundle, opened at the same moment by someone else: theirs
        # committed first and stands.
        if _constraint(error) == UNIQUE_SEAL:
            return Opened(Run.objects.get(origin_seal=manifest["seal"]), imported=False)
        raise ImportRefused(f"its rows are not consistent: {_first_line(error)}") from error
    except DataError as error:
        raise ImportRefused(f"its rows are not consistent: {_first_line(error)}") from error
    except (OSError, zipfile.BadZipFile) as error:
        raise ImportRefused(f"cannot read it: {error}") from error
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        # Sealed is not the same as well-formed: anyone can seal a bundle.
        raise ImportRefused(f"not a bundle this Rundesk can open: {error!r}") from error
    return Opened(run, imported=True)


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


def _constraint(error: IntegrityError) -> str | None:
    diag = getattr(error.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None)


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
    def __init__(self, bundle: zipfile.ZipFile, manifest: dict[str, Any]) -> None:
        self.bundle, self.manifest = bundle, manifest
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
        ((row, _),) = list(self._lines("run.json"))
        if row.get("id") != self.manifest.get("run_id"):
            raise ImportRefused(
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
        self.lost += int(row.get("count") or 0)

    def _fix_evidence_copies(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        self.copies += 1

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
            raise ImportRefused(
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
            raise ImportRefused(f"{name}: not in the manifest")
        sha256, size = hashlib.sha256(), 0
        with self.bundle.open(name) as data:
            while line := data.readline(MAX_ROW_BYTES + 1):
                if len(line) > MAX_ROW_BYTES:
                    raise ImportRefused(f"{name}: a row of more than {MAX_ROW_BYTES} bytes")
                sha256.update(line)
                size += len(line)
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ImportRefused(f"{name}: a row that is not a JSON object")
                    yield row, len(line)
        if sha256.hexdigest() != expected.get("sha256") or size != expected.get("bytes"):
            raise ImportRefused(f"{name}: changed since it was verified")


def _instance(model: type[models.Model], row: dict[str, Any], **values: Any) -> models.Model:
    """A new row of `model` from a bundle row: its own columns only, no id,
    times parsed; `values` override."""
    columns = {f.attname: f for f in model._meta.concrete_fields}
    fields: dict[str, Any] = {}
    for column, value in row.items():
        field_ = columns.get(column)
        if field_ is None or column == "id":
            continue
        if isinstance(field_, models.DateTimeField) and isinstance(value, str):
            value = _when(value)
        fields[column] = value
    fields.update(values)
    return model(**fields)


def _when(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)
