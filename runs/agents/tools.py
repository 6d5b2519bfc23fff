"""The shipped agents' tools: reading a document of the corpus, a model
call, delivering a report, and a no-op for the benchmarks.

Each runs outside any database transaction (runs/agent.py says what a tool
answers).  Every real execution is appended to the tool journal when
RUNDESK_TOOL_JOURNAL is set: drills and tests count executions from it.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import http.client
import json
import os
import re
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

from django.conf import settings

from runs.agent import EFFECT, READ, OutcomeUnknown, Tool, ToolCall, ToolFailed, ToolRefused
from runs.agents.corpus import NotInCorpus, corpus_file
from runs.agents.providers import ProviderError, get_provider
from runs.agents.unredirected import NOT_REDIRECTED
from runs.durable_files import sync_folder
from runs.models import UNSTORABLE

MAX_DOCUMENT_BYTES = 1_000_000
# How a file that is no text begins: it is refused, not read as garbage.
NOT_TEXT = {
    b"%PDF-": "a PDF document",
    b"\x89PNG\r\n\x1a\n": "a PNG image",
    b"GIF87a": "a GIF image",
    b"GIF89a": "a GIF image",
    b"\xff\xd8\xff": "a JPEG image",
    b"PK\x03\x04": "a ZIP archive (or a document in one: .docx, .xlsx, .odt)",
    b"\x1f\x8b": "a gzip archive",
    b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1": "an Office 97-2003 document",
    b"\x7fELF": "a program",
    b"SQLite format 3\x00": "an SQLite database",
    b"7z\xbc\xaf\x27\x1c": "a 7-Zip archive",
    b"\xfd7zXZ\x00": "an xz archive",
    b"\x28\xb5\x2f\xfd": "a zstd archive",
}


def journal(tool: str, identity: str, **detail: Any) -> None:
    """Appends one line per real execution.  O_APPEND keeps lines from
    concurrent processes whole."""
    path = settings.RUNDESK_TOOL_JOURNAL
    if not path:
        return
    line = json.dumps({"tool": tool, "identity": identity, "pid": os.getpid(), **detail})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def resolve_in_corpus(relative: str, corpus: Path) -> Path:
    """The file `relative` names inside the corpus folder, or ToolRefused
    saying why not (runs/agents/corpus.py: a submission is refused in the same
    words)."""
    try:
        return corpus_file(relative, corpus)
    except NotInCorpus as refusal:
        raise ToolRefused(str(refusal)) from None


def read_document(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    path = resolve_in_corpus(str(input.get("path", "")), settings.RUNDESK_CORPUS_DIR)
    try:
        with path.open("rb") as handle:
            data = read_at_most(handle, MAX_DOCUMENT_BYTES + 1)
    except OSError as error:  # no permission, an I/O error: a definite answer
        raise ToolRefused(f"{input['path']!r}: {error.strerror or error}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ToolRefused(f"{input['path']!r}: larger than {MAX_DOCUMENT_BYTES} bytes")
    if kind := next((kind for head, kind in NOT_TEXT.items() if data.startswith(head)), ""):
        raise ToolRefused(f"{input['path']!r}: {kind}, not text")
    text = decoded(data)
    if _unreadable_share(text) > MAX_UNREADABLE:
        raise ToolRefused(
            f"{input['path']!r}: not text (binary data, or an encoding other than UTF-8 and UTF-16)"
        )
    journal("read_document", call.identity, path=input["path"])
    return {
        "path": input["path"],
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "text": text,
    }


def read_at_most(handle: BinaryIO, limit: int) -> bytes:
    """The file's bytes, `limit` at most.  `read(limit)` sets aside
    `limit` bytes before it reads (a megabyte for each small document, and
    three system calls to map and unmap it): it asks for what the file
    holds, one byte more to see it grew meanwhile, and only then for the
    rest."""
    size = os.fstat(handle.fileno()).st_size
    data = handle.read(min(size + 1, limit))
    if len(data) > size:
        data += handle.read(limit - len(data))
    return data


# Past this share of characters no text holds, in the first SAMPLE of a
# document of at least SAMPLE_MIN characters, a file is no text: an archive,
# an image, a database, a program (mostly NULs, and bytes no UTF-8 has), or
# text in another encoding (Shift_JIS: nearly every character lost).  A
# Latin-1 page loses its accented letters only, far fewer.  Below SAMPLE_MIN
# a share says nothing (one accented letter in a word of three).
MAX_UNREADABLE = 0.3
SAMPLE, SAMPLE_MIN = 65_536, 16
_UNREADABLE = re.compile("[\ufffd\x00-\x08\x0b\x0e-\x1f\x7f]")


def _unreadable_share(text: str) -> float:
    sample = text[:SAMPLE]
    if len(sample) < SAMPLE_MIN:
        return 0.0
    return len(_UNREADABLE.findall(sample)) / len(sample)


def decoded(data: bytes) -> str:
    """A document's bytes as text: UTF-8, or UTF-32 or UTF-16 where a
    byte-order mark says so (UTF-32's little-endian mark begins with
    UTF-16's: it is looked for first) or, for UTF-16 without one, where
    every other byte is a NUL.  What cannot be decoded becomes U+FFFD
    (`storable`)."""
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        encoding = "utf-32"
    elif data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        encoding = "utf-16"
    else:
        encoding = _unmarked_utf16(data) or "utf-8-sig"
    return storable(data.decode(encoding, errors="replace"))


def _unmarked_utf16(data: bytes) -> str | None:
    """UTF-16 without a byte-order mark, as text of mostly Latin letters
    writes it: the high byte of each character a NUL (odd bytes in
    little-endian, even in big-endian), the other bytes hardly ever."""
    if len(data) < 4 or len(data) % 2:
        return None
    even, odd = data[0::2].count(0), data[1::2].count(0)
    if odd >= len(data) // 4 and even * 10 <= odd:
        return "utf-16-le"
    if even >= len(data) // 4 and odd * 10 <= even:
        return "utf-16-be"
    return None


def storable(text: str) -> str:
    """`text` as a receipt can hold it: NUL (no PostgreSQL text or jsonb
    value can) and lone surrogates (UTF-8 cannot encode them) as U+FFFD.
    Left in, they would fail every attempt to write the receipt."""
    return UNSTORABLE.sub("\ufffd", text)


def deliver_report(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """POSTs the report with the action's Idempotency-Key, or, with no
    RUNDESK_DELIVERY_URL, writes it to the outbox once per key.  The key is
    unique in the world (models.new_idempotency_key), unlike the identity: a
    run 4 of another installation, or of this one's database made anew,
    never meets this run 4's report."""
    identity, idempotency_key = call.identity, call.idempotency_key
    body = input["content"].encode()
    sha = hashlib.sha256(body).hexdigest()
    if settings.RUNDESK_DELIVERY_URL:
        url = settings.RUNDESK_DELIVERY_URL
        status = post(
            url,
            body,
            idempotency_key,
            content_type="text/markdown; charset=utf-8",
            timeout=settings.RUNDESK_DELIVERY_TIMEOUT,
            what="the report",
        )
        journal("deliver_report", identity, to="url", status=status, key=idempotency_key)
        return {"delivered_to": named_address(url), "status": status, "sha256": sha}
    target = outbox_file(idempotency_key)
    outbox = target.parent
    # Written whole to a temporary file, then linked into place: link() fails
    # if the target exists, so a report appears once, complete, or not at all.
    # Until the link, a failure leaves nothing delivered: known not to have
    # happened.
    try:
        outbox.mkdir(parents=True, exist_ok=True)
        incoming = tempfile.NamedTemporaryFile(dir=outbox, prefix=".incoming-")  # noqa: SIM115 (the with below)
    except OSError as error:
        raise ToolFailed(f"outbox {outbox}: {error.strerror or error}") from None
    with incoming as handle:
        try:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
            os.link(handle.name, target)
            already = False
        except FileExistsError:
            if hashlib.sha256(target.read_bytes()).hexdigest() != sha:
                raise ToolFailed(f"{target} holds another report under this key") from None
            already = True  # by an attempt that died before its receipt
        except OSError as error:
            raise ToolFailed(f"outbox {outbox}: {error.strerror or error}") from None
    # The report's name is durable once the outbox is synced: before its
    # receipt says it was delivered (runs/durable_files.py).  Linked and
    # not synced, it may or may not survive a crash.
    try:
        sync_folder(outbox)
    except OSError as error:
        raise OutcomeUnknown(
            f"{target} written, the outbox not synced: {error.strerror or error}"
        ) from None
    if already:
        return {"delivered_to": str(target), "sha256": sha, "already_delivered": True}
    journal("deliver_report", identity, to="outbox", key=idempotency_key)
    return {"delivered_to": str(target), "sha256": sha}


def outbox_file(idempotency_key: str) -> Path:
    """The outbox file a report sent under `idempotency_key` is written
    to: one file per key, named so that no two keys share it."""
    return Path(settings.RUNDESK_OUTBOX_DIR) / (
        urllib.parse.quote(idempotency_key, safe="") + ".md"
    )


def receiver(idempotency_key: str) -> str:
    """Where a report sent under `idempotency_key` goes, as an operator
    is shown it (to look it up there): the delivery address
    (`shown_address`), or the outbox file."""
    if not settings.RUNDESK_DELIVERY_URL:
        return str(outbox_file(idempotency_key))
    return shown_address(settings.RUNDESK_DELIVERY_URL)


def shown_address(url: str) -> str:
    """An HTTP receiver's address as an operator is shown it: without the
    user and password it may carry and with its query's values blanked
    (?token=…: most webhooks carry their secret there)."""
    url, _ = _credentials(url)
    parts = urllib.parse.urlsplit(url)
    # A part with no "=" is a value alone (?s3cret): blanked whole.
    query = "&".join(
        f"{part.partition('=')[0]}=…" if "=" in part else "…"
        for part in parts.query.split("&")
        if part
    )
    return urllib.parse.urlunsplit(parts._replace(query=query, fragment=""))


def _credentials(url: str) -> tuple[str, str]:
    """The receiver's address without the user and password it may carry
    (https://user:password@host/...: urllib would take them for the host
    name), and the Authorization header they make ("" with none).  The
    receipt names the address, never the password."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, ""
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    plain = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return plain, "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def named_address(url: str) -> str:
    """An HTTP receiver's address as a receipt (immutable, shown to staff)
    names it: without the user and password it may carry, and without its
    query, where most webhooks carry their secret (?token=, ?sig=).  One
    kept in the path (Slack's, Discord's) stays, as the receiver's name:
    bundles' redaction knows those addresses."""
    plain, _ = _credentials(url)
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(plain)._replace(query="", fragment=""))


def post(url: str, body: bytes, key: str, *, content_type: str, timeout: float, what: str) -> int:
    """POSTs `body` to an HTTP receiver under `Idempotency-Key: key` and
    answers its status; the user and password `url` may carry go as Basic
    authorization.  ToolFailed when it is known the receiver did not take
    `what` (no connection, or a 4xx refusal); OutcomeUnknown when it may
    have (the answer lost, a 5xx, a redirect)."""
    url, credentials = _credentials(url)
    headers = {"Content-Type": content_type, "Idempotency-Key": key}
    if credentials:
        headers["Authorization"] = credentials
    request = urllib.request.Request(  # noqa: S310 (settings.env_url allows http(s) only)
        url, data=body, method="POST", headers=headers
    )
    try:
        with NOT_REDIRECTED.open(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        # A 5xx, or a redirect (3xx): the receiver may have taken it.
        if 400 <= error.code < 500 and error.code not in (408, 409, 429):
            raise ToolFailed(f"receiver refused {what}: HTTP {error.code}") from error
        raise OutcomeUnknown(f"receiver answered HTTP {error.code}: delivery unknown") from error
    except urllib.error.URLError as error:
        # Refused, or its name not found: no connection, so nothing was sent.
        if isinstance(error.reason, ConnectionRefusedError | socket.gaierror):
            raise ToolFailed(f"receiver unreachable: {error.reason}") from error
        raise OutcomeUnknown(f"delivery answer lost: {error.reason}") from error
    except (TimeoutError, ConnectionError, http.client.HTTPException) as error:
        raise OutcomeUnknown(f"delivery answer lost: {error!r}") from error


def model_call(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """A read-class action: repeatable, no outside effect."""
    provider = get_provider()
    try:
        text = provider.complete(input["messages"])
    except ProviderError as error:
        raise ToolFailed(str(error)) from error
    journal("model_call", call.identity, provider=provider.name)
    return {"provider": provider.name, "text": storable(text)}


def noop(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """A read that does nothing: `bench` measures the executor's own cost."""
    journal("noop", call.identity)
    return {"ok": True}


DOCUMENT = {"type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}}
MESSAGES = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
        }
    },
}
REPORT = {
    "type": "object",
    "required": ["content"],
    "properties": {"content": {"type": "string"}, "revision": {"type": "integer"}},
}

READ_DOCUMENT = Tool("read_document", READ, read_document, timeout=30, input_schema=DOCUMENT)
MODEL_CALL = Tool(
    "model_call",
    READ,
    model_call,
    timeout=settings.RUNDESK_MODEL_TIMEOUT,
    input_schema=MESSAGES,
)
DELIVER_REPORT = Tool(
    "deliver_report",
    EFFECT,
    deliver_report,
    accepts_idempotency_key=True,
    timeout=settings.RUNDESK_DELIVERY_TIMEOUT,
    input_schema=REPORT,
    receiver=lambda input, key: receiver(key),
)
NOOP = Tool("noop", READ, noop)
