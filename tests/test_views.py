"""Login everywhere; the runs pages and the admin for every model."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from runs.executor import execute
from runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run() -> Run:
    run = Run.objects.submit(
        question="Compare <script>alert(1)</script>", documents=["northwind-clean-energy.md"]
    )
    execute(run.pk)
    return run


@pytest.fixture
def viewer(client: Client) -> Client:
    client.force_login(User.objects.create_user("viewer", password="x-long-password"))
    return client


@pytest.mark.parametrize("path", ["/", "/runs/1/", "/admin/"])
def test_anonymous_is_sent_to_sign_in(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith(("/login/", "/admin/login/"))


def test_runs_list_shows_runs_to_a_signed_in_viewer(viewer, run):
    response = viewer.get("/")
    assert response.status_code == 200
    assert f'href="/runs/{run.pk}/"' in response.content.decode()
    assert "completed" in response.content.decode()


def test_run_page_shows_actions_revisions_and_timeline_escaped(viewer, run):
    page = viewer.get(f"/runs/{run.pk}/").content.decode()
    assert "read:0" in page and "deliver" in page and "Revision 2 (final)" in page
    assert "<td>run completed</td>" in page and "run_completed" not in page
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_unknown_run_is_404(viewer):
    assert viewer.get("/runs/987654/").status_code == 404


def test_pages_refuse_post(viewer, run):
    assert viewer.post("/").status_code == 405
    assert viewer.post(f"/runs/{run.pk}/").status_code == 405


def test_sign_in_enforces_csrf():
    client = Client(enforce_csrf_checks=True)
    User.objects.create_user("viewer", password="x-long-password")
    response = client.post("/login/", {"username": "viewer", "password": "x-long-password"})
    assert response.status_code == 403


@pytest.mark.parametrize("model", ["run", "action", "receipt", "answerrevision", "runevent"])
def test_admin_lists_every_model_for_staff(client, run, model):
    client.force_login(User.objects.create_superuser("admin", password="x-long-password"))
    assert client.get(f"/admin/runs/{model}/").status_code == 200


def test_admin_never_offers_to_delete_a_receipt(client, run):
    client.force_login(User.objects.create_superuser("admin", password="x-long-password"))
    receipt = run.receipts.first()
    response = client.get(f"/admin/runs/receipt/{receipt.pk}/delete/")
    assert response.status_code == 403
