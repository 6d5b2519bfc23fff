"""What the drills' lab and the tests use to stage work on real processes
and read back what happened: waiting for a condition, this database as a
URL another process can use, the tool journal, process groups, and the
evidence tables.  (Runs never import tests: the tests import this.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from django.conf import settings
from django.db import connection

# The longest a wait lasts unless told: a condition that holds at all holds
# in seconds, and a loaded machine (a suite on two cores) may take ten.
WAIT_SECONDS = 60.0


def wait_for(
    condition: Callable[[], object],
    what: str = "the condition",
    timeout: float = WAIT_SECONDS,
    *,
    watching: Iterable[Callable[[], object]] = (),
) -> None:
    """Polls `condition` every 50 ms until it holds: TimeoutError after
    `timeout` seconds.  Each of `watching` is called between polls, to fail
    at once when what the condition waits on has died (it raises)."""
    watching = list(watching)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        for check in watching:
            check()
        time.sleep(0.05)


def database_url() -> str:
    """This process's database, as a URL another process can use."""
    db = connection.settings_dict
    host = db.get("HOST") or db.get("OPTIONS", {}).get("host", "")
    port = db.get("PORT") or 5432
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    if not host or host.startswith("/"):
        socket_dir = f"?host={host}" if host else ""
        return f"postgresql://{user}{password}@/{db['NAME']}{socket_dir}"
    return f"postgresql://{user}{password}@{host}:{port}/{db['NAME']}"


class Journal:
    """The tool journal (RUNDESK_TOOL_JOURNAL): one line per real tool
    execution, written outside the database.  Counting lines counts
    executions."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def counts(self, tool: str | None = None) -> Counter[str]:
        """Executions per action identity (of `tool` only, if given)."""
        return Counter(e["identity"] for e in self.entries() if tool in (None, e["tool"]))


class GroupProcess:
    """A process (an executor, a Celery worker) in a process group of its
    own, so a kill takes its children too (a worker's pool, an embedded
    beat), its output (stdout and stderr) in a log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("w")
        self.process = subprocess.Popen(
            argv,
            cwd=settings.BASE_DIR,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def exited(self) -> bool:
        return self.process.poll() is not None

    def wait(self, timeout: float) -> int:
        """Its exit status, once it exits by itself (TimeoutExpired after
        `timeout` seconds)."""
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL to the whole group, and waits for it."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # a child left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        self._out.close()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a warm shutdown), then what is left is killed."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        self.kill()


def evidence_tables() -> list[str]:
    """The evidence app's tables in this database (what locking "all of
    evidence" locks)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            " AND tablename LIKE 'evidence\\_%%' ORDER BY tablename"
        )
        return [name for (name,) in cursor.fetchall()]
