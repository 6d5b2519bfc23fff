"""Investigation bundles: a run's whole story in one signed, redacted zip
that opens without a Rundesk server.

A bundle holds `run.json`, one JSON Lines file per kind of row (actions,
receipts, checkpoints, outcome items, decisions, revisions, events,
sources, model calls and their copies, capture gaps, lock incidents and
waits touching the run), `report.html` (the run page, self-contained),
`README.txt`, and `manifest.json`: every other file's size and SHA-256, what
was redacted where (counts), the installation's Ed25519 signature of all
that (evidence/bundle_signing.py), and the seal, the SHA-256 of the
manifest's own canonical content.  Everything is read from one read-only
snapshot, and rows are written as they are read, through server-side
cursors, so memory stays flat however large the run.  The same unchanged
run exports to the same bytes but for the manifest's export time.

`verify()` recomputes every hash and the seal, and checks the signature;
any changed byte of the files it holds, any file added or removed, any
edit of the manifest fails it (the zip's own framing -- its comment, bytes
around its entries -- is not signed: what is read from it is).  It reads
in bounded memory and refuses, without an exception, a zip damaged in
transit or made to harm.  The seal alone proves nothing (anyone who changes
a bundle can compute a new one); the signature proves the manifest is what
the holder of its key signed, and a bundle verifies only when that key is
this installation's or one it trusts.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import queue
import socket
import stat
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.contrib.postgres.aggregates import ArrayAgg
from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from evidence import bundle_signing
from evidence.bundle_report import report_html
from evidence.bundle_signing import Signer
from evidence.models import (
    CaptureGap,
    EvidenceCopy,
    LockIncident,
    LockWait,
    ModelCall,
    Source,
)
from evidence.redaction import Redactor
from runs.checkpoints import canonical as checkpoint_text
from runs.models import (
    Action,
    AnswerRevision,
    Checkpoint,
    OperatorDecision,
    OutcomeItem,
    Receipt,
    Run,
    RunEvent,
    canonical_json,
)
from runs.sql import close_named, name_connection

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
# know a log it imported before (an incident's report_digest) or to find
# the gap of a record it tries again (a gap's retry_key): no fact of the
# run.  (A gap's saved_at and attempts are facts: they go.)
LEFT_OUT = {"user_id", "report_digest", "retry_key"}


# -- export -------------------------------------------------------------------------


@dataclass
class Exported:
    manifest: dict[str, Any]
    rows: int

    @property
    def seal(self) -> str:
        return self.manifest["seal"]

    @property
    def signer(self) -> Signer:
        return signer_of(self.manifest)


class _Hashed:
    """Writes to a zip entry, counting and hashing what it writes."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha256, self.bytes = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.sha256.update(data)
        self.bytes += len(data)


Progress = Callable[[int, int], None]


def export(
    run_id: int,
    target: str | Path | IO[bytes],
    *,
    include_evidence: bool = True,
    progress: Progress | None = None,
    redactor: Redactor | None = None,
) -> Exported:
    """Writes run `run_id`'s bundle to `target` (a path or a binary file).
    `progress(rows_written, rows_total)` is called as it goes.

    Everything the bundle holds -- the counts, every file, report.html --
    is read from one REPEATABLE READ, READ ONLY snapshot, on a connection
    of its own: a run that moves meanwhile cannot make a bundle refer to a
    row it does not hold.  `progress` is called on the caller's thread and
    connection, outside that snapshot, so it may write (the export task
    records its progress).  Called inside a transaction (a test's), the
    export reads in that transaction instead, on the caller's thread."""
    redactor = redactor or Redactor()

    def write(tick: Progress | None) -> Exported:
        return _write(run_id, target, include_evidence, redactor, tick)

    if connection.in_atomic_block:
        return write(progress)
    return _in_snapshot(write, progress, run_id)


class _Stopped(Exception):
    """The caller's progress callback raised: the export stops."""


_FINISHED = object()


def _in_snapshot(
    work: Callable[[Progress], Exported], progress: Progress | None, run_id: int
) -> Exported:
    """Runs `work` in a thread of its own, in one read-only snapshot of its
    own connection, relaying its progress to `progress` here."""
    reports: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()
    outcome: list[Exported | BaseException] = []

    def report(written: int, total: int) -> None:
        if stop.is_set():
            raise _Stopped
        reports.put((written, total))

    def read() -> None:
        try:
            name_connection("bundle-export", run_id)
            with transaction.atomic():
                with connection.cursor() as cursor:
                    # The transaction's first statement: the snapshot is
                    # taken at the next one, and every read shares it.
                    cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                outcome.append(work(report))
        except BaseException as error:  # handed to the caller, raised there
            outcome.append(error)
        finally:
            close_named()
            reports.put(_FINISHED)

    thread = threading.Thread(target=read, name=f"bundle-export-run-{run_id}", daemon=True)
    thread.start()
    failed: BaseException | None = None
    try:
        while (item := reports.get()) is not _FINISHED:
            if failed is None and progress is not None:
                try:
                    progress(*item)
                except BaseException as error:
                    failed = error
                    stop.set()
    finally:
        stop.set()  # the caller stops waiting (interrupted): so does the export
    thread.join()
    if failed is not None:
        raise failed
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def _write(
    run_id: int,
    target: str | Path | IO[bytes],
    include_evidence: bool,
    redactor: Redactor,
    progress: Progress | None,
) -> Exported:
    run = Run.objects.get(pk=run_id)
    kinds = [kind for kind in KINDS if include_evidence or not kind.evidence]
    total = 1 + sum(kind.rows(run).count() for kind in kinds)
    hidden = None if include_evidence else _WithoutEvidence.of(run)
    written = 0
    files: dict[str, dict[str, Any]] = {}

    def tick(rows: int) -> None:
        nonlocal written
        written += rows
        if progress is not None:
            progress(written, total)

    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as bundle:

        def entry(name: str, chunks: Iterable[bytes]) -> None:
            with bundle.open(_info(name), "w", force_zip64=True) as raw:
                out = _Hashed(raw)
                for chunk in chunks:
                    out.write(chunk)
            files[name] = {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}

        run_row = _row(Run.objects.filter(pk=run_id).values().get())
        entry("run.json", [canonical(redactor.value(run_row, "run.json")) + b"\n"])
        files["run.json"]["rows"] = 1
        tick(1)
        for kind in kinds:
            counted = [0]
            entry(kind.name, _lines(kind, run, redactor, hidden, counted, tick))
            files[kind.name]["rows"] = counted[0]
        html = report_html(
            run,
            include_evidence=include_evidence,
            redact=lambda text: redactor.text(text, "report.html"),
        )
        entry("report.html", [html.encode()])
        left_out = hidden.report() if hidden is not None else {}
        entry("README.txt", [_readme(kinds, hidden).encode()])
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
        if hidden is not None:
            manifest["left_out"] = left_out
        sign(manifest)
        with bundle.open(_info(MANIFEST), "w") as out:
            out.write(json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    return Exported(manifest, written)


def sign(manifest: dict[str, Any]) -> None:
    """Signs `manifest` with this installation's key and seals it: its
    `signature` covers everything but itself and the seal; the seal is the
    SHA-256 of everything but itself."""
    manifest.pop("seal", None)
    manifest["signature"] = bundle_signing.signature(_signed(manifest))
    manifest["seal"] = seal_of(manifest)


def _signed(manifest: dict[str, Any]) -> bytes:
    """What a manifest's signature signs: its canonical JSON without the
    signature and the seal."""
    return canonical({k: v for k, v in manifest.items() if k not in ("seal", "signature")})


def signer_of(manifest: dict[str, Any]) -> Signer:
    """Who signed `manifest`, as this installation knows them; any manifest,
    even one made to harm (a stored import's, a bundle's)."""
    if not isinstance(manifest, dict):
        return bundle_signing.UNSIGNED
    try:
        signed = _signed(manifest)
    except (ValueError, TypeError, RecursionError):  # a lone surrogate, a value not JSON
        return bundle_signing.UNSIGNED
    return bundle_signing.signer(manifest.get("signature"), signed)


# What --no-evidence replaces by its digest and size: the model's inputs and
# outputs wherever a row holds them.  A model call is an action of this tool
# (or one with a model record); a document read's result is the text the
# run gives the model.
MODEL_CALL_TOOLS = frozenset({"model_call"})
DOCUMENT_READ_TOOLS = frozenset({"read_document"})


@dataclass
class _WithoutEvidence:
    """Rows of a bundle exported without evidence: each copy of a model's
    input or output replaced by what stands for it -- the SHA-256 of its
    canonical JSON (the digest its row keeps: the chain still verifies)
    and its size -- and counted."""

    model_calls: set[int]
    reads: set[int]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, run: Run) -> _WithoutEvidence:
        actions = Action.objects.filter(run=run)
        model_calls = actions.filter(
            Q(kind__in=MODEL_CALL_TOOLS)
            | Q(pk__in=ModelCall.objects.filter(run=run).values("action_id"))
        )
        reads = actions.filter(
            Q(kind__in=DOCUMENT_READ_TOOLS)
            | Q(pk__in=Source.objects.filter(run=run).values("read_action_id"))
        )
        return cls(
            set(model_calls.values_list("pk", flat=True)),
            set(reads.values_list("pk", flat=True)),
        )

    def row(self, name: str, row: dict[str, Any]) -> dict[str, Any]:
        if name == "actions.jsonl" and row["id"] in self.model_calls:
            self._replace(name, row, "input", "model input")
        elif name == "receipts.jsonl" and row["action_id"] in self.model_calls:
            self._replace(name, row, "result", "model output")
        elif name == "receipts.jsonl" and row["action_id"] in self.reads:
            self._replace(name, row, "result", "document text given to the model")
        elif name == "checkpoints.jsonl" and row["state"] is not None:
            # An agent's saved state holds what its model said (summaries);
            # its digest is of the checkpoint's own canonical text.
            self._replace(name, row, "state", "agent state", checkpoint_text)
        return row

    def _replace(
        self,
        name: str,
        row: dict[str, Any],
        column: str,
        what: str,
        text_of: Callable[[Any], str] = canonical_json,
    ) -> None:
        text = text_of(row[column]).encode()
        row[column] = {
            "left_out": what,
            "sha256": hashlib.sha256(text).hexdigest(),
            "bytes": len(text),
        }
        counts = self.counts.setdefault(name, {})
        counts[what] = counts.get(what, 0) + 1

    def report(self) -> dict[str, dict[str, int]]:
        return {name: dict(sorted(counts.items())) for name, counts in sorted(self.counts.items())}


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
    hidden: _WithoutEvidence | None,
    counted: list[int],
    tick: Callable[[int], None],
) -> Iterator[bytes]:
    """The rows of `kind`, one JSON line each, read through a server-side
    cursor and written as they are read."""
    batch: list[bytes] = []
    for values in kind.rows(run).values().iterator(chunk_size=CHUNK):
        row = _row(values)
        if hidden is not None:
            row = hidden.row(kind.name, row)
        batch.append(canonical(redactor.value(row, kind.name)) + b"\n")
        if len(batch) == CHUNK:
            counted[0] += len(batch)
            tick(len(batch))
            yield b"".join(batch)
            batch = []
    counted[0] += len(batch)
    tick(len(batch))
    yield b"".join(batch)


def _readme(kinds: list[Rows], hidden: _WithoutEvidence | None) -> str:
    lines = [
        "Rundesk investigation bundle",
        "============================",
        "",
        "One run's whole story: what it did, what is known, what is not, and who",
        "decided what. Secrets were replaced by [REDACTED:<kind>] before anything was",
        "written; manifest.json counts what was replaced where (never a value).",
        "",
    ]
    if hidden is not None:
        lines += [
            "Exported without evidence",
            "-------------------------",
            "Every copy of what the model was given and what it answered is left out:",
            "the copies of model calls (no evidence_copies.jsonl), the input (prompt) of each",
            "model call in actions.jsonl, the result of each model call and of each",
            "document read (the text given to the model) in receipts.jsonl, and the",
            "agent's saved state in checkpoints.jsonl. Each is replaced by",
            '  {"left_out": WHAT, "sha256": SHA-256, "bytes": SIZE}',
            "where SHA-256 and SIZE are those of the value's canonical JSON (sorted keys,",
            "no spaces, UTF-8): the digest its row keeps (input_digest, result_digest,",
            "state_digest), so each still verifies against it. manifest.json's",
            '"left_out" counts them per file. The answers (revisions.jsonl, report.html)',
            "are the run's result and are kept: they say what the model wrote into them.",
            "",
        ]
    lines += [
        "Files",
        "-----",
        "manifest.json  format, run, export time, Rundesk version, installation;",
        "               each file's size, SHA-256 and row count; what was redacted;",
        "               the signature (Ed25519) of all that by the exporting",
        "               installation, with its public key; the seal: SHA-256 of the",
        "               manifest's canonical JSON (sorted keys, no spaces, UTF-8)",
        "               without the seal itself",
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
        "recomputes every file's SHA-256 and checks the manifest's signature: it says",
        "who signed it (this installation, a trusted key by name, or a key not known",
        "there) and accepts only a bundle it can authenticate. The signature proves",
        "the bundle is unchanged since the holder of that key signed it; to trust it,",
        "get the exporter's public key through another channel (they print it with",
        "`python manage.py verify_bundle --public-key`) and add it to",
        "RUNDESK_BUNDLE_TRUSTED_KEYS. Without Rundesk: sha256sum each file and compare",
        "with manifest.json, and check the Ed25519 signature of the manifest's",
        "canonical JSON without seal and signature, prefixed with the line",
        f"{bundle_signing.CONTEXT.decode().strip()!r}.",
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
    """What `verify` found: `failures` names each file (or the manifest)
    whose content does not match; `signer` says who signed the manifest.
    `ok` only when nothing fails and the signer is authenticated: this
    installation, or a key trusted here."""

    manifest: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    signer: Signer = bundle_signing.UNSIGNED

    @property
    def authenticated(self) -> bool:
        return self.signer.authenticated

    @property
    def ok(self) -> bool:
        return not self.failures and self.authenticated

    @property
    def problems(self) -> list[str]:
        """Why the bundle is refused: its failures, and that it is not
        authenticated (say who signed it)."""
        if self.authenticated:
            return list(self.failures)
        return [*self.failures, f"{MANIFEST}: {self.signer.words}"]


def verify(path: str | Path) -> Verification:
    """Checks a bundle's signature, its seal and every file's size and hash.
    Whatever the file holds (damaged in transit, or made to harm), the
    answer is a Verification, read in bounded memory: never an exception,
    never a wait."""
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
        checked.signer = signer_of(manifest)
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


def manifest_of(path: str | Path) -> dict[str, Any]:
    """The manifest of the bundle at `path`, unchecked ({} when it holds
    none that can be read): what a page says of a bundle without reading
    it whole."""
    try:
        with zipfile.ZipFile(path) as bundle:
            if bundle.getinfo(MANIFEST).file_size > MAX_MANIFEST_BYTES:
                return {}
            manifest = json.loads(_read(bundle, MANIFEST))
    except (KeyError, ValueError, RecursionError, UnicodeDecodeError, *UNREADABLE):
        return {}
    return manifest if isinstance(manifest, dict) else {}


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
