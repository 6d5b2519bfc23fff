"""An approval in a real browser (Debian's Chromium, Playwright): an
approver finds the reply in the inbox, shown as an email, edits it,
approves it, and sees the edit as a diff; the mail the SMTP server then
receives is the edited one.  Screenshots go to var/screenshots/, as in
tests/test_browser.py."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from runs.executor import claim_and_drive
from runs.models import Approval, RunStatus
from tests.test_approvals import (
    CUSTOMER,
    SUBJECT,
    installed,
    make_approver,
    receivers,
    waiting_reply,
)
from tests.test_browser import SCREENSHOTS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

__all__ = ["installed", "receivers"]  # fixtures: the approved support agent, its receivers


@pytest.fixture
def operator_user() -> User:
    """The person signed in: an approver (and an operator)."""
    return make_approver("ana", operator=True)


def test_an_approver_edits_the_email_and_approves_it(page: Page, receivers):
    run, item = waiting_reply()

    page.goto("/inbox/")
    row = page.locator("#inbox-rows tr", has_text="needs approval")
    expect(row).to_contain_text(CUSTOMER)
    expect(row).to_contain_text(SUBJECT)
    row.get_by_role("link", name=str(item.pk), exact=True).click()

    expect(page.locator("#approval-proposed")).to_contain_text(SUBJECT)
    expect(page.locator("#approval-published")).to_contain_text("Revision 2 (final)")
    page.get_by_label("Approve with an edit").check()
    page.get_by_label("Subject").fill("Your refund is on its way")
    page.get_by_label("Body").fill("Dear Ada,\n\nYour refund is on its way.\n\n<Rundesk>")
    page.get_by_label("Why (required to reject").fill("shorter and kinder")
    page.get_by_role("button", name="Record the decision").click()

    expect(page.locator(".messages")).to_contain_text("Recorded: approve with an edit by ana.")
    expect(page.locator("#approval-diff")).to_contain_text("+subject: Your refund is on its way")
    expect(page.locator("#approval-diff")).to_contain_text(f"-subject: {SUBJECT}")
    expect(page.locator("#approval-sent")).to_contain_text("<Rundesk>")  # escaped, shown as text
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "approval-edited.png", full_page=True)

    assert claim_and_drive(run.pk) == RunStatus.COMPLETED
    (mail,) = receivers.mailbox.messages()
    assert mail["Subject"] == "Your refund is on its way"
    body = mail.get_content().replace("\r\n", "\n").strip()
    assert body == "Dear Ada,\n\nYour refund is on its way.\n\n<Rundesk>"
    assert Approval.objects.get(run=run).sent["body"].endswith("<Rundesk>")
