"""The plans of the per-step statements stay bounded by the run, not by the
table, whichever plan PostgreSQL keeps for a prepared statement.

A prepared statement may run under a generic plan, made once without the
parameters' values (plan_cache_mode auto picks one when it looks cheap
enough, and keeps it).  Each test asks for the generic plan of a statement
as the runtime sends it, on tables whose statistics invite the plan that
once made a step cost milliseconds on a busy database."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from evidence.records import NEW_CALLS
from runs import leases, lifecycle
from runs.leases import Lease, PendingReceipt
from runs.models import Run, RunStatus
from runs.sql import fetch_one
from runs.submission import submit

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md"]
TABLES = ("runs_run", "runs_action", "runs_receipt", "runs_hold", "runs_answerrevision")


def generic_plan(sql: str, params: dict[str, Any] | list[Any], explain: str = "") -> str:
    """EXPLAIN of `sql` (with %(name)s or %s placeholders) prepared on the
    server and run under its generic plan with `params`; `explain`: its
    options (`(ANALYZE, FORMAT JSON)` runs it)."""
    if isinstance(params, dict):
        names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
        text = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", sql)
        values = [params[name] for name in names]
    else:
        count = iter(range(1, len(params) + 1))
        text = re.sub(r"%s", lambda m: f"${next(count)}", sql)
        values = list(params)
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(f"PREPARE planned AS {text}")
            try:
                marks = ", ".join(["%s"] * len(values))
                cursor.execute(f"EXPLAIN {explain} EXECUTE planned({marks})", values)
                # FORMAT JSON comes back parsed.
                rows = [row if isinstance(row, str) else json.dumps(row) for (row,) in cursor]
                return "\n".join(rows)
            finally:
                cursor.execute("DEALLOCATE planned")
        finally:
            cursor.execute("RESET plan_cache_mode")


@pytest.fixture
def never_analysed() -> None:
    """The runtime's tables as in a new installation: never analysed (what
    an earlier test's ANALYZE left is forgotten), so the planner reckons
    with their size alone."""
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM pg_statistic WHERE starelid = ANY(%s::regclass[])", [list(TABLES)]
        )
        cursor.execute(
            "UPDATE pg_class SET relpages = 0, reltuples = -1 WHERE oid = ANY(%s::regclass[])",
            [list(TABLES)],
        )


@pytest.fixture
def churned() -> None:
    """Many actions of other runs, all completed, and the table analysed:
    the statistics say that hardly any action is dispatched, so the index
    of dispatched actions looks like the cheapest way to anything."""
    other = submit(question="other", documents=DOCS)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_action (run_id, step_key, kind, effect_class, input, input_digest,"
            " state, epoch, attempts, idempotency_key, error, created_at, dispatched_at)"
            " SELECT %s, 'step:' || i, 'read_document', 'read', '{}', '', 'completed', 1, 1,"
            " 'key-' || i, '', now(), now() FROM generate_series(1, 5000) AS i",
            [other.pk],
        )
        cursor.execute("ANALYZE runs_action")


def sent(monkeypatch, write: Callable[[Lease, list[PendingReceipt]], object]) -> tuple[str, dict]:
    """The statement, and its parameters, a lease sends for `write` (given
    the receipt of the run's first read) on a newly claimed run."""
    run = submit(question="q", documents=DOCS)
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    action = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    assert action is not None
    statements = []

    def recorded(sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        statements.append((sql, params))
        return fetch_one(sql, params)

    monkeypatch.setattr(leases, "fetch_one", recorded)
    monkeypatch.setattr(lifecycle, "fetch_one", recorded)
    write(lease, [PendingReceipt(action, {"text": "x"})])
    return statements[0]


WRITES = {
    "receipts": lambda lease, receipts: lease.record_receipts(receipts),
    "boundary": lambda lease, receipts: lease.record_boundary(
        step_key="read:1",
        kind="read_document",
        effect_class="read",
        input={"path": DOCS[1]},
        receipts=receipts,
    ),
    "publication": lambda lease, receipts: lease.publish_revision(
        1, "draft", is_final=False, receipts=receipts
    ),
    "finish": lambda lease, receipts: lease.finish(RunStatus.COMPLETED, receipts=receipts),
}


def test_a_receipt_never_finds_its_action_through_the_index_of_dispatched_actions(
    churned, monkeypatch
):
    # That index keeps an entry for each version of a row ever dispatched
    # until VACUUM: a plan through it read every action dispatched since.
    plan = generic_plan(*sent(monkeypatch, WRITES["receipts"]))
    assert "runs_action" in plan
    assert "action_dispatched_idx" not in plan, plan


@pytest.mark.parametrize("write", WRITES)
def test_a_plan_made_while_the_tables_are_small_never_reads_them_whole(
    never_analysed, monkeypatch, write
):
    # A connection keeps a generic plan for as long as it lives, while the
    # tables grow (with autovacuum off, nothing makes it plan again): on
    # these few rows, a scan of the whole table can look cheapest.
    plan = generic_plan(*sent(monkeypatch, WRITES[write]))
    assert "runs_action" in plan
    assert "Seq Scan" not in plan, plan


# Each write a run sends at every step or with its end, with the receipt of
# the read before it, and what tells its prepared statement from the others.
REPEATED = {
    "boundary": r"INSERT INTO runs_action ",
    "receipts": r"RETURNING action_id\)\s+SELECT \(SELECT count",
    "publication": r"INSERT INTO runs_answerrevision ",
    "finish": r"UPDATE runs_run SET\s+status = CASE",
}


@pytest.mark.parametrize("write", REPEATED)
@pytest.mark.parametrize("tables", ["never_analysed", "churned"])
def test_each_write_of_a_run_is_planned_once_per_connection_not_once_per_step(
    request, tables, write
):
    # Planning the boundary each step cost as much of the server's CPU as
    # running it: PostgreSQL keeps a generic plan for a prepared statement
    # (plan_cache_mode auto) only where it costs less than the custom plans
    # it made.  The receipts' ids, seen as a parameter by the custom plans
    # only, made every receipt, publication and finish look dearer under a
    # generic plan: they were planned at each call.
    request.getfixturevalue(tables)
    connection.close()  # a new session: no statement an earlier test prepared
    for number in range(1, 16):
        run = submit(question="q", documents=DOCS)
        lease = Lease.claim(run.pk, "owner")
        assert lease is not None
        action = lease.record_boundary(
            step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
        )
        assert action is not None
        WRITES[write](lease, [PendingReceipt(action, {"text": f"x{number}"})])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement ~ %s",
            [REPEATED[write]],
        )
        ((generic, custom),) = cursor.fetchall()
    assert custom <= 5 and generic >= 10, (generic, custom)


@pytest.mark.parametrize("write", WRITES)
def test_a_receipt_in_a_long_run_reads_its_own_action_not_every_action_of_the_run(
    monkeypatch, write
):
    # A run of thousands of steps, on a busy installation whose runs have a
    # few actions each: a plan that found the receipt's action among the
    # run's own (its entries in the run's index) read them all at each step.
    statement, params = sent(monkeypatch, WRITES[write])
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_action (run_id, step_key, kind, effect_class, input, input_digest,"
            " state, epoch, attempts, idempotency_key, error, created_at, dispatched_at)"
            " SELECT %s, 'earlier:' || i, 'read_document', 'read', '{}', '', 'completed', 1, 1,"
            " 'earlier-key-' || i, '', now(), now() FROM generate_series(1, 5000) AS i",
            [params["run"]],
        )
        # What the statistics of thousands of short runs say of a run.
        cursor.execute("ALTER TABLE runs_action ALTER COLUMN run_id SET (n_distinct = -0.2)")
        try:
            cursor.execute("ANALYZE runs_action")
            plan = json.loads(generic_plan(statement, params, "(ANALYZE, FORMAT JSON)"))
        finally:
            cursor.execute("ALTER TABLE runs_action ALTER COLUMN run_id RESET (n_distinct)")
            cursor.execute("ANALYZE runs_action")
    assert scans(plan, "runs_action") == {"runs_action_pkey"}, json.dumps(plan, indent=1)
    assert max(rows_read(plan, "runs_action", ACTION_INDEXES)) <= 10, json.dumps(plan, indent=1)


@pytest.mark.parametrize("write", WRITES)
def test_a_step_finds_its_run_by_id_never_among_the_running_ones(monkeypatch, write):
    # Statistics taken while no run ran say the index of running runs is
    # empty, and a generic plan made then searched it (the run's id a mere
    # filter) rather than the primary key: with a thousand runs in flight,
    # each step of each read them all.  Without the primary key, no plan may
    # find the run through an index of running runs either.
    statement, params = sent(monkeypatch, WRITES[write])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ALTER TABLE runs_run DROP CONSTRAINT runs_run_pkey CASCADE")
        plan = generic_plan(statement, params)
        transaction.set_rollback(True)
    for index in ("run_running_lease_idx", "run_status_listing_idx"):
        assert index not in plan, plan


def scans(plan: list[dict[str, Any]], table: str) -> set[str]:
    """How an EXPLAIN (FORMAT JSON) reads `table`: the indexes it scans,
    or the kind of scan."""
    return {
        node.get("Index Name", node["Node Type"])
        for node in _nodes(plan[0]["Plan"])
        if node.get("Relation Name") == table and node["Node Type"] != "ModifyTable"
    }


def rows_read(plan: list[dict[str, Any]], table: str, indexes: tuple[str, ...]) -> list[int]:
    """The rows each node of an EXPLAIN (ANALYZE, FORMAT JSON) read from
    `table` or its `indexes`, those its filter removed too."""
    return [
        (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        for node in _nodes(plan[0]["Plan"])
        if node.get("Relation Name") == table or node.get("Index Name") in indexes
    ] or [0]


ACTION_INDEXES = ("runs_action_pkey", "action_identity_unique", "action_dispatched_idx")


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A plan's node and all below it."""
    return [node, *(each for child in node.get("Plans", ()) for each in _nodes(child))]


def test_a_batch_of_model_calls_looks_up_each_calls_documents_by_run_and_path():
    # The batch's size is unknown to the planner (JSON): a join may scan
    # every document ever read, once per batch, for its few.
    runs = [submit(question=f"q{i}", documents=DOCS).pk for i in range(3)]
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH read AS (INSERT INTO runs_action (run_id, step_key, kind, effect_class, input,"
            " input_digest, state, epoch, attempts, idempotency_key, error, created_at,"
            " dispatched_at) SELECT id, 'read', 'read_document', 'read', '{}', '', 'completed',"
            " 1, 1, 'key-' || id, '', now(), now() FROM runs_run WHERE id = ANY(%s)"
            " RETURNING id, run_id)"
            " INSERT INTO evidence_source (run_id, path, read_action_id, digest, bytes,"
            " created_at, changed)"
            " SELECT read.run_id, 'doc-' || i || '.md', read.id, '', 1, now(), false"
            " FROM read, generate_series(1, 3000) AS i",
            [runs],
        )
        cursor.execute("ANALYZE evidence_source")
    call = {
        "run": runs[0],
        "action": 1,
        "provider": "offline",
        "input_digest": "",
        "output_digest": "",
        "paths": DOCS,
        "input": "",
        "output": "",
        "input_bytes": 0,
        "output_bytes": 0,
        "truncated": False,
    }
    plan = generic_plan(NEW_CALLS, [json.dumps([call])])
    assert "evidence_source" in plan
    assert "Seq Scan on evidence_source" not in plan, plan


@pytest.mark.parametrize(
    "statistics",
    ["taken_while_the_queue_was_short", "taken_after_many_runs_were_deleted", "never_taken"],
)
def test_a_claim_reads_the_runs_it_takes_not_the_whole_queue(statistics):
    # Statistics say few runs wait (taken while the queue was short, as
    # autovacuum leaves them on a large table; or none): reading every
    # queued run and sorting them looked cheapest, and with a backlog of
    # thousands each claim read them all.  Taken after many runs were
    # deleted (their pages still there, few rows in them), they made the
    # claim join the runs it took with a walk of the whole table.
    first = submit(question="q", documents=DOCS)
    columns = [field.column for field in Run._meta.concrete_fields if field.column != "id"]
    copied = ", ".join(
        "created_at + i * interval '1 ms'" if column == "created_at" else column
        for column in columns
    )
    copy = (
        f"INSERT INTO runs_run ({', '.join(columns)}) SELECT {copied}"
        " FROM runs_run, generate_series(1, %s) AS i WHERE id = %s"
    )
    with connection.cursor() as cursor:
        if statistics == "never_taken":
            cursor.execute(
                "DELETE FROM pg_statistic WHERE starelid = 'runs_run'::regclass;"
                " UPDATE pg_class SET relpages = 0, reltuples = -1 WHERE oid = 'runs_run'::regclass"
            )
        else:
            if statistics == "taken_after_many_runs_were_deleted":
                cursor.execute(copy, [1000, first.pk])
                cursor.execute("DELETE FROM runs_run WHERE id <> %s", [first.pk])
            cursor.execute("ANALYZE runs_run")
        cursor.execute(copy, [3000, first.pk])
    for most in (1, 20):
        with transaction.atomic():
            before = rows_read_so_far("runs_run")
            claimed = lifecycle.claim("owner", dt.timedelta(seconds=30), lab=False, most=most)
            read = rows_read_so_far("runs_run") - before
            transaction.set_rollback(True)
        assert [run_id for run_id, _ in claimed][:1] == [first.pk]  # the oldest first
        assert len(claimed) == most
        assert read <= 3 * most + 10, (most, read)


def rows_read_so_far(table: str) -> int:
    """The rows of `table` this session's scans have read and not reported
    yet (pg_stat_xact_user_tables: counts a session keeps until it reports
    them, its transaction's among them)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_tup_read + idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relname = %s",
            [table],
        )
        return cursor.fetchone()[0]
