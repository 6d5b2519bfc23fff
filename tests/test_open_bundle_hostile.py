"""Opening a bundle changes none of this installation's own facts, and costs
bounded time whatever the zip holds: an imported lock incident never stops
this server's log from being imported and is marked imported wherever it
shows; a zip bomb, a member whose size lies, a row nested too deep, too many
rows or a load too slow is refused quickly, naming the limit it met, and
leaves nothing behind.  Real bundles, a real PostgreSQL."""

from __future__ import annotations

import json
import re
import struct
import threading
import time
import zipfile
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from evidence import bundles
from evidence.models import LockIncident
from evidence.opening import MAX_DEPTH, MAX_ROWS, OpenRefused, open_bundle
from runs.models import Run
from runs.submission import submit
from tests.faultruns import DOCS
from tests.test_open_bundle import bundle_of, counts, reseal, rewrite

pytestmark = pytest.mark.django_db(transaction=True)

THREE_WAY_CSV = Path(__file__).parent / "fixtures" / "pglog" / "three_way.csv"
# What "quickly" means for a refusal, on a CI machine shared with others.
QUICK = 2.0


def with_events(count: int) -> Run:
    run = submit(question=f"{count} events", documents=DOCS[:1])
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO runs_runevent (run_id, kind, message, data, created_at)
               SELECT %s, 'fault_injected', 'filler event ' || n, jsonb_build_object('n', n),
                   now() + n * interval '1 millisecond'
               FROM generate_series(1, %s) AS n""",
            [run.pk, count],
        )
    return run


def refused_within(
    path: Path, match: str, clock: Callable[[], float] = time.monotonic
) -> OpenRefused:
    """Opening `path` is refused, saying `match`, within QUICK seconds of
    `clock`."""
    started = clock()
    with pytest.raises(OpenRefused, match=match) as refused:
        open_bundle(path)
    assert clock() - started < QUICK
    return refused.value


def refused_quickly(path: Path, match: str) -> OpenRefused:
    """The same, within QUICK seconds of this process's CPU (a busy
    machine's other processes do not count; a quadratic read would take far
    more of it), and no row is left behind."""
    before = counts()
    refused = refused_within(path, match, time.process_time)
    assert counts() == before
    assert not Run.objects.imported().exists()
    return refused


def events_rewritten(change: Callable[[bytes], bytes], *, rows: int | None = None):
    """A rewrite of events.jsonl, sealed again as anyone can (the manifest's
    row count left as it was unless `rows` is given)."""

    def rewritten(files: dict[str, bytes]) -> None:
        files["events.jsonl"] = change(files["events.jsonl"])
        if rows is not None:
            manifest = json.loads(files["manifest.json"])
            manifest["files"]["events.jsonl"]["rows"] = rows
            files["manifest.json"] = json.dumps(manifest).encode()
        reseal(files)

    return rewritten


# -- an imported incident is another installation's -----------------------------------


@pytest.fixture
def incident_log(tmp_path: Path) -> tuple[Run, Path]:
    """A run of this installation and a server log whose deadlock report
    names it (its executor's connection)."""
    run = submit(question="a run that deadlocked", documents=DOCS[:1])
    log = tmp_path / "postgresql.csv"
    log.write_text(THREE_WAY_CSV.read_text().replace("run-2", f"run-{run.pk}"))
    return run, log


def import_log(log: Path) -> dict:
    out = StringIO()
    call_command("import_pg_log", str(log), "--json", stdout=out)
    return json.loads(out.getvalue())


def bundle_with_the_reports_digest(run: Run, log: Path, tmp_path: Path) -> Path:
    """The run's bundle, its incident holding the report's digest (as a
    forger, or an exporter that kept it, would write it); then the log's
    incident is gone, as on an installation that never imported that log."""
    assert import_log(log)["incidents"]
    incident = LockIncident.objects.get()
    digest = incident.report_digest
    assert digest
    path = bundle_of(run, tmp_path)

    def with_digest(files: dict[str, bytes]) -> None:
        row = json.loads(files["lock_incidents.jsonl"])
        row["report_digest"] = digest
        files["lock_incidents.jsonl"] = bundles.canonical(row) + b"\n"
        reseal(files)

    rewrite(path, with_digest)
    assert bundles.verify(path).ok
    incident.delete()
    return path


def test_an_imported_incident_never_stops_this_servers_log_from_being_imported(
    incident_log, tmp_path
):
    run, log = incident_log
    path = bundle_with_the_reports_digest(run, log, tmp_path)
    copy = open_bundle(path).run
    imported = LockIncident.objects.get()
    assert (imported.imported_run_id, imported.report_digest) == (copy.pk, "")
    assert list(LockIncident.objects.local()) == []

    printed = import_log(log)
    assert len(printed["incidents"]) == 1 and printed["imported_before"] == 0
    local = LockIncident.objects.local().get()
    assert local.report_digest and local.imported_run is None
    assert local.waits.filter(waiter_run=run).exists()  # this server's, about this run
    # Imported again, it is known: the local incident's digest, not the bundle's.
    assert import_log(log)["imported_before"] == 1
    assert LockIncident.objects.count() == 2


def test_the_lock_pages_mark_an_imported_incident_with_its_run(incident_log, tmp_path, viewer):
    run, log = incident_log
    copy = open_bundle(bundle_with_the_reports_digest(run, log, tmp_path)).run
    import_log(log)
    imported = LockIncident.objects.imported().get()
    local = LockIncident.objects.local().get()

    def rows(query: str = "") -> dict[int, str]:
        page = viewer.get(f"/locks/{query}")
        assert page.status_code == 200
        found = re.findall(
            r'<tr>\s*<td><a href="/locks/(\d+)/">(.*?)</tr>', page.content.decode(), re.S
        )
        return {int(pk): row for pk, row in found}

    listed = rows()
    assert set(listed) == {imported.pk, local.pk}
    origin = f"run {copy.origin_run_id} of {copy.origin_installation}"
    assert "imported" in listed[imported.pk] and f'href="/runs/{copy.pk}/"' in listed[imported.pk]
    assert origin in listed[imported.pk]
    assert "imported" not in listed[local.pk]
    assert set(rows("?origin=here")) == {local.pk}
    assert set(rows("?origin=imported")) == {imported.pk}
    assert viewer.get("/locks/?origin=elsewhere").status_code == 400

    detail = viewer.get(f"/locks/{imported.pk}/").content.decode()
    assert 'id="incident-imported"' in detail and origin in detail
    assert 'id="incident-imported"' not in viewer.get(f"/locks/{local.pk}/").content.decode()


def test_a_log_naming_an_imported_runs_id_links_none_of_its_waits_to_it(incident_log, tmp_path):
    """An imported run's id here is not the id its server's connections gave."""
    run, _ = incident_log
    copy = open_bundle(bundle_of(run, tmp_path)).run
    log = tmp_path / "naming-the-copy.csv"
    log.write_text(THREE_WAY_CSV.read_text().replace("run-2", f"run-{copy.pk}"))
    import_log(log)
    waits = LockIncident.objects.local().get().waits.all()
    assert waits and not any(w.waiter_run_id or w.blocker_run_id for w in waits)


# -- bounded time ---------------------------------------------------------------------


@pytest.mark.parametrize("line", [b"\n", b" \t \r\n"], ids=["newlines", "whitespace"])
def test_a_zip_bomb_of_blank_lines_is_refused_at_the_row_limit(tmp_path, line):
    """5 MB of blank lines deflate to a few kilobytes; each is a read."""
    path = bundle_of(with_events(3), tmp_path)
    rewrite(path, events_rewritten(lambda events: events + line * 5_000_000))
    with zipfile.ZipFile(path) as bundle:
        assert bundle.getinfo("events.jsonl").compress_size < 100_000
    refused_quickly(
        path,
        rf"^events\.jsonl: more than {MAX_ROWS} rows \(the limit, RUNDESK_OPEN_BUNDLE_MAX_ROWS\)$",
    )


def directory_entry(data: bytearray, name: str) -> int:
    """Where `name`'s entry of the zip's central directory starts."""
    at = 0
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:
        (length,) = struct.unpack_from("<H", data, at + 28)
        if data[at + 46 : at + 46 + length] == name.encode():
            return at
    raise AssertionError(f"{name} not in the directory")


def declared_size(path: Path, name: str, size: int) -> None:
    """The zip's directory made to declare `size` inflated bytes for `name`."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<L", data, directory_entry(data, name) + 24, size)
    path.write_bytes(bytes(data))


def test_a_member_declared_larger_than_the_limit_is_refused_before_anything_is_inflated(
    tmp_path,
):
    path = bundle_of(with_events(3), tmp_path)
    declared_size(path, "events.jsonl", 0xFFFF_FFF0)
    refused_quickly(
        path,
        r"^events\.jsonl: more than \d+ bytes inflated \(the limit, RUNDESK_OPEN_BUNDLE_MAX_FILE",
    )


def test_a_member_that_inflates_to_more_than_it_declares_is_refused(tmp_path):
    """50 MB of newlines whose directory entry and manifest say a few
    hundred bytes: never read past what was declared."""
    path = bundle_of(with_events(3), tmp_path)
    with zipfile.ZipFile(path) as bundle:
        declared = bundle.getinfo("events.jsonl").file_size
    rewrite(path, lambda files: files.update({"events.jsonl": b"\n" * 50_000_000}))
    declared_size(path, "events.jsonl", declared)
    refused = refused_quickly(path, "^the bundle does not verify$")
    assert "events.jsonl: its content does not match the manifest" in refused.failures


def test_the_limits_on_inflated_bytes_are_settings(tmp_path, settings):
    path = bundle_of(with_events(3), tmp_path)
    settings.RUNDESK_OPEN_BUNDLE_MAX_FILE_BYTES = 100
    refused_quickly(
        path,
        r"^[\w.]+: more than 100 bytes inflated \(the limit, RUNDESK_OPEN_BUNDLE_MAX_FILE_BYTES",
    )
    settings.RUNDESK_OPEN_BUNDLE_MAX_FILE_BYTES = 1 << 30
    settings.RUNDESK_OPEN_BUNDLE_MAX_BYTES = 1000
    refused_quickly(
        path, r"^the bundle: more than 1000 bytes inflated in all \(the limit, RUNDESK_OPEN_BUNDLE_"
    )


def test_a_zip_whose_directory_names_many_files_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "many.zip"
    with zipfile.ZipFile(path, "w") as bundle:
        for n in range(5000):
            bundle.writestr(f"{n}.jsonl", b"")
    refused_quickly(path, r"^the zip's directory names 5000 files in \d+ bytes; a bundle holds")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_000_000])
def test_a_row_nested_too_deep_is_refused(tmp_path, depth):
    path = bundle_of(with_events(3), tmp_path)

    def deeper(events: bytes) -> bytes:
        row = json.loads(events.splitlines()[-1])
        row["data"] = "deep"
        deep = b"[" * depth + b"]" * depth
        return events + bundles.canonical(row).replace(b'"deep"', deep) + b"\n"

    rewrite(path, events_rewritten(deeper, rows=4))
    refused_quickly(path, rf"^events\.jsonl: a row nested more than {MAX_DEPTH} deep$")


def test_a_file_of_more_rows_than_the_limit_is_refused_before_or_while_loading(tmp_path, settings):
    settings.RUNDESK_OPEN_BUNDLE_MAX_ROWS = 20
    limit = r"^events\.jsonl: more than 20 rows \(the limit, RUNDESK_OPEN_BUNDLE_MAX_ROWS\)$"
    path = bundle_of(with_events(50), tmp_path)
    refused_quickly(path, limit)  # as the manifest says
    rewrite(path, events_rewritten(lambda events: events, rows=3))
    refused_quickly(path, limit)  # as counted: the manifest said 3


def test_a_load_longer_than_the_time_limit_is_refused_and_rolled_back(tmp_path, settings):
    """100,000 events take seconds to load: refused once the limit passes."""
    path = bundle_of(with_events(1), tmp_path)

    def many(events: bytes) -> bytes:
        last = events.splitlines(keepends=True)[-1]
        return events + last * 100_000

    rewrite(path, events_rewritten(many))
    settings.RUNDESK_OPEN_BUNDLE_SECONDS = 0.3
    refused_quickly(
        path, r"^opening took more than 0\.3 seconds \(the limit, RUNDESK_OPEN_BUNDLE_SECONDS\)$"
    )


def test_a_load_held_by_a_lock_is_refused_when_the_time_limit_passes(tmp_path, settings):
    """A statement that waits (here on a table another session holds) is
    bounded by the time left, not only the reading between statements."""
    path = bundle_of(with_events(3), tmp_path)
    settings.RUNDESK_OPEN_BUNDLE_SECONDS = 0.5
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("LOCK TABLE runs_runevent IN ACCESS EXCLUSIVE MODE")
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    before = counts()
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(5)
        refused_within(path, r"^opening took more than 0\.5 seconds")
    finally:
        release.set()
        holder.join()
    assert counts() == before
