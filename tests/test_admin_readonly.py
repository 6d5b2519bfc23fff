"""The admin shows the runtime models and changes none of them: a form that
saved a run's whole row back would write a stale lease epoch, or documents
nobody checked, under the run's live owner."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone

from evidence import locks, pglog
from evidence.capture import record_gaps
from evidence.models import IncidentSource
from runs.executor import claim_and_drive
from runs.models import Run
from runs.submission import submit
from runs.timeline import timeline
from tests.test_pglog import THREE_WAY

pytestmark = pytest.mark.django_db(transaction=True)

RUNTIME_APPS = {"runs", "evidence"}


def runtime_models() -> list[type[models.Model]]:
    return [model for model in admin.site._registry if model._meta.app_label in RUNTIME_APPS]


def admin_url(model: type[models.Model], view: str, pk: Any = None) -> str:
    base = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
    return base + (f"{pk}/{view}/" if pk is not None else f"{view}/" if view else "")


def snapshot(model: type[models.Model]) -> list[dict[str, Any]]:
    return list(model.objects.order_by("pk").values())


@pytest.fixture
def rows() -> Run:
    """A finished run with its actions, receipts, revisions, checkpoints,
    events, sources and model calls; a capture gap; a lock incident."""
    run = submit(question="Compare", documents=["northwind-clean-energy.md"])
    claim_and_drive(run.pk)
    record_gaps(Counter({(run.pk, None, "queue_full", "capacity 5"): 1}))
    (report,) = pglog.parse(THREE_WAY)
    locks.store(IncidentSource.LOG, report.graph, summary="imported")
    timeline.flush()
    return run


def change_form(run: Run) -> dict[str, Any]:
    """What the run's change form posted when it could be saved: every
    editable field as it is now, in the admin's widgets' names."""
    data: dict[str, Any] = {"_save": "Save"}
    for field in Run._meta.concrete_fields:
        if not field.editable or field.primary_key:
            continue
        value = getattr(run, field.attname)
        if isinstance(field, models.DateTimeField):
            local = timezone.localtime(value) if value else None
            data[f"{field.name}_0"] = local.date().isoformat() if local else ""
            data[f"{field.name}_1"] = local.time().isoformat() if local else ""
        elif isinstance(field, ArrayField):
            data[field.name] = ",".join(value)
        elif isinstance(field, models.JSONField):
            data[field.name] = json.dumps(value)
        else:
            data[field.name] = "" if value is None else value
    return data


def test_saving_a_run_from_the_admin_changes_nothing(staff, rows):
    Run.objects.filter(pk=rows.pk).update(lease_epoch=7)
    rows.refresh_from_db()
    before = snapshot(Run)
    form = change_form(rows) | {"documents": "../../etc/passwd", "lease_epoch": 1}
    response = staff.post(admin_url(Run, "change", rows.pk), form)
    rows.refresh_from_db()
    assert rows.lease_epoch == 7 and rows.documents == ["northwind-clean-energy.md"]
    assert snapshot(Run) == before
    assert response.status_code == 403


def test_every_runtime_model_is_registered_read_only(staff, rows):
    registered = {model._meta.label for model in runtime_models()}
    assert {
        "runs.Run",
        "runs.Action",
        "runs.Receipt",
        "runs.AnswerRevision",
        "runs.Checkpoint",
        "runs.RunEvent",
        "evidence.Source",
        "evidence.ModelCall",
        "evidence.CaptureGap",
        "evidence.LockIncident",
    } <= registered
    for model in runtime_models():
        assert staff.get(admin_url(model, "")).status_code == 200, model
        assert staff.get(admin_url(model, "add")).status_code == 403, model
        assert staff.post(admin_url(model, "add"), {"_save": "Save"}).status_code == 403, model


def test_staff_view_runtime_rows_and_cannot_change_or_delete_them(staff, rows):
    seen = set()
    for model in runtime_models():
        row = model.objects.order_by("pk").first()
        if row is None:
            continue
        seen.add(model._meta.label)
        before = snapshot(model)
        page = staff.get(admin_url(model, "change", row.pk))
        assert page.status_code == 200, model
        assert 'name="_save"' not in page.content.decode(), model  # a view page, no form
        assert staff.post(admin_url(model, "change", row.pk), {"_save": "Save"}).status_code == 403
        assert staff.get(admin_url(model, "delete", row.pk)).status_code == 403, model
        assert staff.post(admin_url(model, "delete", row.pk), {"post": "yes"}).status_code == 403
        bulk = {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"}
        staff.post(admin_url(model, ""), bulk)
        assert snapshot(model) == before, model
    # The rows this test was meant to try (the fixture makes them all).
    assert {
        "runs.Run",
        "runs.Action",
        "runs.Receipt",
        "runs.AnswerRevision",
        "runs.Checkpoint",
        "runs.RunEvent",
        "evidence.Source",
        "evidence.ModelCall",
        "evidence.CaptureGap",
        "evidence.CaptureStats",
        "evidence.LockIncident",
    } <= seen


def test_admin_list_filter_with_nul_is_400_not_500(staff, rows):
    response = staff.get("/admin/runs/run/", {"status__exact": "\x00"})
    assert response.status_code == 400
    assert "NUL" in response.content.decode()
    assert staff.get("/admin/runs/run/", {"status__exact": "completed"}).status_code == 200
