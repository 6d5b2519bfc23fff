"""Log formats: stderr with any log_line_prefix (none, redacted, without a
pid, with any zone, re-prefixed by syslog, journald or docker), csvlog and
jsonlog; the format found from the content, or the one asked for."""

from __future__ import annotations

import datetime as dt
import json
import zoneinfo
from collections.abc import Callable
from pathlib import Path

import pytest

from evidence import pglog, pglog_formats

FIXTURES = Path(__file__).parent / "fixtures" / "pglog"
UTC = dt.UTC

# (clock, pid, severity or label, text): a two-process report between
# other sessions' duration and statement logging.
EVENTS = [
    ("10:00:00.900", 4105, "LOG", "duration: 0.412 ms  statement: SELECT 1"),
    ("10:00:01.456", 4102, "ERROR", "deadlock detected"),
    (
        "10:00:01.456",
        4102,
        "DETAIL",
        "Process 4102 waits for ShareLock on transaction 9001; blocked by process 4103.\n"
        "Process 4103 waits for ShareLock on transaction 9002; blocked by process 4102.\n"
        "Process 4102: UPDATE accounts SET balance = 1 WHERE id = 2\n"
        "Process 4103: UPDATE accounts SET balance = 2 WHERE id = 1",
    ),
    ("10:00:01.456", 4102, "HINT", "See server log for query details."),
    ("10:00:01.456", 4102, "CONTEXT", 'while updating tuple (0,2) in relation "accounts"'),
    ("10:00:01.456", 4102, "STATEMENT", "UPDATE accounts SET balance = 1 WHERE id = 2"),
    ("10:00:02.000", 4105, "LOG", "statement: SELECT 2"),
]
EPOCH = dt.datetime(2026, 11, 29, 10, 0, 1, 456000, UTC).timestamp()


def stderr(prefix: Callable[[str, int], str], continued: Callable[[str], str] = lambda _: "\t"):
    """EVENTS as a server writes them to stderr: each message's first line
    after `prefix`, its further lines after `continued` (a tab, unless a
    log shipper prefixes every line again)."""
    lines = []
    for clock, pid, word, text in EVENTS:
        first, *rest = text.split("\n")
        head = prefix(clock, pid)
        lines.append(f"{head}{word}:  {first}")
        lines += [continued(head) + line for line in rest]
    return "\n".join(lines) + "\n"


def at(zone: dt.tzinfo, seconds: float = 1.456) -> dt.datetime:
    whole = int(seconds)
    return dt.datetime(2026, 11, 29, 10, 0, whole, round((seconds - whole) * 1e6), zone)


def syslog_next(head: str) -> str:
    """The next line of a syslog message: [7-1] becomes [7-2], a tab #011."""
    return head.replace("-1] ", "-2] ") + "#011"


PREFIXES = [
    # (log_line_prefix or shipper, prefix, continuation, time, reporter)
    ("none", lambda c, p: "", None, None, None),
    ("%t", lambda c, p: f"2026-11-29 {c[:8]} UTC ", None, at(UTC, 1), None),
    ("%m [%p]", lambda c, p: f"2026-11-29 {c} UTC [{p}] ", None, at(UTC), 4102),
    ("%n [%p]", lambda c, p: f"{EPOCH:.3f} [{p}] ", None, at(UTC), 4102),
    (
        "%m [%p-%l] %q%u@%d",
        lambda c, p: f"2026-11-29 {c} CET [{p}-3] rundesk@app ",
        None,
        at(dt.timezone(dt.timedelta(hours=1))),
        4102,
    ),
    (
        "RDS %t:%r:%u@%d:[%p]:",
        lambda c, p: f"2026-11-29 {c[:8]} UTC:10.0.0.5(51234):rundesk@app:[{p}]:",
        None,
        at(UTC, 1),
        4102,
    ),
    ("%c", lambda c, p: f"6769a1b0.{p:x} ", None, None, 4102),
    ("pid=%p,app=%a", lambda c, p: f"pid={p},user=rundesk,app=rundesk:executor ", None, None, 4102),
    (
        "offset zone",
        lambda c, p: f"2026-11-29 {c} -03 [{p}] ",
        None,
        at(dt.timezone(dt.timedelta(hours=-3))),
        4102,
    ),
    (
        "ISO with offset",
        lambda c, p: f"2026-11-29T{c}+05:30 [{p}] ",
        None,
        at(dt.timezone(dt.timedelta(hours=5, minutes=30))),
        4102,
    ),
    (
        "named zone",
        lambda c, p: f"2026-11-29 {c} Europe/Berlin [{p}] ",
        None,
        at(zoneinfo.ZoneInfo("Europe/Berlin")),
        4102,
    ),
    ("redacted", lambda c, p: "XXXX-XX-XX XX:XX:XX.XXX UTC [XXXX] ", None, None, None),
    ("no pid", lambda c, p: f"2026-11-29 {c} UTC [] ", None, at(UTC), None),
    (
        "syslog",
        lambda c, p: f"Nov 29 {c[:8]} db1 postgres[{p}]: [7-1] ",
        syslog_next,
        None,
        4102,
    ),
    (
        "journald",
        lambda c, p: f"Nov 29 {c[:8]} db1 postgres[{p}]: 2026-11-29 {c} UTC [{p}] ",
        lambda head: head.split(" 2026")[0] + " \t",
        at(UTC),
        4102,
    ),
    (
        "docker",
        lambda c, p: f"db-1  | 2026-11-29 {c} UTC [{p}] ",
        lambda head: "db-1  | \t",
        at(UTC),
        4102,
    ),
]


@pytest.mark.parametrize(
    ("prefix", "continued", "time", "reporter"),
    [case[1:] for case in PREFIXES],
    ids=[case[0] for case in PREFIXES],
)
def test_stderr_report_is_read_under_any_prefix(prefix, continued, time, reporter):
    text = stderr(prefix, continued or (lambda _: "\t"))
    assert pglog_formats.detect(text) == "stderr"
    (report,) = pglog.parse(text)
    assert [(e.waiter, e.blocker, e.mode, e.locked) for e in report.graph.edges] == [
        (4102, 4103, "ShareLock", "transaction 9001"),
        (4103, 4102, "ShareLock", "transaction 9002"),
    ]
    assert report.graph.cycle() == [4102, 4103]
    assert report.graph.processes[4103].query == "UPDATE accounts SET balance = 2 WHERE id = 1"
    assert report.statement == "UPDATE accounts SET balance = 1 WHERE id = 2"
    assert report.context == 'while updating tuple (0,2) in relation "accounts"'
    assert (report.time, report.reporter) == (time, reporter)
    assert report.unread == []


def test_a_time_in_a_zone_that_names_several_offsets_is_unknown_and_said():
    (report,) = pglog.parse(stderr(lambda c, p: f"2026-11-29 {c} CST [{p}] "))
    assert report.time is None
    assert report.unread == [
        "the time '2026-11-29 10:00:01.456 CST' is in zone CST, whose offset is not known here"
    ]
    (report,) = pglog.parse(stderr(lambda c, p: f"2026-11-29 {c} [{p}] "))
    assert report.time is None
    assert report.unread == ["the time '2026-11-29 10:00:01.456' gives no time zone"]


def three_way_facts(report: pglog.Report) -> dict[str, object]:
    data = report.as_json()
    return {key: data[key] for key in ("edges", "cycle", "time", "context", "statement", "lead_up")}


@pytest.mark.parametrize(
    ("name", "format"), [("three_way.csv", "csvlog"), ("three_way.json", "jsonlog")]
)
def test_csvlog_and_jsonlog_reports_read_like_the_same_report_in_stderr(name, format):
    """csvlog spreads a report over one record's fields (its DETAIL a quoted
    multi-line field); jsonlog over one object's keys."""
    text = (FIXTURES / name).read_text()
    assert pglog_formats.detect(text) == format
    (report,) = pglog.parse(text)
    (stderr_report,) = pglog.parse((FIXTURES / "three_way.log").read_text())
    assert three_way_facts(report) == three_way_facts(stderr_report)
    assert report.graph.cycle() == [4102, 4103, 4104]
    assert [w.waiter for w in report.lead_up] == [4103, 4104, 4102]
    assert report.reporter == 4102
    # Both name each session's application: roles and runs.
    roles = {p.pid: (p.role, p.run_id) for p in report.graph.processes.values()}
    assert roles == {4102: ("capture", 3), 4103: ("executor", 2), 4104: ("source refresh", None)}
    assert report.unread == []


@pytest.mark.parametrize(
    "shape",
    [
        "{user}@{db} {app} ",  # %u@%d %a
        "{db}:{app} ",  # %d:%a, the database named like the product
        "app={app},user={user} ",  # app=%a,user=%u
    ],
)
def test_stderr_names_rundesk_connections_where_the_prefix_has_their_application(shape):
    """stderr has no columns: of the words a log_line_prefix prints, a
    Rundesk connection's application name is told by its shape, and names
    the role and run as csvlog's column does.  Another application's name
    is not guessed at: its process's query names its role."""
    applications = {4102: "rundesk:capture:run-3", 4103: "rundesk:executor:run-2", 4104: "psql"}
    lines = []
    for line in (FIXTURES / "three_way.log").read_text().splitlines():
        if not line.startswith("\t"):
            pid = int(line.split("[", 1)[1].split("]", 1)[0])
            words = shape.format(user="rundesk", db="rundesk", app=applications.get(pid, "psql"))
            line = line.replace(" rundesk@app ", f" {words}", 1)
        lines.append(line)
    (report,) = pglog.parse("\n".join(lines) + "\n")
    roles = {p.pid: (p.role, p.run_id) for p in report.graph.processes.values()}
    assert roles == {4102: ("capture", 3), 4103: ("executor", 2), 4104: ("source refresh", None)}
    assert report.graph.cycle() == [4102, 4103, 4104]
    assert report.unread == []


def test_stderr_without_application_names_leaves_roles_to_the_queries():
    (report,) = pglog.parse((FIXTURES / "three_way.log").read_text())
    roles = {p.pid: (p.role, p.run_id) for p in report.graph.processes.values()}
    assert roles[4104] == ("source refresh", None)
    assert roles[4102][1] is None and roles[4103][1] is None


def test_a_sqlstate_in_the_prefix_tells_a_raised_message_from_the_servers_report():
    """With %e in log_line_prefix, the SQLSTATE is in the prefix, not after
    the severity: P0001 is a function's message; 40P01 is the server's report.
    The fixture is a real PostgreSQL 15 log with log_line_prefix '%m [%p] %e '
    of a RAISE EXCEPTION 'deadlock detected' with a made-up wait."""
    raised = (FIXTURES / "servers" / "raised_sqlstate_prefix.log").read_text()
    assert pglog.parse(raised) == []
    real = stderr(lambda c, p: f"2026-11-29 {c} UTC [{p}] 40P01 ")
    (report,) = pglog.parse(raised + real)
    assert report.graph.cycle() == [4102, 4103] and report.reporter == 4102
    # Five digits alone may be a pid (%p without brackets), and a user may be
    # named SVC01: neither is a SQLSTATE.
    for words in ("{p}0", "user=SVC01 [{p}]"):
        (report,) = pglog.parse(stderr(lambda c, p: f"2026-11-29 {c} UTC {words.format(p=p)} "))
        assert report.graph.cycle() == [4102, 4103]


def test_json_nested_deeper_than_the_parser_goes_is_not_a_server_entry():
    deep = '{"a": ' + "[" * 100_000 + "\n"
    with pytest.raises(pglog.LogFormatError, match="jsonlog line 1 is not JSON"):
        pglog.parse(deep, "jsonlog")
    assert pglog.parse(deep, "auto") == []  # read as text: nothing a server reported


def test_a_format_asked_for_overrides_what_the_content_says():
    csv_text = (FIXTURES / "three_way.csv").read_text()
    json_text = (FIXTURES / "three_way.json").read_text()
    with pytest.raises(pglog.LogFormatError, match="jsonlog line 1 is not JSON"):
        pglog.parse(csv_text, "jsonlog")
    with pytest.raises(pglog.LogFormatError, match="csvlog record ending on line 1 has 20 fields"):
        pglog.parse(json_text, "csvlog")
    # As text, the server's entries are still read.
    (report,) = pglog.parse(json_text, "stderr")
    assert report.graph.cycle() == [4102, 4103, 4104]
    with pytest.raises(pglog.LogFormatError, match="unknown format 'syslog'"):
        pglog.parse(json_text, "syslog")


def test_csvlog_of_an_older_server_and_a_broken_record():
    # PostgreSQL 12 and older: 23 columns, no backend_type, leader_pid, query_id.
    row = (
        '2026-11-29 10:00:01.456 UTC,"rundesk","app",4102,"[local]",6769a1b0.1006,5,"UPDATE",'
        '2026-11-29 09:59:00 UTC,3/12,9001,ERROR,40P01,"deadlock detected","'
        "Process 4102 waits for ShareLock on transaction 9001; blocked by process 4103.\n"
        'Process 4103 waits for ShareLock on transaction 9002; blocked by process 4102.",'
        '"See server log for query details.",,,,"UPDATE accounts SET balance = 1",,,"psql"\n'
    )
    assert pglog_formats.detect(row) == "csvlog"
    (report,) = pglog.parse(row)
    assert report.graph.cycle() == [4102, 4103]
    assert report.statement == "UPDATE accounts SET balance = 1"
    cut = row[: row.index(',"See server')] + "\n"
    with pytest.raises(pglog.LogFormatError, match="has 15 fields; csvlog records have 23 to 26"):
        pglog.parse(row + cut, "csvlog")


@pytest.mark.parametrize("name", ["three_way.csv", "three_way.json", "three_way.log"])
def test_a_byte_order_mark_before_the_first_line_is_not_part_of_the_log(name):
    """An editor, or a Windows tool that copied the log, may start it with
    a UTF-8 byte order mark: the format is still found from the content."""
    raw = (FIXTURES / name).read_bytes()
    text, warning = pglog.decode(b"\xef\xbb\xbf" + raw)
    assert warning == ""
    assert pglog_formats.detect(text) == pglog_formats.detect(raw.decode())
    (report,) = pglog.parse(text)
    (plain,) = pglog.parse(raw.decode())
    assert report.as_json() == plain.as_json()


# A record before the report, spread over two lines by its quoted field.
CUT_CSV = (
    "2026-11-29 09:59:59.000 UTC,rundesk,app,4105,[local],6769a1b0.1009,1,SELECT,"
    '2026-11-29 09:59:00 UTC,3/11,0,LOG,00000,"statement: SELECT 1,\n  2",,,,,,,,,psql,'
    "client backend,,0\n"
)
CUT_JSON = (
    '{"timestamp": "2026-11-29 09:59:59.000 UTC", "pid": 4105, "error_severity": "LOG", '
    '"message": "statement: SELECT \'{1}\'"}\n'
)


@pytest.mark.parametrize(
    ("name", "format", "before", "refused"),
    [
        ("three_way.csv", "csvlog", CUT_CSV, "record ending on line 1 has 5 fields"),
        ("three_way.json", "jsonlog", CUT_JSON, "jsonlog line 1 is not JSON"),
    ],
)
def test_a_log_read_from_the_middle_of_a_record_is_read_from_the_next(
    name, format, before, refused
):
    """`tail -c`, or a collector that cuts at a size, starts a log inside a
    record -- at any character of it, in a timestamp field or a quoted
    one: the rest of that record is left out (as a record the input ends
    inside of is), and the log is read from the next, in its own format."""
    log = (FIXTURES / name).read_text()
    (whole,) = pglog.parse(log)
    for cut in range(1, len(before) - 1):
        text = before[cut:] + log
        assert pglog_formats.detect(text) == format, cut
        (report,) = pglog.parse(text)
        assert three_way_facts(report) == three_way_facts(whole), cut
        assert report.line == whole.line + before[cut:].count("\n"), cut
    # Where no record follows the cut, the input is not in that format.
    with pytest.raises(pglog.LogFormatError, match=refused):
        pglog.parse('  2",,,,psql\nnot a record\n', format)


def test_a_shippers_lines_of_other_processes_between_a_messages_lines_are_not_its_own():
    """syslog sends each line of a message on its own: another process's
    lines may come between them, its new message and its message's further
    lines alike.  Each further line continues the message of the process
    its prefix names."""
    head = "Nov 29 10:00:01 db1 postgres[{pid}]: [{seq}-{chunk}] "
    text = stderr(lambda c, p: f"Nov 29 {c[:8]} db1 postgres[{p}]: [7-1] ", syslog_next)
    (alone,) = pglog.parse(text)
    lines = text.splitlines()
    detail = next(n for n, line in enumerate(lines) if "DETAIL" in line)
    other = [
        head.format(pid=4106, seq=3, chunk=1) + "LOG:  statement: SELECT 1,",
        head.format(pid=4106, seq=3, chunk=2) + "#011  2 FROM accounts",
    ]
    # 4106's message starts after the DETAIL's first line, and goes on
    # after its second; the report's lines go on after both.
    lines[detail + 1 : detail + 1] = other[:1]
    lines[detail + 3 : detail + 3] = other[1:]
    records = list(pglog_formats.read("\n".join(lines) + "\n"))
    (statement,) = [r for r in records if r.pid == 4106]
    assert statement.text == "statement: SELECT 1,\n  2 FROM accounts"
    (report,) = pglog.parse("\n".join(lines) + "\n")
    assert report.as_json() == alone.as_json()
    assert report.graph.cycle() == [4102, 4103] and report.unread == []
    # The records come in the order their messages start.
    assert [r.line for r in records] == sorted(r.line for r in records)


def test_text_before_a_jsonlog_is_no_cut_entry_and_a_long_first_entry_is_whole():
    """Only a first line that ends an entry (`...}`) is taken for the rest of
    one: `tail -n` of two files, with its `==> a.json <==` lines, is read as
    text (which reads the server's entries too).  A first entry longer than
    the head looked at for a cut (a bulk INSERT's statement) is read whole."""
    log = (FIXTURES / "three_way.json").read_text()
    tailed = "==> a.json <==\n" + log + "\n==> b.json <==\n" + log
    assert pglog_formats.detect(tailed) == "stderr"
    assert [r.graph.cycle() for r in pglog.parse(tailed)] == [[4102, 4103, 4104]] * 2
    long = json.dumps(
        {"timestamp": "2026-11-29 09:59:59.000 UTC", "pid": 4105, "error_severity": "LOG",
         "message": "statement: INSERT INTO t VALUES " + "(1)," * (pglog_formats.CUT_HEAD // 4)}
    )  # fmt: skip
    assert pglog_formats.detect(long + "\n" + log) == "jsonlog"
    (report,) = pglog.parse(long + "\n" + log)
    assert [w.waiter for w in report.lead_up] == [4103, 4104, 4102]


@pytest.mark.parametrize("shape", ["{time}\t[{pid}]\t", "[{pid}]\t{time} "])
def test_a_log_line_prefix_with_tabs_starts_each_message_anew(shape):
    """'%m\\t[%p]\\t': the words before a line's first tab are the first
    field of its own prefix, not a shipper's prefix of the message before."""
    lines = []
    for line in (FIXTURES / "three_way.log").read_text().splitlines():
        if not line.startswith("\t"):
            time, rest = line.split(" [", 1)
            pid, rest = rest.split("] rundesk@app ", 1)
            line = shape.format(time=time, pid=pid) + rest
        lines.append(line)
    (report,) = pglog.parse("\n".join(lines) + "\n")
    (plain,) = pglog.parse((FIXTURES / "three_way.log").read_text())
    assert three_way_facts(report) == three_way_facts(plain)
    assert report.unread == []
