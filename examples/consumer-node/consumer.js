'use strict';
// A consumer that turns at-least-once delivery into an exactly-once effect:
// the event is marked processed with idem_mark_processed in the same
// transaction as its business writes, so the mark and the writes commit
// together or not at all, and any later (or concurrent) copy of the event
// finds the mark and skips the work.

const IS_PROCESSED = 'SELECT idempotency.idem_is_processed($1, $2) AS done';
const MARK_PROCESSED = 'SELECT idempotency.idem_mark_processed($1, $2) AS first';

// Handle one delivery of `event` (a row of idempotency.outbox) for the
// consumer named `consumer`. `apply(client, event)` does the business writes
// on `client`, inside the transaction. Resolves to
//   'processed'  the effect was applied and committed, by this delivery
//   'duplicate'  another delivery had applied it (this one waited for it)
//   'skipped'    it had been applied long before (the cheap check)
// and rejects when the effect could not be applied: nothing was committed,
// and the event should be delivered again.
async function consume(pool, consumer, event, apply) {
  const eventId = String(event.id); // the outbox id identifies the event

  // 1. Cheap check, outside any transaction: a redelivery of something done.
  //    It only sees committed marks, so it decides nothing; the mark does.
  const { rows: [seen] } = await pool.query(IS_PROCESSED, [consumer, eventId]);
  if (seen.done) return 'skipped';

  // 2. One transaction: the mark decides, the effect follows.
  const client = await pool.connect();
  let broken;
  try {
    await client.query('BEGIN');
    // true the first time; false for a duplicate. A copy of the event being
    // handled concurrently makes this wait until that transaction ends, then
    // answers by its outcome (false if it committed, true if it rolled back).
    const { rows: [mark] } = await client.query(MARK_PROCESSED, [consumer, eventId]);
    if (mark.first) await apply(client, event);
    await client.query('COMMIT');
    return mark.first ? 'processed' : 'duplicate';
  } catch (error) {
    // The mark is rolled back with the effect: a redelivery will process it.
    await client.query('ROLLBACK').catch((rollbackError) => { broken = rollbackError; });
    throw error;
  } finally {
    client.release(broken); // a connection that failed to roll back is discarded
  }
}

module.exports = { consume };
