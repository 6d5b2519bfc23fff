"""Reports as clients print the server's error inside their own: each input
is built to the shape that client prints (its message, its field names, its
quoting, the logger or stack trace around it), and reads as the report it
quotes.  A client is sent the report without the processes' queries, so
each says so; a client that sends no DETAIL at all (pgx's error string)
gives a report that says that."""

from __future__ import annotations

import datetime as dt
import json

from evidence import pglog

NO_QUERIES = (
    "no process's query is in the input (PostgreSQL sends clients the report without them; "
    "the server log has them)"
)
NO_DETAIL = "the report has no DETAIL: which processes waited for what is not in the input"


def edges(report: pglog.Report) -> list[tuple[int, int, str, str]]:
    return [(e.waiter, e.blocker, e.mode, e.locked) for e in report.graph.edges]


def two_way(a: int, b: int, xa: int, xb: int) -> list[tuple[int, int, str, str]]:
    return [(a, b, "ShareLock", f"transaction {xa}"), (b, a, "ShareLock", f"transaction {xb}")]


def read_two_way(
    text: str, pids: tuple[int, int], xids: tuple[int, int], *problems: str, context: str = ""
) -> pglog.Report:
    """The one report of `text`: two processes each waiting for the other's
    transaction, with its context and what it says it could not read."""
    (report,) = pglog.parse(text)
    assert edges(report) == two_way(*pids, *xids)
    assert report.context == context
    assert report.unread == list(problems)
    return report


def detail(a: int, b: int, xa: int, xb: int, joiner: str = "\n") -> str:
    return joiner.join(
        [
            f"Process {a} waits for ShareLock on transaction {xa}; blocked by process {b}.",
            f"Process {b} waits for ShareLock on transaction {xb}; blocked by process {a}.",
        ]
    )


def test_psycopg_error_logged_with_repr_on_one_line_with_escapes():
    message = (
        f"deadlock detected\nDETAIL:  {detail(12749, 12750, 102047, 102046)}\n"
        "HINT:  See server log for query details.\n"
        'CONTEXT:  while updating tuple (0,2) in relation "accounts"'
    )
    line = f"2026-11-29 10:00:01,456 ERROR worker: settle failed: DeadlockDetected({message!r})"
    assert "\\n" in line and "\n" not in line
    report = read_two_way(
        "2026-11-29 10:00:00,001 INFO worker: started\n" + line + "\n",
        (12749, 12750),
        (102047, 102046),
        # Python logging's time has no zone: not guessed.
        "the time '2026-11-29 10:00:01,456' gives no time zone",
        NO_QUERIES,
        context='while updating tuple (0,2) in relation "accounts"',
    )
    assert report.time is None


def test_sqlalchemy_chained_traceback_is_one_report_with_its_statement():
    report_lines = (
        "deadlock detected\n"
        f"DETAIL:  {detail(974074, 974077, 2274650, 2274652)}\n"
        "HINT:  See server log for query details.\n"
        'CONTEXT:  while updating tuple (12,4) in relation "jobs"\n'
    )
    output = (
        "Traceback (most recent call last):\n"
        '  File "/app/worker.py", line 42, in settle\n'
        "    session.commit()\n"
        f"psycopg2.errors.DeadlockDetected: {report_lines}\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n"
        '  File "/app/worker.py", line 42, in settle\n'
        "    session.commit()\n"
        f"sqlalchemy.exc.OperationalError: (psycopg2.errors.DeadlockDetected) {report_lines}\n"
        "[SQL: UPDATE jobs SET state=%(state)s WHERE jobs.id = %(id_1)s]\n"
        "[parameters: {'state': 'done', 'id_1': 7}]\n"
        "(Background on this error at: https://sqlalche.me/e/20/e3q8)\n"
    )
    report = read_two_way(
        output,
        (974074, 974077),
        (2274650, 2274652),
        NO_QUERIES,
        context='while updating tuple (12,4) in relation "jobs"',
    )
    assert report.statement == "UPDATE jobs SET state=%(state)s WHERE jobs.id = %(id_1)s"


def test_sqlalchemy_error_flattened_onto_one_line():
    line = "(psycopg2.errors.DeadlockDetected) deadlock detected DETAIL: " + detail(
        974074, 974077, 2274650, 2274652, joiner=" "
    )
    read_two_way(line, (974074, 974077), (2274650, 2274652), NO_QUERIES)


def test_jdbc_exception_in_a_spring_boot_log():
    jdbc = (
        "ERROR: deadlock detected\n"
        "  Detail: Process 4508 waits for ShareLock on transaction 1002; blocked by process 4509.\n"
        "Process 4509 waits for ShareLock on transaction 1001; blocked by process 4508.\n"
        "  Hint: See server log for query details.\n"
        '  Where: while updating tuple (0,1) in relation "accounts"\n'
    )
    prefix = "2026-11-29 10:00:01.456 {level} 1 --- [nio-8080-exec-3] {logger} : "
    log = (
        prefix.format(level=" WARN", logger="o.h.engine.jdbc.spi.SqlExceptionHelper  ")
        + "SQL Error: 0, SQLState: 40P01\n"
        + prefix.format(level="ERROR", logger="o.h.engine.jdbc.spi.SqlExceptionHelper  ")
        + jdbc
        + prefix.format(level="ERROR", logger="o.a.c.c.C.[.[.[/].[dispatcherServlet]   ")
        + "Servlet.service() for servlet [dispatcherServlet] threw exception\n\n"
        + "org.postgresql.util.PSQLException: "
        + jdbc
        + "\tat org.postgresql.core.v3.QueryExecutorImpl.receiveErrorResponse"
        "(QueryExecutorImpl.java:2713) ~[postgresql-42.6.0.jar!/:42.6.0]\n"
        "\tat org.postgresql.jdbc.PgStatement.executeInternal(PgStatement.java:517)"
        " ~[postgresql-42.6.0.jar!/:42.6.0]\n"
        "\t... 96 common frames omitted\n"
    )
    read_two_way(
        log,
        (4508, 4509),
        (1002, 1001),
        "the time '2026-11-29 10:00:01.456' gives no time zone",
        NO_QUERIES,
        context='while updating tuple (0,1) in relation "accounts"',
    )


NODE_DETAIL = (
    "  detail: 'Process 31337 waits for ShareLock on transaction 5678; "
    "blocked by process 31338.\\n' +\n"
    "    'Process 31338 waits for ShareLock on transaction 5679; blocked by process 31337.',\n"
)


def test_node_postgres_error_printed_by_console_error():
    output = (
        "error: deadlock detected\n"
        "    at /app/node_modules/pg/lib/client.js:526:17\n"
        "    at process.processTicksAndRejections (node:internal/process/task_queues:95:5)\n"
        "    at async settle (/app/src/jobs.js:41:5) {\n"
        "  length: 316,\n"
        "  severity: 'ERROR',\n"
        "  code: '40P01',\n" + NODE_DETAIL + "  hint: 'See server log for query details.',\n"
        "  position: undefined,\n"
        "  internalPosition: undefined,\n"
        "  internalQuery: undefined,\n"
        "  where: 'while updating tuple (0,1) in relation \"jobs\"',\n"
        "  schema: undefined,\n"
        "  file: 'deadlock.c',\n"
        "  line: '1148',\n"
        "  routine: 'DeadLockReport'\n"
        "}\n"
    )
    read_two_way(
        output,
        (31337, 31338),
        (5678, 5679),
        NO_QUERIES,
        context='while updating tuple (0,1) in relation "jobs"',
    )


def test_node_postgres_error_in_a_pino_json_log_line():
    error = {
        "type": "DatabaseError",
        "message": "deadlock detected",
        "stack": "error: deadlock detected\n    at /app/node_modules/pg/lib/client.js:526:17",
        "length": 316,
        "name": "error",
        "severity": "ERROR",
        "code": "40P01",
        "detail": detail(31337, 31338, 5678, 5679),
        "hint": "See server log for query details.",
        "where": 'while updating tuple (0,1) in relation "jobs"',
        "file": "deadlock.c",
        "line": "1148",
        "routine": "DeadLockReport",
    }
    line = {"level": 50, "time": 1764410401456, "pid": 12, "err": error, "msg": "deadlock detected"}
    report = read_two_way(
        json.dumps(line) + "\n",
        (31337, 31338),
        (5678, 5679),
        NO_QUERIES,
        context='while updating tuple (0,1) in relation "jobs"',
    )
    assert report.time == dt.datetime.fromtimestamp(1764410401.456, dt.UTC)
    assert report.reporter is None  # pino's pid is the application's


def test_pgx_error_string_has_no_detail_and_says_so():
    plain = "2026/11/29 10:00:01 settle job 7: ERROR: deadlock detected (SQLSTATE 40P01)\n"
    zap = {
        "level": "error",
        "ts": 1764410401.456,
        "caller": "jobs/settle.go:41",
        "msg": "settle failed",
        "job": 7,
        "error": "ERROR: deadlock detected (SQLSTATE 40P01)",
    }
    first, second = pglog.parse(plain + json.dumps(zap) + "\n")
    assert first.graph.edges == [] and first.unread == [NO_DETAIL]
    assert first.time is None
    assert second.time == dt.datetime.fromtimestamp(1764410401.456, dt.UTC)
    assert second.unread == [NO_DETAIL]


def test_postgrex_error_message_from_elixir_logger():
    log = (
        "2023-09-01T05:54:46.740 application=indexer fetcher=block_catchup [error] "
        "** (Postgrex.Error) ERROR 40P01 (deadlock_detected) deadlock detected\n"
        "\n"
        "    hint: See server log for query details.\n"
        "\n"
        f"{detail(25244, 25273, 26982184, 26982183)}\n"
        "    (ecto_sql 3.9.2) lib/ecto/adapters/sql.ex:913: "
        "Ecto.Adapters.SQL.raise_sql_call_error/1\n"
        "    (ecto_sql 3.9.2) lib/ecto/adapters/sql.ex:803: Ecto.Adapters.SQL.insert_all/9\n"
        "2023-09-01T05:54:47.001 application=indexer [info] fetched 20 blocks\n"
    )
    read_two_way(
        log,
        (25244, 25273),
        (26982184, 26982183),
        "the time '2023-09-01T05:54:46.740' gives no time zone",
        NO_QUERIES,
    )


def test_postgrex_error_struct_inspected_on_one_line():
    where = (
        'while locking tuple (17142683,15) in relation "transactions"\n'
        'SQL statement "SELECT 1 FROM ONLY "public"."transactions" x FOR KEY SHARE OF x"'
    )
    line = (
        "2019-01-04T21:27:58.318Z application=indexer [error] failed to insert: "
        "%Postgrex.Error{connection_id: 22574, message: nil, postgres: %{code: "
        f":deadlock_detected, detail: {json.dumps(detail(22574, 22560, 36155926, 36155811))}, "
        'file: "deadlock.c", hint: "See server log for query details.", line: "1140", '
        'message: "deadlock detected", pg_code: "40P01", routine: "DeadLockReport", '
        f'severity: "ERROR", unknown: "ERROR", where: {json.dumps(where)}}}, query: nil}}.  '
        "Block will be retried by catchup indexer."
    )
    report = read_two_way(
        line + "\n", (22574, 22560), (36155926, 36155811), NO_QUERIES, context=where
    )
    assert report.time == dt.datetime(2019, 1, 4, 21, 27, 58, 318000, dt.UTC)


def test_postgrex_message_in_an_elixir_json_log_line():
    message = (
        "** (Postgrex.Error) ERROR 40P01 (deadlock_detected) deadlock detected\n\n"
        "    hint: See server log for query details.\n\n" + detail(25244, 25273, 26982184, 26982183)
    )
    line = {"time": "2026-11-29T10:00:01.456Z", "severity": "error", "message": message}
    report = read_two_way(json.dumps(line) + "\n", (25244, 25273), (26982184, 26982183), NO_QUERIES)
    assert report.time == dt.datetime(2026, 11, 29, 10, 0, 1, 456000, dt.UTC)


def test_active_record_deadlocked_in_a_rails_log():
    log = (
        "I, [2026-11-29T10:00:01.456789 #12]  INFO -- : [req-7] Completed 500 Internal Server "
        "Error in 1043ms (ActiveRecord: 1012.4ms)\n"
        "F, [2026-11-29T10:00:01.458123 #12] FATAL -- : [req-7]\n"
        "[req-7] ActiveRecord::Deadlocked (PG::TRDeadlockDetected: ERROR:  deadlock detected\n"
        f"DETAIL:  {detail(8812, 8813, 77001, 77002)}\n"
        "HINT:  See server log for query details.\n"
        'CONTEXT:  while updating tuple (3,14) in relation "orders"\n'
        "):\n"
        "[req-7]\n"
        "[req-7] app/models/order.rb:42:in `settle!'\n"
    )
    report = read_two_way(
        log,
        (8812, 8813),
        (77001, 77002),
        NO_QUERIES,
        context='while updating tuple (3,14) in relation "orders"',
    )
    assert report.reporter is None


def test_a_sentence_that_mentions_a_deadlock_is_not_a_report():
    log = (
        "2026-11-29 10:00:01,456 INFO worker: retrying job 7 after deadlock detected\n"
        "2026-11-29 10:00:02,001 INFO worker: job 7 done\n"
    )
    assert pglog.parse(log) == []


def test_a_report_is_compared_only_with_those_it_may_repeat(monkeypatch):
    """A log of thousands of reports: each was compared with every report
    kept before it (20,000 took a minute), though only a client's report
    of the same edges can be its repetition."""
    compared: list[int] = []
    same = pglog._same_deadlock
    monkeypatch.setattr(
        pglog, "_same_deadlock", lambda first, second: compared.append(1) or same(first, second)
    )
    server = "2024-01-01 00:00:00 UTC [1] ERROR:  deadlock detected\n" * 2000
    assert len(pglog.parse(server)) == 2000 and compared == []

    raised = "psycopg.errors.DeadlockDetected: deadlock detected\nDETAIL:  "
    printed = "".join(f"{raised}{detail(a, a + 1, a, a + 2)}\n\n" for a in range(100, 700, 3))
    assert len(pglog.parse(printed + printed)) == 200
    assert len(compared) == 200  # each repetition with its first print, once
