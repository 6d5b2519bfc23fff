"""`bench --peers` (runs/benchmarks/peers.py): the server's counters count
what a block did, read as soon as its connections are closed; the module
needs the bench extra only when it runs; and, with the extra installed, a
short report says what each peer's step costs."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection
from psycopg import sql

from runs.benchmarks import peers
from tests.conftest import database_url, python

pytestmark = pytest.mark.django_db(transaction=True)


def extra_installed() -> bool:
    return (
        all(
            importlib.util.find_spec(top) is not None for top in ("dbos", "langgraph", "sqlalchemy")
        )
        and importlib.util.find_spec("langgraph.checkpoint.postgres") is not None
    )


@pytest.fixture(scope="module")
def counted_database() -> Iterator[str]:
    """A database of its own on the test server, named for the test
    database (another suite's, or xdist worker's, has its own), with an
    empty table.  Kept after the tests, for the next run of the suite to
    empty again: a DROP DATABASE waits for a checkpoint (18 s in a busy
    suite)."""
    params = peers.connection_params(connection.settings_dict["NAME"])
    counted = f"{connection.settings_dict['NAME']}_peer_count"
    with psycopg.connect(**params, autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [counted]).fetchone():
            admin.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(counted))
            )
    with psycopg.connect(**peers.connection_params(counted), autocommit=True) as setup:
        setup.execute("DROP TABLE IF EXISTS counted")
        setup.execute("CREATE TABLE counted (id bigserial PRIMARY KEY)")
    yield counted


@pytest.fixture
def observer(counted_database: str) -> Iterator[peers.Observer]:
    """An observer of the counted database, from the test database: every
    backend started from now on the counted database is the test's."""
    with psycopg.connect(
        **peers.connection_params(connection.settings_dict["NAME"]), autocommit=True
    ) as conn:
        since = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        yield peers.Observer(conn, since, [counted_database])


def inserts(database: str, count: int) -> None:
    """`count` single-row INSERTs in autocommit, on a connection of their
    own, closed at the end; never prepared (a PREPARE is a transaction too)."""
    with psycopg.connect(
        **peers.connection_params(database), autocommit=True, prepare_threshold=None
    ) as conn:
        for _ in range(count):
            conn.execute("INSERT INTO counted DEFAULT VALUES")


def test_count_sees_every_commit_of_a_block_as_soon_as_its_connection_is_closed(
    observer: peers.Observer, counted_database: str
) -> None:
    # A backend that committed less than a second ago holds its counts for
    # up to 10 s when it goes idle; one that exits hands them over, a few
    # milliseconds after its client closed it: count() waits for that.
    for _ in range(3):
        tally = observer.count(counted_database, inserts, counted_database, 50)

        assert tally.commits == 50 + 1  # the connection's start is a transaction too
        # One WAL fsync per durable commit, less those someone else's fsync
        # covered (a busy server: other test runs share it), plus theirs.
        assert tally.wal_syncs >= 25
        assert tally.seconds < 5


def test_count_of_a_block_that_commits_nothing_is_its_connection_only(
    observer: peers.Observer, counted_database: str
) -> None:
    assert observer.count(counted_database, inserts, counted_database, 0).commits == 1


def test_a_rundesk_block_leaves_no_backend_of_its_process_behind() -> None:
    # The bench runs with the process's pool of connections (as production
    # does, unlike pytest): a pooled backend outlives the block and keeps
    # its counts for ten idle seconds, so count() read none of Rundesk's.
    code = (
        "import time, psycopg, django; django.setup()\n"
        "from django.db import connection\n"
        "from runs.benchmarks import peers\n"
        "assert connection.pool is not None\n"
        "with connection.cursor() as cursor:\n"
        "    cursor.execute('SELECT pg_backend_pid()')\n"
        "    (pid,) = cursor.fetchone()\n"
        "peers.release_django_connections()\n"
        "params = peers.connection_params(connection.settings_dict['NAME'])\n"
        "with psycopg.connect(**params, autocommit=True) as conn:\n"
        "    for _ in range(500):\n"
        "        query = 'SELECT count(*) FROM pg_stat_activity WHERE pid = %s'\n"
        "        if not conn.execute(query, (pid,)).fetchone()[0]:\n"
        "            break\n"
        "        time.sleep(0.01)\n"
        "    else:\n"
        "        raise SystemExit(f'backend {pid} still there')\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "DJANGO_SETTINGS_MODULE": "dashboard.settings",
        "RUNDESK_DB_POOL_SIZE": "4",
    }
    done = python(code, env)
    assert done.returncode == 0, done.stderr


def test_peers_within_five_percent_of_the_best_share_the_lead() -> None:
    assert peers.leaders({"dbos": 1.01, "langgraph": 2.01, "rundesk": 1.04}) == "dbos, rundesk"
    assert peers.leaders({"dbos": 6.4, "langgraph": 3.1, "rundesk": 1.4}) == "rundesk"


def test_without_the_extra_the_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "dbos", None)  # `import dbos` raises ImportError

    with pytest.raises(RuntimeError) as raised:
        peers.report(steps=20, rounds=1)

    assert str(raised.value) == "bench --peers needs the bench extra: pip install -e '.[bench]'"


def test_the_module_imports_without_the_extra() -> None:
    code = (
        "import sys\n"
        "for name in ('dbos', 'langgraph', 'sqlalchemy'): sys.modules[name] = None\n"
        "import django; django.setup()\n"
        "from runs.benchmarks import peers\n"
        "print(peers.EXTRA)\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "DJANGO_SETTINGS_MODULE": "dashboard.settings",
    }
    done = python(code, env)
    assert done.returncode == 0, done.stderr
    assert "bench extra" in done.stdout


@pytest.mark.skipif(
    not extra_installed(),
    reason="the bench extra (dbos, langgraph, langgraph-checkpoint-postgres) is not installed: "
    "pip install -e '.[bench]'",
)
def test_a_short_report_says_what_each_peers_step_costs() -> None:
    result = peers.report(steps=20, rounds=1)

    assert set(result["peers"]) == {"dbos", "langgraph", "rundesk"}
    for name, peer in result["peers"].items():
        assert peer["step_ms_p50"] > 0 and peer["over_commit"] > 0, name
        # Every peer's step is made durable by at least one commit of its
        # own database, each a WAL fsync, unless someone else's covered it
        # (a busy server: other test runs share it).
        assert peer["commits_per_step"] >= 1, name
        assert peer["wal_syncs_per_step"] >= 0.3, name
        assert peer["guarantee"], name
    # DBOS reads its step's checkpoint, then writes it: two transactions.
    assert result["peers"]["dbos"]["commits_per_step"] >= 2
    assert set(result["fastest"].split(", ")) <= set(result["peers"])
    assert set(result["fewest_wal_syncs"].split(", ")) <= set(result["peers"])
    assert result["commit_ms_p50"] > 0 and result["noise_wal_syncs_per_s"] >= 0
    with psycopg.connect(
        **peers.connection_params(connection.settings_dict["NAME"]), autocommit=True
    ) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname = ANY(%s)",
            (list(peers.BENCH_DATABASES.values()),),
        ).fetchall()
    assert left == []  # the peers' databases are dropped
