"""The approval pages (dashboard/approvals.py): the inbox lists an approval
item with its email, the item page shows it escaped and offers approve,
edit and approve, reject; only approvers decide, by POST, with CSRF."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client
from django.urls import reverse

from runs.approvals import APPROVERS
from runs.models import Approval, ApprovalState, OperatorDecision, OutcomeItem
from tests.conftest import make_user, signed_in
from tests.test_approvals import CUSTOMER, SUBJECT, installed, make_approver, waiting_reply

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["installed"]  # the fixture that installs the approved support agent


@pytest.fixture
def item() -> OutcomeItem:
    return waiting_reply()[1]


def approve_url(item: OutcomeItem) -> str:
    return reverse("inbox-approve", args=[item.pk])


def posted(client: Client, item: OutcomeItem, **fields: str):
    return client.post(approve_url(item), {"token": uuid.uuid4().hex, **fields})


def test_the_inbox_lists_the_approval_with_its_email(item):
    page = signed_in(make_user("viewer")).get(reverse("inbox"))

    text = page.content.decode()
    assert page.status_code == 200
    assert "send_reply (send) needs approval within 2 h" in text
    assert f'<dd><span class="text">{CUSTOMER}</span></dd>' in text
    assert SUBJECT in text


def test_the_item_page_shows_the_email_what_was_published_and_who_may_approve():
    make_approver("ana")
    bo = make_approver("bo")
    _, item = waiting_reply()  # who may approve is said as it was when it was asked
    page = signed_in(bo).get(reverse("inbox-item", args=[item.pk]))

    text = page.content.decode()
    assert 'id="approval-decide"' in text
    assert CUSTOMER in text and SUBJECT in text
    assert "From our article “Refunds and returns”" in text
    assert "Revision 2 (final)" in text
    assert f"Members of the <strong>{APPROVERS}</strong> group: ana, bo." in text


def test_anonymous_is_sent_to_sign_in(item):
    page = Client().post(approve_url(item), {"choice": "approve", "token": "t"})
    assert page.status_code == 302 and "/login/" in page["Location"]
    assert Client().get(reverse("inbox-item", args=[item.pk])).status_code == 302


def test_a_viewer_reads_but_may_not_approve(item):
    viewer = signed_in(make_user("viewer"))
    assert (
        'id="approval-decide"'
        not in viewer.get(reverse("inbox-item", args=[item.pk])).content.decode()
    )
    assert posted(viewer, item, choice="approve").status_code == 403
    assert Approval.objects.get(item=item).state == ApprovalState.PENDING


def test_an_operator_without_the_approver_permission_may_not_approve(item):
    operator = signed_in(make_user("olga", operator=True))
    text = operator.get(reverse("inbox-item", args=[item.pk])).content.decode()
    assert "Approvers decide (it needs the approver permission" in text
    assert posted(operator, item, choice="approve").status_code == 403
    assert not OperatorDecision.objects.exists()


def test_an_approver_approves_and_the_run_is_back_in_the_queue(item):
    approver = signed_in(make_approver("ana"))
    page = posted(approver, item, choice="approve")

    assert page.status_code == 302
    assert page["Location"] == reverse("inbox-item", args=[item.pk])
    approval = Approval.objects.get(item=item)
    assert (approval.state, approval.decision.decided_by) == ("approved", "ana")
    assert approval.run.status == "queued"
    text = approver.get(page["Location"]).content.decode()
    assert "Recorded: approve by ana." in text


def test_an_edit_is_shown_escaped_as_a_diff_and_sent(item):
    approver = signed_in(make_approver("ana"))
    proposed = Approval.objects.get(item=item).proposed

    posted(
        approver,
        item,
        choice="approve_edited",
        reason="friendlier",
        edit_to=CUSTOMER,
        edit_subject="<b>Your refund</b>",
        edit_body="Dear Ada,\r\n\r\nRefunded.",
        edit_ticket=proposed["ticket"],
    )

    approval = Approval.objects.get(item=item)
    assert approval.sent["body"] == "Dear Ada,\n\nRefunded."
    text = approver.get(reverse("inbox-item", args=[item.pk])).content.decode()
    assert "&lt;b&gt;Your refund&lt;/b&gt;" in text and "<b>Your refund</b>" not in text
    assert "+subject: &lt;b&gt;Your refund&lt;/b&gt;" in text
    assert f"-subject: {SUBJECT}" in text


def test_a_bad_edit_is_refused_with_the_field_named_and_nothing_decided(item):
    approver = signed_in(make_approver("ana"))
    page = posted(
        approver, item, choice="approve_edited", edit_to="nobody", edit_subject="s", edit_body="b"
    )

    assert page.status_code == 400
    assert 'id="error-edit_to"' in page.content.decode()
    assert "input.to: &#x27;nobody&#x27; does not match" in page.content.decode()
    assert Approval.objects.get(item=item).state == ApprovalState.PENDING


def test_a_rejection_without_a_reason_is_refused(item):
    approver = signed_in(make_approver("ana"))
    page = posted(approver, item, choice="reject")
    assert (
        "Not decided: say why: a rejection needs a reason."
        in approver.get(page["Location"]).content.decode()
    )
    posted(approver, item, choice="reject", reason="wrong tone")
    assert Approval.objects.get(item=item).state == ApprovalState.REJECTED


def test_get_is_not_allowed(item):
    assert signed_in(make_approver("ana")).get(approve_url(item)).status_code == 405


def test_csrf_is_enforced(item):
    client = signed_in(make_approver("ana"), enforce_csrf_checks=True)
    assert posted(client, item, choice="approve").status_code == 403
    assert Approval.objects.get(item=item).state == ApprovalState.PENDING
