"""The process's lease renewal (runs/renewal.py): one statement renews
every lease the process holds, and says which it could not."""

from __future__ import annotations

import pytest
from django.db.models.functions import Now

from runs.leases import Lease
from runs.models import Run
from runs.renewal import Renewals
from runs.submission import submit

# The renewal's connection is its own: it sees committed rows only.
pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ["northwind-clean-energy.md"]


def expiry(lease: Lease):
    return Run.objects.values_list("lease_expires_at", flat=True).get(pk=lease.run_id)


def test_one_renewal_renews_every_lease_held_and_marks_the_one_taken_over_as_lost():
    renewals = Renewals()
    mine = [Lease.claim(submit(question="q", documents=DOCS).pk, "this-process") for _ in range(3)]
    taken = mine[1]
    with (
        renewals.held(mine[0]) as kept_first,
        renewals.held(taken) as lost,
        renewals.held(mine[2]) as kept_last,
    ):
        # Another owner took one run over (its lease expired, then a claim).
        Run.objects.filter(pk=taken.run_id).update(lease_expires_at=Now())
        other = Lease.claim(taken.run_id, "another-process")
        assert other is not None and other.epoch == taken.epoch + 1
        before = {lease: expiry(lease) for lease in mine}

        assert renewals.renew() == 2

        assert lost.is_set() and not kept_first.is_set() and not kept_last.is_set()
        assert expiry(mine[0]) > before[mine[0]] and expiry(mine[2]) > before[mine[2]]
        # The new owner's lease is not this process's to renew.
        assert expiry(taken) == before[taken]
    # Leases no longer held are not renewed (and its connection is closed).
    assert renewals.renew() == 0
