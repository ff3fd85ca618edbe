'use strict';
// POST /orders behind the Idempotency-Key plugin of pg-idempotency: the
// order's row and the stored answer commit in one transaction.
//
//   ./serve PORT          the database from PGHOST, PGPORT, PGUSER, PGDATABASE
//
// IDEM_MIDDLEWARE=off runs the same handler without the plugin, in a
// transaction of its own (bench/http.sh compares the two). IDEM_TEST_HOOKS=1
// makes the handler obey the test headers X-Delay-Ms, X-Fail-Status,
// X-Crash, and X-User (the principal, request.user).

const Fastify = require('fastify');
const pg = require('pg');
const idempotency = require('pg-idempotency');

const port = Number(process.argv[2]);
const hooks = process.env.IDEM_TEST_HOOKS === '1';
const withMiddleware = process.env.IDEM_MIDDLEWARE !== 'off';
const pool = new pg.Pool({ max: 20 });
// an idle client whose connection is lost (a server restart) reports it
// here; without a listener, node-postgres's error would end the process
pool.on('error', (error) => console.error(`idle database client lost: ${error.message}`));

const app = Fastify();
if (hooks) {
  app.decorateRequest('user', null);
  app.addHook('onRequest', async (request) => {
    request.user = request.headers['x-user'] ?? null;
  });
}
if (withMiddleware) app.register(idempotency.fastify, { pool });

const orderBody = {
  type: 'object',
  required: ['sku', 'qty'],
  properties: { sku: { type: 'string' }, qty: { type: 'integer' } },
};

app.post('/orders', {
  schema: { body: orderBody },
  config: { idempotency: { required: true } },
}, async (request, reply) => {
  const { sku, qty } = request.body;
  if (hooks && request.headers['x-fail-status']) {
    return reply.code(Number(request.headers['x-fail-status'])).send({ error: 'failed as asked' });
  }
  const order = withMiddleware
    ? await insertOrder(request.idempotency.db, request, sku, qty)
    : await inTransaction((db) => insertOrder(db, request, sku, qty));
  return reply.code(201).send(order);
});

async function insertOrder(db, request, sku, qty) {
  const { rows: [row] } = await db.query(
    'INSERT INTO orders (sku, qty) VALUES ($1, $2) RETURNING id, sku, qty', [sku, qty]);
  if (hooks) {
    const delay = Number(request.headers['x-delay-ms'] ?? 0);
    if (delay > 0) await new Promise((resolve) => setTimeout(resolve, delay));
    if (request.headers['x-crash'] === '1') process.kill(process.pid, 'SIGKILL');
  }
  return { id: Number(row.id), sku: row.sku, qty: row.qty };
}

async function inTransaction(fn) {
  const db = await pool.connect();
  try {
    await db.query('BEGIN');
    const result = await fn(db);
    await db.query('COMMIT');
    return result;
  } catch (error) {
    await db.query('ROLLBACK').catch(() => {});
    throw error;
  } finally {
    db.release();
  }
}

pool.query(`CREATE TABLE IF NOT EXISTS orders (
    id bigserial PRIMARY KEY, sku text NOT NULL, qty integer NOT NULL)`)
  .then(() => app.listen({ port, host: '127.0.0.1' }))
  .then((address) => console.log(`listening on ${address}`))
  .catch((error) => {
    console.error(error);
    process.exit(1);
  });
