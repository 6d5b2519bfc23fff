"""Logs of real servers set up otherwise than the default, read like any
other: tests/fixtures/pglog/servers/ holds what a PostgreSQL 15.20 cluster
wrote with log_error_verbosity=verbose, lc_messages ko_KR and sv_SE, a
LATIN1 database with French messages, a SQL_ASCII one with French
messages (glibc writes "?" for each accented letter), log_timezone
Asia/Manila, Azure's
log_line_prefix (%t-%c-), a prefix with %x and no time, queries holding
U+2028, a logrotate .gz, logs read while being written (jsonlog, csvlog), a
12,000-character statement, and multi-line queries whose lines say
"ERROR:  " or "deadlock detected" -- each cut to the lines around its
report -- and whole logs of four deadlocks (rows of two and three
sessions, a table lock, advisory locks) among statements that RAISE
"deadlock detected" as a WARNING and as an error of their own, and a
whole log of two deadlocks whose queries write E'...\\n...' strings
around a quoted report."""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from evidence import pglog, pglog_formats
from evidence.models import LockIncident

SERVERS = Path(__file__).parent / "fixtures" / "pglog" / "servers"
# The second query of every scenario, over three lines, its last one quoting a severity.
QUERY = "UPDATE t\n   SET v = v + 1\n WHERE id = 2 AND note <> 'ERROR:  x'"


def parse(name: str, shown: Callable[[str], str] = str, **options: object) -> list[pglog.Report]:
    """The reports of fixture `name`, its text as `shown` gives it."""
    text, warning = pglog.decode((SERVERS / name).read_bytes())
    assert warning == ""
    return pglog.parse(shown(text), **options)


def journald(text: str) -> str:
    """A server's stderr as journalctl shows it: each line after the
    journal's prefix, a message's further lines after its process's."""
    shown, clock, pid = [], "", ""
    for line in text.splitlines():
        if not line.startswith("\t"):
            clock, pid = line[11:19], line.split("[", 1)[1].split("]", 1)[0]
        shown.append(f"Dec 02 {clock} db1 postgres[{pid}]: {line}")
    return "\n".join(shown) + "\n"


def test_verbose_messages_are_read_after_their_sqlstate():
    (report,) = parse("verbose.log")

    assert report.graph.cycle() == [19294, 19295]
    assert report.graph.processes[19295].query == QUERY
    assert [(w.waiter, w.holders) for w in report.lead_up] == [(19294, [19295])]
    assert report.statement == "UPDATE t SET v = v + 1 WHERE id = 1"
    # Its log_timezone was Asia/Manila, which writes PST, as Los Angeles does.
    assert report.time is None
    assert report.unread == [
        "the time '2026-12-01 21:49:53 PST' is in zone PST, whose offset is not known here"
    ]


def test_the_servers_log_timezone_reads_an_abbreviation_that_names_several():
    (report,) = parse("verbose.log", zone=zoneinfo.ZoneInfo("Asia/Manila"))

    assert report.time == dt.datetime(2026, 12, 1, 13, 49, 53, tzinfo=dt.UTC)
    assert report.unread == []
    # An abbreviation the zone does not use is read as written.
    (utc,) = parse("azure.log", zone=zoneinfo.ZoneInfo("Asia/Manila"))
    assert utc.time == dt.datetime(2026, 12, 1, 13, 50, 46, tzinfo=dt.UTC)


def test_the_hour_a_clock_goes_back_is_read_by_its_zone_name():
    los_angeles = zoneinfo.ZoneInfo("America/Los_Angeles")
    for written, utc in [("PDT", 8), ("PST", 9)]:
        time, problem = pglog_formats.read_time(f"2026-11-01 01:30:00.000 {written}", los_angeles)
        # (A time in the repeated hour equals no time of another zone: PEP 495.)
        assert time.astimezone(dt.UTC) == dt.datetime(2026, 11, 1, utc, 30, tzinfo=dt.UTC)
        assert problem == ""


@pytest.mark.parametrize(
    ("name", "cycle", "lead_up"),
    [
        ("ko_KR.log", [20422, 20423], [(20422, [20423])]),
        ("sv_SE.log", [20475, 20476], [(20475, [20476])]),
    ],
)
def test_korean_and_swedish_servers_are_read(name, cycle, lead_up):
    (report,) = parse(name)

    assert report.graph.cycle() == cycle
    assert report.graph.processes[cycle[1]].query == QUERY
    assert [(w.waiter, w.holders) for w in report.lead_up] == lead_up
    assert report.time is not None and report.unread == []


def test_a_logged_query_that_says_deadlock_detected_is_no_report():
    assert parse("phantom.log") == []


def test_a_wait_ended_by_a_timeout_is_not_the_lead_up_of_a_later_deadlock():
    (report,) = parse("stale_wait_and_label.log")

    # 19052 waited on transaction 737 until its lock timeout cancelled the
    # statement (the server logs no end of the wait then); its later wait,
    # in the deadlock, was never logged.
    assert [(w.waiter, w.locked) for w in report.lead_up] == [(19051, "transaction 739")]
    assert report.graph.processes[19052].query == QUERY


def test_azures_prefix_gives_the_time_and_the_pid_of_its_session_id():
    (report,) = parse("azure.log")

    assert report.time == dt.datetime(2026, 12, 1, 13, 50, 46, tzinfo=dt.UTC)
    assert report.reporter == 0x50DE == 20702
    assert report.graph.processes[20703].query == QUERY


def test_an_xid_in_a_prefix_is_no_time():
    (report,) = parse("xid.log")

    assert report.time is None and report.unread == []
    assert report.graph.cycle() == [21915, 21916]


@pytest.mark.parametrize("name", ["u2028.json", "u2028_stderr.log"])
def test_a_line_separator_inside_a_query_stays_in_it(name):
    (report,) = parse(name)

    queries = [process.query for process in report.graph.processes.values()]
    assert "UPDATE t SET v = v + 1, note = 'a\u2028b' WHERE id = 2" in queries
    assert report.graph.cycle() and report.unread == []


def test_a_gzipped_log_is_imported(db):
    out = StringIO()
    call_command("import_pg_log", str(SERVERS / "en.log.gz"), stdout=out)

    assert out.getvalue().startswith("1 deadlock reports imported")
    assert LockIncident.objects.get().cycle == [18680, 18681]


def test_a_log_in_another_encoding_is_said_and_read_with_its_encoding(db):
    log = str(SERVERS / "fr_latin1.log")
    out, err = StringIO(), StringIO()
    call_command("import_pg_log", log, stdout=out, stderr=err)

    assert out.getvalue().startswith("0 deadlock reports imported")
    assert "some bytes are not utf-8 (the first at byte 70)" in err.getvalue()
    assert "--encoding" in err.getvalue()

    out, err = StringIO(), StringIO()
    call_command("import_pg_log", log, "--encoding", "latin-1", stdout=out, stderr=err)
    assert out.getvalue().startswith("1 deadlock reports imported") and err.getvalue() == ""
    assert LockIncident.objects.get().cycle == [20628, 20629]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--log-timezone", "Mars/Olympus"), "not a time zone this server knows"),
        (("--encoding", "klingon"), "not an encoding a PostgreSQL server writes its log in"),
    ],
)
def test_an_unknown_zone_or_encoding_is_refused(db, option, message):
    with pytest.raises(CommandError, match=message):
        call_command("import_pg_log", str(SERVERS / "azure.log"), *option)
    assert not LockIncident.objects.exists()


def test_a_gzip_that_is_not_whole_is_refused(tmp_path, db):
    broken = tmp_path / "broken.log.gz"
    broken.write_bytes((SERVERS / "en.log.gz").read_bytes()[:200])

    with pytest.raises(CommandError, match="gzip-compressed, but not readable"):
        call_command("import_pg_log", str(broken))


@pytest.mark.parametrize(
    ("name", "cycle", "refusal"),
    [
        ("truncated.json", [21169, 21170], "jsonlog line 21 is not JSON"),
        ("truncated.csv", [19614, 19615], "csvlog record ending on line 26 has 13 fields"),
    ],
)
def test_a_log_read_while_the_server_writes_it_leaves_out_its_unfinished_record(
    name, cycle, refusal
):
    (report,) = parse(name)
    assert report.graph.cycle() == cycle and report.unread == []

    # The same record with another after it is not unfinished but broken.
    text = (SERVERS / name).read_text()
    with pytest.raises(pglog.LogFormatError, match=refusal):
        pglog.parse(text + "\n" + text.split("\n", 1)[0] + "\n")


def test_a_csvlog_cut_inside_a_quoted_fields_lines_leaves_out_that_record():
    text = (SERVERS / "truncated.csv").read_text()
    # Cut just after a line of the deadlock's DETAIL, inside its quotes.
    cut = text[: text.index("blocked by process 19615.\n") + len("blocked by process 19615.\n")]

    assert pglog.parse(cut) == []  # the report was being written: not read yet
    # A lone CR inside an earlier quoted field is a line end to csv: counted alike.
    assert pglog.parse(cut.replace("ending log", "ending\rlog", 1), "csvlog") == []


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("query_quotes_a_report.log", str),
        ("query_quotes_a_report.csv", str),
        ("query_quotes_a_report.json", str),
        ("query_quotes_a_report.log", journald),
    ],
    ids=["stderr", "csvlog", "jsonlog", "journald"],
)
def test_a_query_whose_text_quotes_a_report_is_kept_whole_and_adds_no_wait(name, shown):
    """Two sessions deadlocked writing an error message that quotes a
    report ("Process 7 waits for ... blocked by process 8.") into a table
    (PostgreSQL 15.20; stderr, csvlog, jsonlog; stderr as the journal shows
    it): the quoted wait is the queries' text, not two more processes and
    an edge."""
    (report,) = parse(name, shown)

    assert sorted(report.graph.processes) == [23130, 23131]
    assert report.graph.cycle() == [23130, 23131] and report.unread == []
    for pid, row in ((23131, 1), (23130, 2)):
        query = report.graph.processes[pid].query
        assert query.startswith("update t set note='job failed: deadlock detected\n")
        assert query.endswith(f"blocked by process 8.' where id={row}")


# The queries of escaped_query_quotes_a_report.log, as the server wrote them.
ESCAPED_QUERIES = {
    10331: r"update t set note = E'line one\nline two\tcol', reason = 'Process 1 waits for "
    r"ShareLock on transaction 5; blocked by process 2.' where id = 1;",
    10329: r"update t set note = E'job failed:\nProcess 1 waits for ShareLock on transaction 5; "
    r"blocked by process 2.\nretrying' where id = 2;",
    10774: "update t\n   set note = E'job failed: deadlock detected\\nDETAIL:  Process 7 waits "
    "for ShareLock on transaction 1; blocked by process 8.'\n where id = 2;",
    10776: r"update t set note = E'C:\\jobs\\new\tlog', reason = 'Process 1 waits for ShareLock "
    r"on transaction 5; blocked by process 2.' where id = 1;",
}


@pytest.mark.parametrize("shown", [str, journald], ids=["stderr", "journald"])
def test_a_querys_backslash_escapes_around_a_quoted_report_are_kept_as_written(shown):
    """Two deadlocks (PostgreSQL 15.20, log_line_prefix '%m [%p] ') between
    sessions whose queries write E'...\\n...' strings and quote a report's
    wait or "deadlock detected\\nDETAIL:" in them: the server's lines
    quote nothing, so each query is as the server wrote it.  Read as a
    client's quoting, `\\n` split each line there and cut the query at its
    string's end, and what followed was lost: a process's query, and the
    other process's whole line.  A query's first line quoting a wait is
    the query's too, and its closing `;` (or `'`) is kept."""
    first, second = parse("escaped_query_quotes_a_report.log", shown)

    assert sorted(first.graph.processes) == [10329, 10331]
    assert sorted(second.graph.processes) == [10774, 10776]
    for report, reporter in ((first, 10331), (second, 10774)):
        assert report.reporter == reporter and report.graph.cycle() and report.unread == []
        for pid, process in report.graph.processes.items():
            assert process.query == ESCAPED_QUERIES[pid]
        assert report.statement == ESCAPED_QUERIES[reporter]
    assert [(w.waiter, w.holders) for w in first.lead_up] == [(10329, [10331]), (10331, [10329])]
    assert [(w.waiter, w.holders) for w in second.lead_up] == [(10774, [10776])]


def test_a_statement_longer_than_a_searched_line_is_kept_whole():
    (report,) = parse("longstmt.log")

    assert report.statement.startswith("UPDATE t SET v = v + 1")
    assert len(report.statement) == 12046
    assert report.graph.cycle() == [21641, 21642] and report.unread == []


@pytest.mark.parametrize("name", ["raised_verbose.log", "raised_fr.csv", "raised_ja.json"])
def test_a_function_that_raises_deadlock_detected_is_no_deadlock_report(name):
    """`RAISE WARNING 'deadlock detected'` (01000) and `RAISE EXCEPTION
    'deadlock detected' USING DETAIL = 'Process 1 waits for ...'` (P0001)
    were taken for the server's reports (40P01): two incidents that never
    happened, one with a made-up wait.  Where the log says a message's
    severity and SQLSTATE (verbose stderr, csvlog, jsonlog), only the
    server's report is one; French and Japanese logs word it their way."""
    reports = parse(name)

    assert [len(report.graph.processes) for report in reports] == [2, 3, 2, 2]
    assert all(report.graph.cycle() for report in reports)
    assert 1 not in {pid for report in reports for pid in report.graph.processes}


def test_a_sql_ascii_databases_french_report_is_read_through_its_question_marks():
    """A SQL_ASCII database with lc_messages fr_FR.UTF-8: the server writes
    "interblocage (deadlock) d?tect?", "D?TAIL", "<< t >>" (glibc's
    gettext in the database's C locale)."""
    (report,) = parse("fr_sql_ascii.log")

    assert report.graph.cycle() == [18203, 18204]
    assert report.graph.processes[18204].query == "UPDATE t SET v = v + 1 WHERE id = 1"
    assert [(w.waiter, w.holders) for w in report.lead_up] == [(18204, [18203]), (18203, [18204])]
    assert report.context == "lors de la mise ? jour de la ligne (0,2) dans la relation << t >>"
    assert report.statement == "UPDATE t SET v = v + 1 WHERE id = 2"
    assert report.unread == []
