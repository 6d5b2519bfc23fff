"""Real local HTTP servers standing in for services the project does not
own: a report receiver (webhook) and an OpenAI-compatible model API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    def __init__(self, respond: Callable[[BaseHTTPRequestHandler, bytes], None]) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append((dict(self.headers), body))
                respond(self, body)

            do_GET = do_POST  # a client that follows a redirect may send one

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # Looks for shutdown() every 20 ms (serve_forever's default, 0.5 s, is
        # what each test would wait at its end).
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> LocalServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def status(
    code: int, delay: float = 0.0, headers: dict[str, str] | None = None
) -> Callable[[BaseHTTPRequestHandler, bytes], None]:
    def respond(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        time.sleep(delay)
        handler.send_response(code)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return respond


def chat_completion(text: str | None) -> Callable[[BaseHTTPRequestHandler, bytes], None]:
    def respond(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload.encode())

    return respond
