from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import Group, Permission, User
from django.contrib.staticfiles.storage import ManifestFilesMixin, staticfiles_storage
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from runs.agents.receivers import Helpdesk, Mailbox
from runs.approvals import APPROVERS
from runs.models import Run
from runs.submission import submit
from runs.tasks import execute_run

SAMPLE_RUNS: list[dict[str, Any]] = [
    {
        "question": "Which of these funds is cheapest to hold, and what do I give up for it?",
        "documents": [
            "crestline-short-treasury.md",
            "meridian-world-equity.md",
            "harborlight-global-dividend.md",
        ],
    },
    {
        "question": "Compare the growth funds' fees, holdings and risks.",
        "documents": [
            "northwind-clean-energy.md",
            "meridian-world-equity.md",
            "sable-frontier-markets.md",
        ],
        # Slow enough to follow live in the browser.
        "faults": [{"point": "tool_delay", "ms": 1500}],
    },
    {
        "question": "Compare all five funds, within a small action budget.",
        "documents": sorted(
            p.name for p in Path(settings.RUNDESK_CORPUS_DIR).glob("*.md") if p.name != "README.md"
        ),
        "action_budget": 7,
    },
    {
        # A path out of the corpus is refused at submission; one that names
        # no file there yet is taken, and its read is refused.
        "question": "Compare these funds (one of them is not in the corpus).",
        "documents": ["harborlight-global-dividend.md", "orion-frontier-income.md"],
    },
]

# One run for each row of the decision table (docs/DESIGN.md), and an effect
# whose answer is lost.  Their fault plans (runs/faults.py) make each happen
# on the real code path; their questions say what to look for.
TWO_FUNDS = ["crestline-short-treasury.md", "meridian-world-equity.md"]
DECISION_TABLE_RUNS: list[tuple[str, list[dict[str, Any]]]] = [
    (
        "Row 1: the checkpoint after read 1 fails before write; the receipt verifies, so "
        "research goes on in the same phase.",
        [{"point": "checkpoint_serialize_error", "action": 1}],
    ),
    (
        "Row 2: the checkpoint after action 2 gets no answer to its COMMIT, which had "
        "committed: adopted by its xid.",
        [{"point": "drop_connection_at_commit", "write": "checkpoint", "action": 2}],
    ),
    (
        "Row 2: the checkpoint after action 2 gets no answer to its COMMIT, which never "
        "happened: known not written, not written again.",
        [
            {
                "point": "drop_connection_at_commit",
                "write": "checkpoint",
                "action": 2,
                "outcome": "aborted",
            }
        ],
    ),
    (
        "Row 2: the checkpoint after action 2 is still in flight when the runtime stops "
        "asking: left unknown for an operator, until the sweep settles it.",
        [
            {
                "point": "drop_connection_at_commit",
                "write": "checkpoint",
                "action": 2,
                "outcome": "late",
                "stall_ms": 8_000,
            }
        ],
    ),
    (
        "Row 3: the lease is lost before read 2: the old owner stops; a new owner resumes "
        "from the checkpoint and the receipts.",
        [{"point": "lease_stolen", "action": 3}],
    ),
    (
        "Row 3: cancelled before read 2: nothing new is dispatched.",
        [{"point": "cancel", "action": 3}],
    ),
    (
        "An effect: the report is delivered but the answer is lost. Only the receiver "
        "knows, so it waits for an operator.",
        [{"point": "delivery_timeout"}],
    ),
]


# The support agent's runs, with real effects: a mail through the demo's SMTP
# server and a ticket update in its helpdesk (support_receivers), each seen
# there.  One loses its mail's answer (the fault plan): only "it happened"
# or "it did not" settles it.  Another's update is kept by the helpdesk,
# which loses its answer (HELPDESK_LOSES): sent again under its key, it is
# kept once.
HELPDESK_LOSES = "T-1044"
SUPPORT_RUNS: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
    ({"ticket": "T-1042"}, []),
    ({"ticket": "T-1043"}, [{"point": "delivery_timeout"}]),
    ({"ticket": HELPDESK_LOSES, "articles": ["subscriptions.md", "refunds.md"]}, []),
    ({"ticket": "T-1045"}, [{"point": "tool_delay", "ms": 1500}]),
]


# A run of the support agent whose replies a person approves
# (support-approved): its reply waits in the inbox, the email shown, for the
# demo's operator, who is an approver too, to approve, edit or reject.
APPROVAL_RUN: dict[str, Any] = {"ticket": "T-1042", "articles": ["refunds.md"]}


def support_receivers(var: Path, smtp_url: str, helpdesk_url: str) -> tuple[Mailbox, Helpdesk]:
    """The demo's SMTP server and helpdesk, at the addresses the support
    agent sends to, keeping what they receive under `var`."""
    smtp, helpdesk = urllib.parse.urlsplit(smtp_url), urllib.parse.urlsplit(helpdesk_url)
    return (
        Mailbox(var / "mailbox", smtp.hostname or "", smtp.port or 25),
        Helpdesk(
            var / "helpdesk",
            helpdesk.hostname or "",
            helpdesk.port or 80,
            lose_answers_for={HELPDESK_LOSES},
        ),
    )


def operator_account(password: str) -> User:
    """The demo's `operator`, signing in with `password`: an operator, and
    an approver too (the demo's approval waits for one)."""
    with transaction.atomic():
        operators, _ = Group.objects.get_or_create(name="operators")
        operators.permissions.add(Permission.objects.get(codename="operate_run"))
        approvers, _ = Group.objects.get_or_create(name=APPROVERS)
        approvers.permissions.add(Permission.objects.get(codename="approve_action"))
        user, _ = User.objects.get_or_create(username="operator")
        user.is_staff = True
        user.set_password(password)
        user.save()
        user.groups.add(operators, approvers)
    return user


def web_server(port: int) -> list[str]:
    """The web tier as production runs it: gunicorn (dashboard/gunicorn.py)
    on this port of the loopback interface, static files from WhiteNoise."""
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "--config",
        str(settings.BASE_DIR / "dashboard" / "gunicorn.py"),
        "--bind",
        f"127.0.0.1:{port}",
        "--log-level",
        "warning",
    ]


def site_environment(port: int) -> dict[str, str]:
    """What the web server needs to answer at http://127.0.0.1:PORT/ and
    http://localhost:PORT/ with DEBUG off."""
    return {
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "CSRF_TRUSTED_ORIGINS": f"http://127.0.0.1:{port},http://localhost:{port}",
    }


class Command(BaseCommand):
    help = (
        "Brings up the demo as production runs: migrates, collects the static files if they "
        "are not, creates an operator account, seeds sample runs, starts the web server "
        "(gunicorn), an executor and a Celery worker with beat; Ctrl-C stops them all."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM stops the demo like Ctrl-C: children first, then the
        # embedded database (pgserver stops it when this process exits).
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        port = options["port"]
        call_command("migrate", verbosity=0)
        self._collect_static()
        password = self._operator_account()
        with ExitStack() as receivers:
            mailbox, helpdesk = self._receivers(receivers)
            self._seed()
            self._serve(port, password, mailbox, helpdesk)

    def _serve(self, port: int, password: str, mailbox: Mailbox, helpdesk: Helpdesk) -> None:
        env = {"DATABASE_URL": settings.DATABASE_URL, **site_environment(port)}
        manage = [sys.executable, str(settings.BASE_DIR / "manage.py")]
        children = [
            self._start("web", web_server(port), env),
            self._start("executor", [*manage, "executor", "--concurrency", "2"], env),
            self._start(
                "worker",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "dashboard",
                    "worker",
                    "--beat",  # the sweep (runs/sweep.py) every RUNDESK_SWEEP_SECONDS
                    "--concurrency",
                    "1",
                    "--loglevel",
                    "warning",
                ],
                env,
            ),
        ]
        debug = "on: development pages" if settings.DEBUG else "off, as in production"
        self.stdout.write(
            self.style.SUCCESS(
                f"\nRundesk demo: http://127.0.0.1:{port}/  (gunicorn, DEBUG {debug})\n"
                f"  sign in as  operator / {password}\n"
                f"  the support agent's mail: {mailbox.folder}/*.eml  ({mailbox.url})\n"
                f"  its ticket updates:       {helpdesk.url}\n"
                "  operator is also an approver: a support-approved reply waits for approval "
                "in the inbox\n"
                # The demo runs without DEBUG; a command beside it, with.
                "  hold a tool: the Holds page, or  DEBUG=1 .venv/bin/python manage.py holds add "
                "--tool send_email --reason '...' --as operator\n"
                "  Ctrl-C stops the web server, the executor, the worker, the receivers and "
                "the database.\n"
            )
        )
        try:
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            self.stderr.write("demo: a process stopped; stopping the others")
        except KeyboardInterrupt:
            self.stdout.write("\ndemo: stopping")
        finally:
            self._stop(children)

    def _collect_static(self) -> None:
        """Without DEBUG, pages name the static files by the manifest
        collectstatic writes (`make demo` keeps it current); with none, every
        page would fail."""
        if isinstance(staticfiles_storage, ManifestFilesMixin) and not staticfiles_storage.exists(
            staticfiles_storage.manifest_name
        ):
            self.stdout.write("demo: collecting the static files")
            call_command("collectstatic", interactive=False, verbosity=0)

    def _operator_account(self) -> str:
        """The operator account, with a fresh password printed at each start."""
        password = secrets.token_urlsafe(12)
        operator_account(password)
        return password

    def _receivers(self, stack: ExitStack) -> tuple[Mailbox, Helpdesk]:
        """The support agent's receivers, started in this process (they
        stop with it): at the addresses its tools send to."""
        smtp, helpdesk = settings.RUNDESK_SMTP_URL, settings.RUNDESK_HELPDESK_URL
        try:
            receivers = support_receivers(Path(settings.VAR_DIR), smtp, helpdesk)
            for receiver in receivers:
                stack.enter_context(receiver)
        except OSError as error:
            raise CommandError(
                f"demo: cannot start the support agent's receivers at RUNDESK_SMTP_URL {smtp} "
                f"and RUNDESK_HELPDESK_URL {helpdesk}: {error}"
            ) from None
        return receivers

    def _seed(self) -> None:
        if Run.objects.exists():
            return
        for index, sample in enumerate(SAMPLE_RUNS):
            with transaction.atomic():
                run = submit(**sample)
                if index == 0:  # this one goes through Celery; the lease settles who runs it
                    execute_run.delay_on_commit(run.pk)
        for question, faults in DECISION_TABLE_RUNS:
            submit(question=question, documents=TWO_FUNDS, faults=faults)
        for input, faults in SUPPORT_RUNS:
            submit(agent="support", input=input, faults=faults)
        submit(agent="support-approved", input=APPROVAL_RUN)
        self.stdout.write(
            f"demo: {len(SAMPLE_RUNS) + len(DECISION_TABLE_RUNS)} research runs queued, "
            f"{len(DECISION_TABLE_RUNS)} of them with a fault plan; {len(SUPPORT_RUNS)} support "
            "runs, one losing its mail's answer and one its ticket update's; one support-approved "
            "run, its reply waiting for approval"
        )

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.stdout.write(f"demo: starting {name}")
        return subprocess.Popen(argv, env={**os.environ, **env, "RUNDESK_ROLE": name})

    def _stop(self, children: list[subprocess.Popen]) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
