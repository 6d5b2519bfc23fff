"""The tools themselves: what read_document lets out of the corpus, and how
deliver_report tells delivered, refused and unknown apart."""

from __future__ import annotations

import base64
import codecs
import errno
import hashlib
import io
import os
import socket
import tarfile
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from runs.agent import OutcomeUnknown, ToolFailed, ToolRefused
from runs.agents import tools
from runs.agents.tools import MAX_DOCUMENT_BYTES, deliver_report, read_at_most, read_document
from tests.receivers import LocalServer, status
from tests.tool_calls import call

IDENTITY = "rundesk:run-7:read:0"
# The key a delivery is sent under (runs.models.new_idempotency_key), and
# the outbox file it names.
KEY = "rundesk:host-a:0123456789abcdef0123456789abcdef"
KEY_FILE = "rundesk%3Ahost-a%3A0123456789abcdef0123456789abcdef.md"
REPORT = "# Report\n\nCSTB is cheapest: 0.07%.\n"


@pytest.fixture
def corpus(tmp_path: Path, settings) -> Path:
    """A corpus folder with one sheet, a subfolder, and a secret next to it."""
    root = tmp_path / "corpus"
    (root / "funds").mkdir(parents=True)
    (root / "fund.md").write_text("# Fund\n\n- Expense ratio: 0.10%\n")
    (root / "funds" / "nested.md").write_text("nested sheet\n")
    (tmp_path / "secret.txt").write_text("outside the corpus\n")
    settings.RUNDESK_CORPUS_DIR = root
    return root


class Receiver:
    """One real local HTTP receiver for the whole module (starting and
    stopping a server costs half a second); each test says how it answers."""

    def __init__(self) -> None:
        self.answer: Callable = status(200)
        self.server = LocalServer(lambda handler, body: self.answer(handler, body))
        self.url = self.server.url

    @property
    def requests(self) -> list[tuple[dict[str, str], bytes]]:
        return self.server.requests


@pytest.fixture(scope="module")
def _receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    with receiver.server:
        yield receiver


@pytest.fixture
def receiver(_receiver: Receiver, settings) -> Receiver:
    _receiver.requests.clear()
    _receiver.answer = status(200)
    settings.RUNDESK_DELIVERY_URL = _receiver.url + "/reports"
    settings.RUNDESK_DELIVERY_TIMEOUT = 2.0
    return _receiver


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- read_document ------------------------------------------------------------


def test_read_document_returns_the_file_with_its_digest_and_journals_one_read(corpus, journal):
    data = (corpus / "fund.md").read_bytes()

    result = read_document({"path": "fund.md"}, call(IDENTITY))

    assert result == {
        "path": "fund.md",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "text": data.decode(),
    }
    entries = journal.entries()
    assert [(e["tool"], e["identity"], e["path"]) for e in entries] == [
        ("read_document", IDENTITY, "fund.md")
    ]


def test_read_document_reads_a_file_in_a_corpus_subfolder(corpus, journal):
    assert read_document({"path": "funds/nested.md"}, call(IDENTITY))["text"] == "nested sheet\n"
    assert journal.counts("read_document") == {IDENTITY: 1}


def test_read_document_allows_a_symlink_that_stays_inside_the_corpus(corpus, journal):
    (corpus / "alias.md").symlink_to(corpus / "funds" / "nested.md")

    result = read_document({"path": "alias.md"}, call(IDENTITY))

    assert result["text"] == "nested sheet\n" and result["path"] == "alias.md"
    assert journal.counts("read_document") == {IDENTITY: 1}


def test_read_document_text_holds_no_nul_and_follows_a_byte_order_mark(corpus, journal):
    (corpus / "nul.md").write_bytes(b"a\x00b")
    (corpus / "wide.md").write_text("wide sheet\n", "utf-16")
    # UTF-32's little-endian mark begins with UTF-16's: read as UTF-16, every
    # other character was a NUL.
    (corpus / "wider.md").write_bytes(codecs.BOM_UTF32_LE + "wider sheet\n".encode("utf-32-le"))
    (corpus / "wider-be.md").write_bytes(codecs.BOM_UTF32_BE + "wider sheet\n".encode("utf-32-be"))
    (corpus / "marked.md").write_bytes(b"\xef\xbb\xbfmarked\n")

    nul = read_document({"path": "nul.md"}, call(IDENTITY))
    assert nul["text"] == "a\ufffdb" and nul["bytes"] == 3
    assert nul["sha256"] == hashlib.sha256(b"a\x00b").hexdigest()  # of the bytes as read
    assert read_document({"path": "wide.md"}, call("wide"))["text"] == "wide sheet\n"
    assert read_document({"path": "wider.md"}, call("wider"))["text"] == "wider sheet\n"
    assert read_document({"path": "wider-be.md"}, call("wider-be"))["text"] == "wider sheet\n"
    assert read_document({"path": "marked.md"}, call("marked"))["text"] == "marked\n"


@pytest.mark.parametrize(
    ("data", "text"),
    [
        # UTF-8 with one bad byte: only that byte is lost.
        ("Café ".encode() + b"\xff\n", "Café \ufffd\n"),
        ("Alpha fund\n".encode("utf-16-le"), "Alpha fund\n"),
        ("Alpha fund\n".encode("utf-16-be"), "Alpha fund\n"),
    ],
)
def test_read_document_reads_text_of_an_encoding_no_mark_names(corpus, journal, data, text):
    (corpus / "sheet.txt").write_bytes(data)
    assert read_document({"path": "sheet.txt"}, call(IDENTITY))["text"] == text


def tar_of_text() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        sheet = b"# Inner fund\n\n- Ticker: INNR\n"
        member = tarfile.TarInfo("inner.md")
        member.size = len(sheet)
        archive.addfile(member, io.BytesIO(sheet))
    return out.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        tar_of_text(),
        b"BM" + bytes(range(256)) * 8,  # a bitmap: no mark of its own
        b"MZ\x90\x00" + b"\x00" * 600 + b"This program cannot be run in DOS mode.",
        "ファンドの概要\n\n純資産総額 120億円\n".encode("shift_jis") * 20,
        bytes(range(256))[::5],  # 52 bytes: short is no text either
    ],
    ids=["tar", "bitmap", "windows-program", "shift-jis", "tiny-binary"],
)
def test_read_document_refuses_what_is_mostly_no_text(corpus, journal, data):
    """No mark names them: most of what they hold is no character of
    UTF-8 text.  A Latin-1 page (its accented letters lost) is still read."""
    (corpus / "thing.md").write_bytes(data)
    with pytest.raises(ToolRefused, match=r"not text \(binary data, or an encoding other than"):
        read_document({"path": "thing.md"}, call(IDENTITY))
    latin = ("Les frais de gestion sont élevés à Genève. " * 20).encode("latin-1")
    (corpus / "latin.md").write_bytes(latin)
    assert read_document({"path": "latin.md"}, call(IDENTITY))["text"].count("\ufffd") == 80
    assert journal.counts("read_document") == {IDENTITY: 1}


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj", "a PDF document"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "a PNG image"),
        (b"PK\x03\x04\x14\x00\x06\x00", "a ZIP archive"),
        (b"SQLite format 3\x00\x10\x00", "an SQLite database"),
    ],
)
def test_read_document_refuses_a_file_that_is_no_text(corpus, journal, data, kind):
    (corpus / "report.bin").write_bytes(data)
    with pytest.raises(ToolRefused, match=f"'report.bin': {kind}.*, not text"):
        read_document({"path": "report.bin"}, call(IDENTITY))
    assert journal.entries() == []


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/etc/passwd", "absolute paths are refused"),
        ("../secret.txt", "'..' is refused"),
        ("funds/../../secret.txt", "'..' is refused"),
        ("missing.md", "no such document"),
        ("funds", "not a regular file"),
        ("fund.md/inside", "no such document"),
        ("", "empty or invalid document path"),
    ],
)
def test_read_document_refuses_paths_that_do_not_name_a_corpus_file(corpus, journal, path, message):
    with pytest.raises(ToolRefused, match=message):
        read_document({"path": path}, call(IDENTITY))
    assert journal.entries() == []


def test_read_document_refuses_a_symlink_that_leaves_the_corpus(corpus, journal, tmp_path):
    (corpus / "escape.md").symlink_to(tmp_path / "secret.txt")

    with pytest.raises(ToolRefused, match="resolves outside the corpus") as refused:
        read_document({"path": "escape.md"}, call(IDENTITY))

    assert "outside the corpus\n" not in str(refused.value)
    assert journal.entries() == []


def test_read_document_refuses_a_symlinked_folder_that_leaves_the_corpus(corpus, journal, tmp_path):
    (corpus / "elsewhere").symlink_to(tmp_path)

    with pytest.raises(ToolRefused, match="resolves outside the corpus"):
        read_document({"path": "elsewhere/secret.txt"}, call(IDENTITY))
    assert journal.entries() == []


def test_read_document_reads_a_path_written_with_dot_parts(corpus, journal):
    assert (
        read_document({"path": "./funds/./nested.md"}, call(IDENTITY))["text"] == "nested sheet\n"
    )


def test_read_document_refuses_a_symlink_loop(corpus, journal):
    (corpus / "loop.md").symlink_to(corpus / "loop.md")

    with pytest.raises(ToolRefused, match=r"'loop\.md': Too many levels of symbolic links"):
        read_document({"path": "loop.md"}, call(IDENTITY))
    assert journal.entries() == []


def test_read_document_confines_to_the_folder_a_symlinked_corpus_points_at(
    tmp_path, settings, journal
):
    """A corpus setting that is itself a symlink: its target is the folder,
    and a link inside that leads back out of it is still refused."""
    real = tmp_path / "real-corpus"
    real.mkdir()
    (real / "fund.md").write_text("sheet\n")
    (real / "out.md").symlink_to(tmp_path / "secret.txt")
    (tmp_path / "secret.txt").write_text("outside\n")
    (tmp_path / "corpus-link").symlink_to(real)
    settings.RUNDESK_CORPUS_DIR = tmp_path / "corpus-link"

    assert read_document({"path": "fund.md"}, call(IDENTITY))["text"] == "sheet\n"
    with pytest.raises(ToolRefused, match="resolves outside the corpus"):
        read_document({"path": "out.md"}, call("other"))
    assert journal.counts() == {IDENTITY: 1}


def test_read_document_refuses_a_file_larger_than_the_limit(corpus, journal):
    (corpus / "huge.md").write_bytes(b"x" * (MAX_DOCUMENT_BYTES + 1))
    (corpus / "limit.md").write_bytes(b"y" * MAX_DOCUMENT_BYTES)

    with pytest.raises(ToolRefused, match=f"larger than {MAX_DOCUMENT_BYTES} bytes"):
        read_document({"path": "huge.md"}, call(IDENTITY))
    assert journal.entries() == []

    # Exactly at the limit is still a document.
    assert read_document({"path": "limit.md"}, call("other"))["bytes"] == MAX_DOCUMENT_BYTES
    assert journal.counts() == {"other": 1}


def test_a_read_takes_what_a_file_holds_beyond_the_size_it_reports(tmp_path):
    # /proc's files say they hold nothing: what they hold counts, up to the limit.
    with open("/proc/self/status", "rb") as handle:
        status = read_at_most(handle, 100_000)
    assert status.startswith(b"Name:") and len(status) > 100
    with open("/proc/self/status", "rb") as handle:
        assert read_at_most(handle, 10) == status[:10]

    sheet = tmp_path / "sheet.md"
    sheet.write_bytes(b"a" * 30)
    for limit, expected in [(25, 25), (30, 30), (31, 30), (100, 30)]:
        with sheet.open("rb") as handle:
            assert read_at_most(handle, limit) == b"a" * expected


# -- deliver_report to a receiver ---------------------------------------------


def test_delivery_posts_the_report_with_the_actions_key_as_idempotency_key(receiver, journal):
    receiver.answer = status(201)

    result = deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))

    assert result == {
        "delivered_to": receiver.url + "/reports",
        "status": 201,
        "sha256": hashlib.sha256(REPORT.encode()).hexdigest(),
    }
    [(headers, body)] = receiver.requests
    assert body.decode() == REPORT
    assert headers["Idempotency-Key"] == KEY
    assert journal.counts("deliver_report") == {"rundesk:run-7:deliver": 1}


def test_delivery_refused_by_the_receiver_with_4xx_is_known_not_delivered(receiver, journal):
    receiver.answer = status(422)

    with pytest.raises(ToolFailed, match="HTTP 422"):
        deliver_report({"content": REPORT}, call("id-422", "id-422"))

    assert len(receiver.requests) == 1
    assert journal.entries() == []


@pytest.mark.parametrize("code", [500, 503])
def test_delivery_answered_with_5xx_is_an_unknown_outcome(receiver, journal, code):
    receiver.answer = status(code)

    with pytest.raises(OutcomeUnknown, match=f"HTTP {code}"):
        deliver_report({"content": REPORT}, call("id-5xx", "id-5xx"))

    assert len(receiver.requests) == 1
    assert journal.entries() == []


def test_delivery_answer_lost_to_a_timeout_is_unknown_though_the_receiver_got_it(
    receiver, settings, journal
):
    settings.RUNDESK_DELIVERY_TIMEOUT = 0.3
    receiver.answer = status(200, delay=0.8)

    with pytest.raises(OutcomeUnknown, match="answer lost"):
        deliver_report({"content": REPORT}, call("id-slow", "id-slow"))

    # The request reached the receiver: only its answer was lost.
    [(headers, body)] = receiver.requests
    assert body.decode() == REPORT and headers["Idempotency-Key"] == "id-slow"
    assert journal.entries() == []


def test_delivery_to_a_port_nothing_listens_on_is_known_not_delivered(settings, journal):
    settings.RUNDESK_DELIVERY_TIMEOUT = 0.3
    settings.RUNDESK_DELIVERY_URL = f"http://127.0.0.1:{free_port()}/reports"

    with pytest.raises(ToolFailed, match="unreachable"):
        deliver_report({"content": REPORT}, call("id-refused", "id-refused"))
    assert journal.entries() == []


def test_delivery_to_an_address_with_credentials_sends_them_as_basic_auth(
    receiver, settings, journal
):
    receiver.answer = status(201)
    port = receiver.url.rsplit(":", 1)[1]
    settings.RUNDESK_DELIVERY_URL = f"http://rundesk:p%40ss w0rd@127.0.0.1:{port}/reports"

    result = deliver_report({"content": REPORT}, call("id-auth", "id-auth"))

    [(headers, _)] = receiver.requests
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"rundesk:p@ss w0rd").decode()
    assert result["delivered_to"] == f"http://127.0.0.1:{port}/reports"  # no password kept


def test_a_webhooks_token_in_the_query_is_sent_but_never_kept(receiver, settings, journal):
    """A receipt is immutable and shown to staff: it names the receiver,
    not the secret its address carries."""
    paths: list[str] = []

    def answer(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        paths.append(handler.path)
        status(200)(handler, body)

    receiver.answer = answer
    settings.RUNDESK_DELIVERY_URL = receiver.url + "/hooks/reports?token=tok-SECRET-456#x"

    result = deliver_report({"content": REPORT}, call("id-token", "id-token"))

    assert paths == ["/hooks/reports?token=tok-SECRET-456"]
    assert result["delivered_to"] == receiver.url + "/hooks/reports"
    assert "SECRET" not in str(result) and "SECRET" not in str(journal.entries())


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_receiver_that_redirects_is_never_followed(receiver, settings, journal, code):
    """Followed, the POST became a GET without the report, its credentials
    sent to wherever the redirect pointed, and the receipt said delivered."""
    with LocalServer(status(200)) as elsewhere:
        receiver.answer = status(code, headers={"Location": elsewhere.url + "/x"})
        port = receiver.url.rsplit(":", 1)[1]
        settings.RUNDESK_DELIVERY_URL = f"http://svc:secret@127.0.0.1:{port}/reports"
        with pytest.raises(OutcomeUnknown, match=f"HTTP {code}"):
            deliver_report({"content": REPORT}, call("id-redirected", "id-redirected"))
        assert len(receiver.requests) == 1 and elsewhere.requests == []


def test_delivery_to_a_name_that_does_not_resolve_is_known_not_delivered(settings, journal):
    settings.RUNDESK_DELIVERY_URL = "http://no-such-receiver.invalid/reports"

    with pytest.raises(ToolFailed, match="unreachable"):
        deliver_report({"content": REPORT}, call("id-nowhere", "id-nowhere"))
    assert journal.entries() == []


# -- deliver_report to the outbox ----------------------------------------------


def test_outbox_delivery_writes_the_report_once_under_its_key(settings, _outbox, journal):
    settings.RUNDESK_DELIVERY_URL = ""

    first = deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))

    target = _outbox / KEY_FILE
    assert first == {
        "delivered_to": str(target),
        "sha256": hashlib.sha256(REPORT.encode()).hexdigest(),
    }
    assert target.read_text() == REPORT
    assert journal.counts("deliver_report") == {"rundesk:run-7:deliver": 1}


def test_outbox_delivery_repeated_with_the_same_content_is_already_delivered(
    settings, _outbox, journal
):
    settings.RUNDESK_DELIVERY_URL = ""
    deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    target = _outbox / KEY_FILE
    written = target.stat().st_mtime_ns, target.stat().st_ino

    again = deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))

    assert again["already_delivered"] is True
    assert again["delivered_to"] == str(target)
    assert (target.stat().st_mtime_ns, target.stat().st_ino) == written
    assert target.read_text() == REPORT
    assert list(_outbox.iterdir()) == [target]
    # Only the first call was a real execution.
    assert journal.counts("deliver_report") == {"rundesk:run-7:deliver": 1}


def test_outbox_refuses_other_content_under_a_used_key_and_keeps_the_first(
    settings, _outbox, journal
):
    settings.RUNDESK_DELIVERY_URL = ""
    deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))

    with pytest.raises(ToolFailed, match="another report under this key"):
        deliver_report({"content": "# A different report\n"}, call("rundesk:run-7:deliver", KEY))

    assert (_outbox / KEY_FILE).read_text() == REPORT
    assert journal.counts("deliver_report") == {"rundesk:run-7:deliver": 1}


def test_an_outbox_that_cannot_be_written_is_a_known_failure(settings, tmp_path, journal):
    settings.RUNDESK_DELIVERY_URL = ""
    settings.RUNDESK_OUTBOX_DIR = tmp_path / "a-file"
    settings.RUNDESK_OUTBOX_DIR.write_text("not a folder")

    with pytest.raises(ToolFailed, match=r"outbox .*a-file"):
        deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    assert journal.entries() == []


def test_outbox_keeps_reports_of_different_keys_apart(settings, _outbox):
    settings.RUNDESK_DELIVERY_URL = ""
    deliver_report({"content": "run 7\n"}, call("rundesk:run-7:deliver", "rundesk:a:7"))
    deliver_report({"content": "run 8\n"}, call("rundesk:run-8:deliver", "rundesk:a:8"))

    assert {p.name: p.read_text() for p in _outbox.iterdir()} == {
        "rundesk%3Aa%3A7.md": "run 7\n",
        "rundesk%3Aa%3A8.md": "run 8\n",
    }


def test_outbox_delivery_syncs_the_outbox_once_the_report_is_linked(settings, _outbox, file_syncs):
    # Until its folder is synced, a crash may take the report's name back:
    # the receipt that follows the tool's answer would say it was delivered.
    settings.RUNDESK_DELIVERY_URL = ""
    deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    target = str(_outbox / KEY_FILE)
    assert file_syncs[-2:] == [("link", target), ("fsync", str(_outbox))]

    # Found there by a later attempt (its first died before its receipt):
    # synced again before it says so.
    file_syncs.clear()
    again = deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    assert again["already_delivered"] is True
    assert file_syncs[-1] == ("fsync", str(_outbox))


def test_an_outbox_that_cannot_be_synced_leaves_the_delivery_unknown(
    settings, _outbox, monkeypatch, journal
):
    # Linked and not synced, the report may or may not survive a crash.
    settings.RUNDESK_DELIVERY_URL = ""

    def broken(folder):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(tools, "sync_folder", broken)
    with pytest.raises(OutcomeUnknown, match="the outbox not synced: Input/output error"):
        deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    assert (_outbox / KEY_FILE).read_text() == REPORT


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EBADF])
def test_a_system_that_cannot_sync_a_folder_still_delivers(settings, _outbox, monkeypatch, code):
    # Some file systems refuse to sync a folder at all (PostgreSQL ignores
    # the same answers): the report is delivered as well as they allow.
    settings.RUNDESK_DELIVERY_URL = ""
    fsync = os.fsync

    def folders_refused(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(code, os.strerror(code))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", folders_refused)
    result = deliver_report({"content": REPORT}, call("rundesk:run-7:deliver", KEY))
    assert result["delivered_to"] == str(_outbox / KEY_FILE)
