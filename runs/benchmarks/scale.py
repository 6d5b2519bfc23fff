"""`bench --scale`: runs per second with 1, 2 and 4 Celery worker processes.

Each measurement starts N `celery worker` nodes of one pool process each
(prefork, as production runs them: N machines of one process), waits until
they are ready, warms them with a few runs, then sends a batch of 100 runs
and times from the first task sent until the last run has completed.  The runs read
one document each with the offline provider and no tool delay: what is
measured is the runtime (claims, fenced writes, receipts, checkpoints,
publication, delivery) and the broker, not a model.

The runs go to a database of their own (`rundesk_bench_scale` on the same
server, made if missing), so a benchmark leaves the dashboard's runs alone,
and the tasks to a queue of their own on the broker (`Broker`), removed
afterwards.  The filesystem broker by default; `--broker URL` for Redis
(redis://) or RabbitMQ (amqp://).

The tests start their worker processes through `Broker` and `CeleryWorker`
too (tests/processes.py, tests/test_scale.py).

Why prefork: measured here, the solo pool on RabbitMQ often receives the
next task only when Celery's event loop wakes by itself, 10 s later (about
one run a second on one worker); and a prefork or threads pool on the
filesystem broker polls its folder once a second (kombu's default
`polling_interval`): one run a second per worker, so this queue is polled
every 50 ms.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection, transaction
from kombu import Connection, Exchange, Queue

from runs import submission
from runs.benchmarks.pages import bench_database
from runs.harness import GroupProcess
from runs.models import Run, RunStatus
from runs.tasks import execute_run
from runs.timeline import timeline

FILESYSTEM = "filesystem://"
WORKER_COUNTS = (1, 2, 4)
BATCH = 100
DATABASE = "rundesk_bench_scale"
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "pyamqp": 5672, "amqps": 5671}

# A worker process configured for one broker and queue: `celery -A
# dashboard worker`, with the Celery settings given as JSON applied over
# the project's (settings.py reads no queue name or transport options
# from the environment).
BOOT = """import json, sys
from dashboard.celery import app
app.conf.update(json.loads(sys.argv[1]))
app.worker_main(sys.argv[2:])
"""


@dataclass(frozen=True)
class Broker:
    """A broker and a queue of one's own on it: nothing else that uses the
    broker (another test session, another benchmark, production) sees its
    tasks, and `remove()` deletes only what it left there."""

    url: str
    queue: str
    transport_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def own(cls, url: str, folder: Path, *, visibility_timeout: float | None = None) -> Broker:
        """A new queue on the broker at `url`.  The filesystem broker keeps
        its messages under `folder`, looked at every 50 ms.  On Redis every key of this queue
        carries its name as a prefix: the hash of unacknowledged messages
        is per prefix, so the broker gives back only this queue's messages,
        after `visibility_timeout` seconds when one is given (kombu looks
        every second then, instead of every 100)."""
        queue = f"rundesk-{uuid.uuid4().hex[:12]}"
        options: dict[str, Any] = {}
        if url == FILESYSTEM:
            folder.mkdir(parents=True, exist_ok=True)
            options = {
                "data_folder_in": str(folder),
                "data_folder_out": str(folder),
                "control_folder": str(folder),
                "store_processed": False,
                "polling_interval": 0.05,
            }
        elif cls.scheme_of(url).startswith("redis"):
            options = {"global_keyprefix": f"{queue}:"}
            if visibility_timeout is not None:
                options |= {
                    "visibility_timeout": visibility_timeout,
                    "unacked_restore_interval": 1,
                    "unacked_restore_throttle": 1,
                }
        return cls(url, queue, options)

    @staticmethod
    def scheme_of(url: str) -> str:
        return url.split("://", 1)[0]

    @property
    def name(self) -> str:
        return {"redis": "redis", "amqp": "rabbitmq", "pyamqp": "rabbitmq"}.get(
            self.scheme_of(self.url), self.scheme_of(self.url)
        )

    @property
    def gives_back_lost_consumers_messages(self) -> bool:
        """Does a message come back when the process that received it dies
        before acknowledging it?  RabbitMQ: when its connection closes;
        Redis: after the visibility timeout.  The filesystem broker has no
        acknowledgements: the message is gone with its consumer (beat's
        sweep requeues the run, runs/sweep.py)."""
        return self.url != FILESYSTEM

    @staticmethod
    def unreachable(url: str, timeout: float = 1.0) -> str:
        """Why the broker at `url` does not answer (its TCP port refuses or
        times out); "" when it does, or when it is the filesystem."""
        if url == FILESYSTEM:
            return ""
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        port = parts.port or DEFAULT_PORTS.get(parts.scheme, 0)
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return ""
        except OSError as error:
            return f"{host}:{port}: {error}"

    def celery_settings(self) -> dict[str, Any]:
        """Celery settings of a worker that consumes this queue.  Its
        default queue is this one, so what it sends itself (a retry, beat's
        sweep) comes back here; no remote control, so no broadcast queue
        is left behind."""
        return {
            "broker_url": self.url,
            "broker_transport_options": self.transport_options,
            "task_default_queue": self.queue,
            "worker_enable_remote_control": False,
        }

    def connection(self) -> Connection:
        return Connection(self.url, transport_options=self.transport_options)

    def send(self, run_ids: Sequence[int]) -> list[str]:
        """An `execute_run` task per run, on this queue (declared with
        the first).  Returns the task ids."""
        queue = Queue(self.queue, Exchange(self.queue, "direct"), routing_key=self.queue)
        with self.connection() as conn:
            return [
                execute_run.apply_async((run_id,), connection=conn, queue=queue).id
                for run_id in run_ids
            ]

    def remove(self) -> None:
        """Deletes what this queue left on the broker: on Redis its keys (the
        queue, its bindings, its unacknowledged messages), on RabbitMQ the
        queue and its exchange.  The filesystem's folder is the caller's."""
        scheme = self.scheme_of(self.url)
        if scheme.startswith("redis"):
            import redis

            client = redis.Redis.from_url(self.url)
            try:
                keys = list(client.scan_iter(match=f"{self.queue}:*", count=1000))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()
        elif scheme in ("amqp", "pyamqp", "amqps"):
            with self.connection() as conn:
                channel = conn.default_channel
                channel.queue_delete(self.queue)
                channel.exchange_delete(self.queue)


class CeleryWorker(GroupProcess):
    """A `celery worker` process for `broker` (the project's settings when
    None), in a process group of its own (a kill takes its pool and an
    embedded beat too), its output in `log`."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        broker: Broker | None = None,
        beat: bool = False,
        pool: str = "solo",
        concurrency: int = 1,
        name: str = "worker",
    ) -> None:
        super().__init__(
            [
                sys.executable,
                "-c",
                BOOT,
                json.dumps(broker.celery_settings() if broker else {}),
                "worker",
                "--pool",
                pool,
                "--concurrency",
                str(concurrency),
                "--hostname",
                f"{name}-{uuid.uuid4().hex[:6]}@%h",
                "--loglevel",
                "info",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                *(["--beat"] if beat else []),
            ],
            env,
            log,
        )

    def ready(self) -> bool:
        return " ready." in self.output()


def report(broker_url: str = FILESYSTEM) -> dict[str, Any]:
    """Runs/s with 1, 2 and 4 worker processes on the broker at
    `broker_url`, each count measured with workers of its own."""
    if reason := Broker.unreachable(broker_url):
        raise RuntimeError(f"the broker does not answer: {reason}")
    with (
        tempfile.TemporaryDirectory(prefix="rundesk-bench-scale-") as folder,
        bench_database(DATABASE),
    ):
        broker = Broker.own(broker_url, Path(folder) / "broker")
        try:
            measured = [measure(broker, n, BATCH, Path(folder) / str(n)) for n in WORKER_COUNTS]
        finally:
            broker.remove()
    one = measured[0]["runs_per_s"]
    return {
        "broker": broker.name,
        "batch": BATCH,
        "documents_per_run": 1,
        "runs_per_s": {str(m["workers"]): m["runs_per_s"] for m in measured},
        "speedup": {str(m["workers"]): round(m["runs_per_s"] / one, 2) for m in measured},
        "measured": measured,
        "cpus": os.cpu_count(),
    }


def measure(broker: Broker, workers: int, runs: int, folder: Path) -> dict[str, Any]:
    """Starts `workers` worker processes on the database Django uses now,
    warms them, and times a batch of `runs` runs through them."""
    folder.mkdir(parents=True, exist_ok=True)
    env = worker_env(folder)
    fleet = [
        CeleryWorker(
            env, folder / f"worker-{i}.log", broker=broker, pool="prefork", name=f"bench-{i}"
        )
        for i in range(workers)
    ]
    try:
        wait(lambda: all(w.ready() for w in fleet), fleet, 120, "workers not ready")
        # First runs pay for imports, connections, prepared statements.
        drain(broker, submit(2 * workers, "warm-up"), fleet)
        batch = submit(runs, "batch")
        start = time.perf_counter()
        drain(broker, batch, fleet)
        seconds = time.perf_counter() - start
    finally:
        for worker in fleet:
            worker.stop()
    return {
        "workers": workers,
        "runs": runs,
        "seconds": round(seconds, 2),
        "runs_per_s": round(runs / seconds, 1),
    }


def worker_env(folder: Path) -> dict[str, str]:
    """The environment of a benchmark's worker process: the database
    Django uses now, the offline provider, files under `folder`."""
    database = connection_url()
    return {
        **os.environ,
        "DATABASE_URL": database,
        "RUNDESK_VAR_DIR": str(folder / "var"),
        "RUNDESK_OUTBOX_DIR": str(folder / "outbox"),
        "RUNDESK_TOOL_JOURNAL": "",
        "RUNDESK_MODEL_PROVIDER": "offline",
        "RUNDESK_CORPUS_DIR": str(settings.RUNDESK_CORPUS_DIR),
        "RUNDESK_ROLE": "worker",
        "RUNDESK_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }


def connection_url() -> str:
    """settings.DATABASE_URL, naming the database Django's connection uses
    now (bench_database switches it)."""
    return (
        urlsplit(settings.DATABASE_URL)
        ._replace(path="/" + connection.settings_dict["NAME"])
        .geturl()
    )


def submit(count: int, what: str) -> list[int]:
    document = "northwind-clean-energy.md"
    with transaction.atomic():
        run_ids = [
            submission.submit(question=f"bench --scale: {what} {i}", documents=[document]).pk
            for i in range(count)
        ]
    return run_ids


def drain(broker: Broker, run_ids: list[int], fleet: list[CeleryWorker]) -> None:
    """Sends a task per run and waits until every run has completed."""
    broker.send(run_ids)
    runs = Run.objects.filter(pk__in=run_ids)
    active = runs.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING])
    wait(lambda: not active.exists(), fleet, 600, f"{len(run_ids)} runs")
    if ended := list(runs.exclude(status=RunStatus.COMPLETED).values_list("pk", "status")):
        raise RuntimeError(f"runs that did not complete: {ended}")
    timeline.flush()


def wait(condition: Any, fleet: list[CeleryWorker], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if exited := [w for w in fleet if w.exited()]:
            raise RuntimeError(f"a worker exited: {exited[0].output()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done in {timeout} s")
        time.sleep(0.02)
