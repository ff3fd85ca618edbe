// Checked by tsc --noEmit (test.sh): the declarations of index.d.ts fit
// the way the README uses the package.
import { Pool } from 'pg';
import Fastify from 'fastify';
import * as idempotency from '..';

const pool = new Pool();

// Express: a middleware factory; the transaction on req.idempotency
const middleware = idempotency.express({ pool, required: true, wait: '2 seconds', lease: 30000 });
declare const req: Express.Request;
const db = req.idempotency?.db;
void db?.query('SELECT 1');
void middleware;

// Fastify: a plugin, with per-route configuration
const app = Fastify();
void app.register(idempotency.fastify, { pool, mode: 'two-transaction', storeHeaders: ['content-type'] });
app.post('/orders', { config: { idempotency: { required: true } } }, async (request) => {
  const context = request.idempotency;
  if (context) await context.checkpoint('step 1');
  return { attempt: context?.attempt };
});

// @ts-expect-error: the plugin's options need the pool
void app.register(idempotency.fastify, { mode: 'two-transaction' });
app.post('/stream', { config: { idempotency: false } }, async () => 'not stored');

// Consumers
interface Event { id: string; amount: number }
const consume = idempotency.dedup<Event>(async (event, client) => {
  await client.query('INSERT INTO t VALUES ($1)', [event.amount]);
}, { pool, consumer: 'billing', retention: '14 days' });
const handled: Promise<boolean> = consume({ id: 'evt-1', amount: 1 });
const batch = idempotency.dedupBatch<Event>(async (events) => { void events.length; }, { pool, consumer: 'billing' });
const fresh: Promise<Event[]> = batch([{ id: 'evt-2', amount: 2 }]);
void handled;
void fresh;

// @ts-expect-error: the pool is required
idempotency.express({ required: true });
