"""runs/postgresql: a connection the pool has served before is taken again
without Django's set-up of a new connection, and handed out as Django's
connect() hands one out: autocommit on, no transaction state left over.
A real pool on the test database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from runs.postgresql.base import DatabaseWrapper

pytestmark = pytest.mark.django_db


@pytest.fixture
def pooled() -> Iterator[DatabaseWrapper]:
    """A wrapper of this backend on the test database, with a pool of one
    connection (every taking takes the same one).  Its alias is the
    default's (the receivers of connection_created look the alias up), whose
    own wrapper in the tests has no pool."""
    options = {**connection.settings_dict["OPTIONS"], "pool": {"min_size": 1, "max_size": 1}}
    db = DatabaseWrapper(
        {**connection.settings_dict, "CONN_MAX_AGE": 0, "OPTIONS": options}, alias="default"
    )
    try:
        yield db
    finally:
        db.close()
        db.close_pool()


@pytest.fixture
def set_up() -> Iterator[list[Any]]:
    """The raw connections connection_created is sent for."""
    made: list[Any] = []

    def receiver(sender: object, connection: Any, **kwargs: object) -> None:
        made.append(connection.connection)

    connection_created.connect(receiver)
    try:
        yield made
    finally:
        connection_created.disconnect(receiver)


def in_autocommit(db: DatabaseWrapper) -> bool:
    with db.cursor() as cursor:
        cursor.execute("SELECT 1")
    raw = db.connection
    return (
        db.get_autocommit()
        and raw.autocommit
        and (raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)
    )


def test_a_connection_taken_again_is_set_up_once(pooled, set_up):
    taken = []
    for _ in range(3):
        pooled.ensure_connection()
        taken.append(pooled.connection)
        assert in_autocommit(pooled)
        pooled.close()
    assert taken == [taken[0]] * 3  # the pool's one connection
    assert set_up == [taken[0]]


def test_a_connection_given_back_inside_a_transaction_comes_back_in_autocommit(pooled, set_up):
    pooled.ensure_connection()
    pooled.set_autocommit(False)
    with pooled.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert not pooled.connection.autocommit
    pooled.close()  # the pool rolls the transaction back
    pooled.ensure_connection()
    assert in_autocommit(pooled)
    assert not pooled.in_atomic_block and not pooled.needs_rollback
