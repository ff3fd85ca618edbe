"""Statements sent as one query string by the simple protocol, for psycopg 3.

The one-transaction mode's own round trips (BEGIN with the claim, the
completion with COMMIT) go this way in the ASGI and Flask adapters, as in
the Node package: the simple protocol runs several statements in one
string and prepares nothing, which is safe through pgbouncer's transaction
pooling. The %s arguments are bound here as literals, and the rows read
back from libpq directly (psycopg.pq, psycopg's public wrapper), with as
few calls into libpq as a statement needs: Debian's psycopg calls libpq
through ctypes, and each call lets go of the GIL, which under a threaded
server (gunicorn's threads, 8 requests at once) made a replay through a
psycopg cursor cost twice the Python time it takes alone (bench/README.md).

A text argument with a quote or a backslash is escaped by PQescapeLiteral,
for the connection's encoding and settings as they are at that moment; one
without either (the usual) needs no escaping: it is quoted as it is.
"""
from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Optional

import psycopg
from psycopg import pq

from ._protocol import CLAIM, COMPLETE_OR_ABORT, LEASE_LEFT, Claim

Row = Optional[list[Optional[str]]]

_MICROSECOND = timedelta(microseconds=1)


class Statements:
    """One or more statements with %s arguments, as one query string."""

    def __init__(self, sql: str) -> None:
        self.parts = [part.encode("ascii") for part in sql.split("%s")]

    def _query(self, pgconn: pq.abc.PGconn, encoding: str, params: tuple[Any, ...]) -> bytes:
        query = [self.parts[0]]
        for value, part in zip(params, self.parts[1:]):
            query.append(_literal(pgconn, encoding, value))
            query.append(part)
        return b"".join(query)

    def run(self, conn: psycopg.Connection[Any], params: tuple[Any, ...] = ()) -> Row:
        """Sync: the row of the last statement (as text), or None without one.

        PQexec, which waits in libpq with the GIL let go, and answers with
        the last statement's result, or the error of the first that failed
        (the server skips those after it), raised as psycopg's class for its
        SQLSTATE.
        """
        pgconn = conn.pgconn
        encoding = conn.info.encoding
        query = self._query(pgconn, encoding, params)
        with conn.lock:  # as psycopg's own calls: one at a time
            result = pgconn.exec_(query)
        return _row(result, encoding)

    async def send(self, conn: psycopg.AsyncConnection[Any], params: tuple[Any, ...] = (),
                   row_of: int = 0) -> Row:
        """Async: the row of statement ``row_of`` (as text), or None without
        one; waiting on the event loop. The first statement that fails
        raises its error, and the server skips those after it."""
        pgconn = conn.pgconn
        encoding = conn.info.encoding
        query = self._query(pgconn, encoding, params)
        async with conn.lock:
            results = await _exchange(pgconn, query)
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=encoding)
        return _row(results[row_of], encoding)


# The one-transaction mode's statements, as both adapters send them
BEGIN_CLAIM = Statements("BEGIN; " + CLAIM)
LEASE_LEFT_OF = Statements(LEASE_LEFT)
COMPLETE_COMMIT = Statements(COMPLETE_OR_ABORT + "; COMMIT")
COMMIT = Statements("COMMIT")
ROLLBACK = Statements("ROLLBACK")


def claim_of(row: Row) -> Claim:
    """idem_claim's row as text, typed as psycopg reads it."""
    assert row is not None
    outcome, status, body, headers, attempt, recovery_point, lease_expires_at = row
    return Claim(str(outcome), int_of(status), body, headers, int_of(attempt), recovery_point,
                 lease_expires_at)


def int_of(text: Optional[str]) -> Optional[int]:
    return None if text is None else int(text)


def _row(result: pq.abc.PGresult, encoding: str) -> Row:
    if result.status == pq.ExecStatus.FATAL_ERROR:
        raise psycopg.errors.error_from_result(result, encoding=encoding)
    if result.ntuples == 0:
        return None
    return [None if value is None else value.decode(encoding)
            for value in (result.get_value(0, column) for column in range(result.nfields))]


def _literal(pgconn: pq.abc.PGconn, encoding: str, value: Any) -> bytes:
    if value is None:
        return b"NULL"
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d" % value
    if isinstance(value, timedelta):
        return b"'%d microseconds'::interval" % (value // _MICROSECOND)
    data = str(value).encode(encoding)
    if b"\x00" in data:  # PQescapeLiteral would cut the string there
        raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    if b"'" not in data and b"\\" not in data:
        # nothing to escape (the usual key, scope and fingerprint): no byte
        # of it, even inside a character of a multibyte encoding, can end
        # the literal or start an escape, whatever standard_conforming_strings
        # says; half the binding's cost, without libpq's call
        return b"'" + data + b"'"
    return bytes(pq.Escaping(pgconn).escape_literal(data))


async def _exchange(pgconn: pq.abc.PGconn, query: bytes) -> list[pq.abc.PGresult]:
    """Send one query string, wait on the event loop for all its results.

    Cancelled in the middle, the connection is left busy: the pool closes
    such a connection rather than reuse it, as it does after psycopg's own.
    """
    pgconn.send_query(query)
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():  # what did not fit in the socket's buffer
        await _ready(loop, fd, loop.add_writer, loop.remove_writer)
    results = []
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)
        await _ready(loop, fd, loop.add_reader, loop.remove_reader)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, add: Any, remove: Any) -> None:
    ready = loop.create_future()
    add(fd, ready.set_result, None)
    try:
        await ready
    finally:
        remove(fd)
