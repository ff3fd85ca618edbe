'use strict';
// Values that would break a naive quoting of the one-query-string SQL
// (lib/protocol.js literal): keys, scopes and bodies with quotes,
// backslashes, NUL, non-ASCII and lone surrogates, and a handler that
// changes the session's client_encoding, standard_conforming_strings and
// backslash_quote inside the transaction the answer is stored in. And the
// connections: a lost one does not end the process, and failing requests
// leave every pooled client back in the pool.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { randomUUID } = require('node:crypto');
const express = require('express');
const pg = require('pg');
const idempotency = require('..');
const { literal, recordFields } = require('../lib/protocol');
const http = require('node:http');
const { pool, createTables, listen, request, gate, waitFor, installIdempotency } = require('./support');

const KEYS = 'SELECT scope, key, body, headers FROM idempotency.keys WHERE key = $1';

// Strings that end a literal early under a naive quoting, or under SJIS
// (0x85 after U+0085's 0xC2 is a lead byte that takes the next backslash)
const HOSTILE = [
  "'", '\\', "\\'", "''", "'; DROP TABLE node_items; --", '\\\\\'\'', '$1', '$$', '"',
  "caf\u00e9 \u00ff\u00fe", '\u0085\\\'); SELECT 1/0; --', 'x\u2028y\u{1F600}z', '%s%n',
];

before(createTables);

after(() => pool.end());

// Resolves once no pooled client is checked out (a rollback may still be
// on its way back when the answer was sent)
async function poolSettled() {
  const deadline = Date.now() + 10000;
  while (pool.idleCount !== pool.totalCount || pool.waitingCount !== 0) {
    if (Date.now() > deadline) throw new Error(`pool not settled: ${pool.totalCount} clients, ${pool.idleCount} idle`);
    await new Promise((resolve) => setImmediate(resolve));
  }
}

test('literal: printable ASCII only, whatever the string', async () => {
  for (const value of [...HOSTILE, '\u0000', '\t\r\n', '\u{10FFFF}']) {
    assert.match(literal(value), /^E'[\x20-\x7e]*'$/);
  }
  assert.throws(() => literal('a\ud800b'), /lone UTF-16 surrogate/);
  assert.throws(() => literal('\udc00'), /lone UTF-16 surrogate/);
  // each comes back from the server as it was
  const { rows } = await pool.query(
    `SELECT ${HOSTILE.map((value, i) => `${literal(value)} AS v${i}`).join(', ')}`);
  assert.deepEqual(Object.values(rows[0]), HOSTILE);
});

// POST /echo: answers with the body the test asks for (x-answer, base64),
// after setting the session the test names (x-session: SET LOCAL ...)
function echoApp(options = {}) {
  const app = express();
  app.set('env', 'test');
  app.use(idempotency.express({ pool, ...options }));
  app.post('/echo', async (req, res) => {
    if (req.get('x-session')) await req.idempotency.db.query(req.get('x-session'));
    const { rows: [row] } = await req.idempotency.db.query(
      'INSERT INTO node_items (label) VALUES ($1) RETURNING id', [req.get('x-label') ?? 'echo']);
    res.status(201).set('content-type', 'text/plain; charset=utf-8').set('etag', `"${row.id}"`);
    res.end(Buffer.from(req.get('x-answer'), 'base64'));
  });
  return app;
}

test('recordFields reads what the server writes for a composite, field for field', async () => {
  const values = [...HOSTILE, '', ' ', '(', ')', ',', '","', '\\"', 'a\nb', '{"a": "x,y\\\\z"}', null];
  for (let i = 0; i < values.length; i++) {
    // the value first, in the middle and last, between NULLs and empty strings
    const row = [null, values[i], '', values[(i + 1) % values.length], null, values[i]];
    const { rows: [{ c }] } = await pool.query(
      'SELECT ROW($1::text, $2::text, $3::text, $4::text, $5::text, $6::text)::text AS c', row);
    assert.deepEqual(recordFields(c), row, c);
  }
  assert.deepEqual(recordFields('()'), [null]);
  assert.deepEqual(recordFields('(,)'), [null, null]);
});

test('hostile keys and answers are stored and replayed byte for byte, under any session settings', async () => {
  const server = await listen(echoApp());
  const sessions = [
    undefined,
    "SET LOCAL standard_conforming_strings = off",
    "SET LOCAL client_encoding = 'SJIS'; SET LOCAL backslash_quote = on",
  ];
  try {
    for (const session of sessions) {
      for (const hostile of HOSTILE) {
        // a header carries bytes, which Node reads as latin1: the key's
        // UTF-8 bytes go out one character each, and come back as the key
        const key = `${hostile} ${randomUUID()}`;
        const header = Buffer.from(key).toString('latin1');
        const answer = Buffer.from(`${hostile}\n${hostile}`);
        const label = randomUUID();
        const headers = { 'x-answer': answer.toString('base64'), 'x-label': label };
        if (session) headers['x-session'] = session;
        const first = await request(server, { path: '/echo', key: header, body: hostile, headers });
        assert.equal(first.status, 201, `${session}: ${hostile}: ${first.body}`);
        assert.ok(first.body.equals(answer));
        const { rows: [stored] } = await pool.query(KEYS, [key]);
        assert.equal(stored.key, key);
        assert.equal(stored.body, answer.toString());
        const replay = await request(server, { path: '/echo', key: header, body: hostile, headers });
        assert.equal(replay.headers['idempotent-replayed'], 'true');
        assert.ok(replay.body.equals(answer), `${session}: ${hostile}`);
        assert.equal(replay.headers.etag, first.headers.etag);
        const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM node_items WHERE label = $1', [label]);
        assert.equal(n, 1, `${session}: ${hostile}`);
      }
    }
  } finally {
    await server.close();
  }
});

test('an answer with NUL bytes or invalid UTF-8 is stored in base64 and replayed byte for byte', async () => {
  const server = await listen(echoApp());
  try {
    for (const answer of [Buffer.from("a'\0\\'b"), Buffer.from([0xc3, 0x28, 0x27, 0x5c]), Buffer.from([0xed, 0xa0, 0x80])]) {
      const key = randomUUID();
      const headers = { 'x-answer': answer.toString('base64') };
      assert.equal((await request(server, { path: '/echo', key, headers })).status, 201);
      const { rows: [stored] } = await pool.query(KEYS, [key]);
      assert.equal(stored.headers[':idem-body-encoding'], 'base64');
      const replay = await request(server, { path: '/echo', key, headers });
      assert.equal(replay.headers['idempotent-replayed'], 'true');
      assert.ok(replay.body.equals(answer));
    }
  } finally {
    await server.close();
  }
});

test('hostile scopes keep each caller apart; one with NUL or a lone surrogate is a 500, nothing claimed', async () => {
  const server = await listen(echoApp({ scope: (req) => req.get('x-scope-base64') === undefined
    ? 'a\ud800'.padEnd(Number(req.get('x-scope-length') ?? 0), '.')
    : Buffer.from(req.get('x-scope-base64'), 'base64').toString() }));
  try {
    const key = randomUUID();
    const answers = [];
    for (const scope of [...HOSTILE, "'", '\\']) {
      const headers = { 'x-scope-base64': Buffer.from(scope).toString('base64'), 'x-answer': Buffer.from(scope).toString('base64') };
      const response = await request(server, { path: '/echo', key, headers });
      answers.push([scope, response.body.toString(), response.headers['idempotent-replayed']]);
    }
    // every scope its own answer; the two repeated ones are replays
    assert.deepEqual(answers, [...HOSTILE.map((scope) => [scope, scope, undefined]),
      ["'", "'", 'true'], ['\\', '\\', 'true']]);
    const scopes = (await pool.query(KEYS, [key])).rows.map((row) => row.scope).sort();
    assert.deepEqual(scopes, [...HOSTILE].sort());

    const nul = await request(server, { path: '/echo', key, headers: { 'x-scope-base64': Buffer.from("a\0'").toString('base64'), 'x-answer': '' } });
    assert.equal(nul.status, 500);
    const surrogate = await request(server, { path: '/echo', key, headers: { 'x-answer': '' } });
    assert.equal(surrogate.status, 500);
    // one over 255 bytes too, which would be hashed
    const hashed = await request(server, { path: '/echo', key, headers: { 'x-answer': '', 'x-scope-length': '300' } });
    assert.equal(hashed.status, 500);
    assert.equal((await pool.query(KEYS, [key])).rows.length, HOSTILE.length);
    await poolSettled();
  } finally {
    await server.close();
  }
});

test('a lost connection under a running handler: the process stays up, the client is back in the pool at once, the request fails', async () => {
  const held = gate();
  const entered = gate();
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool }));
  app.post('/slow', async (req, res) => {
    const { rows: [{ pid }] } = await req.idempotency.db.query('SELECT pg_backend_pid() AS pid');
    entered.open(pid);
    await held.promise;
    await req.idempotency.db.query('INSERT INTO node_items (label) VALUES ($1)', [req.idempotency.key]);
    res.status(201).json({});
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const first = request(server, { path: '/slow', key, body: {} });
    const pid = await entered.promise;
    // what a server restart or idle_in_transaction_session_timeout does
    await pool.query('SELECT pg_terminate_backend($1)', [pid]);
    // a handler that never answers holds no pooled client once its
    // connection is gone
    await poolSettled();
    held.open();
    assert.equal((await first).status, 500);
    assert.equal((await pool.query(KEYS, [key])).rows.length, 0);
    await poolSettled();
  } finally {
    held.open();
    await server.close();
  }
});

test('many failing requests leave no pooled client checked out', async () => {
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool, wait: 0 }));
  app.post('/fail', async (req, res) => {
    await req.idempotency.db.query('SELECT 1');
    if (req.query.how === 'throw') throw new Error('the handler failed');
    if (req.query.how === 'sql') await req.idempotency.db.query('SELECT 1/0');
    return res.status(503).json({});
  });
  app.post('/ok', (req, res) => res.status(201).json({}));
  const server = await listen(app);
  try {
    const key = randomUUID();
    assert.equal((await request(server, { path: '/ok', key, body: {} })).status, 201);
    // three times the pool's size, in parallel: thrown errors, SQL errors,
    // 5xx answers, replays, and mismatches
    const answers = await Promise.all(Array.from({ length: 30 }, (_, i) => {
      if (i % 5 === 3) return request(server, { path: '/ok', key, body: {} });
      if (i % 5 === 4) return request(server, { path: '/ok', key, body: { other: i } });
      return request(server, { path: `/fail?how=${['throw', 'sql', '503'][i % 5]}`, key: randomUUID(), body: {} });
    }));
    assert.deepEqual(answers.map((a) => a.status), Array.from({ length: 30 }, (_, i) => [500, 500, 503, 201, 422][i % 5]));
    await poolSettled();
    assert.ok(pool.totalCount <= 10);
    assert.equal((await request(server, { path: '/ok', key: randomUUID(), body: {} })).status, 201);
  } finally {
    await server.close();
  }
});

test('a client that goes away mid-request: the handler\'s answer is still stored, and its retry replays it', async () => {
  const held = gate();
  const entered = gate();
  const app = express();
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool }));
  app.post('/gone', async (req, res) => {
    entered.open();
    await held.promise;
    const { rows: [row] } = await req.idempotency.db.query(
      'INSERT INTO node_items (label) VALUES ($1) RETURNING id', [req.idempotency.key]);
    res.status(201).json({ id: row.id });
  });
  const server = await listen(app);
  try {
    const key = randomUUID();
    const gone = http.request({ host: '127.0.0.1', port: server.port, method: 'POST', path: '/gone',
      headers: { 'content-type': 'application/json', 'idempotency-key': key } });
    gone.on('error', () => {}); // the socket hang-up this test causes
    gone.end('{}');
    await entered.promise;
    const closed = new Promise((resolve) => gone.on('close', resolve));
    gone.destroy();
    await closed;
    held.open();
    await waitFor('SELECT status_code FROM idempotency.keys WHERE key = $1', [key], (rows) => rows[0]?.status_code === 201);
    const retry = await request(server, { path: '/gone', key, body: {} });
    assert.equal(retry.status, 201);
    assert.equal(retry.headers['idempotent-replayed'], 'true');
    const { rows: [{ n }] } = await pool.query('SELECT count(*)::int AS n FROM node_items WHERE label = $1', [key]);
    assert.equal(n, 1);
    await poolSettled();
  } finally {
    held.open();
    await server.close();
  }
});

test('an exhausted pool: the claim\'s connection timeout is answered as an error, and nothing leaks', async () => {
  const small = new pg.Pool({ max: 1, connectionTimeoutMillis: 200 });
  const held = gate();
  const entered = gate();
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: idempotency.keepRawBody }));
  app.use(idempotency.express({ pool: small }));
  app.post('/hold', async (req, res) => {
    entered.open();
    await held.promise;
    res.status(201).json({});
  });
  const server = await listen(app);
  try {
    const first = request(server, { path: '/hold', key: randomUUID(), body: {} });
    await entered.promise;
    // the pool's one client is the first request's: this one cannot claim
    const key = randomUUID();
    assert.equal((await request(server, { path: '/hold', key, body: {} })).status, 500);
    held.open();
    assert.equal((await first).status, 201);
    assert.equal(small.totalCount, 1);
    assert.equal(small.idleCount, 1);
    // and the key was never claimed: its retry runs
    assert.equal((await request(server, { path: '/hold', key, body: {} })).status, 201);
  } finally {
    held.open();
    await server.close();
    await small.end();
  }
});

test('a database in SQL_ASCII: characters beyond ASCII go as they are, and come back byte for byte', async () => {
  // a \u escape above U+007F is an error there ("conversion between UTF8
  // and SQL_ASCII is not supported")
  const name = `${pool.options.database ?? process.env.PGDATABASE}_sql_ascii`;
  await pool.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await pool.query(`CREATE DATABASE ${name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`);
  const ascii = new pg.Pool({ database: name, max: 2 });
  ascii.on('error', () => {}); // its sessions end with the DROP DATABASE below
  try {
    await installIdempotency(ascii);
    await ascii.query('CREATE TABLE node_items (id serial PRIMARY KEY, label text NOT NULL)');
    const server = await listen(echoApp({ pool: ascii }));
    try {
      for (const hostile of HOSTILE) {
        const key = `${hostile} ${randomUUID()}`;
        const answer = Buffer.from(`${hostile}\n${hostile}`);
        const headers = { 'x-answer': answer.toString('base64') };
        const header = Buffer.from(key).toString('latin1');
        const first = await request(server, { path: '/echo', key: header, body: hostile, headers });
        assert.equal(first.status, 201, `${hostile}: ${first.body}`);
        const { rows: [stored] } = await ascii.query(KEYS, [key]);
        assert.equal(stored.key, key);
        const replay = await request(server, { path: '/echo', key: header, body: hostile, headers });
        assert.equal(replay.headers['idempotent-replayed'], 'true');
        assert.ok(replay.body.equals(answer), hostile);
      }
    } finally {
      await server.close();
    }
  } finally {
    await ascii.end();
    await pool.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  }
});
