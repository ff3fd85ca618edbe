'use strict';
// The Express middleware against a real server and PostgreSQL: what
// doc/http.md says about transactions, scopes, stored bodies and the
// two-transaction mode.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { randomUUID } = require('node:crypto');
const express = require('express');
const idempotency = require('..');
const { pool, createTables, listen, request, gate, waitFor } = require('./support');

const KEYS = 'SELECT scope, attempt, recovery_point, lease_expires_at, status_code, headers FROM idempotency.keys WHERE key = $1';

async function count(label) {
  const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM node_items WHERE label = $1', [label]);
  return n;
}

before(createTables);

after(() => pool.end());

// POST /items: inserts { label } on req.idempotency.db; ?fail=throw throws
// after the insert, ?fail=503 answers 503 after it
function itemsApp(options = {}) {
  const app = express();
  app.set('env', 'test'); // Express's error handler: no stack traces on stderr
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use((req, res, next) => {
    req.user = req.get('x-user');
    next();
  });
  app.use(idempotency.express({ pool, ...options }));
  app.post('/items', async (req, res) => {
    const { rows: [row] } = await req.idempotency.db.query(
      'INSERT INTO node_items (label) VALUES ($1) RETURNING id', [req.body.label]);
    if (req.query.fail === 'throw') throw new Error('the handler failed');
    if (req.query.fail === '503') return res.status(503).json({ error: 'unavailable' });
    return res.status(201).location(`/items/${row.id}`).json({ id: row.id });
  });
  return app;
}

test('one transaction: a thrown error or a 5xx rolls the writes back and frees the key', async () => {
  const server = await listen(itemsApp());
  try {
    const label = randomUUID();
    const key = randomUUID();
    const thrown = await request(server, { path: '/items?fail=throw', key, body: { label } });
    assert.equal(thrown.status, 500);
    assert.equal(await count(label), 0);
    assert.deepEqual((await pool.query(KEYS, [key])).rows, []);

    const unavailable = await request(server, { path: '/items?fail=503', key: randomUUID(), body: { label } });
    assert.equal(unavailable.status, 503);
    assert.equal(await count(label), 0);

    const created = await request(server, { path: '/items', key: randomUUID(), body: { label } });
    assert.equal(created.status, 201);
    assert.equal(await count(label), 1);
  } finally {
    await server.close();
  }
});

test('the stored headers are the allow-list, in lower case', async () => {
  const server = await listen(itemsApp({ storeHeaders: ['Location', 'Content-Type'] }));
  try {
    const key = randomUUID();
    const created = await request(server, { path: '/items', key, body: { label: randomUUID() } });
    const { rows: [row] } = await pool.query(KEYS, [key]);
    assert.deepEqual(Object.keys(row.headers).sort(), ['content-type', 'location']);
    assert.equal(row.headers.location, created.headers.location);
  } finally {
    await server.close();
  }
});

test('a response written in pieces and a binary body are stored and replayed byte for byte', async () => {
  const bytes = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
  const app = express(); // no body parser: the middleware reads the body itself
  app.use(idempotency.express({ pool }));
  app.post('/echo', (req, res) => {
    res.writeHead(200, { 'content-type': 'application/octet-stream', 'x-not-stored': 'yes' });
    res.write(req.rawBody.subarray(0, 100));
    res.write(req.rawBody.subarray(100));
    res.end(bytes);
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const body = Buffer.from([0, 1, 2, 255, 254]);
    const first = await request(server, { path: '/echo', key, body, headers: { 'content-type': 'application/octet-stream' } });
    assert.equal(first.status, 200);
    assert.equal(first.headers['x-not-stored'], 'yes');
    assert.ok(first.body.equals(Buffer.concat([body, bytes])));
    const { rows: [row] } = await pool.query(KEYS, [key]);
    assert.equal(row.headers[':idem-body-encoding'], 'base64');

    const replay = await request(server, { path: '/echo', key, body, headers: { 'content-type': 'application/octet-stream' } });
    assert.equal(replay.status, 200);
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.equal(replay.headers['content-type'], 'application/octet-stream');
    assert.equal(replay.headers['x-not-stored'], undefined);
    assert.equal(replay.headers[':idem-body-encoding'], undefined);
    assert.ok(replay.body.equals(first.body));
    // another binary request body is another request
    const other = await request(server, { path: '/echo', key, body: Buffer.from([0, 1, 2, 255, 253]) });
    assert.equal(other.status, 422);
  } finally {
    await server.close();
  }
});

test('scopes: each principal has its own keys; a scope option replaces the default', async () => {
  const server = await listen(itemsApp());
  const byTenant = await listen(itemsApp({ scope: (req) => `tenant-${req.get('x-tenant')}`.padEnd(300, '.') }));
  try {
    const label = randomUUID();
    const key = randomUUID();
    const alice = await request(server, { path: '/items', key, body: { label }, headers: { 'x-user': 'alice' } });
    const bob = await request(server, { path: '/items', key, body: { label }, headers: { 'x-user': 'bob' } });
    const anonymous = await request(server, { path: '/items', key, body: { label } });
    assert.deepEqual([alice.status, bob.status, anonymous.status], [201, 201, 201]);
    assert.equal(await count(label), 3);
    const scopes = (await pool.query(KEYS, [key])).rows.map((row) => row.scope).sort();
    assert.deepEqual(scopes, ['alice:POST /items', 'anonymous:POST /items', 'bob:POST /items']);
    assert.ok((await request(server, { path: '/items', key, body: { label }, headers: { 'x-user': 'bob' } })).body.equals(bob.body));

    const tenantKey = randomUUID();
    for (const tenant of ['a', 'b', 'a']) {
      await request(byTenant, { path: '/items', key: tenantKey, body: { label }, headers: { 'x-tenant': tenant } });
    }
    assert.equal(await count(label), 5);
    // a scope over 255 bytes is kept as its hash
    const tenantScopes = (await pool.query(KEYS, [tenantKey])).rows.map((row) => row.scope);
    assert.equal(tenantScopes.length, 2);
    for (const scope of tenantScopes) assert.match(scope, /^sha256:[0-9a-f]{64}$/);
  } finally {
    await server.close();
    await byTenant.close();
  }
});

test('a route that requires a key, behind an app-wide middleware; other methods pass through', async () => {
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, methods: ['POST', 'PUT'] }));
  const handler = (req, res) => res.json({ transaction: Boolean(req.idempotency) });
  app.post('/optional', handler);
  app.put('/optional', handler);
  app.patch('/optional', handler);
  app.post('/required', idempotency.express({ pool, required: true }), handler);
  const server = await listen(app);
  try {
    assert.equal((await request(server, { path: '/optional', body: {} })).body.toString(), '{"transaction":false}');
    assert.equal((await request(server, { path: '/optional', key: randomUUID(), body: {} })).body.toString(), '{"transaction":true}');
    assert.equal((await request(server, { method: 'PUT', path: '/optional', key: randomUUID(), body: {} })).body.toString(), '{"transaction":true}');
    assert.equal((await request(server, { method: 'PATCH', path: '/optional', key: randomUUID(), body: {} })).body.toString(), '{"transaction":false}');
    const missing = await request(server, { path: '/required', body: {} });
    assert.equal(missing.status, 400);
    assert.equal(missing.headers['content-type'], 'application/problem+json');
    // claimed once, by the app-wide middleware: the route's lets it through
    const key = randomUUID();
    assert.equal((await request(server, { path: '/required', key, body: {} })).status, 200);
    assert.equal((await pool.query(KEYS, [key])).rows.length, 1);
  } finally {
    await server.close();
  }
});

test('two transactions: the heartbeat keeps the lease, a duplicate gets 409, the answer is stored', async () => {
  const held = gate();
  const entered = gate();
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, mode: 'two-transaction', lease: 1500, wait: 0 }));
  app.post('/exports', async (req, res) => {
    await req.idempotency.checkpoint('started');
    entered.open();
    await held.promise;
    res.status(201).json({ attempt: req.idempotency.attempt });
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const first = request(server, { path: '/exports', key, body: {} });
    await entered.promise;
    const [{ lease_expires_at: claimed }] = (await pool.query(KEYS, [key])).rows;
    // the heartbeat extends the lease; once the first lease would have run
    // out, a duplicate still finds the key in progress (not a takeover)
    await waitFor(KEYS, [key], ([row]) => row.lease_expires_at > claimed);
    await waitFor('SELECT clock_timestamp() > $1 AS past', [claimed], ([row]) => row.past);
    const duplicate = await request(server, { path: '/exports', key, body: {} });
    assert.equal(duplicate.status, 409);
    assert.match(duplicate.headers['retry-after'], /^[1-9][0-9]*$/);
    const [row] = (await pool.query(KEYS, [key])).rows;
    assert.equal(row.attempt, 1);
    assert.equal(row.recovery_point, 'started');

    held.open();
    assert.equal((await first).status, 201);
    const replay = await request(server, { path: '/exports', key, body: {} });
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.equal(replay.body.toString(), '{"attempt":1}');
  } finally {
    held.open();
    await server.close();
  }
});

test('Retry-After is the seconds left of the holder\'s lease, by the database\'s clock; 1 while its transaction is open', async () => {
  const held = gate();
  const entered = gate();
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  // a lease as an interval's text: the heartbeat's period comes from the database
  app.post('/long', idempotency.express({ pool, mode: 'two-transaction', lease: '1 hour', wait: 0 }),
    async (req, res) => {
      entered.open();
      await held.promise;
      res.status(201).json({});
    });
  const shortHeld = gate();
  const shortEntered = gate();
  app.post('/short', idempotency.express({ pool, wait: 0 }), async (req, res) => {
    shortEntered.open();
    await shortHeld.promise;
    res.status(201).json({});
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const first = request(server, { path: '/long', key, body: {} });
    await entered.promise;
    const duplicate = await request(server, { path: '/long', key, body: {} });
    assert.equal(duplicate.status, 409);
    const [{ left }] = (await pool.query(
      'SELECT date_part(\'epoch\', lease_expires_at - clock_timestamp()) AS left FROM idempotency.keys WHERE key = $1', [key])).rows;
    const retryAfter = Number(duplicate.headers['retry-after']);
    assert.ok(retryAfter >= Math.floor(left) && retryAfter <= 3600, `Retry-After ${retryAfter}, ${left} s left`);
    held.open();
    assert.equal((await first).status, 201);

    // one transaction: the holder's lease is not visible until it commits
    const shortKey = randomUUID();
    const holder = request(server, { path: '/short', key: shortKey, body: {} });
    await shortEntered.promise;
    const waiting = await request(server, { path: '/short', key: shortKey, body: {} });
    assert.equal(waiting.status, 409);
    assert.equal(waiting.headers['retry-after'], '1');
    shortHeld.open();
    assert.equal((await holder).status, 201);
  } finally {
    held.open();
    shortHeld.open();
    await server.close();
  }
});

test('two transactions: a retry takes over with the recovery point; the stale attempt answers 409', async () => {
  const held = gate();
  const entered = gate();
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, mode: 'two-transaction', lease: 60000 }));
  app.post('/charges', async (req, res) => {
    if (req.idempotency.attempt === 1) {
      await req.idempotency.checkpoint('charged ch_1');
      entered.open();
      await held.promise;
    }
    res.status(201).json({ attempt: req.idempotency.attempt, resumedFrom: req.idempotency.recoveryPoint });
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const first = request(server, { path: '/charges', key, body: { amount: 1 } });
    await entered.promise;
    // the first attempt's process stalls: its lease runs out
    await pool.query("UPDATE idempotency.keys SET lease_expires_at = now() - interval '1 second' WHERE key = $1", [key]);
    const retry = await request(server, { path: '/charges', key, body: { amount: 1 } });
    assert.equal(retry.status, 201);
    assert.equal(retry.body.toString(), '{"attempt":2,"resumedFrom":"charged ch_1"}');

    held.open();
    const stale = await first;
    assert.equal(stale.status, 409);
    assert.equal(stale.headers['content-type'], 'application/problem+json');
    const replay = await request(server, { path: '/charges', key, body: { amount: 1 } });
    assert.ok(replay.body.equals(retry.body));
  } finally {
    held.open();
    await server.close();
  }
});

test('the server\'s release policy decides, whichever path the default policy suggests', async () => {
  // the handler sets the policy in its transaction, where idem_complete reads it
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool }));
  app.post('/policy', async (req, res) => {
    await req.idempotency.db.query("SELECT set_config('idempotency.release_statuses', $1, true)", [req.body.policy]);
    await req.idempotency.db.query('INSERT INTO node_items (label) VALUES ($1)', [req.body.label]);
    res.status(req.body.status).json({ label: req.body.label });
  });
  const server = await listen(app);
  try {
    // a 409 released by the policy: rolled back (through the guard), not stored
    const released = { policy: '409', status: 409, label: randomUUID() };
    const key = randomUUID();
    assert.equal((await request(server, { path: '/policy', key, body: released })).status, 409);
    assert.equal(await count(released.label), 0);
    assert.deepEqual((await pool.query(KEYS, [key])).rows, []);
    // a 503 stored by the policy (an empty list: ' ', as '' is unset in the SQL edition)
    const kept = { policy: ' ', status: 503, label: randomUUID() };
    const other = randomUUID();
    const first = await request(server, { path: '/policy', key: other, body: kept });
    assert.equal(first.status, 503);
    assert.equal(await count(kept.label), 1);
    const replay = await request(server, { path: '/policy', key: other, body: kept });
    assert.equal(replay.status, 503);
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.ok(replay.body.equals(first.body));
  } finally {
    await server.close();
  }
});

test('res.flushHeaders() sends nothing before the commit: the status stored is the status sent', async () => {
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool }));
  app.post('/flush', (req, res) => {
    res.flushHeaders();
    res.status(201).json({ flushed: true });
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const first = await request(server, { path: '/flush', key, body: {} });
    assert.equal(first.status, 201);
    const replay = await request(server, { path: '/flush', key, body: {} });
    assert.equal(replay.status, 201);
    assert.ok(replay.body.equals(first.body));
  } finally {
    await server.close();
  }
});

test('a COMMIT that fails: the client gets 500 instead of the handler\'s 201, nothing remains, the key is free', async () => {
  const logged = [];
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, log: (message) => logged.push(message) }));
  app.post('/deferred', async (req, res) => {
    // checked at COMMIT only: the handler's answer is already written
    const times = req.body.twice ? 2 : 1;
    for (let i = 0; i < times; i++) {
      await req.idempotency.db.query('INSERT INTO node_deferred (label) VALUES ($1)', [req.body.label]);
    }
    res.status(201).json({ label: req.body.label });
  });
  const server = await listen(app);
  try {
    const label = randomUUID();
    const key = randomUUID();
    const failed = await request(server, { path: '/deferred', key, body: { label, twice: true } });
    assert.equal(failed.status, 500);
    assert.equal(failed.headers['content-type'], 'application/problem+json');
    assert.match(logged.join('\n'), /node_deferred_once/);
    assert.deepEqual((await pool.query('SELECT * FROM node_deferred WHERE label = $1', [label])).rows, []);
    assert.deepEqual((await pool.query(KEYS, [key])).rows, []);
    // the same key again (another body, as nothing was stored): it runs
    assert.equal((await request(server, { path: '/deferred', key, body: { label } })).status, 201);
  } finally {
    await server.close();
  }
});

// fails before the fix in any version that committed the handler's writes
// and released the key: the retry would have written the row twice
test('one transaction: a response too large to store rolls everything back and answers 500; the retry runs again', async () => {
  const logged = [];
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, log: (message) => logged.push(message) }));
  app.post('/big', async (req, res) => {
    await req.idempotency.db.query('INSERT INTO node_items (label) VALUES ($1)', [req.body.label]);
    // PGC_SUSET: the suite's PGUSER is a superuser; for this transaction only
    await req.idempotency.db.query("SET LOCAL idempotency.max_response_bytes = '1kB'");
    res.status(201).type('text/plain').send('x'.repeat(2048));
  });
  const server = await listen(app);
  try {
    const label = randomUUID();
    const key = randomUUID();
    for (const attempt of [1, 2]) { // the retry is claimed again: it runs again
      const refused = await request(server, { path: '/big', key, body: { label } });
      assert.equal(refused.status, 500, `attempt ${attempt}`);
      assert.equal(refused.headers['content-type'], 'application/problem+json');
      assert.equal(refused.headers['idempotent-replayed'], undefined);
      assert.match(JSON.parse(refused.body).detail, /too large to store.*nothing was done/);
      assert.equal(await count(label), 0);
      assert.deepEqual((await pool.query(KEYS, [key])).rows, []);
      assert.equal(logged.length, attempt);
      assert.match(logged.at(-1), new RegExp(`key "${key}" in scope ".*POST /big" was too large to store`));
    }
  } finally {
    await server.close();
  }
});
