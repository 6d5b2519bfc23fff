"""Investigation bundles: a run's whole story in one sealed, redacted zip
that opens without a Rundesk server.

A bundle holds `run.json`, one JSON Lines file per kind of row (actions,
receipts, checkpoints, outcome items, decisions, revisions, events,
sources, model calls, evidence copies, capture gaps, lock incidents and
waits touching the run), `report.html` (the run page, self-contained),
`README.txt`, and `manifest.json`: every other file's size and SHA-256, what
was redacted where (counts), and the seal, the SHA-256 of the manifest's
own canonical content.  Rows are written as they are read, through
server-side cursors, so memory stays flat however large the run.  The same
unchanged run exports to the same bytes but for the manifest's export time.

`verify()` recomputes every hash and the seal; any changed byte of the
files it holds, any file added or removed, any edit of the manifest fails
it (the zip's own framing -- its comment, bytes around its entries -- is
not sealed: what is read from it is).  It reads in bounded memory and
refuses, without an exception, a zip damaged in transit or made to harm.  The seal proves the
bundle is the one whose seal the exporter printed: compare them through
another channel (anyone who changes a bundle can compute a new seal).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import socket
import stat
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.contrib.postgres.aggregates import ArrayAgg
from django.db.models import Q, QuerySet
from django.utils import timezone

from evidence.bundle_report import report_html
from evidence.models import (
    CaptureGap,
    EvidenceCopy,
    LockIncident,
    LockWait,
    ModelCall,
    Source,
)
from evidence.redaction import Redactor
from runs.models import (
    Action,
    AnswerRevision,
    Checkpoint,
    OperatorDecision,
    OutcomeItem,
    Receipt,
    Run,
    RunEvent,
)

FORMAT = "rundesk-bundle/1"
MANIFEST = "manifest.json"
# Every entry carries this time, so the same run exports to the same bytes.
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
CHUNK = 2000  # rows fetched per round trip of a server-side cursor
# A manifest names some sixteen files: one larger than this is no manifest.
MAX_MANIFEST_BYTES = 1 << 20
# What reading a damaged member raises: a bad CRC, inflating bytes that are
# not deflate's, a member cut short, one flagged encrypted (RuntimeError) or
# packed by a method zipfile lacks (NotImplementedError).
UNREADABLE = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    OSError,
    RuntimeError,
    NotImplementedError,
)


def canonical(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_jsonable
    ).encode()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def seal_of(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in manifest.items() if k != "seal"})).hexdigest()


# -- what a bundle holds ------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """One JSON Lines file: a kind of row, in a fixed order."""

    name: str
    what: str  # for README.txt
    rows: Callable[[Run], QuerySet[Any]]
    evidence: bool = False  # left out by --no-evidence


def _lock_waits(run: Run) -> QuerySet[LockWait]:
    return LockWait.objects.filter(Q(waiter_run=run) | Q(blocker_run=run))


def _source_ids() -> ArrayAgg:
    """The ids of the sources a record links, [] for none: a model record
    stands without its links when they could not be saved (records.py),
    and the join's NULL made a bundle no database could open."""
    return ArrayAgg(
        "sources__id", order_by="sources__id", filter=Q(sources__isnull=False), default=[]
    )


KINDS: list[Rows] = [
    Rows(
        "actions.jsonl",
        "each action: identity (step key), tool, effect class, input and its digest, state, "
        "lease epoch, attempts",
        lambda run: Action.objects.filter(run=run).order_by("id"),
    ),
    Rows(
        "receipts.jsonl",
        "the immutable record that an action completed, with its result and digest",
        lambda run: Receipt.objects.filter(run=run).order_by("action_id"),
    ),
    Rows(
        "checkpoints.jsonl",
        "saved agent states and the outcome of each checkpoint write",
        lambda run: Checkpoint.objects.filter(run=run).order_by("number", "id"),
    ),
    Rows(
        "outcome_items.jsonl",
        "what the runtime could not settle itself, with the evidence it recorded",
        lambda run: OutcomeItem.objects.filter(run=run).order_by("id"),
    ),
    Rows(
        "decisions.jsonl",
        "operators' and the system's decisions: who, why, the evidence shown and its SHA-256",
        lambda run: OperatorDecision.objects.filter(run=run).order_by("id"),
    ),
    Rows(
        "revisions.jsonl",
        "answer revisions as published, and the model-call actions each used",
        lambda run: AnswerRevision.objects.filter(run=run).order_by("number"),
    ),
    Rows(
        "events.jsonl",
        "the run's timeline, in order",
        lambda run: RunEvent.objects.filter(run=run).order_by("created_at", "id"),
    ),
    Rows(
        "sources.jsonl",
        "the documents the run read, as they were when read",
        lambda run: Source.objects.filter(run=run).order_by("id"),
    ),
    Rows(
        "model_calls.jsonl",
        "the model record of each model call, with the sources it was given",
        lambda run: (
            ModelCall.objects.filter(run=run).annotate(source_ids=_source_ids()).order_by("id")
        ),
    ),
    Rows(
        "evidence_copies.jsonl",
        "bounded copies of the model calls' inputs and outputs (capture)",
        lambda run: (
            EvidenceCopy.objects.filter(run=run).annotate(source_ids=_source_ids()).order_by("id")
        ),
        evidence=True,
    ),
    Rows(
        "capture_gaps.jsonl",
        "evidence records that were not saved, and why",
        lambda run: CaptureGap.objects.filter(run=run).order_by("id"),
    ),
    Rows(
        "lock_incidents.jsonl",
        "lock-wait incidents with a wait that involved the run",
        lambda run: LockIncident.objects.filter(
            pk__in=_lock_waits(run).values("incident")
        ).order_by("id"),
    ),
    Rows(
        "lock_waits.jsonl",
        "the wait-for edges of those incidents that involved the run",
        lambda run: _lock_waits(run).order_by("id"),
    ),
]

# Every file a bundle may hold; any other name is refused.
MEMBERS = {"run.json", "report.html", "README.txt", *(kind.name for kind in KINDS)}

# What a row says about who it was, and what this installation keeps to
# know a log it imported before (an incident's report_digest): no fact of
# the run.
LEFT_OUT = {"user_id", "report_digest"}


# -- export -------------------------------------------------------------------------


@dataclass
class Exported:
    manifest: dict[str, Any]
    rows: int

    @property
    def seal(self) -> str:
        return self.manifest["seal"]


class _Hashed:
    """Writes to a zip entry, counting and hashing what it writes."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha256, self.bytes = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.sha256.update(data)
        self.bytes += len(data)


def export(
    run_id: int,
    target: str | Path | IO[bytes],
    *,
    include_evidence: bool = True,
    progress: Callable[[int, int], None] | None = None,
    redactor: Redactor | None = None,
) -> Exported:
    """Writes run `run_id`'s bundle to `target` (a path or a binary file).
    `progress(rows_written, rows_total)` is called as it goes."""
    run = Run.objects.get(pk=run_id)
    redactor = redactor or Redactor()
    kinds = [kind for kind in KINDS if include_evidence or not kind.evidence]
    total = 1 + sum(kind.rows(run).count() for kind in kinds)
    written = 0
    files: dict[str, dict[str, Any]] = {}

    def tick(rows: int) -> None:
        nonlocal written
        written += rows
        if progress is not None:
            progress(written, total)

    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as bundle:

        def entry(name: str, chunks: Iterable[bytes], rows: int | None = None) -> None:
            with bundle.open(_info(name), "w", force_zip64=True) as raw:
                out = _Hashed(raw)
                for chunk in chunks:
                    out.write(chunk)
            files[name] = {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}
            if rows is not None:
                files[name]["rows"] = rows

        run_row = _row(Run.objects.filter(pk=run_id).values().get())
        entry("run.json", [canonical(redactor.value(run_row, "run.json")) + b"\n"], 1)
        tick(1)
        for kind in kinds:
            counted = [0]
            entry(kind.name, _lines(kind, run, redactor, counted, tick), None)
            files[kind.name]["rows"] = counted[0]
        html = report_html(
            run,
            include_evidence=include_evidence,
            redact=lambda text: redactor.text(text, "report.html"),
        )
        entry("report.html", [html.encode()])
        entry("README.txt", [_readme(kinds).encode()])
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "run_id": run_id,
            "exported_at": timezone.now().isoformat(),
            "rundesk_version": metadata.version("rundesk"),
            "installation": settings.RUNDESK_INSTALLATION or socket.gethostname(),
            "evidence_included": include_evidence,
            "files": dict(sorted(files.items())),
            "redacted": redactor.report(),
        }
        manifest["seal"] = seal_of(manifest)
        with bundle.open(_info(MANIFEST), "w") as out:
            out.write(json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    return Exported(manifest, written)


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def _row(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in LEFT_OUT}


def _lines(
    kind: Rows,
    run: Run,
    redactor: Redactor,
    counted: list[int],
    tick: Callable[[int], None],
) -> Iterator[bytes]:
    """The rows of `kind`, one JSON line each, read through a server-side
    cursor and written as they are read."""
    batch: list[bytes] = []
    for values in kind.rows(run).values().iterator(chunk_size=CHUNK):
        batch.append(canonical(redactor.value(_row(values), kind.name)) + b"\n")
        if len(batch) == CHUNK:
            counted[0] += len(batch)
            tick(len(batch))
            yield b"".join(batch)
            batch = []
    counted[0] += len(batch)
    tick(len(batch))
    yield b"".join(batch)


def _readme(kinds: list[Rows]) -> str:
    lines = [
        "Rundesk investigation bundle",
        "============================",
        "",
        "One run's whole story: what it did, what is known, what is not, and who",
        "decided what. Secrets were replaced by [REDACTED:<kind>] before anything was",
        "written; manifest.json counts what was replaced where (never a value).",
        "",
        "Files",
        "-----",
        "manifest.json  format, run, export time, Rundesk version, installation;",
        "               each file's size, SHA-256 and row count; what was redacted;",
        "               the seal: SHA-256 of the manifest's canonical JSON (sorted keys,",
        "               no spaces, UTF-8) without the seal itself",
        "run.json       the run: question, documents, status, phase, lease, budget",
    ]
    lines += [f"{kind.name:<22} {kind.what}" for kind in kinds]
    lines += [
        "report.html    the run as the dashboard shows it; opens offline in any browser",
        "README.txt     this file",
        "",
        "Every .jsonl file holds one JSON object per line, in a fixed order; times",
        "are ISO 8601 with their zone.",
        "",
        "Verify",
        "------",
        "  python manage.py verify_bundle BUNDLE.zip",
        "recomputes every file's SHA-256 and the seal, and names each file that does",
        "not match (or is missing, or was added). Compare the seal with the one the",
        "sender gave you through another channel: it proves the bundle is the one",
        "they exported. Without Rundesk: sha256sum each file and compare with",
        "manifest.json.",
        "",
        "Open",
        "----",
        "  python manage.py open_bundle BUNDLE.zip",
        "loads it into a Rundesk dashboard as a read-only imported run.",
        "",
    ]
    return "\n".join(lines)


# -- verify -------------------------------------------------------------------------


@dataclass
class Verification:
    manifest: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def verify(path: str | Path) -> Verification:
    """Checks a bundle's seal and every file's size and hash.  Whatever the
    file holds (damaged in transit, or made to harm), the answer is a list
    of failures, read in bounded memory: never an exception, never a wait."""
    checked = Verification()
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            checked.failures.append("not a regular file")
            return checked
        bundle = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError) as error:  # a name not UTF-8
        checked.failures.append(f"not a readable zip file: {error}")
        return checked
    with bundle:
        members = {info.filename: info for info in bundle.infolist()}
        if len(members) != len(bundle.infolist()):
            checked.failures.append("a file name appears twice in the zip")
        if MANIFEST not in members:
            checked.failures.append(f"{MANIFEST}: missing")
            return checked
        if members[MANIFEST].file_size > MAX_MANIFEST_BYTES:
            checked.failures.append(
                f"{MANIFEST}: {members[MANIFEST].file_size} bytes, more than a manifest holds"
            )
            return checked
        try:
            manifest = json.loads(_read(bundle, MANIFEST))
            files = manifest["files"]
            if not isinstance(files, dict) or not all(isinstance(f, dict) for f in files.values()):
                raise TypeError("its files are not named with their size and hash")
            seal = seal_of(manifest)  # a lone surrogate cannot be sealed: ValueError
        except (ValueError, KeyError, TypeError, RecursionError, *UNREADABLE) as error:
            checked.failures.append(f"{MANIFEST}: not a bundle manifest ({error})")
            return checked
        checked.manifest = manifest
        if manifest.get("format") != FORMAT:
            checked.failures.append(
                f"{MANIFEST}: format {manifest.get('format')!r} is not {FORMAT}"
            )
        if manifest.get("seal") != seal:
            checked.failures.append(f"{MANIFEST}: the seal does not match its content")
        for name in sorted(set(members) - set(files) - {MANIFEST}):
            checked.failures.append(f"{name}: not in the manifest (added)")
        for name in sorted(set(files) - MEMBERS):
            # Nothing here reads it, but a recipient who unzips the bundle
            # would write it (../, an absolute path).
            checked.failures.append(f"{name}: no file a bundle holds")
        for name, expected in sorted(files.items()):
            if name not in members:
                checked.failures.append(f"{name}: missing")
            elif (
                # The size the zip's directory gives is known before anything
                # is inflated: a member larger than its manifest says is not read.
                members[name].file_size != expected.get("bytes")
                or _sha256(bundle, name) != expected.get("sha256")
            ):
                checked.failures.append(f"{name}: its content does not match the manifest")
    return checked


def _read(bundle: zipfile.ZipFile, name: str) -> bytes:
    with bundle.open(name) as data:
        return data.read()


def _sha256(bundle: zipfile.ZipFile, name: str) -> str:
    """The SHA-256 of a member's content, read a megabyte at a time; a
    member that cannot be read (its compressed bytes damaged, its CRC
    wrong) has none: ""."""
    sha256 = hashlib.sha256()
    try:
        with bundle.open(name) as data:
            while chunk := data.read(1 << 20):
                sha256.update(chunk)
    except UNREADABLE:
        return ""
    return sha256.hexdigest()
