"""The processes benchmarks start (executors, Celery workers): each in a
process group of its own, so a kill takes its children too (a worker's
pool, an embedded beat), its output (stdout and stderr) in a log file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from django.conf import settings


class GroupProcess:
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
