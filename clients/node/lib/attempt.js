'use strict';
// One request's hold on its key, from the claim to the stored answer, in
// either mode of doc/http.md:
//   one-transaction  a pooled client inside BEGIN: the claim, the handler's
//                    writes and idem_complete commit together, or not at all
//   two-transaction  the claim commits at once with a lease kept alive by a
//                    heartbeat; idem_complete, fenced by the attempt, later

const P = require('./protocol');

class Attempt {
  constructor(settings, scope, key, fingerprint) {
    this.settings = settings;
    this.scope = scope;
    this.key = key;
    this.fingerprint = fingerprint;
    this.client = null; // one-transaction: the client inside BEGIN, while it is ours
    this.transaction = null; // one-transaction: the same client, for the handler
    this.lost = null; // one-transaction: the error that ended its connection
    this.utf8 = true; // one-transaction: whether the database is in UTF8 (P.literal)
    this.attempt = null;
    this.recoveryPoint = null;
    this.heartbeat = null;
    this.open = false; // claimed, and not yet completed or released
  }

  // Claims the key: resolves to null when this request runs the handler,
  // else to the answer to send instead ({ status, headers, body })
  async claim() {
    const s = this.settings;
    const args = P.claimArgs(s, this.scope, this.key, this.fingerprint);
    let claim;
    if (s.mode === 'one-transaction') {
      const client = await s.pool.connect();
      watch(client);
      try {
        // BEGIN and the claim in one round trip (the simple protocol, so
        // the arguments are literals)
        const utf8 = P.utf8Database(s.pool, client); // known after the pool's first time
        this.utf8 = typeof utf8 === 'boolean' ? utf8 : await utf8;
        const [, result] = await client.query(`BEGIN; ${P.inline(P.CLAIM, args, this.utf8)}`);
        claim = P.claimOf(result.rows[0].c);
      } catch (error) {
        await this.#rollback(client);
        throw error;
      }
      if (claim.outcome !== 'claimed') {
        // the answer does not wait for the ROLLBACK of a transaction that
        // wrote nothing; the client goes back to the pool after it
        try {
          return await P.answerTo(client, claim);
        } finally {
          this.#rollback(client);
        }
      }
      this.client = client;
      this.transaction = client;
      client.on('error', this.#onLost);
    } else {
      const leaseMs = await P.leaseMs(s); // before the claim: nothing to undo if it fails
      claim = P.claimOf((await s.pool.query(P.CLAIM, args)).rows[0].c);
      if (claim.outcome !== 'claimed') return P.answerTo(s.pool, claim);
      this.#startHeartbeat(leaseMs);
    }
    this.attempt = claim.attempt;
    this.recoveryPoint = claim.recovery_point;
    this.open = true;
    return null;
  }

  // Where the handler writes: the transaction, or the pool in two-transaction mode
  get db() {
    return this.transaction ?? this.settings.pool;
  }

  // Records how far the handler got (two-transaction mode)
  async checkpoint(point) {
    await this.db.query(P.CHECKPOINT, [this.scope, this.key, point, this.attempt]);
    this.recoveryPoint = point;
  }

  // The handler answered (or threw, failed = true): store or release, and
  // commit. Resolves to null when the handler's answer goes to the client
  // as it is, or to the answer to send instead.
  async finish(status, headers, body, failed = false) {
    if (!this.open) return null;
    this.open = false;
    const s = this.settings;
    if (s.mode === 'one-transaction') {
      const client = this.client;
      this.client = null;
      if (this.lost) {
        // nothing was committed, and the key was never claimed for others
        if (failed) return null;
        s.log(`pg-idempotency: the response to key "${this.key}" was not stored: the connection was lost: ${this.lost.message}`);
        return problemAnswer(500, 'Response not stored',
          'The request could not be completed; nothing was kept, and it may be retried.');
      }
      if (failed) {
        await this.#rollback(client);
        return null;
      }
      try {
        const stored = P.storedResponse(s, headers, body);
        const args = [this.scope, this.key, status, stored.body, JSON.stringify(stored.headers), this.attempt];
        if (P.likelyStored(status)) {
          // the completion and COMMIT in one round trip; should the
          // server's policy release the answer after all, the guard's
          // division by zero aborts the transaction before COMMIT
          await client.query(`${P.inline(P.COMPLETE_OR_ABORT, args, this.utf8)}; COMMIT`);
        } else {
          // an answer the default policy releases: no COMMIT unless the
          // server stores it, and no ERROR in the server's log
          const { rows: [{ done }] } = await client.query(P.COMPLETE, args);
          if (done !== 'stored') {
            await this.#rollback(client);
            return null; // nothing the handler wrote remains
          }
          await client.query('COMMIT');
        }
        this.#giveBack(client);
        return null;
      } catch (error) {
        await this.#rollback(client);
        if (error.code === P.RELEASED) return null; // nothing the handler wrote remains
        if (error.code === P.TOO_LARGE) {
          // the claim went with the handler's writes: the key is free again
          s.log(`pg-idempotency: the response to key "${this.key}" in scope "${this.scope}" was too large to store, and the handler's transaction was rolled back: ${error.message}`);
          return tooLarge();
        }
        s.log(`pg-idempotency: the response to key "${this.key}" could not be stored, and the handler's transaction was rolled back: ${error.message}`);
        return problemAnswer(500, 'Response not stored',
          'The request could not be completed; nothing was kept, and it may be retried.');
      }
    }
    this.#stopHeartbeat();
    if (failed) {
      await this.#release();
      return null;
    }
    try {
      const stored = P.storedResponse(s, headers, body);
      await s.pool.query(P.COMPLETE,
        [this.scope, this.key, status, stored.body, stored.headers, this.attempt]);
      return null;
    } catch (error) {
      if (P.LOST_CLAIM.has(error.code)) {
        return problemAnswer(409, 'Idempotency-Key taken over',
          'This attempt lost its claim of the Idempotency-Key to a retry; its answer was not stored.');
      }
      // too large to store (P.TOO_LARGE) or any other failure: the
      // handler's answer goes to the client as it is, the key is released
      const why = error.code === P.TOO_LARGE ? 'was too large to store' : 'was not stored';
      s.log(`pg-idempotency: the response to key "${this.key}" in scope "${this.scope}" ${why}, and the key was released: ${error.message}`);
      await this.#release();
      return null;
    }
  }

  // The request ended without an answer (the client went away): let go
  async abandon() {
    if (!this.open) return;
    this.open = false;
    if (this.settings.mode === 'one-transaction') {
      const client = this.client;
      this.client = null;
      if (client) await this.#rollback(client);
    } else {
      this.#stopHeartbeat();
      await this.#release();
    }
  }

  // A client whose ROLLBACK failed is discarded rather than reused
  async #rollback(client) {
    let broken;
    try {
      await client.query('ROLLBACK');
    } catch (error) {
      broken = error;
    }
    this.#giveBack(client, broken);
  }

  #giveBack(client, broken) {
    client.removeListener('error', this.#onLost);
    if (!broken) unwatch(client); // a broken one may still emit 'error'
    client.release(broken);
  }

  // The connection of the handler's transaction was lost (a server
  // restart, pg_terminate_backend, idle_in_transaction_session_timeout):
  // the client goes back to the pool as broken (the pool discards it) as
  // soon as the connection has ended, so that a handler that never answers
  // holds no pooled client; the handler's next query on it fails. Not
  // before the end: an error still on its way (pgbouncer sends its own
  // after the server's) would reach the pool's listener, which emits it on
  // the pool.
  #onLost = (error) => {
    const client = this.client;
    if (!client) return; // finish or abandon owns it now
    this.client = null;
    this.lost = error;
    client.once('end', () => this.#giveBack(client, error));
  };

  async #release() {
    try {
      await this.settings.pool.query(P.RELEASE, [this.scope, this.key, this.attempt]);
    } catch (error) {
      if (!P.LOST_CLAIM.has(error.code)) {
        this.settings.log(`pg-idempotency: key "${this.key}" could not be released: ${error.message}`);
      }
    }
  }

  // idem_extend_lease every third of the lease, until finish or abandon
  #startHeartbeat(leaseMs) {
    const every = Math.max(10, leaseMs / 3);
    const s = this.settings;
    this.heartbeat = setInterval(() => {
      s.pool.query(P.EXTEND, [this.scope, this.key, this.attempt, s.lease]).catch((error) => {
        if (P.LOST_CLAIM.has(error.code)) this.#stopHeartbeat();
        else s.log(`pg-idempotency: the lease of key "${this.key}" was not extended: ${error.message}`);
      });
    }, every);
    this.heartbeat.unref();
  }

  #stopHeartbeat() {
    clearInterval(this.heartbeat);
    this.heartbeat = null;
  }
}

// A pooled client in a handler's hands: node-postgres emits 'error' on it
// when its connection is lost while no query runs (a server restart, a
// terminated backend, idle_in_transaction_session_timeout), and an 'error'
// nobody listens to ends the process. The pool listens only to its idle
// clients; this listener keeps the process up, and the client's next query
// fails instead, which the handler or the ROLLBACK sees.
function ignoreLostConnection() {}

function watch(client) {
  client.on('error', ignoreLostConnection);
}

function unwatch(client) {
  client.removeListener('error', ignoreLostConnection);
}

// One-transaction mode: idem_complete refused the body
// (idempotency.max_response_bytes) and everything was rolled back
function tooLarge() {
  return problemAnswer(500, 'Response too large to store',
    'The response was too large to store (idempotency.max_response_bytes): nothing was done, and the request may be retried.');
}

function problemAnswer(status, title, detail) {
  return {
    status,
    headers: { 'content-type': 'application/problem+json' },
    body: P.problem(status, title, detail),
  };
}

module.exports = { Attempt, problemAnswer, watch, unwatch };
