"""Investigation bundles: sealed, redacted, deterministic, verified, and
exported in flat memory.  Real runs on a real PostgreSQL; the CLI as a
real process where memory is measured."""

from __future__ import annotations

import hashlib
import html
import json
import os
import struct
import time
import uuid
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.contrib.staticfiles import finders
from django.core.management import call_command
from django.db import connection

from evidence import bundles
from evidence.bundle_report import PLOTLY_JS
from evidence.capture import capture
from evidence.redaction import Redactor
from runs.decisions import Request, Who, decide
from runs.executor import claim_and_drive
from runs.leases import Lease
from runs.management.commands.bench import measured_command
from runs.models import DecisionChoice, OutcomeItem, Run, RunStatus
from runs.submission import submit
from runs.timeline import timeline
from tests.faultruns import DOCS, run_with

pytestmark = pytest.mark.django_db(transaction=True)

OPENAI_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0" * 2
ENV_TOKEN = "acme-token-" + "x7Y8z9" * 3
MODEL_KEY = "model-api-key-" + "Q" * 24


@pytest.fixture
def decided_run(journal) -> Run:
    """A run whose delivery answer was lost, settled by an operator."""
    run, outcome = run_with([{"point": "delivery_timeout"}], documents=DOCS[:2])
    assert outcome == RunStatus.NEEDS_OPERATOR
    user = User.objects.create_user("olga")
    group, _ = Group.objects.get_or_create(name="operators")
    group.permissions.add(Permission.objects.get(codename="operate_run"))
    user.groups.add(group)
    item = OutcomeItem.objects.get(run=run)
    request = Request(
        choice=DecisionChoice.CONFIRMED_HAPPENED,
        who=Who(user=User.objects.get(pk=user.pk)),
        token=uuid.uuid4().hex,
        reason="in the receiver's log",
        reference="DLV-1",
    )
    decide(item.pk, request)
    timeline.flush()  # its events are all written: the run's story is complete
    capture.flush()
    return run


def entries(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as bundle:
        return {name: bundle.read(name) for name in bundle.namelist()}


def rewrite(path: Path, change) -> None:
    """Rewrites the bundle with `change(files)` applied to its entries."""
    files = entries(path)
    change(files)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in files.items():
            bundle.writestr(name, data)


def test_a_bundle_holds_the_runs_whole_story_and_verifies(decided_run, tmp_path):
    path = tmp_path / "run.zip"
    exported = bundles.export(decided_run.pk, path)
    files = entries(path)
    assert set(files) == {
        "manifest.json",
        "run.json",
        "report.html",
        "README.txt",
        *(kind.name for kind in bundles.KINDS),
    }
    manifest = json.loads(files["manifest.json"])
    assert manifest["seal"] == exported.seal == bundles.seal_of(manifest)
    assert manifest["run_id"] == decided_run.pk and manifest["format"] == bundles.FORMAT
    lines = {name: files[name].decode().splitlines() for name in files if name.endswith(".jsonl")}
    for name, rows in lines.items():
        assert manifest["files"][name]["rows"] == len(rows)
    decisions = [json.loads(line) for line in lines["decisions.jsonl"]]
    assert [d["choice"] for d in decisions] == ["confirmed_happened"]
    assert decisions[0]["decided_by"] == "olga" and "user_id" not in decisions[0]
    steps = [json.loads(line)["step_key"] for line in lines["receipts.jsonl"]]
    assert "deliver" in steps  # confirmed by the operator
    assert json.loads(files["run.json"])["question"] == decided_run.question
    assert bundles.verify(path).ok


def test_every_tampering_is_detected_and_named(decided_run, tmp_path):
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)

    def tampered(change) -> list[str]:
        copy = tmp_path / f"{uuid.uuid4().hex}.zip"
        copy.write_bytes(original.read_bytes())
        rewrite(copy, change)
        checked = bundles.verify(copy)
        assert not checked.ok
        return checked.failures

    def flip_a_byte(files):
        data = bytearray(files["receipts.jsonl"])
        data[10] ^= 1
        files["receipts.jsonl"] = bytes(data)

    assert tampered(flip_a_byte) == ["receipts.jsonl: its content does not match the manifest"]
    assert tampered(lambda files: files.pop("events.jsonl")) == ["events.jsonl: missing"]
    assert tampered(lambda files: files.update({"extra.txt": b"x"})) == [
        "extra.txt: not in the manifest (added)"
    ]

    def edit_manifest(files):
        manifest = json.loads(files["manifest.json"])
        manifest["installation"] = "somewhere else"
        files["manifest.json"] = json.dumps(manifest).encode()

    assert tampered(edit_manifest) == ["manifest.json: the seal does not match its content"]

    def hide_an_edit(files):
        # The file changed and its hash in the manifest too: the seal says so.
        files["report.html"] += b"<!-- changed -->"
        manifest = json.loads(files["manifest.json"])
        manifest["files"]["report.html"]["sha256"] = "0" * 64
        files["manifest.json"] = json.dumps(manifest).encode()

    failures = tampered(hide_an_edit)
    assert "manifest.json: the seal does not match its content" in failures
    assert "report.html: its content does not match the manifest" in failures
    garbage = tmp_path / "garbage.zip"
    garbage.write_bytes(b"not a zip")
    assert bundles.verify(garbage).failures[0].startswith("not a readable zip file")


def test_a_bundle_damaged_or_made_to_harm_is_refused_with_its_failures(decided_run, tmp_path):
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)
    data = original.read_bytes()

    # A byte of a member's compressed data damaged in transit.
    with zipfile.ZipFile(original) as bundle:
        info = bundle.getinfo("receipts.jsonl")
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(data[: start + 5] + bytes([data[start + 5] ^ 0xFF]) + data[start + 6 :])
    assert bundles.verify(damaged).failures == [
        "receipts.jsonl: its content does not match the manifest"
    ]

    def verified(files: dict[str, bytes]) -> list[str]:
        path = tmp_path / f"{uuid.uuid4().hex}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name, content in files.items():
                bundle.writestr(name, content)
        return bundles.verify(path).failures

    # A manifest larger than any manifest (spaces, a few kilobytes zipped): not read.
    bomb = {"manifest.json": b" " * (bundles.MAX_MANIFEST_BYTES + 1) + b"{}"}
    assert verified(bomb) == [
        f"manifest.json: {bundles.MAX_MANIFEST_BYTES + 3} bytes, more than a manifest holds"
    ]
    for files in ([], {"run.json": "abc"}):
        (failure,) = verified({"manifest.json": json.dumps({"files": files}).encode()})
        assert failure.startswith("manifest.json: not a bundle manifest")
    fifo = tmp_path / "fifo.zip"
    os.mkfifo(fifo)
    assert bundles.verify(fifo).failures == ["not a regular file"]


def test_a_bundle_zipfile_cannot_read_is_refused_never_raised(decided_run, tmp_path):
    """A member flagged encrypted or packed by a method zipfile lacks, one
    named in bytes that are no UTF-8, a manifest holding a lone surrogate,
    a listed file a bundle never holds (../, an absolute path): each was
    a traceback from verify and open_bundle, or verified."""
    original = tmp_path / "run.zip"
    bundles.export(decided_run.pk, original)
    data = original.read_bytes()
    with zipfile.ZipFile(original) as bundle:
        record = bundle.start_dir  # the central directory's first record: run.json's
    for flags, method in [(0x1, 8), (0x0, 99)]:  # encrypted; a method zipfile lacks
        path = tmp_path / f"{flags}-{method}.zip"
        path.write_bytes(
            data[: record + 8] + struct.pack("<HH", flags, method) + data[record + 12 :]
        )
        assert bundles.verify(path).failures == [
            "run.json: its content does not match the manifest"
        ]

    named = tmp_path / "named.zip"
    with zipfile.ZipFile(named, "w") as bundle:
        bundle.writestr("\u00ff.txt", b"x")
    named.write_bytes(named.read_bytes().replace("\u00ff".encode(), b"\xff\xbf"))
    (failure,) = bundles.verify(named).failures
    assert failure.startswith("not a readable zip file")

    def resealed(files: dict[str, bytes], manifest: dict[str, Any], seal: str) -> Path:
        files["manifest.json"] = json.dumps({**manifest, "seal": seal}).encode()
        path = tmp_path / f"{uuid.uuid4().hex}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name, content in files.items():
                bundle.writestr(name, content)
        return path

    files = entries(original)
    manifest = json.loads(files["manifest.json"])
    (failure,) = bundles.verify(
        resealed(files, {**manifest, "installation": "\ud800"}, "no seal holds it")
    ).failures
    assert failure.startswith("manifest.json: not a bundle manifest")
    for name in ("../evil.txt", "/tmp/abs.txt"):
        files[name] = b"x"
        manifest["files"][name] = {"bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    assert bundles.verify(resealed(files, manifest, bundles.seal_of(manifest))).failures == [
        "../evil.txt: no file a bundle holds",
        "/tmp/abs.txt: no file a bundle holds",
    ]


def test_secrets_never_leave_in_any_byte(journal, tmp_path, settings, monkeypatch):
    monkeypatch.setenv("ACME_API_TOKEN", ENV_TOKEN)
    settings.RUNDESK_MODEL_API_KEY = MODEL_KEY
    question = (
        f"Compare these funds. My key is {OPENAI_KEY}, the token {ENV_TOKEN}, "
        f"and the model key {MODEL_KEY}. Authorization: Bearer abcdefghijklmnop123456"
    )
    run = submit(question=question, documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.record(run.pk, "fault_injected", f"header Authorization: Bearer {OPENAI_KEY}")
    timeline.flush()
    capture.flush()
    path = tmp_path / "run.zip"
    exported = bundles.export(run.pk, path)
    for name, data in entries(path).items():
        for secret in (OPENAI_KEY, ENV_TOKEN, MODEL_KEY, "abcdefghijklmnop123456"):
            assert secret.encode() not in data, f"{secret[:8]}... left in {name}"
    redacted = exported.manifest["redacted"]
    # Each twice: in the question, and in the input that holds it.
    assert redacted["run.json"]["openai_key"] == 2
    assert redacted["run.json"]["env:ACME_API_TOKEN"] == 2
    assert redacted["run.json"]["setting:RUNDESK_MODEL_API_KEY"] == 2
    assert redacted["evidence_copies.jsonl"]  # the model's input quoted the question
    assert "[REDACTED:openai_key]" in entries(path)["report.html"].decode()
    assert OPENAI_KEY not in json.dumps(exported.manifest)


# A known secret with what JSON, HTML and json_script each write otherwise.
ODD_SECRET = 'pa"ss\\wörd&<x>' + "Z" * 8


def escaped_forms(text: str) -> set[str]:
    """`text` as written, HTML-escaped, and inside JSON up to three deep."""
    forms = {text, html.escape(text)}
    for _ in range(3):
        forms |= {json.dumps(form)[1:-1] for form in forms}
    return forms


def test_a_known_secret_never_leaves_however_it_is_escaped(journal, tmp_path, monkeypatch):
    """A model call's copy holds the question inside its request's JSON
    text, and report.html's chart holds it inside json_script's JSON: a
    known secret with a quote, a backslash, a non-ASCII letter, & or <
    was spelt otherwise there, and left."""
    monkeypatch.setenv("ACME_DB_PASSWORD", ODD_SECRET)
    run = submit(question=f"Compare. Ours is {ODD_SECRET} here.", documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    # An error the chart's hover shows cut short, the secret across the cut.
    assert run.actions.filter(effect_class="read").update(error="x" * 190 + ODD_SECRET)
    timeline.flush()
    capture.flush()
    path = tmp_path / "run.zip"
    exported = bundles.export(run.pk, path)
    files = entries(path)
    assert files["evidence_copies.jsonl"]
    for name, data in files.items():
        for part in escaped_forms('pa"ss'):
            assert part.encode() not in data, f"{part} left in {name}"
    redacted = exported.manifest["redacted"]
    assert redacted["evidence_copies.jsonl"]["env:ACME_DB_PASSWORD"] >= 1
    assert redacted["report.html"]["env:ACME_DB_PASSWORD"] >= 2


# Keys as a document may hold them, each at the start of a line.
LINE_START_KEYS = [
    "AKIAQQQQQQQQQQQQQQQQ",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiI5OTkifQ.linestartJwtSig",
    "sk-proj-linestartopenaikey0123456789",
    "ghp_linestartgithubtoken0123456789abcdef",
    "AIza" + ("L1n3St4rt" * 4)[:35],
]


def test_keys_at_the_start_of_a_documents_lines_never_leave(journal, tmp_path, settings):
    """A model call's copy holds its messages as JSON text, where each
    line of the document follows a "\n": a key there was glued to that
    "n", no key pattern saw where it began, and it left in
    evidence_copies.jsonl (redacted everywhere else)."""
    settings.RUNDESK_CORPUS_DIR = tmp_path / "corpus"
    settings.RUNDESK_CORPUS_DIR.mkdir()
    lines = ["# Keys", *LINE_START_KEYS, "Authorization: Basic bGluZXVzZXI6bGluZXB3ZA=="]
    (settings.RUNDESK_CORPUS_DIR / "keys.md").write_text("\n".join(lines) + "\r\n\tend\n")
    run = submit(question="Compare", documents=["keys.md"])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    capture.flush()
    path = tmp_path / "run.zip"
    exported = bundles.export(run.pk, path)
    assert "evidence_copies.jsonl" in entries(path)
    for name, data in entries(path).items():
        for secret in [*LINE_START_KEYS, "bGluZXVzZXI6bGluZXB3ZA=="]:
            assert secret.encode() not in data, f"{secret[:8]}... left in {name}"
    assert exported.manifest["redacted"]["evidence_copies.jsonl"]["aws_access_key"] >= 1


@pytest.mark.parametrize("escape", ["\n", "\r\n", "\t", "\u2028", "\u00a0"])
@pytest.mark.parametrize("key", [*LINE_START_KEYS, "Bearer abcdefghijklmnopqrstuvwxyz"])
def test_a_key_after_a_json_escape_is_redacted(escape, key):
    text = json.dumps(f"before{escape}{key}{escape}after")
    assert key.split()[-1] not in Redactor({}).text(text, "x")


def test_passwords_in_urls_and_named_fields_never_leave(journal, tmp_path):
    secrets = {
        "url_password": "BobsPassw0rd!",
        "credential": [
            "Tr0ub4dor&3xyz",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            "s3cr3t-value",
        ],
    }
    question = (
        "Compare. The database is postgres://bob:BobsPassw0rd!@10.0.0.5/app, password: "
        "Tr0ub4dor&3xyz, aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY and "
        '{"client_secret": "s3cr3t-value"}.'
    )
    run = submit(question=question, documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    capture.flush()
    path = tmp_path / "run.zip"
    exported = bundles.export(run.pk, path)

    files = entries(path)
    for name, data in files.items():
        for secret in [secrets["url_password"], *secrets["credential"]]:
            for form in {secret, html.escape(secret)}:
                assert form.encode() not in data, f"{secret[:6]}... left in {name}"
    redacted = exported.manifest["redacted"]["run.json"]
    # Each twice: in the question, and in the input that holds it.
    assert (redacted["url_password"], redacted["credential"]) == (2, 6)
    # What the secrets belonged to stays readable.
    run_json = json.loads(files["run.json"])
    assert "postgres://bob:[REDACTED:url_password]@10.0.0.5/app" in run_json["question"]
    assert '"client_secret": "[REDACTED:credential]"' in run_json["question"]


def test_secrets_in_an_answer_are_redacted_before_its_markdown_is_rendered(
    journal, tmp_path, monkeypatch
):
    """Rendered, `password: `X`` becomes `password: <code>X</code>` and a
    key's lines become list items: a pattern run over the page finds
    neither.  A known secret that also occurs in plotly.js must not
    change the page's own code."""
    monkeypatch.setenv("DB_PASSWORD", "12345678")
    key = "MIIEowIBAAKCAQEAsecretkeybodyABCDEFGH"
    answer = (
        "# Report\n\n- the password: `CodeSpanSecret99`\n- api_key=**BoldSecret12345**\n"
        "- client_secret: *ItalicSecret777*\n- PEM: -----BEGIN RSA PRIVATE KEY-----\n"
        f"- {key}\n- -----END RSA PRIVATE KEY-----\n"
    )
    run = submit(question="q", documents=DOCS[:1])
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None and lease.publish_revision(1, answer, is_final=False)
    lease.finish(RunStatus.FAILED, "test")
    timeline.flush()
    path = tmp_path / "run.zip"
    bundles.export(run.pk, path)
    report = entries(path)["report.html"].decode()
    for secret in ("CodeSpanSecret99", "BoldSecret12345", "ItalicSecret777", key):
        assert secret not in report
    assert "[REDACTED:private_key]" in report and "[REDACTED:credential]" in report
    assert Path(finders.find(PLOTLY_JS)).read_text() in report  # the page's own code, whole


@pytest.mark.parametrize(
    "text",
    [
        "Authorization: `Bearer SpanBearerToken123456abc`",
        "Authorization: (Bearer SpanBearerToken123456abc)",
        "the header [Bearer SpanBearerToken123456abc]",
        "Bearer: SpanBearerToken123456abc",
        "PGPASSWORD=SpanBearerToken123456abc psql",
        # Named like a key (Django's own setting, camelCase, what it keys).
        "SECRET_KEY=SpanBearerToken123456abc",
        '"secretKey": "SpanBearerToken123456abc"',
        "encryption_key=SpanBearerToken123456abc",
        # A value that only begins like a plain one.
        "password=no-SpanBearerToken123456abc",
        "secret=true.SpanBearerToken123456abc",
        "token=123-SpanBearerToken123456abc",
        "api_key=$SpanBearerToken123456abc",
    ],
)
def test_a_secret_in_backquotes_brackets_or_glued_to_its_name_is_redacted(text):
    assert "SpanBearerToken123456abc" not in Redactor({}).text(text, "x")


@pytest.mark.parametrize(
    "text",
    [
        'password: "correct horse battery staple"',
        "db_password='correct horse battery staple' then",
        json.dumps({"client_secret": "correct horse battery staple"}),
        json.dumps(json.dumps({"password": "correct horse battery staple"})),
        html.escape('password="correct horse battery staple"'),
    ],
)
def test_a_quoted_secret_of_several_words_is_redacted_whole(text):
    redacted = Redactor({}).text(text, "x")
    assert not any(word in redacted for word in ("correct", "horse", "battery", "staple"))
    assert "[REDACTED:credential]" in redacted


@pytest.mark.parametrize(
    ("address", "kept"),
    [
        (
            "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/WebhookSecret0123456789ab",
            "https://hooks.slack.com/services/",
        ),
        (
            "https://discord.com/api/webhooks/112233445566778899/WebhookSecret0123456789ab",
            "https://discord.com/api/webhooks/",
        ),
    ],
)
def test_a_webhook_whose_address_is_its_secret_keeps_only_its_host(address, kept):
    """A delivery receipt names its receiver by address (tools._named):
    Slack's and Discord's hold their secret in the path."""
    redacted = Redactor({}).text(json.dumps({"delivered_to": address}), "receipts.jsonl")
    assert "WebhookSecret" not in redacted and f"{kept}[REDACTED:webhook_url]" in redacted


@pytest.mark.parametrize(
    "text",
    [
        "PWD=/srv/app",
        "secret: true",
        "Secret: None",
        "max_tokens: 4096",
        "token=${TOKEN}",
        "token=$TOKEN",
        "api_key_env: OPENAI",
    ],
)
def test_a_field_named_like_a_secret_that_holds_none_is_left_alone(text):
    assert Redactor({}).text(text, "x") == text


def test_a_crafted_string_costs_one_pass_not_one_per_word():
    """`a_a_a_..._token`: a name pattern free to start at every `_` and run to
    the end took 109 s on these 100,000 characters."""
    redactor = Redactor({})
    started = time.monotonic()
    for text in ("a_" * 50_000 + "token", "-".join(["x1"] * 33_000) + " key", "a." * 50_000):
        assert redactor.text(text, "x") == text
    assert time.monotonic() - started < 10  # about 0.1 s; before, minutes


class Attributes(HTMLParser):
    """Every attribute of every element of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [(tag, name, value) for name, value in attrs]


def test_redacting_the_report_never_turns_text_into_markup(journal, tmp_path):
    """A private key's BEGIN in a link's title and its END in the text after
    it: a redaction spanning them took the title's closing quote, and the
    text after it became attributes (an off-page link over the whole page)."""
    question = (
        'Compare [t](x "-----BEGIN A PRIVATE KEY-----") then -----END A PRIVATE KEY-----" '
        'style="position:fixed;top:0" href="https://evil.example/login" data-x="'
    )
    run = submit(question=question, documents=DOCS[:1])
    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    timeline.flush()
    path = tmp_path / "run.zip"
    bundles.export(run.pk, path)

    page = Attributes()
    page.feed(entries(path)["report.html"].decode())
    assert page.found  # the page's own elements
    for tag, name, value in page.found:
        assert "evil.example" not in (value or ""), (tag, name)
        assert "position:fixed" not in (value or ""), (tag, name)


def test_the_same_run_exports_to_the_same_bytes_but_the_export_time(decided_run, tmp_path):
    first, second = tmp_path / "1.zip", tmp_path / "2.zip"
    bundles.export(decided_run.pk, first)
    bundles.export(decided_run.pk, second)
    one, two = entries(first), entries(second)
    assert one.keys() == two.keys()
    for name in one:
        if name != "manifest.json":
            assert one[name] == two[name], name
    m1, m2 = json.loads(one["manifest.json"]), json.loads(two["manifest.json"])
    # The signature signs the export time too; the same key signed both.
    assert m1["signature"]["public_key"] == m2["signature"]["public_key"]
    for manifest in (m1, m2):
        del manifest["exported_at"], manifest["seal"], manifest["signature"]
    assert m1 == m2


def test_no_evidence_leaves_the_copies_out(decided_run, tmp_path):
    path = tmp_path / "run.zip"
    exported = bundles.export(decided_run.pk, path, include_evidence=False)
    assert "evidence_copies.jsonl" not in entries(path)
    assert exported.manifest["evidence_included"] is False
    assert bundles.verify(path).ok


def test_the_commands_export_and_verify_and_fail_on_a_changed_bundle(decided_run, tmp_path):
    path = tmp_path / "run.zip"
    call_command("export_bundle", str(decided_run.pk), "-o", str(path), "--json")
    call_command("verify_bundle", str(path))
    rewrite(path, lambda files: files.update({"run.json": b"{}\n"}))
    with pytest.raises(SystemExit) as failed:
        call_command("verify_bundle", str(path))
    assert failed.value.code == 1


@pytest.mark.slow
def test_export_memory_stays_flat_however_many_events(tmp_path, process_env):
    """Peak RSS of exporting a 50,000-event run is within 20 MB of a
    1,000-event one's, each measured in its own process.  Rows are read
    CHUNK (2,000) at a time, which takes about 6 MB more than 1,000 rows;
    holding all 50,000 (a list of them, not a server-side cursor's
    batches) takes about 43 MB more."""
    peaks = {}
    for events in (1_000, 50_000):
        run = submit(question=f"{events} events", documents=DOCS[:1])
        timeline.flush()  # the submission's own event
        with connection.cursor() as cursor:
            cursor.execute(
                """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
                   SELECT %s, 'fault_injected', 'filler event ' || n, jsonb_build_object('n', n),
                       now() + n * interval '1 millisecond'
                   FROM generate_series(1, %s) AS n""",
                [run.pk, events],
            )
        out = tmp_path / f"{events}.zip"
        argv = ["export_bundle", str(run.pk), "-o", str(out)]
        returncode, _, peaks[events] = measured_command(argv, process_env)
        assert returncode == 0
        assert bundles.verify(out).manifest["files"]["events.jsonl"]["rows"] == events + 1
    assert peaks[50_000] - peaks[1_000] <= 20, peaks
