'use strict';
// Every event is delivered at least twice, in parallel, and some many more
// times; each must take effect exactly once, in order per key.
//
//   - 200 events on 2 topics: 6 keys of 15 events each, and 10 without a key
//   - a relay that "crashes": it leases a batch (1 s lease), delivers it and
//     never acks, so those events come back when the lease runs out
//   - 3 relays, each with its own pool, relaying both topics concurrently
//   - the transport hands every event to 2 consumer instances at once, as a
//     broker that duplicates does
//   - injected failures on the first attempt: some events fail after their
//     effect committed (a lost acknowledgement: nack, redelivered after the
//     backoff, found processed) and some fail inside the transaction after
//     the business write (rolled back with the mark: processed on redelivery)
//
// Connects with the PG* environment variables (node-postgres reads them).

const test = require('node:test');
const assert = require('node:assert/strict');
const pg = require('pg');
const { consume } = require('./consumer');
const { runRelay } = require('./relay');

const run = `${Date.now().toString(36)}${process.pid}`; // re-runs never collide
const TOPICS = [`orders.${run}`, `payments.${run}`];
const KEYS = ['k0', 'k1', 'k2', 'k3', 'k4', 'k5'];
const PER_KEY = 15;
const UNKEYED = 10;
const N = TOPICS.length * (KEYS.length * PER_KEY + UNKEYED); // 200
const CONSUMER = `ledger-${run}`;
const RELAYS = 3;
const DEADLINE_MS = 25000;

// The business effect: one ledger row per event, with no unique constraint,
// so a duplicate effect would show as a second row.
async function applyToLedger(client, event) {
  const { n, amount, failBeforeCommit } = event.payload;
  await client.query(
    'INSERT INTO ledger (event_id, topic, key, n, amount) VALUES ($1, $2, $3, $4, $5)',
    [event.id, event.topic, event.key, n, amount]);
  if (failBeforeCommit && event.attempts === 1) {
    throw new Error('injected: failure after the business write, before commit');
  }
}

test('every event delivered twice and in parallel takes effect exactly once', { timeout: 60000 }, async (t) => {
  const admin = new pg.Pool({ max: 2 });
  const consumers = [new pg.Pool({ max: 5 }), new pg.Pool({ max: 5 })];
  const relays = Array.from({ length: RELAYS }, () => new pg.Pool({ max: 3 }));
  const stop = new AbortController();
  let running = [];
  const started = Date.now();
  try {
    await admin.query('DROP TABLE IF EXISTS ledger');
    await admin.query(`CREATE TABLE ledger (
                         seq bigserial PRIMARY KEY,  -- the order effects were applied in
                         event_id bigint NOT NULL, topic text NOT NULL, key text,
                         n int NOT NULL, amount int NOT NULL)`);

    // Enqueue, keys interleaved; within a key, n = 1..15 in id order.
    const ids = [];
    const client = await admin.connect();
    try {
      await client.query('BEGIN');
      for (const topic of TOPICS) {
        for (let n = 1; n <= PER_KEY; n++) {
          for (const [k, key] of [...KEYS, ...(n <= UNKEYED ? [null] : [])].entries()) {
            // Failures to inject on the first attempt: one of each kind per
            // key, at staggered places; a third of the unkeyed events each.
            const payload = {
              n, amount: 100 * n + k,
              lostAck: key ? n === 3 + k : n % 3 === 1,
              failBeforeCommit: key ? n === 9 + k : n % 3 === 2,
            };
            const { rows: [row] } = await client.query(
              'SELECT idempotency.idem_outbox_enqueue($1, $2, $3) AS id', [topic, payload, key]);
            ids.push(row.id);
          }
        }
      }
      await client.query('COMMIT');
    } finally {
      client.release();
    }
    assert.equal(ids.length, N);

    // The at-least-once transport: both consumer instances get the event at
    // the same time.
    const outcomes = { processed: 0, duplicate: 0, skipped: 0, failed: 0 };
    let deliveries = 0;
    async function transport(event) {
      const copies = consumers.map(async (pool) => {
        deliveries++;
        try {
          outcomes[await consume(pool, CONSUMER, event, applyToLedger)]++;
        } catch (error) {
          outcomes.failed++;
          throw error;
        }
      });
      await Promise.all(copies);
      if (event.payload.lostAck && event.attempts === 1) {
        throw new Error('injected: the acknowledgement was lost after processing');
      }
    }

    // The relay that crashes: leases one batch per topic, delivers, never acks.
    for (const topic of TOPICS) {
      const { rows } = await admin.query(
        `SELECT id, topic, key, payload, headers, attempts
           FROM idempotency.idem_outbox_fetch($1, 100, '1 second')`, [topic]);
      assert.ok(rows.length > 0);
      await Promise.allSettled(rows.map(transport));
    }

    // The relays, concurrently, until every event is acknowledged.
    const errors = [];
    running = relays.map((pool) => runRelay(pool, TOPICS, transport, {
      signal: stop.signal, idleMs: 50, onError: (error) => errors.push(error),
    }));
    let left;
    while (Date.now() - started < DEADLINE_MS) {
      ({ rows: [{ left }] } = await admin.query(
        'SELECT count(*)::int AS left FROM idempotency.outbox WHERE topic = ANY ($1)', [TOPICS]));
      if (left === 0) break;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    stop.abort();
    const totals = await Promise.all(running);
    const sum = (field) => totals.reduce((total, relay) => total + relay[field], 0);
    t.diagnostic(`${N} events, ${deliveries} deliveries, outcomes ${JSON.stringify(outcomes)}, ` +
                 `relays ${JSON.stringify(totals)}, ${Date.now() - started} ms`);

    assert.deepEqual(errors, [], 'no relay round failed');

    // Every outbox row was acknowledged: nothing pending, leased or dead.
    const { rows: states } = await admin.query(
      `SELECT state, count(*)::int AS rows FROM idempotency.outbox
        WHERE topic = ANY ($1) GROUP BY state`, [TOPICS]);
    assert.deepEqual(states, [], `outbox rows left within ${DEADLINE_MS} ms`);
    assert.equal(sum('acked'), N, 'each event acknowledged once');

    // Each effect happened exactly once, and for every event.
    const { rows: [ledger] } = await admin.query(
      `SELECT count(*)::int AS rows, count(DISTINCT event_id)::int AS events,
              count(*) FILTER (WHERE event_id <> ALL ($1::bigint[]))::int AS unknown
         FROM ledger`, [ids]);
    assert.deepEqual(ledger, { rows: N, events: N, unknown: 0 });
    const { rows: twice } = await admin.query(
      'SELECT event_id, count(*)::int AS effects FROM ledger GROUP BY event_id HAVING count(*) > 1');
    assert.deepEqual(twice, [], 'no event took effect twice');
    assert.equal(outcomes.processed, N, 'exactly one delivery of each event applied it');

    // Every event is marked processed for this consumer.
    const { rows: [marks] } = await admin.query(
      `SELECT count(*) FILTER (WHERE idempotency.idem_is_processed($2, id::text))::int AS marked
         FROM unnest($1::bigint[]) AS id`, [ids, CONSUMER]);
    assert.equal(marks.marked, N);

    // The duplicates really happened, of every kind.
    assert.ok(deliveries >= 2 * N, `${deliveries} deliveries, at least ${2 * N} expected`);
    assert.ok(outcomes.duplicate > 0, 'concurrent copies waited for each other (mark returned false)');
    assert.ok(outcomes.skipped > 0, 'redeliveries found the event processed');
    assert.ok(outcomes.failed > 0 && sum('nacked') > 0, 'failed deliveries were nacked and retried');
    assert.ok(sum('fetched') > N, 'events were handed out again after a nack or a lease ran out');

    // Per key, the effects were applied in enqueue order.
    const { rows: order } = await admin.query(
      `SELECT topic, key, array_agg(n ORDER BY seq) AS applied,
              bool_and(ordered) AS ids_ascending
         FROM (SELECT topic, key, n, seq,
                      event_id > coalesce(lag(event_id) OVER (PARTITION BY topic, key ORDER BY seq), 0) AS ordered
                 FROM ledger WHERE key IS NOT NULL) AS effects
        GROUP BY topic, key ORDER BY topic, key`);
    assert.equal(order.length, TOPICS.length * KEYS.length);
    const expected = Array.from({ length: PER_KEY }, (_, i) => i + 1);
    for (const { topic, key, applied, ids_ascending } of order) {
      assert.deepEqual(applied, expected, `order of ${topic}/${key}`);
      assert.equal(ids_ascending, true, `ids of ${topic}/${key}`);
    }
  } finally {
    stop.abort();
    await Promise.allSettled(running);
    await Promise.all([admin, ...consumers, ...relays].map((pool) => pool.end()));
  }
});
