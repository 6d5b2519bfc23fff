from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import global_settings
from django.conf import settings as django_settings
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.test import Client

from evidence.capture import capture
from runs.timeline import timeline

ROOT = Path(__file__).resolve().parent.parent

# Production's password hash costs 0.6 s a user, and most tests make one: the
# tests hash with MD5 first, and keep production's hashers after it, so a
# password made for a production process (tests/test_production.py) is
# still made, and checked, the production way.
django_settings.PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    *global_settings.PASSWORD_HASHERS,
]


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


@pytest.fixture(autouse=True)
def _no_write_left_in_flight(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fault plan's late write (outcome "late") stays in flight for its
    stall_ms, and may outlive the test that saw what it needed of it: its
    backend then holds its locks while the tables are emptied for the next
    test, and the two deadlock.  Up to 30 s, it is waited for."""
    yield
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        return  # a test in a transaction: its tables are rolled back, not emptied
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event = 'PgSleep' AND pid <> pg_backend_pid())"
            )
            if not cursor.fetchone()[0]:
                return
        time.sleep(0.05)


@pytest.fixture
def short_settle(settings: object) -> None:
    """Unanswered writes are asked about for 1.5 s, not the default 5."""
    settings.RUNDESK_SETTLE_SECONDS = 1.5


# -- who is signed in ------------------------------------------------------------

PASSWORD = "a-long-password-1"


def make_user(name: str, *, operator: bool = False) -> User:
    """A user of the viewers group, or of the operators group (which has the
    operator permission, runs.operate_run), as migration 0005 makes them;
    transactional tests empty the tables between tests, so made again here."""
    group, _ = Group.objects.get_or_create(name="operators" if operator else "viewers")
    if operator:
        group.permissions.add(Permission.objects.get(codename="operate_run"))
    user = User.objects.create_user(name, password=PASSWORD)
    user.groups.add(group)
    return User.objects.get(pk=user.pk)  # permissions are cached per instance


def signed_in(user: User, **client_options: object) -> Client:
    """A test client signed in as `user`."""
    client = Client(**client_options)
    client.force_login(user)
    return client


@pytest.fixture
def operator_name() -> str:
    """The operator's user name: a module whose pages name the operator
    overrides this fixture."""
    return "operator"


@pytest.fixture
def operator_user(operator_name: str) -> User:
    """A user with the operator permission."""
    return make_user(operator_name, operator=True)


@pytest.fixture
def operator(operator_user: User) -> Client:
    """A client signed in as the operator."""
    return signed_in(operator_user)


@pytest.fixture
def viewer() -> Client:
    """A client signed in as a viewer: reads every page, decides nothing."""
    return signed_in(make_user("viewer"))


@pytest.fixture
def staff() -> Client:
    """A client signed in as a superuser, for the admin."""
    return signed_in(User.objects.create_superuser("admin", password=PASSWORD))


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


# The decision table's and resume's tests look for a checkpoint after the
# actions they break or resume from: here one is due after every action
# (the production cadence, every 100 steps or 0.5 s, has its own tests in
# test_checkpoints.py and test_one_commit_per_step.py, and is what bench
# measures).
CHECKPOINT_EVERY = 1


@pytest.fixture(autouse=True)
def _checkpoint_every_action(settings: object) -> None:
    settings.RUNDESK_CHECKPOINT_EVERY = CHECKPOINT_EVERY


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
        "RUNDESK_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY),
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
