'use strict';
// dedup and dedupBatch: the handler's writes and the marks commit together;
// a redelivery is skipped, a failed delivery is handled again.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { randomUUID } = require('node:crypto');
const { dedup, dedupBatch } = require('..');
const { pool, createTables, gate, waitFor } = require('./support');

async function applied(consumer) {
  const { rows } = await pool.query('SELECT event FROM node_applied WHERE consumer = $1 ORDER BY id', [consumer]);
  return rows.map((row) => row.event);
}

before(createTables);

after(() => pool.end());

const record = (consumer) => (message, db) =>
  db.query('INSERT INTO node_applied (consumer, event) VALUES ($1, $2)', [consumer, message.id]);

test('dedup: an event is handled once; a handler that throws leaves nothing, and the redelivery runs', async () => {
  const consumer = `billing-${randomUUID()}`;
  const consume = dedup(record(consumer), { pool, consumer, retention: '1 day' });
  assert.equal(await consume({ id: 'evt-1' }), true);
  assert.equal(await consume({ id: 'evt-1' }), false);

  const failing = dedup(async (message, db) => {
    await record(consumer)(message, db);
    throw new Error('the broker is down');
  }, { pool, consumer });
  await assert.rejects(failing({ id: 'evt-2' }), /the broker is down/);
  assert.deepEqual(await applied(consumer), ['evt-1']);
  assert.equal(await consume({ id: 'evt-2' }), true);
  assert.deepEqual(await applied(consumer), ['evt-1', 'evt-2']);
  // another consumer handles the same event on its own
  const other = `shipping-${randomUUID()}`;
  assert.equal(await dedup(record(other), { pool, consumer: other })({ id: 'evt-1' }), true);
});

test('dedup: a copy delivered while the first is handled waits for it and is skipped', async () => {
  const consumer = `concurrent-${randomUUID()}`;
  const held = gate();
  const entered = gate();
  const consume = dedup(async (message, db) => {
    await record(consumer)(message, db);
    entered.open();
    await held.promise;
  }, { pool, consumer, id: (message) => message.eventId });
  const first = consume({ id: 'x', eventId: 'evt-7' });
  await entered.promise;
  const copy = consume({ id: 'x', eventId: 'evt-7' });
  await waitFor("SELECT count(*)::int AS n FROM pg_stat_activity WHERE query LIKE '%idem_mark_processed%' AND wait_event_type = 'Lock'",
    [], ([row]) => row.n > 0);
  held.open();
  assert.deepEqual(await Promise.all([first, copy]), [true, false]);
  assert.deepEqual(await applied(consumer), ['x']);
});

test('dedupBatch: the handler gets the new events, each once, in order; a failure marks none', async () => {
  const consumer = `batch-${randomUUID()}`;
  const seen = [];
  const consume = dedupBatch(async (messages, db) => {
    seen.push(messages.map((m) => m.id));
    for (const message of messages) await record(consumer)(message, db);
  }, { pool, consumer });
  const ids = (...list) => list.map((id) => ({ id }));

  assert.deepEqual((await consume(ids('a', 'b'))).map((m) => m.id), ['a', 'b']);
  assert.deepEqual((await consume(ids('c', 'a', 'd', 'c'))).map((m) => m.id), ['c', 'd']);
  assert.deepEqual(await consume(ids('a', 'd')), []);
  assert.deepEqual(seen, [['a', 'b'], ['c', 'd']]); // not called for an empty batch

  const failing = dedupBatch(async () => { throw new Error('no'); }, { pool, consumer });
  await assert.rejects(failing(ids('e', 'f', 'a')));
  assert.deepEqual((await consume(ids('f', 'e'))).map((m) => m.id), ['f', 'e']);
  assert.deepEqual(await applied(consumer), ['a', 'b', 'c', 'd', 'f', 'e']);
});
