"""Saved views: a runs-list filter kept under a name (dashboard.models.
SavedView).  Any signed-in user keeps their own (a view changes no run:
viewers save them too); a shared one opens for everyone by its URL, a
private one for its owner only (anyone else: 404, as if it did not exist);
only its owner removes it."""

from __future__ import annotations

from urllib.parse import parse_qsl

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST, require_safe

from dashboard.models import SavedView
from dashboard.security import rejects_bad_input

QUERY_MAX = 2000


class SavedViewForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True)
    # The runs list's query string as the page has it (without "?").
    query = forms.CharField(max_length=QUERY_MAX, required=False, strip=True)
    shared = forms.BooleanField(required=False)

    def clean_query(self) -> str:
        return SavedView.kept_query(
            parse_qsl(self.cleaned_data["query"].lstrip("?"), keep_blank_values=True)
        )


@require_POST
@rejects_bad_input
def view_save(request: HttpRequest) -> HttpResponse:
    """Keeps the runs list's filter under a name, then shows it.  A name
    the user already has is replaced: saving again updates the view."""
    form = SavedViewForm(request.POST)
    if not form.is_valid():
        errors = "; ".join(f"{field}: {' '.join(e)}" for field, e in form.errors.items())
        messages.error(request, f"The view was not saved: {errors}")
        return redirect("runs-list")
    data = form.cleaned_data
    try:
        with transaction.atomic():
            view, _ = SavedView.objects.update_or_create(
                owner=request.user,
                name=data["name"],
                defaults={"query": data["query"], "shared": data["shared"]},
            )
    except IntegrityError:  # the same name saved twice at once: the other one stands
        view = SavedView.objects.get(owner=request.user, name=data["name"])
    said = "shared: anyone signed in can open its link" if view.shared else "private"
    messages.success(request, f"View “{view.name}” saved ({said}).")
    return redirect(view.list_url)


@require_safe
def view_open(request: HttpRequest, view_id: int) -> HttpResponse:
    """A saved view's link: the runs list, filtered as it says."""
    view = get_object_or_404(SavedView.objects.visible_to(request.user), pk=view_id)
    return redirect(view.list_url)


@require_POST
def view_delete(request: HttpRequest, view_id: int) -> HttpResponse:
    view = get_object_or_404(SavedView.objects.visible_to(request.user), pk=view_id)
    if view.owner_id != request.user.pk:
        raise PermissionDenied("Only its owner removes a saved view.")
    view.delete()
    messages.success(request, f"View “{view.name}” removed.")
    return redirect("runs-list")
