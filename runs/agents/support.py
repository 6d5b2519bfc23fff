"""The support reply agent: "answer this customer's ticket", with real effects.

It reads the ticket and the knowledge-base articles side by side (one
boundary write for all of them), has the model draft a reply (published as
revision 1), publishes the reply as it will be sent (the final revision),
then sends it by email over SMTP and updates the ticket in the helpdesk
over HTTP.  Both are effects, declared differently: SMTP carries no
idempotency key, so after a lost answer an operator can only say whether
the mail arrived; the helpdesk keeps one update per Idempotency-Key, so
sending it again under the same identity is safe.  The mail's Message-ID
holds the action's key, for an operator to find it at the receiver.

Written on the public agent API (runs/agent.py) alone.  It saves no
checkpoints: after a crash `run()` steps through its receipts again.  A
run that names no articles answers from every article of the knowledge
base as it is when the run starts; their names are in the draft's input,
so a knowledge base changed before a resume makes the draft another piece
of work, which the runtime refuses to pass off as the first (the run waits
for an operator) rather than draft again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import email.errors
import email.utils
import hashlib
import json
import re
import smtplib
import time
import urllib.parse
from email.headerregistry import Address
from email.message import EmailMessage
from email.policy import SMTP
from pathlib import Path
from typing import Any, ClassVar

from django.conf import settings

from runs.agent import (
    EFFECT,
    READ,
    ActionFailed,
    Agent,
    OutcomeUnknown,
    Step,
    Tool,
    ToolCall,
    ToolFailed,
    ToolRefused,
)
from runs.agents.corpus import NotInCorpus, corpus_file
from runs.agents.providers import SUPPORT_INSTRUCTIONS, support_prompt
from runs.agents.tools import (
    MAX_DOCUMENT_BYTES,
    MODEL_CALL,
    decoded,
    journal,
    named_address,
    post,
    resolve_in_corpus,
    shown_address,
)

# The sample folder's layout (RUNDESK_SUPPORT_DIR): a ticket per JSON file
# named by its id, the knowledge base's articles as markdown.
TICKETS, ARTICLES = "tickets", "articles"
TICKET_ID = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
TICKET_FIELDS = ("id", "customer", "subject", "body")


# -- reading -----------------------------------------------------------------------


def ticket_file(ticket: str) -> Path:
    """The file of ticket `ticket` in the support folder, or NotInCorpus."""
    return corpus_file(f"{TICKETS}/{ticket}.json", settings.RUNDESK_SUPPORT_DIR)


def load_ticket(path: Path) -> dict[str, str]:
    """A ticket file's fields, or ValueError saying what it lacks."""
    try:
        ticket = json.loads(decoded(path.read_bytes()[: MAX_DOCUMENT_BYTES + 1]))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path.name} is no ticket: {error}") from None
    if not isinstance(ticket, dict):
        raise ValueError(f"{path.name} is no ticket: not a JSON object")
    if missing := [name for name in TICKET_FIELDS if not isinstance(ticket.get(name), str)]:
        raise ValueError(f"{path.name} is no ticket: no {', '.join(missing)}")
    if "@" not in ticket["customer"]:
        raise ValueError(f"{path.name}: its customer {ticket['customer']!r} is no email address")
    return {name: value for name, value in ticket.items() if isinstance(value, str)}


def knowledge_base() -> list[str]:
    """Every article of the knowledge base, by name."""
    folder = Path(settings.RUNDESK_SUPPORT_DIR) / ARTICLES
    return sorted(path.name for path in folder.glob("*.md") if path.is_file())


def read_ticket(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    path = resolve_in_corpus(f"{TICKETS}/{input['ticket']}.json", settings.RUNDESK_SUPPORT_DIR)
    try:
        ticket = load_ticket(path)
    except ValueError as error:
        raise ToolRefused(str(error)) from None
    journal("read_ticket", call.identity, ticket=input["ticket"])
    return ticket


def read_article(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    path = resolve_in_corpus(f"{ARTICLES}/{input['article']}", settings.RUNDESK_SUPPORT_DIR)
    try:
        data = path.read_bytes()[:MAX_DOCUMENT_BYTES]
    except OSError as error:  # no permission, an I/O error: a definite answer
        raise ToolRefused(f"{input['article']}: {error.strerror or error}") from None
    journal("read_article", call.identity, article=input["article"])
    return {"article": input["article"], "text": decoded(data)}


# -- sending the reply by email -----------------------------------------------------


def smtp_server() -> tuple[str, int]:
    parts = urllib.parse.urlsplit(settings.RUNDESK_SMTP_URL)
    return parts.hostname or "", parts.port or 25


def message_id(idempotency_key: str) -> str:
    """The Message-ID a reply sent under `idempotency_key` carries: the key
    as an RFC 5322 id holds it (no colon), unique as the key is."""
    return f"<{re.sub(r'[^A-Za-z0-9-]+', '.', idempotency_key).strip('.')}@rundesk>"


def mail_receiver(input: dict[str, Any], idempotency_key: str) -> str:
    host, port = smtp_server()
    return f"smtp://{host}:{port}, Message-ID {message_id(idempotency_key)}, to {input['to']}"


def send_email(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """Sends the reply through RUNDESK_SMTP_URL.  Until the server has the
    whole message, a failure leaves it known not sent (ToolFailed): no
    connection, a command refused, the connection lost while the message
    was still going out (its closing dot was not sent).  Once the closing
    dot is sent, only the server's answer says whether it took the mail:
    lost, the outcome is unknown; a refusal, known not sent."""
    message = EmailMessage(policy=SMTP)
    try:
        message["From"] = settings.RUNDESK_SUPPORT_FROM
        message["To"] = Address(addr_spec=input["to"])
        message["Subject"] = input["subject"]
        message["Message-ID"] = message_id(call.idempotency_key)
        if input.get("ticket"):
            message["X-Ticket"] = input["ticket"]
        message.set_content(input["body"])
    except (ValueError, email.errors.MessageError) as error:
        raise ToolFailed(f"no mail can say this: {error}") from error
    # A line that begins with a dot is sent with one more (RFC 5321 4.5.2).
    data = re.sub(rb"(?m)^\.", b"..", message.as_bytes()) + b".\r\n"
    host, port = smtp_server()
    deadline = time.monotonic() + call.timeout

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    try:
        smtp = smtplib.SMTP(host, port, timeout=left())
    except (OSError, smtplib.SMTPException) as error:
        raise ToolFailed(f"mail server smtp://{host}:{port} unreachable: {error}") from error
    try:
        try:
            smtp.ehlo_or_helo_if_needed()
            sender = email.utils.parseaddr(settings.RUNDESK_SUPPORT_FROM)[1]
            for command, accepted in (
                (f"MAIL FROM:<{sender}>", (250,)),
                (f"RCPT TO:<{input['to']}>", (250, 251)),
                ("DATA", (354,)),
            ):
                smtp.sock.settimeout(left())
                code, said = smtp.docmd(command)
                if code not in accepted:
                    raise ToolFailed(
                        f"mail server refused {command.split(':')[0]}: {code} {_text(said)}"
                    )
            smtp.sock.settimeout(left())
            smtp.send(data)
        except (OSError, smtplib.SMTPException) as error:
            raise ToolFailed(f"mail not sent: {error!r}") from error
        try:
            smtp.sock.settimeout(left())
            code, said = smtp.getreply()
        except (OSError, smtplib.SMTPException) as error:
            raise OutcomeUnknown(f"mail sent, the server's answer lost: {error!r}") from error
        if code != 250:
            raise ToolFailed(f"mail server refused the message: {code} {_text(said)}")
    finally:
        with contextlib.suppress(OSError, smtplib.SMTPException):
            smtp.quit()
        smtp.close()
    journal("send_email", call.identity, to=input["to"], message_id=message["Message-ID"])
    return {
        "sent_to": input["to"],
        "message_id": message["Message-ID"],
        "server": f"smtp://{host}:{port}",
        "answer": f"{code} {_text(said)}",
    }


def _text(said: bytes) -> str:
    return said.decode("utf-8", "replace")


# -- updating the ticket in the helpdesk -------------------------------------------------


def ticket_updates_url(ticket: str) -> str:
    """Where the updates of `ticket` are posted: below RUNDESK_HELPDESK_URL's
    path, its query kept."""
    parts = urllib.parse.urlsplit(settings.RUNDESK_HELPDESK_URL)
    path = f"{parts.path.rstrip('/')}/tickets/{urllib.parse.quote(ticket, safe='')}/updates"
    return urllib.parse.urlunsplit(parts._replace(path=path))


def helpdesk_receiver(input: dict[str, Any], idempotency_key: str) -> str:
    address = shown_address(ticket_updates_url(input["ticket"]))
    return f"{address}, Idempotency-Key {idempotency_key}"


def update_ticket(input: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    """POSTs the ticket's update with the action's Idempotency-Key: the
    helpdesk keeps one update per key, so a resend under it adds none."""
    url = ticket_updates_url(input["ticket"])
    body = json.dumps(input, sort_keys=True).encode()
    status = post(
        url,
        body,
        call.idempotency_key,
        content_type="application/json",
        timeout=call.timeout,
        what="the ticket update",
    )
    journal("update_ticket", call.identity, ticket=input["ticket"], status=status)
    return {
        "updated": named_address(url),
        "status": status,
        "sha256": hashlib.sha256(body).hexdigest(),
    }


TICKET = {
    "type": "object",
    "required": ["ticket"],
    "properties": {"ticket": {"type": "string", "pattern": TICKET_ID}},
}
ARTICLE = {
    "type": "object",
    "required": ["article"],
    "properties": {"article": {"type": "string", "minLength": 1}},
}
EMAIL = {
    "type": "object",
    "required": ["to", "subject", "body"],
    "properties": {
        "to": {"type": "string", "pattern": r"^[^\s<>@]+@[^\s<>@]+$"},
        "subject": {"type": "string"},
        "body": {"type": "string"},
        "ticket": {"type": "string"},
    },
}
UPDATE = {
    "type": "object",
    "required": ["ticket", "status", "reply"],
    "properties": {
        "ticket": {"type": "string", "pattern": TICKET_ID},
        "status": {"type": "string"},
        "reply": {"type": "string"},
        "message_id": {"type": "string"},
    },
}

# SMTP and the helpdesk each have this long, connecting included.
EFFECT_TIMEOUT = 30.0
READ_TICKET = Tool("read_ticket", READ, read_ticket, timeout=30, input_schema=TICKET)
READ_ARTICLE = Tool("read_article", READ, read_article, timeout=30, input_schema=ARTICLE)
SEND_EMAIL = Tool(
    "send_email",
    EFFECT,
    send_email,
    # SMTP has no idempotency key: a mail sent again is a second mail.
    accepts_idempotency_key=False,
    timeout=EFFECT_TIMEOUT,
    input_schema=EMAIL,
    receiver=mail_receiver,
)
# The same mail, sent only once a person approved it (runs/approvals.py):
# what ApprovedSupportAgent sends its replies with.
SEND_REPLY = dataclasses.replace(
    SEND_EMAIL, name="send_reply", needs_approval=True, approval_timeout=dt.timedelta(hours=2)
)
UPDATE_TICKET = Tool(
    "update_ticket",
    EFFECT,
    update_ticket,
    accepts_idempotency_key=True,
    timeout=EFFECT_TIMEOUT,
    input_schema=UPDATE,
    receiver=helpdesk_receiver,
)


# -- the agent -------------------------------------------------------------------------


class SupportAgent(Agent):
    name = "support"
    version = "1"
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "required": ["ticket"],
        "properties": {
            "ticket": {"type": "string", "pattern": TICKET_ID},
            # The knowledge base's articles to answer from (every one, if
            # not named).
            "articles": {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "uniqueItems": True,
            },
        },
        "additionalProperties": False,
    }
    tools = (READ_TICKET, READ_ARTICLE, MODEL_CALL, SEND_EMAIL, UPDATE_TICKET)
    # The tool its reply is sent with.
    send_tool: ClassVar[str] = SEND_EMAIL.name
    drill_input: ClassVar[dict[str, Any]] = {
        "ticket": "T-1042",
        "articles": ["refunds.md", "shipping.md"],
    }

    @classmethod
    def check_input(cls, input: dict[str, Any]) -> None:
        try:
            load_ticket(ticket_file(input["ticket"]))
        except NotInCorpus:
            raise ValueError(
                f"input.ticket: no ticket {input['ticket']!r} in "
                f"{Path(settings.RUNDESK_SUPPORT_DIR) / TICKETS}"
            ) from None
        except ValueError as error:
            raise ValueError(f"input.ticket: {error}") from None
        for index, article in enumerate(input.get("articles", [])):
            try:
                corpus_file(f"{ARTICLES}/{article}", settings.RUNDESK_SUPPORT_DIR)
            except NotInCorpus as error:
                raise ValueError(f"input.articles[{index}]: {error}") from None

    @classmethod
    def title(cls, input: dict[str, Any]) -> str:
        try:
            subject = load_ticket(ticket_file(input["ticket"]))["subject"]
        except ValueError:  # NotInCorpus too: a run queued before it went
            return f"Reply to ticket {input['ticket']}"
        return f"Reply to ticket {input['ticket']}: {subject}"

    @classmethod
    def documents(cls, input: dict[str, Any]) -> list[str]:
        articles = input.get("articles") or knowledge_base()
        return [f"{TICKETS}/{input['ticket']}.json", *(f"{ARTICLES}/{a}" for a in articles)]

    def run(self) -> None:
        """Reads, drafts, publishes, then sends the mail and updates the
        ticket.  A ticket that cannot be read ends the run (nothing is
        sent); an article that cannot be read is left out, and said so."""
        ticket_id = self.input["ticket"]
        articles = self.input.get("articles") or knowledge_base()
        ticket, *read = self.ctx.side_by_side(
            [
                Step("ticket", "read_ticket", {"ticket": ticket_id}),
                *(Step(f"article:{a}", "read_article", {"article": a}) for a in articles),
            ]
        )
        if isinstance(ticket, ActionFailed):
            raise ticket
        if "refused" in ticket:
            raise ActionFailed("ticket", ticket["refused"])
        found = [
            (name, result["text"])
            for name, result in zip(articles, read, strict=True)
            if isinstance(result, dict) and "refused" not in result
        ]
        missing = [name for name, _ in zip(articles, read, strict=True) if name not in dict(found)]
        heading = f"Ticket {ticket_id} from {ticket.get('name', '')} <{ticket['customer']}>: "
        prompt = support_prompt(heading + ticket["subject"], ticket["body"], found)
        messages = [
            {"role": "system", "content": SUPPORT_INSTRUCTIONS},
            {"role": "user", "content": prompt},
        ]
        sources = [f"{ARTICLES}/{name}" for name, _ in found]
        draft = self.ctx.step("draft", "model_call", {"messages": messages}, sources=sources)
        self.ctx.publish(f"**Draft**\n\n{draft['text']}", revision=1, used=["draft"])
        subject = f"Re: {ticket['subject']} [{ticket_id}]"
        reply = draft["text"]
        final = f"To: {ticket['customer']}\nSubject: {subject}\n\n{reply}"
        if missing:
            final += "\n\n---\nNot used (could not be read): " + ", ".join(missing)
        self.ctx.publish(final, revision=2, final=True, used=["draft"])
        mail = {"to": ticket["customer"], "subject": subject, "body": reply, "ticket": ticket_id}
        sent = self.ctx.step("send", self.send_tool, mail)
        # The ticket says what the customer got: an approver may have
        # edited the mail, or refused it.
        reply = sent.get("approval", {}).get("input", mail)["body"]
        status = "not answered" if "refused" in sent else "answered"
        update = {"ticket": ticket_id, "status": status, "reply": reply}
        if message := sent.get("message_id"):
            update["message_id"] = message
        self.ctx.step("update", "update_ticket", update)


class ApprovedSupportAgent(SupportAgent):
    """The support agent whose every reply a person approves before it is
    sent (SEND_REPLY): approved, edited and approved, or rejected (then
    the ticket is updated as not answered, and no mail goes)."""

    name = "support-approved"
    tools = (READ_TICKET, READ_ARTICLE, MODEL_CALL, SEND_REPLY, UPDATE_TICKET)
    send_tool: ClassVar[str] = SEND_REPLY.name
    # Drills run unattended: nobody would approve.
    drill_input = None
