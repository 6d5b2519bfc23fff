"""Saved views: a runs-list filter kept under a name by whoever is signed
in (viewers too: a view changes no run), opened by its URL, shared with
everyone or kept private, removed by its owner only."""

from __future__ import annotations

import pytest
from django.test import Client

from dashboard.models import SavedView
from tests.conftest import make_user, signed_in

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice() -> Client:
    return signed_in(make_user("alice"))


@pytest.fixture
def bob() -> Client:
    return signed_in(make_user("bob", operator=True))


def save(client: Client, name: str, query: str, *, shared: bool = False):
    data = {"name": name, "query": query, **({"shared": "1"} if shared else {})}
    return client.post("/views/save/", data)


def test_saving_keeps_the_filter_and_opens_the_list_filtered(alice):
    response = save(alice, "risk failures", "status=failed&label=team%3Drisk&before=xyz&junk=1")
    view = SavedView.objects.get(name="risk failures")
    # The page cursor and what the list does not take are left out.
    assert view.query == "status=failed&label=team%3Drisk"
    assert view.owner.username == "alice" and not view.shared
    assert response.status_code == 302 and response.url == "/?status=failed&label=team%3Drisk"
    opened = alice.get(f"/views/{view.pk}/")
    assert opened.status_code == 302 and opened.url == view.list_url
    page = alice.get("/").content.decode()
    assert f'href="/views/{view.pk}/"' in page and "risk failures" in page


def test_saving_a_name_again_updates_the_view(alice):
    save(alice, "mine", "status=failed")
    save(alice, "mine", "status=completed", shared=True)
    view = SavedView.objects.get()
    assert (view.query, view.shared) == ("status=completed", True)


def test_a_shared_view_opens_for_others_a_private_one_does_not(alice, bob):
    save(alice, "shared one", "agent=research", shared=True)
    save(alice, "private one", "status=failed")
    shared = SavedView.objects.get(name="shared one")
    private = SavedView.objects.get(name="private one")
    assert bob.get(f"/views/{shared.pk}/").status_code == 302
    assert bob.get(f"/views/{private.pk}/").status_code == 404  # as if it did not exist
    listed = bob.get("/").content.decode()
    assert "shared one" in listed and "private one" not in listed


def test_only_the_owner_removes_a_view(alice, bob):
    save(alice, "shared one", "agent=research", shared=True)
    view = SavedView.objects.get()
    assert bob.post(f"/views/{view.pk}/delete/").status_code == 403
    assert SavedView.objects.exists()
    assert alice.post(f"/views/{view.pk}/delete/").status_code == 302
    assert not SavedView.objects.exists()


def test_a_view_without_a_name_is_not_saved_and_says_why(alice):
    response = save(alice, "", "status=failed")
    assert response.status_code == 302 and not SavedView.objects.exists()
    assert "The view was not saved: name" in alice.get("/").content.decode()


def test_anonymous_is_sent_to_sign_in(client):
    make_user("alice")
    for response in (
        client.post("/views/save/", {"name": "x", "query": ""}),
        client.get("/views/1/"),
        client.post("/views/1/delete/"),
    ):
        assert response.status_code == 302 and response.url.startswith("/login/")
    assert not SavedView.objects.exists()


def test_wrong_methods_answer_405(alice):
    save(alice, "v", "status=failed")
    view = SavedView.objects.get()
    assert alice.get("/views/save/").status_code == 405
    assert alice.post(f"/views/{view.pk}/").status_code == 405
    assert alice.get(f"/views/{view.pk}/delete/").status_code == 405


def test_csrf_is_enforced():
    user = make_user("carol")
    client = signed_in(user, enforce_csrf_checks=True)
    assert client.post("/views/save/", {"name": "x", "query": ""}).status_code == 403
    assert not SavedView.objects.exists()
