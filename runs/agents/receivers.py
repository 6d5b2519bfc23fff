"""Real local receivers of the support agent's effects, for the demo and
the tests: an SMTP server that keeps every mail it accepts, and an HTTP
helpdesk that keeps every ticket update, one per Idempotency-Key.

Each keeps what it receives in a folder (the mailbox's .eml files, the
helpdesk's updates.jsonl), so a person can look, and each can be told to
lose its answer to the first mail to an address, or the first update of a
ticket: it keeps the mail or the update, then drops the connection before
answering, as a network would.  Both run on threads of the process that
starts them, and stop with it.
"""

from __future__ import annotations

import html
import json
import re
import threading
from collections.abc import Collection
from email import message_from_bytes, policy
from email.message import EmailMessage
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session


class Mailbox:
    """An SMTP server (aiosmtpd) on `host`:`port` (0: any free one) that
    accepts every mail and keeps it in `folder` as NNNN.eml."""

    def __init__(
        self,
        folder: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lose_answers_to: Collection[str] = (),
    ) -> None:
        self.folder = folder
        self.lose_answers_to = set(lose_answers_to)
        self._lock = threading.Lock()
        self._controller = _Controller(self, hostname=host, port=port)

    @property
    def url(self) -> str:
        return f"smtp://{self._controller.hostname}:{self._controller.port}"

    def start(self) -> Mailbox:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._controller.start()
        return self

    def stop(self) -> None:
        self._controller.stop()

    def __enter__(self) -> Mailbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def messages(self) -> list[EmailMessage]:
        """Every mail kept, in the order they came."""
        return [
            message_from_bytes(path.read_bytes(), policy=policy.default)  # type: ignore[misc]
            for path in sorted(self.folder.glob("*.eml"))
        ]

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self._lock:
            number = len(list(self.folder.glob("*.eml"))) + 1
            target = self.folder / f"{number:04d}.eml"
            target.write_bytes(envelope.original_content or b"")
            lost = self.lose_answers_to & set(envelope.rcpt_tos)
            self.lose_answers_to -= lost
        if lost and server.transport is not None:
            server.transport.abort()  # kept, and not a word back
        return "250 OK: kept as " + target.name


class _Controller(Controller):
    """aiosmtpd's Controller, on a free port when told port 0: it checks
    the server is up by connecting to the port it was given."""

    def _trigger_server(self) -> None:
        self.port = self.server.sockets[0].getsockname()[1]
        super()._trigger_server()


# The path an update of a ticket is posted to, below the helpdesk's address.
UPDATES = re.compile(r"/(?:.*/)?tickets/([^/]+)/updates")


class Helpdesk:
    """An HTTP helpdesk on `host`:`port` (0: any free one).  POST
    .../tickets/ID/updates with an Idempotency-Key keeps the update (201)
    and answers its number; the same key again answers the same (200) and
    keeps nothing new; the same key with another body is refused (422).
    GET / shows every update; GET .../tickets/ID/updates answers a
    ticket's as JSON."""

    def __init__(
        self,
        folder: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lose_answers_for: Collection[str] = (),
    ) -> None:
        self.folder = folder
        self.lose_answers_for = set(lose_answers_for)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> Helpdesk:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Helpdesk:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _file(self) -> Path:
        return self.folder / "updates.jsonl"

    def updates(self, ticket: str | None = None) -> list[dict[str, Any]]:
        """Every update kept (of `ticket` only, if given), in order."""
        if not self._file.exists():
            return []
        kept = [json.loads(line) for line in self._file.read_text().splitlines()]
        return [update for update in kept if ticket in (None, update["ticket"])]

    def receive(self, ticket: str, key: str, body: bytes) -> tuple[int, dict[str, Any], bool]:
        """Keeps an update once per key: the status, the answer, and
        whether the answer is to be lost."""
        with self._lock:
            kept = self.updates()
            if earlier := next((u for u in kept if u["idempotency_key"] == key), None):
                if earlier["body"] != body.decode("utf-8", "replace"):
                    return 422, {"error": "this Idempotency-Key came with another update"}, False
                return 200, _answer(earlier), False
            update = {
                "number": len(kept) + 1,
                "ticket": ticket,
                "idempotency_key": key,
                "body": body.decode("utf-8", "replace"),
            }
            with self._file.open("a") as handle:
                handle.write(json.dumps(update) + "\n")
            # Only a ticket's first update ever: kept from an earlier start
            # of the helpdesk, it is not lost again.
            lost = ticket in self.lose_answers_for and ticket not in {u["ticket"] for u in kept}
            self.lose_answers_for.discard(ticket)
        return 201, _answer(update), lost

    def page(self) -> str:
        """Every update as a person reads it: the reply as it was sent."""
        rows = []
        for update in self.updates():
            fields = _fields(update["body"])
            reply = fields.pop("reply", update["body"])
            said = "".join(
                f"{html.escape(k)}: {html.escape(str(v))}<br>" for k, v in fields.items()
            )
            rows.append(
                f"<tr><td>{update['number']}</td><td>{html.escape(update['ticket'])}</td>"
                f"<td><code>{html.escape(update['idempotency_key'])}</code></td>"
                f"<td>{said}<pre>{html.escape(str(reply))}</pre></td></tr>"
            )
        return (
            "<!doctype html><meta charset=utf-8><title>Helpdesk</title>"
            "<h1>Ticket updates received</h1><table border=1><tr><th>#</th><th>ticket</th>"
            f"<th>Idempotency-Key</th><th>update</th></tr>{''.join(rows)}</table>"
        )


def _answer(update: dict[str, Any]) -> dict[str, Any]:
    return {"ticket": update["ticket"], "update": update["number"]}


def _fields(body: str) -> dict[str, Any]:
    """An update's fields, if it is a JSON object ({} if not)."""
    try:
        fields = json.loads(body)
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _handler(helpdesk: Helpdesk) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            match = UPDATES.fullmatch(self.path.partition("?")[0])
            key = self.headers.get("Idempotency-Key", "")
            if match is None:
                self._json(404, {"error": "POST to /tickets/ID/updates"})
            elif not key:
                self._json(400, {"error": "an update needs an Idempotency-Key"})
            else:
                status, answer, lost = helpdesk.receive(match[1], key, body)
                if lost:
                    self.close_connection = True  # kept, and not a word back
                    return
                self._json(status, answer)

        def do_GET(self) -> None:
            path = self.path.partition("?")[0]
            if match := UPDATES.fullmatch(path):
                self._json(200, {"updates": helpdesk.updates(match[1])})
            elif path == "/":
                self._send(200, "text/html; charset=utf-8", helpdesk.page().encode())
            else:
                self._json(404, {"error": "GET / or /tickets/ID/updates"})

        def _json(self, status: int, answer: dict[str, Any]) -> None:
            self._send(status, "application/json", json.dumps(answer).encode())

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler
