"""API tokens: made by their user on /api/tokens/ (login, CSRF) or by
`manage.py api_tokens`, shown once and stored only as a digest, revocable,
each acting as its user with that user's permissions."""

from __future__ import annotations

import hashlib
import json
import re
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client

from dashboard.models import ApiToken
from runs.models import Run
from tests.conftest import make_user, signed_in

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = re.compile(r"rdk_[A-Za-z0-9_-]{43}")


def made(client: Client, name: str = "ci") -> str:
    """Makes a token on the page; the secret its answer shows."""
    answer = client.post("/api/tokens/", {"name": name})
    assert answer.status_code == 201, answer.content.decode()[:500]
    (secret,) = SECRET.findall(answer.content.decode())
    return secret


def api(secret: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {secret}"})


def stored_anywhere(secret: str) -> bool:
    """Whether any column of the tokens table holds the secret."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM dashboard_apitoken t WHERE t::text LIKE %s", [f"%{secret}%"]
        )
        return cursor.fetchone()[0] > 0


# -- the page ------------------------------------------------------------------------


def test_the_page_needs_a_login() -> None:
    anonymous = Client()
    answer = anonymous.get("/api/tokens/")
    assert answer.status_code == 302 and answer["Location"].startswith("/login/")
    assert anonymous.post("/api/tokens/", {"name": "x"}).status_code == 302
    assert anonymous.post("/api/tokens/1/revoke/").status_code == 302
    assert not ApiToken.objects.exists()


def test_a_token_is_shown_once_and_stored_only_as_its_digest() -> None:
    user = make_user("vera")
    client = signed_in(user)
    secret = made(client)
    token = ApiToken.objects.get(user=user)
    assert token.digest == hashlib.sha256(secret.encode()).hexdigest()
    assert not stored_anywhere(secret) and secret.startswith(token.shown)
    listed = client.get("/api/tokens/").content.decode()
    assert "ci" in listed and token.shown in listed and secret not in listed
    assert api(secret).get("/api/runs/").status_code == 200


@pytest.mark.parametrize("operator", [False, True], ids=["viewer", "operator"])
def test_a_token_acts_with_its_users_permissions(operator: bool) -> None:
    secret = made(signed_in(make_user("someone", operator=operator)))
    asked = {
        "input": {"question": "q", "documents": ["northwind-clean-energy.md"]},
        "request_token": "t-1",
    }
    answer = api(secret).post("/api/runs/", json.dumps(asked), content_type="application/json")
    assert answer.status_code == (201 if operator else 403)
    assert Run.objects.count() == (1 if operator else 0)


def test_a_revoked_token_authenticates_nothing_and_its_revoke_says_so() -> None:
    user = make_user("vera")
    client = signed_in(user)
    secret = made(client)
    assert api(secret).get("/api/runs/").status_code == 200
    token = ApiToken.objects.get(user=user)
    answer = client.post(f"/api/tokens/{token.pk}/revoke/", follow=True)
    assert "revoked: it authenticates nothing now" in answer.content.decode()
    assert api(secret).get("/api/runs/").status_code == 401
    again = client.post(f"/api/tokens/{token.pk}/revoke/", follow=True)
    assert "was revoked already" in again.content.decode()
    # Its name is free again.
    assert api(made(client)).get("/api/runs/").status_code == 200


def test_nobody_revokes_anothers_token() -> None:
    secret = made(signed_in(make_user("vera")))
    token = ApiToken.objects.get()
    thief = signed_in(make_user("mallory", operator=True))
    assert thief.post(f"/api/tokens/{token.pk}/revoke/").status_code == 404
    assert "vera" not in thief.get("/api/tokens/").content.decode()
    assert api(secret).get("/api/runs/").status_code == 200


def test_a_name_in_use_or_missing_is_refused_and_makes_nothing() -> None:
    client = signed_in(make_user("vera"))
    made(client, "ci")
    answer = client.post("/api/tokens/", {"name": "ci"})
    assert answer.status_code == 400 and "already" in answer.content.decode()
    assert client.post("/api/tokens/", {"name": "  "}).status_code == 400
    assert client.post("/api/tokens/", {"name": "x" * 101}).status_code == 400
    assert client.post("/api/tokens/", {"name": "a\x00b"}).status_code == 400
    assert ApiToken.objects.count() == 1


def test_the_page_refuses_other_methods() -> None:
    client = signed_in(make_user("vera"))
    assert client.put("/api/tokens/").status_code == 405
    assert client.delete("/api/tokens/").status_code == 405
    assert client.get("/api/tokens/1/revoke/").status_code == 405


def test_the_page_and_revoke_need_the_csrf_token() -> None:
    user = make_user("vera")
    client = signed_in(user, enforce_csrf_checks=True)
    assert client.post("/api/tokens/", {"name": "ci"}).status_code == 403
    assert not ApiToken.objects.exists()
    issued = ApiToken.objects.issue(user, "ci")
    assert client.post(f"/api/tokens/{issued.token.pk}/revoke/").status_code == 403
    assert api(issued.secret).get("/api/runs/").status_code == 200
    page = client.get("/api/tokens/")
    csrf = page.context["csrf_token"]
    answer = client.post("/api/tokens/", {"name": "cd", "csrfmiddlewaretoken": csrf})
    assert answer.status_code == 201


def test_a_tokens_last_use_is_noted() -> None:
    user = make_user("vera")
    issued = ApiToken.objects.issue(user, "ci")
    assert issued.token.last_used_at is None
    api(issued.secret).get("/api/runs/")
    issued.token.refresh_from_db()
    assert issued.token.last_used_at is not None


# -- the command ---------------------------------------------------------------------


def command(*args: str) -> str:
    out = StringIO()
    call_command("api_tokens", *args, stdout=out)
    return out.getvalue()


def test_the_command_makes_lists_and_revokes_tokens() -> None:
    make_user("olga", operator=True)
    said = json.loads(command("create", "olga", "--name", "deploy", "--json"))
    secret = said["token"]
    assert SECRET.fullmatch(secret) and not stored_anywhere(secret)
    assert api(secret).get("/api/runs/").status_code == 200
    (listed,) = json.loads(command("list", "olga", "--json"))
    assert listed["name"] == "deploy" and listed["revoked_at"] is None and "token" not in listed
    assert "deploy" in command("list")
    assert "revoked" in command("revoke", "olga", "--name", "deploy")
    assert api(secret).get("/api/runs/").status_code == 401
    with pytest.raises(CommandError, match="no active token named 'deploy'"):
        command("revoke", "olga", "--name", "deploy")


def test_the_command_prints_the_secret_once_in_plain_text() -> None:
    make_user("olga")
    (secret,) = SECRET.findall(command("create", "olga", "--name", "ci"))
    assert api(secret).get("/api/runs/").status_code == 200
    assert secret not in command("list", "--json")


def test_the_command_refuses_an_unknown_user_or_a_name_in_use() -> None:
    make_user("olga")
    with pytest.raises(CommandError, match="no user 'nobody'"):
        command("create", "nobody", "--name", "ci")
    command("create", "olga", "--name", "ci")
    with pytest.raises(CommandError, match="active token named 'ci'"):
        command("create", "olga", "--name", "ci")
    with pytest.raises(CommandError, match="--name"):
        command("create", "olga", "--name", " ")
    assert ApiToken.objects.count() == 1
    assert User.objects.get(username="olga").api_tokens.count() == 1


# -- the admin -----------------------------------------------------------------------


def test_staff_see_every_token_and_revoke_a_leaked_one_but_never_make_or_edit_one(
    staff: Client,
) -> None:
    issued = ApiToken.objects.issue(make_user("vera"), "leaked")
    listed = staff.get("/admin/dashboard/apitoken/")
    assert listed.status_code == 200 and "leaked" in listed.content.decode()
    assert issued.token.digest not in listed.content.decode()
    shown = staff.get(f"/admin/dashboard/apitoken/{issued.token.pk}/change/")
    assert shown.status_code == 200 and issued.token.digest not in shown.content.decode()
    assert staff.get("/admin/dashboard/apitoken/add/").status_code == 403
    assert staff.post(f"/admin/dashboard/apitoken/{issued.token.pk}/change/", {}).status_code == 403
    answer = staff.post(
        "/admin/dashboard/apitoken/",
        {"action": "revoke", "_selected_action": [issued.token.pk]},
        follow=True,
    )
    assert "1 token(s) revoked." in answer.content.decode()
    assert api(issued.secret).get("/api/runs/").status_code == 401
    assert ApiToken.objects.filter(pk=issued.token.pk).exists()  # kept, revoked
