"""The page where a signed-in user makes and revokes their own API tokens
(/api/tokens/): a token's secret is shown once, in the answer to the form
that made it, and never again (only its digest is kept)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from dashboard.models import ApiToken
from dashboard.security import form_lock_waits, rejects_bad_input

NAME_MAX = ApiToken._meta.get_field("name").max_length


class TokenForm(forms.Form):
    name = forms.CharField(
        max_length=NAME_MAX, help_text="What it is for, e.g. “ci” or “alerting script”"
    )

    def __init__(self, *args: Any, user: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if "\x00" in name:
            raise forms.ValidationError("A name cannot hold a NUL character.")
        if ApiToken.objects.active().filter(user=self.user, name=name).exists():
            raise forms.ValidationError(
                f"You have a token named “{name}” already: revoke it first, or name this one "
                "otherwise."
            )
        return name


def _page(request: HttpRequest, form: TokenForm, secret: str = "", status: int = 200) -> Any:
    context = {
        "form": form,
        "secret": secret,
        "tokens": ApiToken.objects.filter(user=request.user),
    }
    return render(request, "api_tokens.html", context, status=status)


@require_http_methods(["GET", "HEAD", "POST"])
@rejects_bad_input
def tokens(request: HttpRequest) -> HttpResponse:
    """The user's tokens; a post makes one, and the answer shows its secret."""
    if request.method != "POST":
        return _page(request, TokenForm(user=request.user))
    form = TokenForm(request.POST, user=request.user)
    with form_lock_waits():
        if not form.is_valid():
            return _page(request, form, status=400)
        issued = ApiToken.objects.issue(request.user, form.cleaned_data["name"])
    return _page(request, TokenForm(user=request.user), secret=issued.secret, status=201)


@require_POST
def revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    """Revokes one of the user's own tokens (another's is not found)."""
    with form_lock_waits():
        token = get_object_or_404(ApiToken, pk=token_id, user=request.user)
        revoked = token.revoke()
    if revoked:
        messages.success(request, f"Token “{token.name}” revoked: it authenticates nothing now.")
    else:
        messages.info(request, f"Token “{token.name}” was revoked already.")
    return redirect("api:tokens")
