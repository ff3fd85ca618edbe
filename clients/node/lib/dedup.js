'use strict';
// Consumers: the handler's writes and the event's mark (idem_mark_processed)
// commit in one transaction, so a redelivered message is handled once.

const { interval } = require('./protocol');
const { watch, unwatch } = require('./attempt');

const MARK = 'SELECT idempotency.idem_mark_processed($1, $2, $3::interval) AS first';
const MARK_BATCH = `SELECT event_id
FROM idempotency.idem_mark_processed_batch($1, $2::text[], $3::interval) AS event_id`;

function consumerOptions(options = {}) {
  if (!options.pool) throw new TypeError('pg-idempotency: the "pool" option (a pg.Pool) is required');
  if (!options.consumer) throw new TypeError('pg-idempotency: the "consumer" option is required');
  return {
    pool: options.pool,
    consumer: options.consumer,
    retention: interval(options.retention),
    id: options.id ?? ((message) => message.id),
  };
}

// Runs fn(db) inside BEGIN ... COMMIT on a pooled client; ROLLBACK if it throws
async function inTransaction(pool, fn) {
  const client = await pool.connect();
  watch(client);
  let broken;
  try {
    await client.query('BEGIN');
    const result = await fn(client);
    await client.query('COMMIT');
    return result;
  } catch (error) {
    await client.query('ROLLBACK').catch((rollbackError) => { broken = rollbackError; });
    throw error;
  } finally {
    unwatch(client);
    client.release(broken);
  }
}

// dedup(handler, options) -> async (message) => true when handled now,
// false for a message already handled. handler(message, db) does its
// writes on db, the transaction that marks the message.
function dedup(handler, options) {
  const o = consumerOptions(options);
  return (message) => inTransaction(o.pool, async (db) => {
    const { rows: [{ first }] } = await db.query(MARK, [o.consumer, String(o.id(message)), o.retention]);
    if (first) await handler(message, db);
    return first;
  });
}

// dedupBatch(handler, options) -> async (messages) => the messages handled
// now: handler(fresh, db) gets the messages not handled before, each id
// once, in their order, and runs in the transaction that marks them all.
function dedupBatch(handler, options) {
  const o = consumerOptions(options);
  return (messages) => inTransaction(o.pool, async (db) => {
    const ids = messages.map((message) => String(o.id(message)));
    const { rows } = await db.query(MARK_BATCH, [o.consumer, ids, o.retention]);
    const fresh = new Set(rows.map((row) => row.event_id));
    const todo = messages.filter((message, i) => fresh.delete(ids[i]));
    if (todo.length > 0) await handler(todo, db);
    return todo;
  });
}

module.exports = { dedup, dedupBatch };
