from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db import connection

from evidence.capture import capture
from runs.timeline import timeline

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _stop_timeline(django_db_setup: None, django_db_blocker: object) -> Iterator[None]:
    """The timeline and capture threads hold connections to the test
    database: close them before the database is dropped."""
    yield
    timeline.stop()
    capture.stop()


@pytest.fixture(autouse=True)
def _timeline_written() -> Iterator[None]:
    """Each test's events and capture gaps are written before the next test
    starts (the next one may not be allowed to touch the database)."""
    yield
    timeline.flush()
    capture.flush()


@pytest.fixture
def short_settle(settings: object) -> None:
    """Unanswered writes are asked about for 1.5 s, not the default 5."""
    settings.RUNDESK_SETTLE_SECONDS = 1.5


class Journal:
    """The tool journal: one line per real tool execution, written outside
    the database.  Counting lines counts executions."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def counts(self, tool: str | None = None) -> Counter[str]:
        return Counter(e["identity"] for e in self.entries() if tool in (None, e["tool"]))


@pytest.fixture
def journal(tmp_path: Path, settings: object) -> Journal:
    path = tmp_path / "tool-journal.jsonl"
    settings.RUNDESK_TOOL_JOURNAL = str(path)
    return Journal(path)


@pytest.fixture(autouse=True)
def _outbox(tmp_path: Path, settings: object) -> Path:
    settings.RUNDESK_OUTBOX_DIR = tmp_path / "outbox"
    return settings.RUNDESK_OUTBOX_DIR


def database_url() -> str:
    """The test database, as a URL other processes can use."""
    db = connection.settings_dict
    host = db.get("HOST") or db.get("OPTIONS", {}).get("host", "")
    user = db.get("USER") or "postgres"
    if host.startswith("/"):
        return f"postgresql://{user}@/{db['NAME']}?host={host}"
    return f"postgresql://{user}@{host}:{db.get('PORT') or 5432}/{db['NAME']}"


@pytest.fixture
def process_env(tmp_path: Path, journal: Journal) -> dict[str, str]:
    """Environment for a real executor or worker process on the test database."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DEBUG": "1",
        "RUNDESK_VAR_DIR": str(tmp_path / "var"),
        "RUNDESK_TOOL_JOURNAL": str(journal.path),
        "RUNDESK_OUTBOX_DIR": str(tmp_path / "outbox"),
        "RUNDESK_CORPUS_DIR": str(django_settings.RUNDESK_CORPUS_DIR),
        "RUNDESK_LEASE_SECONDS": "2",
        "RUNDESK_POLL_SECONDS": "0.2",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def manage(*args: str, env: dict[str, str], **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
