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
    this.client = null; // one-transaction: the client inside BEGIN
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
      try {
        // BEGIN and the claim in one round trip (the simple protocol, so
        // the arguments are literals)
        const [, result] = await client.query(`BEGIN; ${P.inline(client, P.CLAIM, args)}`);
        [claim] = result.rows;
      } catch (error) {
        await this.#rollback(client);
        throw error;
      }
      if (claim.outcome !== 'claimed') {
        // the answer does not wait for the ROLLBACK of a transaction that
        // wrote nothing; the client goes back to the pool after it
        this.#rollback(client);
        return P.answerTo(claim);
      }
      this.client = client;
    } else {
      ({ rows: [claim] } = await s.pool.query(P.CLAIM, args));
      if (claim.outcome !== 'claimed') return P.answerTo(claim);
      this.#startHeartbeat(claim);
    }
    this.attempt = claim.attempt;
    this.recoveryPoint = claim.recovery_point;
    this.open = true;
    return null;
  }

  // Where the handler writes: the transaction, or the pool in two-transaction mode
  get db() {
    return this.client ?? this.settings.pool;
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
    if (this.client) {
      const client = this.client;
      this.client = null;
      if (failed) {
        await this.#rollback(client);
        return null;
      }
      try {
        // the completion and COMMIT in one round trip; a released key (a
        // transient answer) must not commit what the handler wrote, so the
        // guard's division by zero aborts the transaction before COMMIT
        const stored = P.storedResponse(s, headers, body);
        await client.query(`${P.inline(client, P.COMPLETE_OR_ABORT,
          [this.scope, this.key, status, stored.body, JSON.stringify(stored.headers), this.attempt])}; COMMIT`);
        client.release();
        return null;
      } catch (error) {
        await this.#rollback(client);
        if (error.code === P.RELEASED) return null; // nothing the handler wrote remains
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
      s.log(`pg-idempotency: the response to key "${this.key}" was not stored: ${error.message}`);
      await this.#release();
      return null;
    }
  }

  // The request ended without an answer (the client went away): let go
  async abandon() {
    if (!this.open) return;
    this.open = false;
    if (this.client) {
      const client = this.client;
      this.client = null;
      await this.#rollback(client);
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
    client.release(broken);
  }

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
  #startHeartbeat(claim) {
    const every = Math.max(10, (claim.lease_left_ms ?? 60000) / 3);
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

function problemAnswer(status, title, detail) {
  return {
    status,
    headers: { 'content-type': 'application/problem+json' },
    body: P.problem(status, title, detail),
  };
}

module.exports = { Attempt, problemAnswer };
