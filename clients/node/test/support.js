'use strict';
// What the package's tests share: a pool on the database of PGHOST, PGPORT,
// PGUSER, PGDATABASE (directly or through pgbouncer), real HTTP servers on
// free ports, and a real HTTP client.

const http = require('node:http');
const pg = require('pg');

const pool = new pg.Pool({ max: 10 });

// An Express app listening on a free port: { port, close }
function listen(app) {
  return new Promise((resolve) => {
    const server = app.listen(0, '127.0.0.1', () => resolve({
      port: server.address().port,
      close: () => new Promise((done) => server.close(done)),
    }));
  });
}

// A Fastify app listening on a free port: { port, close }
async function listenFastify(app) {
  await app.listen({ port: 0, host: '127.0.0.1' });
  return { port: app.server.address().port, close: () => app.close() };
}

// One request: resolves to { status, headers, body (a Buffer) }
function request(server, { method = 'POST', path = '/', key, body = '', headers = {} }) {
  const payload = Buffer.isBuffer(body) ? body : Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
  const all = { 'content-type': 'application/json', 'content-length': payload.length, ...headers };
  if (key !== undefined) all['idempotency-key'] = key;
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port: server.port, method, path, headers: all }, (res) => {
      const chunks = [];
      res.on('data', (chunk) => chunks.push(chunk));
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks) }));
      res.on('error', reject);
    });
    req.on('error', reject);
    req.end(payload);
  });
}

// The tables the tests write, made once. node --test runs the files in
// processes of their own, at once on a machine with more cores: two
// CREATE TABLE IF NOT EXISTS of one name at once fail (pg_type's unique
// index), so they take turns on an advisory lock of the transaction.
function createTables() {
  return pool.query(`BEGIN;
    SELECT pg_advisory_xact_lock(hashtext('pg-idempotency tests'));
    CREATE TABLE IF NOT EXISTS node_items (id serial PRIMARY KEY, label text NOT NULL);
    CREATE TABLE IF NOT EXISTS node_applied (id serial PRIMARY KEY, consumer text, event text);
    CREATE TABLE IF NOT EXISTS node_deferred (label text,
      CONSTRAINT node_deferred_once UNIQUE (label) DEFERRABLE INITIALLY DEFERRED);
    COMMIT`);
}

// A promise with its resolve, to hold a handler where a test wants it
function gate() {
  let open;
  const promise = new Promise((resolve) => { open = resolve; });
  return { promise, open };
}

// Polls query until check(rows) holds (10 s at most)
async function waitFor(sql, params, check) {
  const deadline = Date.now() + 10000;
  for (;;) {
    const { rows } = await pool.query(sql, params);
    if (check(rows)) return rows;
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${sql}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

// The extension in a database the test made: the C edition, or the SQL
// edition's script when IDEM_SQL_SCRIPT names it (scripts/check-sql-edition.sh)
async function installIdempotency(db) {
  const script = process.env.IDEM_SQL_SCRIPT;
  await db.query(script ? require('node:fs').readFileSync(script, 'utf8') : 'CREATE EXTENSION idempotency');
}

module.exports = { pool, createTables, listen, listenFastify, request, gate, waitFor, installIdempotency };
