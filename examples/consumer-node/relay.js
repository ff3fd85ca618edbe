'use strict';
// An outbox relay over the pull API of the idempotency extension: lease a
// batch of ready events, deliver each one, acknowledge what was delivered and
// nack what failed. Delivery is at least once: an event whose delivery fails
// comes back after a backoff, and one whose relay dies before the ack comes
// back when its lease runs out. Consumers make the effect exactly once.
//
// Every statement runs on its own (autocommit) and keeps no session state,
// so the relay works through pgbouncer in transaction pooling mode too.

const { setTimeout: sleep } = require('node:timers/promises');

// Leased rows come back with `attempts` counting this hand-out: it fences the
// ack and the nack, which act only while the rows are still leased to us (a
// relay whose lease ran out, and whose rows another relay took, changes
// nothing). `per_key` lets a hand-out carry several consecutive rows of a key.
const FETCH = `SELECT id, topic, key, payload, headers, attempts
                 FROM idempotency.idem_outbox_fetch($1, $2, $3::interval, $4)`;
const ACK = 'SELECT idempotency.idem_outbox_ack($1::bigint[], $2::int[]) AS acked';
const NACK = 'SELECT idempotency.idem_outbox_nack($1, $2, $3) AS nacked';

// One round on one topic: returns how many events were fetched, acked, nacked.
async function relayBatch(pool, topic, deliver, { batch = 100, lease = '30 seconds', perKey = 10 } = {}) {
  // The lease commits at once: other relays skip these rows until it runs out.
  const { rows: events } = await pool.query(FETCH, [topic, batch, lease, perKey]);
  if (events.length === 0) return { fetched: 0, acked: 0, nacked: 0 };

  // The rows of a key, oldest first (a row without a key is a queue of its
  // own). Queues are delivered in parallel; a key's rows one after the other,
  // stopping at the first that fails: it is nacked, and the rows after it go
  // back to pending with it, so the key's order holds.
  const queues = new Map();
  for (const event of events) {
    const queue = event.key === null ? Symbol('no key') : event.key;
    if (!queues.has(queue)) queues.set(queue, []);
    queues.get(queue).push(event);
  }
  const delivered = [];
  let nacked = 0;
  await Promise.all([...queues.values()].map(async (queue) => {
    for (const event of queue) {
      try {
        await deliver(event);
        delivered.push(event);
      } catch (reason) {
        // Recorded as last_error; the row is retried with capped exponential
        // backoff, and is dead after idempotency.outbox_max_attempts.
        const error = reason instanceof Error ? reason.message : String(reason);
        const { rows: [{ nacked: done }] } = await pool.query(NACK, [event.id, error, event.attempts]);
        if (done) nacked++;
        return;
      }
    }
  }));
  // Only after every delivery settled: if we die before this, the leases run
  // out and the events are delivered again (the consumer skips them).
  const acked = delivered.length > 0
    ? (await pool.query(ACK, [delivered.map((e) => e.id), delivered.map((e) => e.attempts)])).rows[0].acked
    : 0;
  return { fetched: events.length, acked, nacked };
}

// Relay the topics until `signal` aborts; resolves to the totals.
async function runRelay(pool, topics, deliver, options = {}) {
  const { signal, idleMs = 200, onError = console.error } = options;
  const totals = { fetched: 0, acked: 0, nacked: 0, errors: 0 };
  while (!signal?.aborted) {
    let fetched = 0;
    for (const topic of topics) {
      try {
        const round = await relayBatch(pool, topic, deliver, options);
        fetched += round.fetched;
        totals.fetched += round.fetched;
        totals.acked += round.acked;
        totals.nacked += round.nacked;
      } catch (error) {
        // The database is unreachable, say: whatever we leased comes back
        // by itself when the lease runs out.
        totals.errors++;
        onError(error);
      }
    }
    // Nothing ready (or everything backing off): poll again a little later.
    if (fetched === 0) await sleep(idleMs, undefined, { signal }).catch(() => {});
  }
  return totals;
}

module.exports = { relayBatch, runRelay };
