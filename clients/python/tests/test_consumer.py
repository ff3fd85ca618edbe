"""dedup and dedup_batch: the handler's writes and the marks, one transaction."""
import asyncio
import uuid

import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import POOL_KWARGS
from pg_idempotency import dedup, dedup_batch

INSERT = "INSERT INTO orders (sku, qty) VALUES (%s, 1)"


@pytest.fixture(scope="module")
def pool():
    with ConnectionPool("", open=True, min_size=1, kwargs=POOL_KWARGS) as pool:
        yield pool


def rows(db, sku):
    return db.execute("SELECT count(*) FROM orders WHERE sku = %s", (sku,)).fetchone()[0]


def handle(message, conn):
    conn.execute(INSERT, (message["sku"],))
    if message.get("fail"):
        raise ValueError("the handler failed")


def test_dedup_runs_the_handler_once_per_event(pool, db):
    process = dedup(handle, pool=pool, consumer=f"c-{uuid.uuid4()}")
    message = {"id": "evt-1", "sku": f"sku-{uuid.uuid4()}"}
    assert process(message) is True
    assert process(message) is False
    assert rows(db, message["sku"]) == 1


def test_dedup_a_failing_handler_leaves_nothing_and_runs_again(pool, db):
    process = dedup(handle, pool=pool, consumer=f"c-{uuid.uuid4()}", retention=3600)
    message = {"id": "evt-1", "sku": f"sku-{uuid.uuid4()}", "fail": True}
    with pytest.raises(ValueError):
        process(message)
    assert rows(db, message["sku"]) == 0
    assert process({**message, "fail": False}) is True
    assert rows(db, message["sku"]) == 1


def test_dedup_batch_hands_over_the_new_events_once_each(pool, db):
    consumer, sku = f"c-{uuid.uuid4()}", f"sku-{uuid.uuid4()}"
    seen = []

    def handle_batch(messages, conn):
        seen.extend(messages)
        for message in messages:
            conn.execute(INSERT, (sku,))

    dedup(handle, pool=pool, consumer=consumer)({"id": "e2", "sku": sku})
    batch = [{"id": "e1", "n": 1}, {"id": "e2"}, {"id": "e1", "n": 2}, {"id": "e3"}]
    new = dedup_batch(handle_batch, pool=pool, consumer=consumer)(batch)
    assert new == seen == [{"id": "e1", "n": 1}, {"id": "e3"}]
    assert rows(db, sku) == 3
    assert dedup_batch(handle_batch, pool=pool, consumer=consumer)(batch) == []


def test_dedup_on_an_async_pool(db):
    sku = f"sku-{uuid.uuid4()}"

    async def handle_async(message, conn):
        await conn.execute(INSERT, (sku,))

    async def handle_batch(messages, conn):
        for _ in messages:
            await conn.execute(INSERT, (sku,))

    async def main():
        async with AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS) as pool:
            consumer = f"c-{uuid.uuid4()}"
            process = dedup(handle_async, pool=pool, consumer=consumer)
            batch = dedup_batch(handle_batch, pool=pool, consumer=consumer,
                                event_id=lambda m: m["key"])
            return ([await process({"id": "a"}), await process({"id": "a"})],
                    await batch([{"key": "a"}, {"key": "b"}]))

    once, new = asyncio.run(main())
    assert once == [True, False] and new == [{"key": "b"}]
    assert rows(db, sku) == 2
