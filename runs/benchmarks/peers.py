"""`bench --peers`: a no-op step through two peers' durable runtimes and
through Rundesk's executor, each against the same bare commit.

- dbos: `@DBOS.step()` no-ops called one after another from one
  `@DBOS.workflow()`, its system database of its own;
- langgraph: a graph whose one node loops on itself, one no-op per
  superstep, checkpointed by `PostgresSaver` with `durability="sync"`, a
  database of its own;
- rundesk: `noop_step` of `noop_run` (runs/benchmarks/steps.py): boundary,
  tool, receipt, timeline, in Django's database.

Every database is on the server of Django's.  The bare commit is a
single-row INSERT + COMMIT (autocommit: one round trip) on a logged table,
on a connection and in a database of its own, made after each timed step,
so a peer's steps and its commits see the same machine at the same moment
(`over_commit`).

What a step costs the server is counted in another block of `steps` steps,
with no commit in between: pg_stat_database.xact_commit of the peer's
database (every committed transaction: read-only ones, and each new
connection's start) and pg_stat_wal.wal_sync (WAL fsyncs, of the whole
server), per step, the block's whole life included (a DBOS launch and
shutdown, a LangGraph connection, a Rundesk run's submit, claim and
finish).  A backend hands its counts to the server only when idle, at most
once a second, and one that handed them less than a second ago waits up
to 10 s more (PostgreSQL 15's PGSTAT_IDLE_INTERVAL): sleeping a second or
two after a block misses counts.  A backend that exits hands them over
first.  So every block opens its own connections and closes them all, and
the counters are read once every backend the bench opened has exited.

The WAL counter sees the whole server.  Others' fsyncs add to a block's
count, and on a busy server one of theirs also covers some of the peer's
commits (group commit), which then need none of their own: a count can be
off either way.  So every count is the median over the rounds (WAL syncs
with the lowest and highest, `wal_syncs_per_step_range`), and each round
ends with an idle block as long as its counted ones, which says how busy
the server was (`noise_wal_syncs_per_s`, the median; per peer, what that
rate puts in one of its counted blocks, `noise_wal_syncs_per_step`): the
WAL figures mean what they say when that is well below 0.1 per step.
`commits_per_step` counts the peer's own database only.  With
`wal_sync_method` open_sync or open_datasync the server counts no fsync
(`server.wal_sync_method` says which).  `fastest` and `fewest_wal_syncs`
name the best peer, and any within 5 % of it."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import importlib
import itertools
import logging
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol, TypedDict

import psycopg
from django.db import connection
from psycopg import sql
from psycopg.conninfo import make_conninfo

from evidence.capture import capture
from runs.benchmarks import ServerCounts, p50
from runs.benchmarks.steps import noop_run, noop_step
from runs.timeline import timeline

logger = logging.getLogger(__name__)

EXTRA = "bench --peers needs the bench extra: pip install -e '.[bench]'"
APPLICATION = "rundesk:bench-peers"
BENCH_DATABASES = {
    "dbos": "rundesk_peer_dbos",
    "langgraph": "rundesk_peer_langgraph",
    "commit": "rundesk_peer_commit",  # the bare commit's table, and the observer
}
PEER_MODULES = ("dbos", "langgraph.graph", "langgraph.checkpoint.postgres")
PEER_PACKAGES = ("dbos", "langgraph", "langgraph-checkpoint-postgres")
WARMUP_STEPS = 20
SETTLE_SECONDS = 15.0  # at most, for the backends of a block to exit
TIE = 0.05  # peers this close to the best (relative) share "fastest", "fewest_wal_syncs"

GUARANTEES = {
    "dbos": (
        "step output checkpointed in one transaction after the step runs: at-least-once "
        "step execution (a crash before the checkpoint runs the step again); the workflow "
        "resumes from its last completed step"
    ),
    "langgraph": (
        'durability="sync": the superstep\'s writes and its checkpoint are written before '
        "the next superstep starts; a crash runs the interrupted superstep's nodes again "
        "(at least once); no owner fence"
    ),
    "rundesk": (
        "durable boundary (identity, input digest) before dispatch, fenced by the lease "
        "(owner, epoch) in the same statement; a read's receipt commits with the next "
        "boundary (a crash repeats at most the last read), an effect's at once; a completed "
        "action never runs again; effects at most once, an unknown outcome waits for an operator"
    ),
}

Between = Callable[[], None]  # what runs after each timed step: the bare commit


def report(steps: int = 500, rounds: int = 5) -> dict[str, Any]:
    """`rounds` rounds; in each, per peer (in a rotating order), `steps`
    no-op steps timed, each followed by a bare commit, then `steps` more
    counted by the server; then an idle block as long as the round's
    counted ones (the module's docstring says how counts are read)."""
    if steps < 2 or rounds < 1:
        # A LangGraph step is timed from one node to the next: two at least.
        raise ValueError("bench --peers needs at least 2 steps and 1 round")
    require_extra()
    release_django_connections()
    with peer_databases() as server, server.observer() as observer:
        peers: list[Peer] = [Dbos(server), LangGraph(server), Rundesk()]
        for peer in peers:
            peer.prepare()
            peer.block(min(steps, WARMUP_STEPS), None)
        measured = Measured(peers)
        for r in range(rounds):
            for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
                with server.bare_commit() as commit:
                    measured.steps[peer.name] += peer.block(steps, commit)
                measured.commits[peer.name] += commit.samples
                # Counted once the commit's connection too has exited.
                tally = observer.count(peer.database, peer.block, steps, None)
                measured.tallies[peer.name].append(tally)
            idle = statistics.mean(measured.tallies[peer.name][-1].seconds for peer in peers)
            measured.idle.append(observer.count(None, time.sleep, idle))
        versions = server.versions()
    return {"steps": steps, "rounds": rounds, **measured.report(steps), **versions}


@dataclass
class Measured:
    """Per peer: its steps' times and the times of the bare commits made
    after them (ms), and what the server counted over each of its counted
    blocks; and what it counted over each idle block."""

    peers: list[Peer]
    steps: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    commits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tallies: dict[str, list[Tally]] = field(default_factory=lambda: defaultdict(list))
    idle: list[Tally] = field(default_factory=list)

    def report(self, steps: int) -> dict[str, Any]:
        noise = statistics.median(tally.wal_syncs / tally.seconds for tally in self.idle)
        peers = {peer.name: self.peer(peer, steps, noise) for peer in self.peers}
        return {
            "commit_ms_p50": p50([ms for commits in self.commits.values() for ms in commits]),
            "noise_wal_syncs_per_s": round(noise, 2),
            "peers": peers,
            "fastest": leaders({name: peer["step_ms_p50"] for name, peer in peers.items()}),
            "fewest_wal_syncs": leaders(
                {name: peer["wal_syncs_per_step"] for name, peer in peers.items()}
            ),
        }

    def peer(self, peer: Peer, steps: int, noise: float) -> dict[str, Any]:
        tallies = self.tallies[peer.name]
        wal_syncs = [tally.wal_syncs / steps for tally in tallies]
        seconds = statistics.median(tally.seconds for tally in tallies)
        return {
            "step_ms_p50": p50(self.steps[peer.name]),
            "over_commit": round(
                statistics.median(self.steps[peer.name])
                / statistics.median(self.commits[peer.name]),
                2,
            ),
            "commits_per_step": round(
                statistics.median(tally.commits / steps for tally in tallies), 2
            ),
            # Three places: a run's own writes (start, claim, end) show there.
            "wal_syncs_per_step": round(statistics.median(wal_syncs), 3),
            "wal_syncs_per_step_range": [round(min(wal_syncs), 3), round(max(wal_syncs), 3)],
            # What the idle blocks' rate would put in a counted block.
            "noise_wal_syncs_per_step": round(noise * seconds / steps, 3),
            "guarantee": peer.guarantee,
        }


def leaders(values: dict[str, float], within: float = TIE) -> str:
    """The peer with the lowest value, or the peers within `within` of it
    (relative), named together: "dbos, rundesk"."""
    best = min(values.values())
    return ", ".join(name for name, value in values.items() if value <= best * (1 + within))


def require_extra() -> None:
    """The peers are an optional extra: say how to install it."""
    try:
        for module in PEER_MODULES:
            importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(EXTRA) from error


def release_django_connections() -> None:
    """Closes this thread's Django connection, the timeline and capture
    writers' ones and the process's pool: Rundesk's blocks open their own,
    so the server has counted everything of theirs once they have exited
    (a pooled connection's backend would live on, and report its counts
    only after ten idle seconds)."""
    timeline.flush()
    timeline.stop()
    capture.flush()
    capture.stop()
    connection.close()
    connection.close_pool()


# -- the server: databases, the bare commit, the counters -----------------------


def connection_params(database: str) -> dict[str, Any]:
    """libpq parameters of `database` on the server of Django's database."""
    keywords = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params = {
        key: value
        for key, value in connection.get_connection_params().items()
        if key in keywords and value not in (None, "")
    }
    return {**params, "dbname": database, "application_name": APPLICATION}


URL_PARTS = ("user", "password", "host", "port", "dbname")  # the rest goes in the query


def sqlalchemy_url(database: str) -> str:
    """A database of the server of Django's as a URL, for SQLAlchemy (DBOS)."""
    from sqlalchemy.engine import URL

    params = connection_params(database)
    host = str(params.pop("host", "")) or None
    query = {key: str(value) for key, value in params.items() if key not in URL_PARTS}
    if host and host.startswith("/"):  # a socket directory
        host, query["host"] = None, host
    return URL.create(
        "postgresql",
        username=params.get("user"),
        password=params.get("password"),
        host=host,
        port=int(params["port"]) if params.get("port") else None,
        database=params["dbname"],
        query=query,
    ).render_as_string(hide_password=False)


class PeerServer:
    """The bench's databases (peer_databases): how to reach them, the
    observer of the server's counters and the bare commit."""

    def __init__(self, started: dt.datetime) -> None:
        self.started = started  # backends started since then are the bench's

    def conninfo(self, name: str) -> str:
        return make_conninfo(**connection_params(BENCH_DATABASES[name]))

    def url(self, name: str) -> str:
        return sqlalchemy_url(BENCH_DATABASES[name])

    @contextlib.contextmanager
    def observer(self) -> Iterator[Observer]:
        databases = [*BENCH_DATABASES.values(), connection.settings_dict["NAME"]]
        with psycopg.connect(self.conninfo("commit"), autocommit=True) as observing:
            yield Observer(observing, self.started, databases)

    @contextlib.contextmanager
    def bare_commit(self) -> Iterator[BareCommit]:
        """The bare commit, on a new connection, closed on leaving."""
        with psycopg.connect(self.conninfo("commit"), autocommit=True) as committing:
            yield BareCommit(committing)

    def versions(self) -> dict[str, Any]:
        with psycopg.connect(self.conninfo("commit"), autocommit=True) as conn:
            setting = "SELECT current_setting(%s)"
            server = {
                "postgresql": conn.execute(setting, ("server_version",)).fetchone()[0],
                "wal_sync_method": conn.execute(setting, ("wal_sync_method",)).fetchone()[0],
                "synchronous_commit": conn.execute(setting, ("synchronous_commit",)).fetchone()[0],
            }
        return {
            "versions": {package: metadata.version(package) for package in PEER_PACKAGES},
            "server": server,
        }


@contextlib.contextmanager
def peer_databases() -> Iterator[PeerServer]:
    """The bench's databases on the server of Django's database, new (a
    bench that died may have left them), dropped on leaving."""
    admin_params = connection_params(connection.settings_dict["NAME"])

    def drop_all(admin: psycopg.Connection[Any]) -> None:
        for name in BENCH_DATABASES.values():
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    try:
        with psycopg.connect(**admin_params, autocommit=True) as admin:
            started = admin.execute(
                "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()[0]
            drop_all(admin)
            for name in BENCH_DATABASES.values():
                # template0: a session left on template1 cannot fail the bench.
                admin.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name))
                )
        with psycopg.connect(
            **connection_params(BENCH_DATABASES["commit"]), autocommit=True
        ) as commit:
            commit.execute(
                "CREATE TABLE bench_commit"
                " (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
            )
        yield PeerServer(started)
    finally:
        with psycopg.connect(**admin_params, autocommit=True) as admin:
            drop_all(admin)


class BareCommit:
    """A single-row INSERT + COMMIT on a logged table, timed (ms) into
    `samples`."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.samples: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self.conn.execute("INSERT INTO bench_commit DEFAULT VALUES")
        self.samples.append((time.perf_counter() - start) * 1000)


@dataclass
class Tally:
    """What the server counted over a block: committed transactions of one
    database, WAL fsyncs of the whole server, and the block's length (s),
    from the first reading of the counters to the second."""

    commits: int = 0
    wal_syncs: int = 0
    seconds: float = 0.0


class Observer:
    """Reads the server's counters, from a connection of its own in a
    database no peer uses (its reads are counted there, and write no WAL)."""

    def __init__(
        self, conn: psycopg.Connection[Any], since: dt.datetime, databases: list[str]
    ) -> None:
        self.conn = conn
        self.since = since  # backends started since then are the bench's
        self.databases = databases  # the bench's

    def settle(self) -> bool:
        """Waits until every backend the bench opened has exited, and so
        handed its counts to the server.  False when some are still there
        after SETTLE_SECONDS.  A backend is the bench's when it connected to
        one of its databases since the bench started: another process that
        connects to Django's database meanwhile makes the bench wait."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s)"
            " AND backend_start >= %s AND pid <> pg_backend_pid()",
            (self.databases, self.since),
        ).fetchone()[0]:
            if time.monotonic() > deadline:
                logger.warning("bench --peers: some backends did not exit: counts may be short")
                return False
            time.sleep(0.01)
        return True

    def count(self, database: str | None, block: Callable[..., object], *args: Any) -> Tally:
        """What the server counted while `block(*args)` ran (committed
        transactions of `database` -- None: the observer's own, for an idle
        block -- and the server's WAL fsyncs), from when
        every backend the bench opened before it has exited to when every
        one it opened has."""
        self.settle()
        before = ServerCounts.read(self.conn, database)
        start = time.perf_counter()
        block(*args)
        self.settle()
        used = ServerCounts.read(self.conn, database) - before
        return Tally(used.commits, used.wal_syncs, time.perf_counter() - start)


# -- the peers -------------------------------------------------------------------


class Peer(Protocol):
    name: str
    database: str  # whose committed transactions count
    guarantee: str

    def prepare(self) -> None:
        """Makes its schema, outside every block."""

    def block(self, steps: int, between: Between | None) -> list[float]:
        """`steps` no-op steps in a new workflow, graph thread or run, each
        followed by `between()`; each step's time (ms).  Every connection
        the block opens is closed when it returns."""


class Dbos:
    """DBOS: no-op steps called from one workflow, in the caller's thread,
    configured as shipped.  A step is two transactions (its checkpoint
    looked up, then written), and its pool pings each connection it hands
    out (pool_pre_ping), a transaction each: four commits, one durable."""

    name = "dbos"
    guarantee = GUARANTEES["dbos"]

    def __init__(self, server: PeerServer) -> None:
        self.database = BENCH_DATABASES["dbos"]
        self.url = server.url("dbos")

    def prepare(self) -> None:
        """DBOS makes its schema at its first launch (the warm-up's)."""

    def block(self, steps: int, between: Between | None) -> list[float]:
        from dbos import DBOS

        workflow = dbos_workflow()
        DBOS(
            config={
                "name": "rundesk-bench-peers",
                "system_database_url": self.url,
                "log_level": "WARNING",
            }
        )
        try:
            DBOS.launch()
            return workflow(steps, between)
        finally:
            # Stops its threads and closes its connections: the process can exit.
            DBOS.destroy()


@functools.cache
def dbos_workflow() -> Callable[[int, Between | None], list[float]]:
    """The DBOS workflow and step, registered once per process.  DBOS keeps
    a workflow's inputs and output: what is only the bench's (the callable,
    the times) goes around it."""
    from dbos import DBOS

    bench: dict[str, Any] = {}

    @DBOS.step()
    def rundesk_bench_noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def rundesk_bench_steps(steps: int) -> None:
        samples, between = bench["samples"], bench["between"]
        for i in range(steps):
            start = time.perf_counter()
            rundesk_bench_noop(i)
            samples.append((time.perf_counter() - start) * 1000)
            if between is not None:
                between()

    def run(steps: int, between: Between | None) -> list[float]:
        bench.update(samples=[], between=between)
        rundesk_bench_steps(steps)
        return bench["samples"]

    return run


class Count(TypedDict):
    i: int


class LangGraph:
    """LangGraph: one node that loops on itself, one no-op per superstep,
    each superstep checkpointed before the next (durability="sync").  A
    step's time runs from one node's return to the next node's start: the
    superstep's writes, its checkpoint, the next superstep's planning."""

    name = "langgraph"
    guarantee = GUARANTEES["langgraph"]

    def __init__(self, server: PeerServer) -> None:
        self.database = BENCH_DATABASES["langgraph"]
        self.conninfo = server.conninfo("langgraph")

    def prepare(self) -> None:
        from langgraph.checkpoint.postgres import PostgresSaver

        with PostgresSaver.from_conn_string(self.conninfo) as saver:
            saver.setup()

    def block(self, steps: int, between: Between | None) -> list[float]:
        from langgraph.checkpoint.postgres import PostgresSaver
        from langgraph.graph import END, START, StateGraph

        marks: list[tuple[float, float]] = []  # each node's start and return

        def noop(state: Count) -> dict[str, int]:
            started = time.perf_counter()
            if between is not None:
                between()
            marks.append((started, time.perf_counter()))
            return {"i": state["i"] + 1}

        def again(state: Count) -> str:
            return "noop" if state["i"] < steps else END

        builder = StateGraph(Count)
        builder.add_node("noop", noop)
        builder.add_edge(START, "noop")
        builder.add_conditional_edges("noop", again, ["noop", END])
        with PostgresSaver.from_conn_string(self.conninfo) as saver:
            builder.compile(checkpointer=saver).invoke(
                {"i": 0},
                {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": steps + 10},
                durability="sync",
            )
        return [
            (started - returned) * 1000 for (_, returned), (started, _) in itertools.pairwise(marks)
        ]


class Rundesk:
    """Rundesk: the run's no-op reads through the real executor path, in
    Django's database."""

    name = "rundesk"
    guarantee = GUARANTEES["rundesk"]

    def __init__(self) -> None:
        self.database = connection.settings_dict["NAME"]

    def prepare(self) -> None:
        """Django's migrations made its schema."""

    def block(self, steps: int, between: Between | None) -> list[float]:
        samples = []
        try:
            with noop_run(steps) as dispatcher:
                for i in range(steps):
                    start = time.perf_counter()
                    noop_step(dispatcher, i)
                    samples.append((time.perf_counter() - start) * 1000)
                    if between is not None:
                        between()
        finally:
            release_django_connections()
        return samples
