'use strict';
// The HTTP tests of the example apps (examples/express, examples/fastify),
// run by each one's test.sh: its real server, started with ./serve on a
// free port, against the database of PGHOST, PGPORT, PGUSER, PGDATABASE,
// and a real HTTP client. What they check is doc/http.md's protocol.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const net = require('node:net');
const { spawn } = require('node:child_process');
const { randomUUID } = require('node:crypto');
// node-postgres from the example's own node_modules
const pg = require(require.resolve('pg', { paths: [process.cwd()] }));

const SERVE = process.env.SERVE ?? './serve';
const STORED_HEADERS = ['content-type', 'content-location', 'location', 'etag',
  'last-modified', 'cache-control', 'vary'];

const pool = new pg.Pool({ max: 2 });
const servers = new Set();
let app; // the server most tests talk to

function freePort() {
  return new Promise((resolve, reject) => {
    const probe = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    }).on('error', reject);
  });
}

// ./serve PORT, resolved once it says it listens
async function start(env = {}) {
  const port = await freePort();
  const child = spawn(SERVE, [String(port)], {
    env: { ...process.env, IDEM_TEST_HOOKS: '1', ...env },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const exited = new Promise((resolve) => child.on('exit', resolve));
  servers.add(child);
  exited.then(() => servers.delete(child));
  await new Promise((resolve, reject) => {
    let out = '';
    child.stdout.on('data', (data) => {
      out += data;
      if (out.includes('listening')) resolve();
    });
    exited.then((code) => reject(new Error(`${SERVE} ${port} exited (${code}) before listening`)));
  });
  return { port, child, exited };
}

// POST /orders: resolves to { status, headers, body (a Buffer) }
function post(server, { key, body, headers = {} }) {
  const payload = Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
  const all = { 'content-type': 'application/json', 'content-length': payload.length, ...headers };
  if (key !== undefined) all['idempotency-key'] = key;
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port: server.port, method: 'POST', path: '/orders', headers: all },
      (res) => {
        const chunks = [];
        res.on('data', (chunk) => chunks.push(chunk));
        res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }));
        res.on('error', reject);
      });
    req.on('error', reject);
    req.end(payload);
  });
}

async function rows(sku) {
  const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM orders WHERE sku = $1', [sku]);
  return n;
}

function assertProblem(res, status) {
  assert.equal(res.status, status);
  assert.match(res.headers['content-type'], /^application\/problem\+json\b/);
  const problem = JSON.parse(res.body);
  assert.equal(problem.status, status);
  assert.equal(typeof problem.title, 'string');
}

function assertReplayOf(replay, first) {
  assert.equal(replay.status, first.status);
  assert.equal(replay.headers['idempotent-replayed'], 'true');
  assert.ok(replay.body.equals(first.body), `replayed body ${replay.body} differs from ${first.body}`);
  for (const name of STORED_HEADERS) assert.equal(replay.headers[name], first.headers[name], name);
}

before(async () => {
  app = await start();
});

after(async () => {
  for (const child of servers) child.kill();
  await pool.end();
});

test('20 concurrent requests with one key make one row; the others get the replay or 409', async () => {
  const sku = `concurrent-${randomUUID()}`;
  const key = randomUUID();
  const answers = await Promise.all(Array.from({ length: 20 }, () =>
    post(app, { key, body: { sku, qty: 1 }, headers: { 'x-delay-ms': '300' } })));
  assert.equal(await rows(sku), 1);
  const first = answers.filter((a) => a.status === 201 && !a.headers['idempotent-replayed']);
  assert.equal(first.length, 1, `statuses: ${answers.map((a) => a.status)}`);
  assert.deepEqual(Object.keys(JSON.parse(first[0].body)), ['id', 'sku', 'qty']);
  for (const answer of answers) {
    if (answer === first[0]) continue;
    if (answer.status === 409) {
      assertProblem(answer, 409);
      assert.match(answer.headers['retry-after'], /^[1-9][0-9]*$/);
    } else {
      assertReplayOf(answer, first[0]);
    }
  }
});

test('a replay is the stored answer, byte for byte, with Idempotent-Replayed: true', async () => {
  const sku = `replay-${randomUUID()}`;
  const key = randomUUID();
  const first = await post(app, { key, body: { sku, qty: 2 } });
  assert.equal(first.status, 201);
  assert.equal(first.headers['idempotent-replayed'], undefined);
  const replay = await post(app, { key, body: { sku, qty: 2 } });
  assertReplayOf(replay, first);
  assert.equal(await rows(sku), 1);
});

test('the same key with another body answers 422 and runs nothing', async () => {
  const sku = `mismatch-${randomUUID()}`;
  const key = randomUUID();
  assert.equal((await post(app, { key, body: { sku, qty: 1 } })).status, 201);
  assertProblem(await post(app, { key, body: { sku, qty: 5 } }), 422);
  assert.equal(await rows(sku), 1);
});

test('a missing, empty or over-long key answers 400 (problem+json); 255 bytes are a key', async () => {
  const sku = `keys-${randomUUID()}`;
  assertProblem(await post(app, { body: { sku, qty: 1 } }), 400);
  assertProblem(await post(app, { key: '', body: { sku, qty: 1 } }), 400);
  assertProblem(await post(app, { key: 'k'.repeat(256), body: { sku, qty: 1 } }), 400);
  // a header's bytes: the key's UTF-8, one latin1 character a byte
  const utf8 = (text) => Buffer.from(text).toString('latin1');
  assertProblem(await post(app, { key: utf8('é'.repeat(128)), body: { sku, qty: 1 } }), 400);
  assertProblem(await post(app, { key: '\xe9t\xe9', body: { sku, qty: 1 } }), 400); // latin1, not UTF-8
  assert.equal(await rows(sku), 0);
  assert.equal((await post(app, { key: `${randomUUID()}`.padEnd(255, 'k'), body: { sku, qty: 1 } })).status, 201);
  // 255 bytes of UTF-8, 127 characters: a key, the one a replay finds
  const wide = `${randomUUID().slice(0, 9)}${'é'.repeat(123)}`;
  const created = await post(app, { key: utf8(wide), body: { sku, qty: 1 } });
  assert.equal(created.status, 201);
  assertReplayOf(await post(app, { key: utf8(wide), body: { sku, qty: 1 } }), created);
  const { rows: [stored] } = await pool.query('SELECT octet_length(key) AS n FROM idempotency.keys WHERE key = $1', [wide]);
  assert.equal(stored.n, 255);
  // a structured-field string is the key within its quotes
  const key = randomUUID();
  const first = await post(app, { key: `"${key}"`, body: { sku, qty: 1 } });
  assertReplayOf(await post(app, { key, body: { sku, qty: 1 } }), first);
  assert.equal(await rows(sku), 3);
});

test('a 503 is not replayed: the retry runs the request', async () => {
  const sku = `transient-${randomUUID()}`;
  const key = randomUUID();
  const failed = await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-fail-status': '503' } });
  assert.equal(failed.status, 503);
  const retry = await post(app, { key, body: { sku, qty: 1 } });
  assert.equal(retry.status, 201);
  assert.equal(retry.headers['idempotent-replayed'], undefined);
  assert.equal(await rows(sku), 1);
});

test('a 4xx of the handler is stored and replayed', async () => {
  const sku = `final-${randomUUID()}`;
  const key = randomUUID();
  const first = await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-fail-status': '404' } });
  assert.equal(first.status, 404);
  assertReplayOf(await post(app, { key, body: { sku, qty: 1 } }), first);
  assert.equal(await rows(sku), 0);
});

test('the same key and body from two principals run twice, each with its own answer', async () => {
  const sku = `scoped-${randomUUID()}`;
  const key = randomUUID();
  const alice = await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-user': 'alice' } });
  const bob = await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-user': 'bob' } });
  assert.equal(alice.status, 201);
  assert.equal(bob.status, 201);
  assert.notEqual(JSON.parse(alice.body).id, JSON.parse(bob.body).id);
  assert.equal(await rows(sku), 2);
  assertReplayOf(await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-user': 'alice' } }), alice);
  assertReplayOf(await post(app, { key, body: { sku, qty: 1 }, headers: { 'x-user': 'bob' } }), bob);
});

test('after a crash in the handler the retried request makes exactly one row', async () => {
  const sku = `crash-${randomUUID()}`;
  const key = randomUUID();
  const doomed = await start();
  await assert.rejects(post(doomed, { key, body: { sku, qty: 1 }, headers: { 'x-crash': '1' } }));
  await doomed.exited;
  const retry = await post(app, { key, body: { sku, qty: 1 } });
  assert.equal(retry.status, 201);
  assert.equal(retry.headers['idempotent-replayed'], undefined);
  assert.equal(await rows(sku), 1);
});

test('IDEM_MIDDLEWARE=off: the same handler, without a key', async () => {
  const plain = await start({ IDEM_MIDDLEWARE: 'off' });
  const sku = `plain-${randomUUID()}`;
  const res = await post(plain, { body: { sku, qty: 3 } });
  assert.equal(res.status, 201);
  assert.equal(JSON.parse(res.body).qty, 3);
  assert.equal(await rows(sku), 1);
  plain.child.kill();
});
