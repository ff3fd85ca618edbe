'use strict';
// The Fastify plugin against a real server and PostgreSQL: the reply
// lifecycle (a thrown error, a streamed payload), per-route configuration
// and the two-transaction mode.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { randomUUID } = require('node:crypto');
const { Readable } = require('node:stream');
const Fastify = require('fastify');
const idempotency = require('..');
const { pool, createTables, listenFastify, request, gate, waitFor } = require('./support');

const KEYS = 'SELECT scope, attempt, status_code, headers FROM idempotency.keys WHERE key = $1';

async function count(label) {
  const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM node_items WHERE label = $1', [label]);
  return n;
}

before(createTables);

after(() => pool.end());

async function itemsApp(options = {}) {
  const app = Fastify();
  app.decorateRequest('user', null);
  app.addHook('onRequest', async (request) => {
    request.user = request.headers['x-user'] ? { id: request.headers['x-user'] } : null;
  });
  // not encapsulated: its hooks apply to the routes of the app
  await app.register(idempotency.fastify, { pool, ...options });
  app.post('/items', async (request, reply) => {
    const { rows: [row] } = await request.idempotency.db.query(
      'INSERT INTO node_items (label) VALUES ($1) RETURNING id', [request.body.label]);
    if (request.query.fail === 'throw') throw new Error('the handler failed');
    if (request.query.fail === '400') {
      const error = new Error('bad item');
      error.statusCode = 400;
      throw error;
    }
    return reply.code(201).header('location', `/items/${row.id}`).send({ id: row.id });
  });
  app.post('/required', { config: { idempotency: { required: true } } }, async () => ({ ok: true }));
  app.post('/stream', async (request, reply) => {
    reply.type('text/plain');
    return Readable.from(['one ', 'two ', `three ${randomUUID()}`]);
  });
  app.post('/long', { config: { idempotency: { mode: 'two-transaction', lease: 60000 } } }, async (request) => {
    const { rows: [row] } = await request.idempotency.db.query('SELECT count(*)::int AS n FROM idempotency.keys WHERE key = $1 AND status_code IS NULL',
      [request.headers['idempotency-key']]);
    return { attempt: request.idempotency.attempt, claimCommitted: row.n === 1 };
  });
  return listenFastify(app);
}

test('a thrown error rolls the writes back and frees the key, even when answered as a 4xx', async () => {
  const server = await itemsApp();
  try {
    const label = randomUUID();
    for (const fail of ['throw', '400']) {
      const key = randomUUID();
      const failed = await request(server, { path: `/items?fail=${fail}`, key, body: { label } });
      assert.equal(failed.status, fail === 'throw' ? 500 : 400);
      assert.equal(await count(label), 0);
      assert.deepEqual((await pool.query(KEYS, [key])).rows, []);
    }
    const key = randomUUID();
    const created = await request(server, { path: '/items', key, body: { label }, headers: { 'x-user': 'carol' } });
    assert.equal(created.status, 201);
    const replay = await request(server, { path: '/items', key, body: { label }, headers: { 'x-user': 'carol' } });
    assert.equal(replay.headers['idempotent-replayed'], 'true');
    assert.equal(replay.headers.location, created.headers.location);
    assert.ok(replay.body.equals(created.body));
    assert.equal(await count(label), 1);
    const [row] = (await pool.query(KEYS, [key])).rows;
    assert.equal(row.scope, 'carol:POST /items');
  } finally {
    await server.close();
  }
});

test('per route: a required key; a streamed payload is stored whole', async () => {
  const server = await itemsApp();
  try {
    const missing = await request(server, { path: '/required', body: {} });
    assert.equal(missing.status, 400);
    assert.match(missing.headers['content-type'], /^application\/problem\+json/);
    assert.equal(JSON.parse(missing.body).status, 400);
    const tooLong = await request(server, { path: '/required', key: 'k'.repeat(256), body: {} });
    assert.equal(tooLong.status, 400);
    assert.equal((await request(server, { path: '/required', key: randomUUID(), body: {} })).status, 200);

    const key = randomUUID();
    const first = await request(server, { path: '/stream', key, body: {} });
    assert.match(first.body.toString(), /^one two three /);
    const replay = await request(server, { path: '/stream', key, body: {} });
    assert.ok(replay.body.equals(first.body));
    assert.equal(replay.headers['content-type'], first.headers['content-type']);
  } finally {
    await server.close();
  }
});

test('per route: two transactions, the claim committed before the handler runs', async () => {
  const server = await itemsApp();
  try {
    const key = randomUUID();
    const first = await request(server, { path: '/long', key, body: {} });
    assert.equal(first.body.toString(), '{"attempt":1,"claimCommitted":true}');
    const replay = await request(server, { path: '/long', key, body: {} });
    assert.ok(replay.body.equals(first.body));
    assert.equal((await request(server, { path: '/long', key, body: { other: 1 } })).status, 422);
  } finally {
    await server.close();
  }
});

test('a duplicate in flight waits for the first answer (one transaction)', async () => {
  const held = gate();
  const entered = gate();
  const app = Fastify();
  await app.register(idempotency.fastify, { pool, wait: 10000 });
  app.post('/slow', async (request) => {
    entered.open();
    await held.promise;
    return { id: randomUUID() };
  });
  const server = await listenFastify(app);
  try {
    const key = randomUUID();
    const first = request(server, { path: '/slow', key, body: {} });
    await entered.promise;
    const second = request(server, { path: '/slow', key, body: {} });
    // the second claim waits in the server for the first transaction
    await waitFor("SELECT count(*)::int AS n FROM pg_stat_activity WHERE query LIKE '%idem_claim%' AND state = 'active' AND pid <> pg_backend_pid()",
      [], ([row]) => row.n > 0);
    held.open();
    const [a, b] = await Promise.all([first, second]);
    assert.equal(a.status, 200);
    assert.equal(b.headers['idempotent-replayed'], 'true');
    assert.ok(b.body.equals(a.body));
  } finally {
    held.open();
    await server.close();
  }
});

test('a hijacked reply: rolled back, the key released, and logged; a route may opt out', async () => {
  const logged = [];
  const app = Fastify();
  await app.register(idempotency.fastify, { pool, log: (message) => logged.push(message) });
  app.post('/hijack', async (request, reply) => {
    await request.idempotency.db.query('INSERT INTO node_items (label) VALUES ($1)', [request.body.label]);
    reply.hijack();
    reply.raw.writeHead(201, { 'content-type': 'text/plain' });
    reply.raw.end('sent around the plugin');
  });
  app.post('/alone', { config: { idempotency: false } }, async (request) => ({ transaction: request.idempotency !== null }));
  const server = await listenFastify(app);
  try {
    const label = randomUUID();
    const key = randomUUID();
    const hijacked = await request(server, { path: '/hijack', key, body: { label } });
    assert.equal(hijacked.status, 201);
    // the transaction ends (rolled back, not committed)
    await waitFor(`SELECT count(*)::int AS n FROM pg_stat_activity
                   WHERE datname = current_database() AND state LIKE 'idle in transaction%'`, [], ([row]) => row.n === 0);
    assert.equal(logged.length, 1);
    assert.match(logged[0], /reply\.hijack\(\)/);
    assert.equal(await count(label), 0);
    assert.deepEqual((await pool.query(KEYS, [key])).rows, []);

    const alone = await request(server, { path: '/alone', key, body: {} });
    assert.equal(alone.body.toString(), '{"transaction":false}');
    assert.equal(alone.headers['idempotent-replayed'], undefined);
  } finally {
    await server.close();
  }
});

test('one transaction: a response too large to store rolls everything back and answers 500; the retry runs again', async () => {
  const logged = [];
  const app = Fastify();
  await app.register(idempotency.fastify, { pool, log: (message) => logged.push(message) });
  app.post('/big', async (request, reply) => {
    await request.idempotency.db.query('INSERT INTO node_items (label) VALUES ($1)', [request.body.label]);
    // PGC_SUSET: the suite's PGUSER is a superuser; for this transaction only
    await request.idempotency.db.query("SET LOCAL idempotency.max_response_bytes = '1kB'");
    return reply.code(201).type('text/plain').send('x'.repeat(2048));
  });
  const server = await listenFastify(app);
  try {
    const label = randomUUID();
    const key = randomUUID();
    for (const attempt of [1, 2]) { // the retry is claimed again: it runs again
      const refused = await request(server, { path: '/big', key, body: { label } });
      assert.equal(refused.status, 500, `attempt ${attempt}`);
      assert.equal(refused.headers['content-type'], 'application/problem+json');
      assert.match(JSON.parse(refused.body).detail, /too large to store.*nothing was done/);
      assert.equal(await count(label), 0);
      assert.deepEqual((await pool.query(KEYS, [key])).rows, []);
      assert.equal(logged.length, attempt);
      assert.match(logged.at(-1), /too large to store/);
    }
  } finally {
    await server.close();
  }
});
