"""Behind PgBouncer in transaction mode (Debian's pgbouncer, which `make
test` installs): a transaction may run on any server connection, so the
runtime keeps nothing on one between transactions.  Real executor
processes run runs through it, one is SIGKILLed mid-run, and another
resumes without running again what had completed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from runs.harness import wait_for
from runs.models import Receipt, Run, RunStatus
from runs.submission import submit
from tests.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)

PGBOUNCER = "/usr/sbin/pgbouncer"
DOCS = ["northwind-clean-energy.md", "meridian-world-equity.md", "crestline-short-treasury.md"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def pgbouncer() -> Iterator[int]:
    """PgBouncer in transaction mode on a free port, in front of the test
    database's server; its port."""
    db = connection.settings_dict
    port = free_port()
    # Its own folder, readable by the user it runs as (it refuses root).
    folder = Path(tempfile.mkdtemp(prefix="rundesk-pgbouncer-"))
    folder.chmod(0o755)
    users = folder / "users.txt"
    users.write_text(f'"{db["USER"] or "postgres"}" ""\n')
    config = folder / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
* = host={db["HOST"] or "127.0.0.1"} port={db["PORT"] or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {users}
admin_users = {db["USER"] or "postgres"}
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
server_reset_query =
ignore_startup_parameters = extra_float_digits
"""
    )
    for path in (users, config):
        path.chmod(0o644)
    user = ["-u", "nobody"] if os.geteuid() == 0 else []
    process = subprocess.Popen(
        [PGBOUNCER, *user, str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, process.communicate()[0]
                assert time.monotonic() < deadline, "pgbouncer did not listen"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def through(port: int) -> str:
    db = connection.settings_dict
    return f"postgresql://{db['USER'] or 'postgres'}@127.0.0.1:{port}/{db['NAME']}"


def transactions_through(port: int) -> int:
    """How many transactions PgBouncer has passed to the test database."""
    db = connection.settings_dict
    with psycopg.connect(
        host="127.0.0.1",
        port=port,
        dbname="pgbouncer",
        user=db["USER"] or "postgres",
        autocommit=True,
    ) as admin:
        cursor = admin.cursor()
        cursor.execute("SHOW STATS")
        names = [column.name for column in cursor.description]
        for row in cursor.fetchall():
            stats = dict(zip(names, row, strict=True))
            if stats["database"] == db["NAME"]:
                return int(stats["total_xact_count"])
    return 0


def test_runs_survive_a_sigkill_and_resume_through_pgbouncer_in_transaction_mode(
    pgbouncer, process_env, journal
):
    env = {
        **process_env,
        "DATABASE_URL": through(pgbouncer),
        "RUNDESK_DB_TRANSACTION_POOLER": "1",
        "RUNDESK_ROLE": "executor",
    }
    runs = [
        submit(question=f"q{i}", documents=DOCS, faults=[{"point": "tool_delay", "ms": 300}]).pk
        for i in range(4)
    ]
    first = manage("executor", "--concurrency", "4", env=env)
    wait_for(lambda: Receipt.objects.filter(run_id=runs[0]).count() >= 3, timeout=60)
    first.send_signal(signal.SIGKILL)
    _, err = first.communicate(timeout=30)
    done_before_kill = set(
        Receipt.objects.filter(run_id__in=runs).values_list("action_id", flat=True)
    )
    identities_done = {
        f"rundesk:run-{run_id}:{step_key}"
        for run_id, step_key in Receipt.objects.filter(action_id__in=done_before_kill).values_list(
            "run_id", "step_key"
        )
    }
    assert identities_done and "prepared statement" not in err, err[-2000:]

    wait_for(
        lambda: (
            Run.objects.claimable().filter(pk__in=runs).count()
            == Run.objects.filter(pk__in=runs).exclude(status=RunStatus.COMPLETED).count()
        ),
        timeout=30,
    )
    second = manage("executor", "--once", "--concurrency", "4", "--json", env=env)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-2000:]
    assert all(json.loads(line)["outcome"] == "completed" for line in out.splitlines()), out
    assert set(Run.objects.filter(pk__in=runs).values_list("status", flat=True)) == {"completed"}
    assert Receipt.objects.filter(run_id__in=runs).count() == 8 * len(runs)
    # What had completed before the kill ran once; a read whose receipt was
    # still to go with the next write is read again at most once.
    counts = journal.counts()
    assert {identity: counts[identity] for identity in identities_done} == dict.fromkeys(
        identities_done, 1
    )
    assert max(journal.counts("read_document").values()) <= 2
    assert "prepared statement" not in err and "ERROR" not in err, err[-2000:]
    assert transactions_through(pgbouncer) > 8 * len(runs)
