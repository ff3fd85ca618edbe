'use strict';
// POST /orders behind the Idempotency-Key middleware of pg-idempotency:
// the order's row and the stored answer commit in one transaction.
//
//   ./serve PORT          the database from PGHOST, PGPORT, PGUSER, PGDATABASE
//
// IDEM_MIDDLEWARE=off runs the same handler without the middleware, in a
// transaction of its own (bench/http.sh compares the two). IDEM_TEST_HOOKS=1
// makes the handler obey the test headers X-Delay-Ms, X-Fail-Status,
// X-Crash, and X-User (the principal, req.user).

const express = require('express');
const pg = require('pg');
const idempotency = require('pg-idempotency');

const port = Number(process.argv[2]);
const hooks = process.env.IDEM_TEST_HOOKS === '1';
const withMiddleware = process.env.IDEM_MIDDLEWARE !== 'off';
const pool = new pg.Pool({ max: 20 });
// an idle client whose connection is lost (a server restart) reports it
// here; without a listener, node-postgres's error would end the process
pool.on('error', (error) => console.error(`idle database client lost: ${error.message}`));

const app = express();
app.use(express.json({ verify: idempotency.keepRawBody }));
if (hooks) {
  app.use((req, res, next) => {
    req.user = req.get('x-user');
    next();
  });
}
const requireKey = withMiddleware
  ? idempotency.express({ pool, required: true })
  : (req, res, next) => next();

app.post('/orders', requireKey, async (req, res) => {
  const { sku, qty } = req.body ?? {};
  if (typeof sku !== 'string' || !Number.isInteger(qty)) {
    return res.status(400).json({ error: 'a JSON body {"sku": text, "qty": integer} is required' });
  }
  if (hooks && req.get('x-fail-status')) {
    return res.status(Number(req.get('x-fail-status'))).json({ error: 'failed as asked' });
  }
  const order = withMiddleware
    ? await insertOrder(req.idempotency.db, req, sku, qty)
    : await inTransaction((db) => insertOrder(db, req, sku, qty));
  return res.status(201).json(order);
});

async function insertOrder(db, req, sku, qty) {
  const { rows: [row] } = await db.query(
    'INSERT INTO orders (sku, qty) VALUES ($1, $2) RETURNING id, sku, qty', [sku, qty]);
  if (hooks) {
    const delay = Number(req.get('x-delay-ms') ?? 0);
    if (delay > 0) await new Promise((resolve) => setTimeout(resolve, delay));
    if (req.get('x-crash') === '1') process.kill(process.pid, 'SIGKILL');
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
  .then(() => app.listen(port, '127.0.0.1', () => console.log(`listening on 127.0.0.1:${port}`)))
  .catch((error) => {
    console.error(error);
    process.exit(1);
  });
