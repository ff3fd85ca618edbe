"""Consumer dedup: a message handler's writes and its mark, in one transaction.

    process = dedup(handle_order, pool=pool, consumer="billing")
    for message in broker:          # any client: Kafka, RabbitMQ, SQS...
        process(message)            # runs handle_order(message, conn) once per id
        message.ack()

A handler that raises rolls back its writes and the mark, so the
redelivery runs it again. With a psycopg_pool.AsyncConnectionPool the
returned function is a coroutine function and the handler must be one too.
"""
from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

M = TypeVar("M")  # a message

MARK = "SELECT idempotency.idem_mark_processed(%s, %s, %s)"
MARK_BATCH = "SELECT event_id FROM idempotency.idem_mark_processed_batch(%s, %s, %s) AS event_id"

__all__ = ["dedup", "dedup_batch"]


def message_id(message: Any) -> str:
    """The default event id: ``message["id"]``, or ``message.id``."""
    try:
        return str(message["id"])
    except (TypeError, KeyError):
        return str(message.id)


def _interval(value: Union[None, float, timedelta]) -> Optional[timedelta]:
    return value if value is None or isinstance(value, timedelta) else timedelta(seconds=value)


def _is_async(pool: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(pool, "getconn", None))


def dedup(handler: Callable[[M, Any], Any], *, pool: Any, consumer: str,
          event_id: Callable[[M], str] = message_id,
          retention: Union[None, float, timedelta] = None) -> Callable[[M], Any]:
    """Wrap ``handler(message, conn)`` to run once per event id.

    The wrapper returns True when the handler ran (and committed), False
    for a duplicate. ``retention`` is how long the mark is kept (seconds or
    a timedelta; default idempotency.event_retention).
    """
    keep = _interval(retention)
    if _is_async(pool):
        async def process_async(message: M) -> bool:
            async with pool.connection() as conn, conn.transaction():
                cursor = await conn.execute(MARK, (consumer, event_id(message), keep),
                                            prepare=False)
                if not (await cursor.fetchone())[0]:
                    return False
                await handler(message, conn)
                return True
        return process_async

    def process(message: M) -> bool:
        with pool.connection() as conn, conn.transaction():
            if not conn.execute(MARK, (consumer, event_id(message), keep),
                                prepare=False).fetchone()[0]:
                return False
            handler(message, conn)
            return True
    return process


def dedup_batch(handler: Callable[[list[M], Any], Any], *, pool: Any, consumer: str,
                event_id: Callable[[M], str] = message_id,
                retention: Union[None, float, timedelta] = None,
                ) -> Callable[[Sequence[M]], Any]:
    """Wrap ``handler(new_messages, conn)`` for a batch (a broker's poll).

    One idem_mark_processed_batch marks every id; the handler gets the
    messages new to the consumer, in order, each id once, in the same
    transaction. The wrapper returns those messages (the handler is not
    called when there are none); acknowledge the whole batch afterwards.
    """
    keep = _interval(retention)

    def new_ones(messages: Sequence[M], fresh: set[str]) -> list[M]:
        chosen = []
        for message in messages:
            mid = event_id(message)
            if mid in fresh:
                fresh.discard(mid)  # a repeated id: its first message only
                chosen.append(message)
        return chosen

    if _is_async(pool):
        async def process_async(messages: Sequence[M]) -> list[M]:
            async with pool.connection() as conn, conn.transaction():
                cursor = await conn.execute(
                    MARK_BATCH, (consumer, [event_id(m) for m in messages], keep), prepare=False)
                chosen = new_ones(messages, {row[0] for row in await cursor.fetchall()})
                if chosen:
                    await handler(chosen, conn)
                return chosen
        return process_async

    def process(messages: Sequence[M]) -> list[M]:
        with pool.connection() as conn, conn.transaction():
            rows = conn.execute(MARK_BATCH, (consumer, [event_id(m) for m in messages], keep),
                                prepare=False).fetchall()
            chosen = new_ones(messages, {row[0] for row in rows})
            if chosen:
                handler(chosen, conn)
            return chosen
    return process
