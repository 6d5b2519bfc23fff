"""The plans of the per-step statements stay bounded by the run, not by the
table, whichever plan PostgreSQL keeps for a prepared statement.

A prepared statement may run under a generic plan, made once without the
parameters' values (plan_cache_mode auto picks one when it looks cheap
enough, and keeps it).  Each test asks for the generic plan of a statement
as the runtime sends it, on tables whose statistics invite the plan that
once made a step cost milliseconds on a busy database."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from evidence.records import NEW_CALLS
from runs.leases import RECEIPT_CTES, RECEIPTS_WRITTEN, Lease, PendingReceipt, receipt_params
from runs.submission import submit

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md", "crestline-short-treasury.md"]


def generic_plan(sql: str, params: dict[str, Any] | list[Any]) -> str:
    """EXPLAIN of `sql` (with %(name)s or %s placeholders) prepared on the
    server and run under its generic plan with `params`."""
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
                cursor.execute(f"EXPLAIN EXECUTE planned({marks})", values)
                return "\n".join(row for (row,) in cursor.fetchall())
            finally:
                cursor.execute("DEALLOCATE planned")
        finally:
            cursor.execute("RESET plan_cache_mode")


@pytest.fixture
def churned() -> Iterator[None]:
    """Many actions of other runs, all completed, and the table analysed:
    the statistics say that hardly any action is dispatched, so the index
    of dispatched actions looks like the cheapest way to anything; and
    that a run has a handful of actions (as most have), so its own look
    cheap to read too."""
    other = submit(question="other", documents=DOCS)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_action (run_id, step_key, kind, effect_class, input, input_digest,"
            " state, epoch, attempts, idempotency_key, error, created_at, dispatched_at)"
            " SELECT %s, 'step:' || i, 'read_document', 'read', '{}', '', 'completed', 1, 1,"
            " 'key-' || i, '', now(), now() FROM generate_series(1, 5000) AS i",
            [other.pk],
        )
        cursor.execute("ALTER TABLE runs_action ALTER COLUMN run_id SET (n_distinct = -0.2)")
        cursor.execute("ANALYZE runs_action")
    yield
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE runs_action ALTER COLUMN run_id RESET (n_distinct)")


def test_a_receipt_never_finds_its_action_through_the_index_of_dispatched_actions(churned):
    # That index keeps an entry for each version of a row ever dispatched
    # until VACUUM: a plan through it read every action dispatched since.
    run = submit(question="q", documents=DOCS)
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    action = lease.record_boundary(
        step_key="read:0", kind="read_document", effect_class="read", input={"path": DOCS[0]}
    )
    assert action is not None
    params = {
        "run": run.pk,
        "owner": "owner",
        "epoch": lease.epoch,
        **receipt_params([PendingReceipt(action, {"text": "x"})]),
    }
    plan = generic_plan(f"WITH {RECEIPT_CTES} SELECT {RECEIPTS_WRITTEN}", params)
    assert "runs_action" in plan
    assert "action_dispatched_idx" not in plan, plan
    # Nor through the run's own actions (action_identity_unique): a long
    # run's every receipt would read all its actions.  By its id.
    assert "runs_action_pkey" in plan, plan
    assert "action_identity_unique" not in plan, plan


@pytest.mark.parametrize("tables", ["never analysed", "churned"])
def test_the_boundary_statement_is_planned_once_per_connection_not_once_per_step(request, tables):
    # Planning it each step cost as much of the server's CPU as running it:
    # PostgreSQL keeps a generic plan for a prepared statement (plan_cache_
    # mode auto) only where it costs less than the custom plans it made.
    if tables == "churned":
        request.getfixturevalue("churned")
    run = submit(question="q", documents=DOCS, action_budget=40)
    lease = Lease.claim(run.pk, "owner")
    assert lease is not None
    action = None
    for i in range(15):
        receipts = [] if action is None else [PendingReceipt(action, {"text": "x"})]
        action = lease.record_boundary(
            step_key=f"read:{i}",
            kind="read_document",
            effect_class="read",
            input={"path": DOCS[0]},
            receipts=receipts,
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%INSERT INTO runs_action %%'"
        )
        ((generic, custom),) = cursor.fetchall()
    assert custom <= 5 and generic >= 10, (generic, custom)


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
