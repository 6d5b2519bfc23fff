"""The filesystem broker (dashboard/broker.py): a consumer polling the
folder while messages are written never takes one half-written, and a file
that is not a message is skipped, not fatal."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

import pytest
from kombu import Connection

from dashboard.broker import Transport

# Big enough that writing one takes a while: kombu's own transport lets a
# consumer take the file in the middle.
PAYLOAD = "x" * 400_000
MESSAGES = 200
# kombu keeps the exchanges declared in a process in one state shared by every
# connection, so each test has a queue name of its own: one declared by an
# earlier test would not be declared again in this test's folder.


def connection(folder: Path) -> Connection:
    return Connection(
        "filesystem://",
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder),
            "store_processed": False,
            "polling_interval": 0,
        },
    )


def test_filesystem_urls_use_the_projects_transport(tmp_path: Path):
    with connection(tmp_path) as conn:
        assert conn.get_transport_cls() is Transport


def produce(folder: Path, name: str) -> None:
    with connection(folder) as conn, conn.SimpleQueue(name) as queue:
        for n in range(MESSAGES):
            queue.put({"n": n, "body": PAYLOAD})


def test_a_consumer_polling_while_messages_are_written_gets_each_whole(tmp_path: Path):
    name = "whole"
    received = []
    # The producer is a process of its own: it writes while the consumer reads.
    producer = multiprocessing.get_context("fork").Process(target=produce, args=(tmp_path, name))
    with connection(tmp_path) as conn, conn.SimpleQueue(name) as queue:
        producer.start()
        try:
            while len(received) < MESSAGES:
                message = queue.get(block=True, timeout=30)
                assert message.payload["body"] == PAYLOAD
                received.append(message.payload["n"])
                message.ack()
        finally:
            producer.join(30)
    assert producer.exitcode == 0
    assert sorted(received) == list(range(MESSAGES))  # in the same ms, in any order
    assert list(tmp_path.iterdir()) == [tmp_path / f"{name}.exchange"]


def test_a_file_that_is_not_a_message_is_logged_and_skipped(tmp_path: Path, caplog):
    name = "broken"
    with connection(tmp_path) as conn, conn.SimpleQueue(name) as queue:
        (tmp_path / f"1_empty.{name}.msg").write_bytes(b"")
        (tmp_path / f"2_garbled.{name}.msg").write_bytes(b"\xff{not json")
        queue.put({"n": 1})
        with caplog.at_level(logging.ERROR, logger="dashboard.broker"):
            message = queue.get(block=True, timeout=5)
        assert message.payload == {"n": 1}
        message.ack()
        with pytest.raises(queue.Empty):
            queue.get(block=False)
    skipped = [r for r in caplog.records if "not JSON" in r.getMessage()]
    assert len(skipped) == 2
    assert list(tmp_path.glob("*.msg")) == []
