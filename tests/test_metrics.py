"""/metrics: refused without its token or from an address not allowed; in
the Prometheus text format promtool accepts; each figure the database's,
counted against a seeded database; counters that do not go down when
retention removes the rows they were counted from; a figure whose query
cannot finish is said to be missing while the others are given."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import subprocess
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from evidence.capture import record_gaps
from runs import retention
from runs.models import (
    Action,
    Alert,
    AlertState,
    OutcomeItem,
    OutcomeState,
    PurgedCount,
    Run,
    RunEvent,
    RunStatus,
    SweepTurn,
)
from runs.sweep import take_turn
from tests.conftest import ROOT, make_user, python, signed_in

TOKEN = "scrape-token-" + "k" * 24
HOST = {"HTTP_HOST": "127.0.0.1"}
BEARER = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}", **HOST}


@pytest.fixture
def token(settings) -> str:
    settings.RUNDESK_METRICS_TOKEN = TOKEN
    settings.RUNDESK_METRICS_ALLOW = []
    return TOKEN


def scrape(client: Client | None = None, **headers: Any) -> str:
    response = (client or Client()).get("/metrics", **(headers or BEARER))
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return response.content.decode()


def figures(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample, by its name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def figure(found: dict, name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


# -- who may scrape ------------------------------------------------------------------


@pytest.mark.django_db
def test_with_no_token_nor_address_set_there_is_no_metrics_page(settings):
    settings.RUNDESK_METRICS_TOKEN = ""
    settings.RUNDESK_METRICS_ALLOW = []
    assert Client().get("/metrics", **BEARER).status_code == 404
    assert signed_in(make_user("viewer")).get("/metrics", **HOST).status_code == 404


@pytest.mark.django_db
@pytest.mark.parametrize(
    "authorization",
    [None, "", f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", "Bearer", TOKEN],
)
def test_a_scrape_without_the_token_is_refused(token, authorization):
    headers = {**HOST} if authorization is None else {"HTTP_AUTHORIZATION": authorization, **HOST}
    response = Client().get("/metrics", **headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"rundesk_" not in response.content


@pytest.mark.django_db
def test_signing_in_is_no_token(token):
    viewer = signed_in(make_user("viewer"))
    operator = signed_in(make_user("operator", operator=True))
    for client in (viewer, operator):
        assert client.get("/metrics", **HOST).status_code == 401
    assert "rundesk_runs" in scrape(operator)


@pytest.mark.django_db
def test_metrics_answer_get_only_and_a_post_needs_csrf(token):
    assert Client().post("/metrics", **BEARER).status_code == 405
    assert Client(enforce_csrf_checks=True).post("/metrics", **BEARER).status_code == 403
    assert Client().head("/metrics", **BEARER).status_code == 405


@pytest.mark.django_db
def test_an_address_not_allowed_is_refused_even_with_the_token(token, settings):
    settings.RUNDESK_METRICS_ALLOW = [ipaddress.ip_network("10.0.0.0/8")]
    refused = Client(REMOTE_ADDR="192.168.1.5").get("/metrics", **BEARER)
    assert refused.status_code == 403
    assert "rundesk_runs" in scrape(Client(REMOTE_ADDR="10.1.2.3"))
    # Addresses alone: no token asked.
    settings.RUNDESK_METRICS_TOKEN = ""
    assert "rundesk_runs" in scrape(Client(REMOTE_ADDR="10.1.2.3"), **HOST)
    assert Client(REMOTE_ADDR="192.168.1.5").get("/metrics", **HOST).status_code == 403


# -- what is measured -----------------------------------------------------------------


def made_run(status: RunStatus, agent: str = "research", **fields: Any) -> Run:
    now = timezone.now()
    if status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields.setdefault("finished_at", now)
        fields.setdefault("started_at", fields["finished_at"] - dt.timedelta(seconds=10))
    if status == RunStatus.COMPLETED:
        fields["phase"] = "done"
    if status == RunStatus.RUNNING:
        fields.setdefault("lease_owner", f"host-a:100:{uuid.uuid4().hex[:8]}")
        fields.setdefault("lease_expires_at", now + dt.timedelta(minutes=1))
        fields.setdefault("lease_epoch", 1)
    return Run.objects.create(
        question="Compare the funds", documents=["a.md"], status=status, agent=agent, **fields
    )


def action(run: Run, key: str, kind: str, seconds: float, ended: dt.datetime) -> Action:
    return Action.objects.create(
        run=run,
        step_key=key,
        kind=kind,
        effect_class="read",
        input={},
        input_digest="",
        epoch=1,
        state="completed",
        dispatched_at=ended - dt.timedelta(seconds=seconds),
        finished_at=ended,
    )


def item(run: Run, kind: str, age: dt.timedelta, state: str = OutcomeState.OPEN) -> OutcomeItem:
    now = timezone.now()
    return OutcomeItem.objects.create(
        run=run,
        kind=kind,
        subject=f"{kind}:{uuid.uuid4().hex}",
        summary="?",
        state=state,
        created_at=now - age,
        resolved_at=now if state == OutcomeState.SETTLED else None,
    )


def imported(status: RunStatus) -> Run:
    return made_run(
        status,
        imported_at=timezone.now(),
        origin_seal=uuid.uuid4().hex,
        origin_run_id=7,
        origin_exported_at=timezone.now(),
        lease_owner="",
        lease_expires_at=None,
    )


@pytest.fixture
def seeded() -> dict[str, Any]:
    """A database with known figures."""
    now = timezone.now()
    for _ in range(2):
        made_run(RunStatus.QUEUED)
    made_run(RunStatus.QUEUED, agent="support")
    waiting = made_run(RunStatus.NEEDS_OPERATOR)
    made_run(RunStatus.RUNNING, lease_owner="host-a:100:one")
    made_run(RunStatus.RUNNING, lease_owner="host-a:100:two")  # the same process
    made_run(RunStatus.RUNNING, lease_owner="host-b:200:one")
    made_run(RunStatus.RUNNING, lease_expires_at=now - dt.timedelta(seconds=30))  # owner died
    imported(RunStatus.RUNNING)  # another installation's: not counted here
    quick = made_run(RunStatus.COMPLETED, started_at=now - dt.timedelta(seconds=3))
    slow = made_run(RunStatus.COMPLETED, started_at=now - dt.timedelta(seconds=100))
    made_run(RunStatus.FAILED, agent="support", started_at=now - dt.timedelta(seconds=20))
    made_run(RunStatus.COMPLETED, finished_at=now - dt.timedelta(hours=2))  # before the window
    action(quick, "read:0", "read_document", 0.02, now)
    action(quick, "summarize:0", "model_call", 0.3, now)
    action(slow, "read:0", "read_document", 0.002, now)
    item(waiting, "effect", dt.timedelta(hours=2))
    item(waiting, "receipt", dt.timedelta(minutes=1))
    item(waiting, "checkpoint", dt.timedelta(days=3), state=OutcomeState.SETTLED)
    drill = made_run(RunStatus.NEEDS_OPERATOR, is_drill=True)
    item(drill, "effect", dt.timedelta(minutes=1))  # staged by a drill: left out
    alerted = item(slow, "publication", dt.timedelta(days=2), state=OutcomeState.SETTLED)
    Alert.objects.create(
        item=alerted,
        channel="email",
        state=AlertState.SENT,
        attempts=1,
        sent_at=now,
        next_try_at=None,
    )
    Alert.objects.create(item=alerted, channel="webhook", state=AlertState.FAILING, attempts=3)
    record_gaps(
        Counter({(quick.pk, None, "queue_full", "t"): 4, (slow.pk, None, "too_large", "t"): 1})
    )
    for run in (quick, slow, slow):
        RunEvent.objects.create(run=run, kind="resumed", created_at=now)
    RunEvent.objects.create(run=imported(RunStatus.COMPLETED), kind="resumed", created_at=now)
    PurgedCount.objects.create(counter="lease_takeovers", value=5)
    PurgedCount.objects.create(counter="alerts_sent", label="email", value=2)
    return {"quick": quick, "slow": slow}


@pytest.mark.django_db
@pytest.mark.usefixtures("seeded")
def test_the_figures_are_the_databases(token):
    params = {**connection.get_connection_params(), "application_name": "rundesk:executor:run-42"}
    with psycopg.connect(**params):
        text = scrape()
    found = figures(text)
    assert "run-42" not in text and "run_id" not in text

    runs = {k: v for k, v in found.items() if k[0] == "rundesk_runs"}
    assert runs == {
        ("rundesk_runs", frozenset({("status", "queued"), ("agent", "research")})): 2,
        ("rundesk_runs", frozenset({("status", "queued"), ("agent", "support")})): 1,
        ("rundesk_runs", frozenset({("status", "needs_operator"), ("agent", "research")})): 2,
        ("rundesk_runs", frozenset({("status", "running"), ("agent", "research")})): 4,
    }

    run = "rundesk_run_duration_seconds"
    done = {"agent": "research", "status": "completed"}
    assert figure(found, f"{run}_bucket", **done, le="5.0") == 1  # 3 s
    assert figure(found, f"{run}_bucket", **done, le="60.0") == 1
    assert figure(found, f"{run}_bucket", **done, le="120.0") == 2  # and 100 s
    assert figure(found, f"{run}_bucket", **done, le="+Inf") == 2  # not the one 2 h ago
    assert figure(found, f"{run}_gcount", **done) == 2
    assert figure(found, f"{run}_gsum", **done) == pytest.approx(103, abs=0.5)
    assert figure(found, f"{run}_gcount", agent="support", status="failed") == 1

    step = "rundesk_step_duration_seconds"
    reads = {"agent": "research", "tool": "read_document"}
    assert figure(found, f"{step}_bucket", **reads, le="0.005") == 1
    assert figure(found, f"{step}_bucket", **reads, le="0.025") == 2
    assert figure(found, f"{step}_bucket", agent="research", tool="model_call", le="0.25") == 0
    assert figure(found, f"{step}_bucket", agent="research", tool="model_call", le="0.5") == 1

    age = "rundesk_open_item_age_seconds"
    assert figure(found, f"{age}_bucket", kind="effect", le="3600.0") == 0
    assert figure(found, f"{age}_bucket", kind="effect", le="21600.0") == 1
    assert figure(found, f"{age}_bucket", kind="receipt", le="300.0") == 1
    assert figure(found, f"{age}_gcount", kind="effect") == 1  # not the drill's
    assert figure(found, f"{age}_gcount", kind="checkpoint") == 0  # settled
    assert figure(found, f"{age}_gcount", kind="publication") == 0

    assert figure(found, "rundesk_capture_gaps_total", reason="queue_full") == 4
    assert figure(found, "rundesk_capture_gaps_total", reason="too_large") == 1
    assert figure(found, "rundesk_lease_takeovers_total") == 3 + 5  # kept + purged; not imported
    assert figure(found, "rundesk_alerts_sent_total", channel="email") == 1 + 2
    assert figure(found, "rundesk_alert_failures_total", channel="webhook") == 3
    assert figure(found, "rundesk_alerts_failing", channel="webhook") == 1
    assert figure(found, "rundesk_alerts_failing", channel="email") == 0

    assert figure(found, "rundesk_lease_processes") == 2  # host-a:100 and host-b:200
    assert figure(found, "rundesk_runs_in_flight") == 3
    assert figure(found, "rundesk_leases_expired") == 1
    assert figure(found, "rundesk_db_sessions", role="executor", state="idle") == 1
    with connection.cursor() as cursor:
        cursor.execute("SELECT split_part(current_setting('application_name'), ':', 2)")
        (ours,) = cursor.fetchone()
    assert figure(found, "rundesk_db_sessions", role=ours, state="active") >= 1  # the scrape's
    assert all(v == 0 for k, v in found.items() if k[0] == "rundesk_scrape_failed")


@pytest.mark.django_db
def test_the_last_sweep_is_when_the_installation_last_swept(token):
    assert figure(figures(scrape()), "rundesk_sweep_last_timestamp_seconds") == 0  # never
    assert take_turn("host-a:100:executor")
    swept = SweepTurn.objects.get().started_at.timestamp()
    assert figure(figures(scrape()), "rundesk_sweep_last_timestamp_seconds") == pytest.approx(
        swept, abs=1e-3
    )


@pytest.mark.django_db
@pytest.mark.usefixtures("seeded")
def test_the_output_passes_promtool(token, tmp_path):
    text = scrape()
    checked = subprocess.run(
        ["/usr/bin/promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "" and checked.stderr.strip() == ""
    names = {family.name for family in text_string_to_metric_families(text)}
    assert all(name.startswith("rundesk_") for name in names)


# Its own transactions: the stranger's lock waits for none of the test's.
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("seeded")
def test_a_figure_whose_query_cannot_finish_is_said_missing_and_the_others_given(token):
    with psycopg.connect(**connection.get_connection_params()) as stranger:
        stranger.execute("LOCK TABLE evidence_capturegaphour IN ACCESS EXCLUSIVE MODE")
        found = figures(scrape())
        stranger.rollback()
    assert figure(found, "rundesk_scrape_failed", family="capture_gaps") == 1
    assert not any(name == "rundesk_capture_gaps_total" for name, _ in found)
    assert figure(found, "rundesk_scrape_failed", family="alerts") == 0
    assert figure(found, "rundesk_lease_takeovers_total") == 8


@pytest.mark.django_db(transaction=True)
def test_counters_do_not_go_down_when_retention_removes_their_rows(token):
    ended = made_run(RunStatus.COMPLETED, finished_at=timezone.now() - dt.timedelta(days=40))
    RunEvent.objects.create(run=ended, kind="resumed", created_at=timezone.now())
    alerted = item(ended, "effect", dt.timedelta(days=41), state=OutcomeState.SETTLED)
    Alert.objects.create(item=alerted, channel="webhook", state=AlertState.FAILING, attempts=2)
    before = figures(scrape())
    assert retention.purge(dt.timedelta(days=30)).run_ids == [ended.pk]
    after = figures(scrape())
    for name, labels in [
        ("rundesk_lease_takeovers_total", {}),
        ("rundesk_alert_failures_total", {"channel": "webhook"}),
    ]:
        assert figure(after, name, **labels) == figure(before, name, **labels) > 0
    assert figure(after, "rundesk_alerts_failing", channel="webhook") == 0  # a gauge: now


def test_the_readmes_alert_rules_and_scrape_config_are_valid(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Metrics for Prometheus") :]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    rules = next(block for block in blocks if "groups:" in block)
    scrape = next(block for block in blocks if "scrape_configs:" in block)
    (tmp_path / "rules.yml").write_text(rules)
    (tmp_path / "rundesk-token").write_text(TOKEN)
    scrape = scrape.replace("/etc/prometheus/rundesk-token", str(tmp_path / "rundesk-token"))
    (tmp_path / "prometheus.yml").write_text(scrape)
    for what, path in [("rules", "rules.yml"), ("config", "prometheus.yml")]:
        checked = subprocess.run(
            ["/usr/bin/promtool", "check", what, str(tmp_path / path)],
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("RUNDESK_METRICS_TOKEN", "short", "at least 16 characters"),
        ("RUNDESK_METRICS_ALLOW", "10.0.0.0/8,the office", "'the office' is not an address"),
        ("RUNDESK_METRICS_WINDOW_SECONDS", "1", "must be from 10"),
    ],
)
def test_a_bad_metrics_setting_stops_the_process_naming_it(variable, value, said):
    started = python(
        "import django; django.setup()",
        {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "dashboard.settings",
            "DEBUG": "1",
            variable: value,
        },
        timeout=60,
    )
    assert started.returncode != 0
    assert variable in started.stderr and said in started.stderr
