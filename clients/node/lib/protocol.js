'use strict';
// The Idempotency-Key protocol of doc/http.md, apart from any framework:
// reading the key, the scope and the fingerprint, the calls to the
// extension, and the stored form of a response. lib/express.js and
// lib/fastify.js put it on a request's lifecycle.

const crypto = require('node:crypto');

// SHA-256 in hex of a string or bytes: crypto.hash (Node 20.12 and later)
// makes no Hash object
const sha256 = typeof crypto.hash === 'function'
  ? (data) => crypto.hash('sha256', data, 'hex')
  : (data) => crypto.createHash('sha256').update(data).digest('hex');
const { isUtf8 } = require('node:buffer');

const MAX_BYTES = 255;
const BODY_ENCODING = ':idem-body-encoding';
const DEFAULT_STORE_HEADERS = [
  'content-type', 'content-location', 'location', 'etag',
  'last-modified', 'cache-control', 'vary',
];

// The claim's row as one composite column (claimOf reads it): the server
// plans no function scan and Node parses one field's description, not
// seven, and it does no arithmetic on the lease (the seconds a 409's
// Retry-After gives are counted by the database's clock only then, by
// leaseSecondsLeft): each of these costs the server about as much again
// as a third of the claim itself
const CLAIM = 'SELECT idempotency.idem_claim($1, $2, $3, $4::interval, $5::interval, $6::interval) AS c';
const LEASE_LEFT = "SELECT ceil(date_part('epoch', $1::timestamptz - clock_timestamp()))::int AS seconds";
const LEASE_MS = "SELECT (date_part('epoch', $1::interval) * 1000)::float8 AS ms";
const COMPLETE = 'SELECT idempotency.idem_complete($1, $2, $3, $4, $5, $6) AS done';
// One-transaction mode, an answer the default policy stores: COMMIT
// follows in the same query string, and must not run if the server's
// policy (idempotency.release_statuses, which only idem_complete reads)
// releases it after all; then the division by zero (SQLSTATE RELEASED)
// aborts the transaction before COMMIT. The server logs that ERROR, so the
// answers the default policy releases take the path without the guard
// (idem_complete, then COMMIT or ROLLBACK: one more round trip, on a
// failure only): see likelyStored.
const COMPLETE_OR_ABORT = `SELECT 1 / (idempotency.idem_complete($1, $2, $3, $4, $5::jsonb, $6) = 'stored')::int`;
const RELEASED = '22012';
// idem_complete refused a body over idempotency.max_response_bytes
const TOO_LARGE = '54000';
const RELEASE = 'SELECT idempotency.idem_release($1, $2, $3)';
const CHECKPOINT = 'SELECT idempotency.idem_checkpoint($1, $2, $3, $4)';
const EXTEND = 'SELECT idempotency.idem_extend_lease($1, $2, $3, $4::interval)';

// A claim that another attempt took over, or that ended meanwhile
const LOST_CLAIM = new Set(['22I01', '22I02', '22I03']);

// A statement with its $n parameters as literals, for a query string of
// several statements (node-postgres sends those by the simple protocol);
// utf8: whether the database's encoding is UTF8 (see literal). Each
// statement is split at its parameters once.
const TEMPLATES = new Map();
function inline(sql, args, utf8 = true) {
  let parts = TEMPLATES.get(sql);
  if (parts === undefined) {
    parts = sql.split(/\$(\d+)/); // text, parameter number, text, ...
    for (let i = 1; i < parts.length; i += 2) parts[i] = Number(parts[i]) - 1;
    TEMPLATES.set(sql, parts);
  }
  let text = parts[0];
  for (let i = 1; i < parts.length; i += 2) {
    const value = args[parts[i]];
    if (value === null || value === undefined) text += 'NULL';
    else if (Number.isSafeInteger(value)) text += String(value);
    else text += literal(String(value), utf8);
    text += parts[i + 1];
  }
  return text;
}

// Every character but printable ASCII, the quote and the backslash
const UNSAFE = /[^\x20-\x26\x28-\x5b\x5d-\x7e]/gu;
// The quote, the backslash and ASCII's control characters
const UNSAFE_ASCII = /['\\\x00-\x1f\x7f]/g;
// A UTF-16 surrogate that is not half of a pair (the u flag reads pairs whole)
const LONE_SURROGATE = /[\ud800-\udfff]/u;

// A string as an SQL literal: E'...' with quotes and backslashes doubled
// and any other character outside printable ASCII as a \uXXXX or
// \UXXXXXXXX escape, so printable ASCII only. The server reads it the same
// whatever the session's settings: no byte of it can be taken for the
// second byte of a multibyte character (as SJIS, BIG5 or GBK would take a
// backslash after a lead byte, were a handler to SET client_encoding), an
// E'' string reads its backslashes whatever standard_conforming_strings
// says, and a quote is doubled, never \' (which backslash_quote may
// refuse). A NUL character (\u0000) is refused by the server, as
// PostgreSQL text has none. node-postgres's escapeLiteral is right for a
// UTF-8 session only.
//
// A \u escape above U+007F needs a database that can convert it, which
// SQL_ASCII cannot: for a database not in UTF8 (utf8 false), characters
// beyond ASCII go as they are, in the session's UTF-8 (node-postgres sets
// client_encoding), and only ASCII's are escaped. A handler that sets a
// client_encoding such as SJIS there still cannot end the literal early:
// a quote is never the second byte of a character, and a backslash taken
// for one leaves a \' that backslash_quote refuses by default.
function literal(text, utf8 = true) {
  if (LONE_SURROGATE.test(text)) {
    throw new TypeError('pg-idempotency: a string with a lone UTF-16 surrogate has no UTF-8 form');
  }
  return `E'${text.replace(utf8 ? UNSAFE : UNSAFE_ASCII, escapeCharacter)}'`;
}

function escapeCharacter(c) {
  if (c === "'") return "''";
  if (c === '\\') return '\\\\';
  const code = c.codePointAt(0);
  return code > 0xffff
    ? `\\U${code.toString(16).padStart(8, '0')}`
    : `\\u${code.toString(16).padStart(4, '0')}`;
}

// Whether a pool's database is in UTF8, asked once per pool on a client of
// it (before the client's first query string with literals): the answer, or
// the first time a promise of it
const UTF8_DATABASE = new WeakMap();
function utf8Database(pool, client) {
  const known = UTF8_DATABASE.get(pool);
  return known === undefined ? askUtf8Database(pool, client) : known;
}

async function askUtf8Database(pool, client) {
  let known = UTF8_DATABASE.get(pool);
  if (known === undefined) {
    const { rows: [row] } = await client.query("SELECT current_setting('server_encoding') = 'UTF8' AS utf8");
    known = row.utf8;
    UTF8_DATABASE.set(pool, known);
  }
  return known;
}

// Whether the extension's default idempotency.release_statuses (408, 425,
// 429, 500-599) stores an answer. Only a guess, to pick the path with the
// fewest round trips: idem_complete decides, under the server's policy.
function likelyStored(status) {
  return status < 500 && status !== 408 && status !== 425 && status !== 429;
}

// A duration option: milliseconds, or a PostgreSQL interval as text
function interval(value) {
  if (value === undefined || value === null) return null;
  if (typeof value === 'number') {
    if (!Number.isFinite(value) || value < 0) throw new TypeError(`invalid duration: ${value}`);
    return `${value} milliseconds`;
  }
  return String(value);
}

// The options of an adapter, with the defaults of doc/http.md
function settings(options = {}) {
  if (!options.pool) throw new TypeError('pg-idempotency: the "pool" option (a pg.Pool) is required');
  const mode = options.mode ?? 'one-transaction';
  if (mode !== 'one-transaction' && mode !== 'two-transaction') {
    throw new TypeError(`pg-idempotency: mode must be "one-transaction" or "two-transaction", not "${mode}"`);
  }
  return {
    pool: options.pool,
    methods: new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase())),
    required: options.required ?? false,
    scope: options.scope ?? null,
    fingerprint: options.fingerprint ?? defaultFingerprint,
    wait: interval(options.wait ?? 2000),
    // two transactions need a lease to count the heartbeat from: 60 s
    lease: interval(options.lease ?? (mode === 'two-transaction' ? 60000 : null)),
    leaseOption: options.lease ?? (mode === 'two-transaction' ? 60000 : null),
    ttl: interval(options.ttl),
    mode,
    storeHeaders: (options.storeHeaders ?? DEFAULT_STORE_HEADERS).map((h) => h.toLowerCase()),
    limit: options.limit ?? 1024 * 1024,
    log: options.log ?? ((message) => process.emitWarning(message, 'IdempotencyWarning')),
  };
}

// RFC 9457 problem details, the body of every answer of the middleware
function problem(status, title, detail) {
  return JSON.stringify({ type: 'about:blank', title, status, detail });
}

// The key of a request: { key } when it has a usable one, { missing: true },
// or { error } (a problem to answer with 400). Node reads a header's bytes
// as latin1, one character each: the key is those bytes read as UTF-8, as
// every adapter reads them, and its length is theirs.
function readKey(header) {
  if (header === undefined) return { missing: true };
  let key = Array.isArray(header) ? header.join(', ') : String(header);
  // a structured-field string ("..."), as the IETF draft writes the key
  if (key.length >= 2 && key.startsWith('"') && key.endsWith('"')) {
    key = key.slice(1, -1).replace(/\\(["\\])/g, '$1');
  }
  // printable ASCII, as keys mostly are: the bytes are the characters
  if (key.length <= MAX_BYTES && PRINTABLE_ASCII.test(key)) return { key };
  // bytes as Node read them; a string with wider characters (an injected
  // request, say) is text already
  const bytes = /[^\x00-\xff]/.test(key) ? Buffer.from(key, 'utf8') : Buffer.from(key, 'latin1');
  if (bytes.length === 0) return { error: problem(400, 'Invalid Idempotency-Key', 'The Idempotency-Key header is empty.') };
  if (bytes.length > MAX_BYTES) {
    return { error: problem(400, 'Invalid Idempotency-Key', `The Idempotency-Key header is longer than ${MAX_BYTES} bytes.`) };
  }
  if (!isUtf8(bytes)) {
    return { error: problem(400, 'Invalid Idempotency-Key', 'The Idempotency-Key header is not UTF-8.') };
  }
  return { key: bytes.toString('utf8') };
}

const PRINTABLE_ASCII = /^[\x20-\x7e]+$/;

const MISSING_KEY = problem(400, 'Idempotency-Key required', 'This request requires an Idempotency-Key header.');

// The principal's name: a string as it is, an object by its id
function principalOf(user) {
  if (typeof user === 'string' && user !== '') return user;
  if (user && user.id !== undefined && user.id !== null) return String(user.id);
  return 'anonymous';
}

function pathOf(url) {
  const q = url.indexOf('?');
  return q === -1 ? url : url.slice(0, q);
}

// A scope over 255 bytes is replaced by its hash
function boundScope(scope) {
  scope = String(scope);
  // refused here too: its hash would be that of U+FFFD in its place
  if (LONE_SURROGATE.test(scope)) throw new TypeError('pg-idempotency: a scope with a lone UTF-16 surrogate has no UTF-8 form');
  if (Buffer.byteLength(scope) <= MAX_BYTES) return scope;
  return 'sha256:' + sha256(scope);
}

// METHOD, path with query, body bytes
function defaultFingerprint(req, body) {
  return sha256(Buffer.concat([Buffer.from(`${req.method} ${req.originalUrl ?? req.url}\n`, 'utf8'), body]));
}

// Seconds until the holder's lease runs out by the database's clock,
// rounded up, at least 1 (and 1 while the holder's transaction is open, when
// its lease is not visible)
async function leaseSecondsLeft(pool, claim) {
  if (claim.lease_expires_at === null || claim.lease_expires_at === undefined) return 1;
  const { rows: [{ seconds }] } = await pool.query(LEASE_LEFT, [claim.lease_expires_at]);
  return Math.max(1, seconds ?? 1);
}

// The lease option in milliseconds (two-transaction mode's heartbeat runs
// every third of it): a number as it is, an interval's text by the database
const LEASE_IN_MS = new WeakMap();
async function leaseMs(s) {
  if (typeof s.leaseOption === 'number') return s.leaseOption;
  let ms = LEASE_IN_MS.get(s);
  if (ms === undefined) {
    ms = s.pool.query(LEASE_MS, [s.lease]).then(({ rows: [row] }) => row.ms);
    LEASE_IN_MS.set(s, ms);
    ms.catch(() => LEASE_IN_MS.delete(s)); // asked again next time
  }
  return ms;
}

// The stored form of a response: the allow-listed headers, the body as text
// when it is UTF-8 without NUL, else base64 with a marker among the headers
function storedResponse(settings, headers, body) {
  const stored = {};
  for (const name of settings.storeHeaders) {
    const value = headers[name];
    if (value === undefined) continue;
    stored[name] = Array.isArray(value) ? value.map(String) : String(value);
  }
  if (body.length > 0 && (body.includes(0) || !isUtf8(body))) {
    stored[BODY_ENCODING] = 'base64';
    return { headers: stored, body: body.toString('base64') };
  }
  return { headers: stored, body: body.toString('utf8') };
}

// A replay's headers and body bytes from a claim's stored response
function replayOf(claim) {
  const headers = { ...(claim.headers ?? {}) };
  const encoding = headers[BODY_ENCODING];
  delete headers[BODY_ENCODING];
  const body = Buffer.from(claim.body ?? '', encoding === 'base64' ? 'base64' : 'utf8');
  headers['idempotent-replayed'] = 'true';
  return { status: claim.status_code, headers, body };
}

function claimArgs(s, scope, key, fingerprint) {
  return [scope, key, fingerprint, s.ttl, s.lease, s.wait];
}

// What the middleware answers instead of running the handler, for a claim
// that was not won: { status, headers, body }, or null for 'claimed'
async function answerTo(pool, claim) {
  switch (claim.outcome) {
    case 'claimed':
      return null;
    case 'replay':
      return replayOf(claim);
    case 'mismatch':
      return {
        status: 422,
        headers: { 'content-type': 'application/problem+json' },
        body: problem(422, 'Idempotency-Key reused', 'This Idempotency-Key was used with a different request.'),
      };
    default: // in_progress
      return {
        status: 409,
        headers: {
          'content-type': 'application/problem+json',
          'retry-after': String(await leaseSecondsLeft(pool, claim)),
        },
        body: problem(409, 'Request in progress',
          'A request with this Idempotency-Key is still being processed; retry later.'),
      };
  }
}

// The fields of a composite's text form (record_out): null for an empty
// field, a quoted one with its "" and backslash escapes undone
function recordFields(text) {
  const fields = [];
  const end = text.length - 1; // the closing parenthesis
  let i = 1;
  for (;;) {
    if (text[i] === '"') {
      let value = '';
      i++;
      for (;;) {
        const quote = text.indexOf('"', i);
        const backslash = text.indexOf('\\', i);
        if (backslash !== -1 && backslash < quote) {
          value += text.slice(i, backslash) + text[backslash + 1];
          i = backslash + 2;
        } else if (text[quote + 1] === '"') {
          value += text.slice(i, quote + 1);
          i = quote + 2;
        } else {
          value += text.slice(i, quote);
          i = quote + 1;
          break;
        }
      }
      fields.push(value);
    } else {
      let comma = text.indexOf(',', i);
      if (comma === -1) comma = end;
      fields.push(comma === i ? null : text.slice(i, comma));
      i = comma;
    }
    if (i >= end) return fields;
    i++; // past the comma
  }
}

// idempotency.claim_result's text: outcome, status_code, body, headers,
// attempt, recovery_point, created_at, lease_expires_at, expires_at
function claimOf(text) {
  const [outcome, status, body, headers, attempt, recoveryPoint, , leaseExpiresAt] = recordFields(text);
  return {
    outcome,
    status_code: status === null ? null : Number(status),
    body,
    headers: headers === null ? null : JSON.parse(headers),
    attempt: attempt === null ? null : Number(attempt),
    recovery_point: recoveryPoint,
    lease_expires_at: leaseExpiresAt, // as the server wrote it
  };
}

module.exports = {
  CLAIM, COMPLETE, COMPLETE_OR_ABORT, RELEASED, TOO_LARGE, RELEASE, CHECKPOINT, EXTEND, LOST_CLAIM, MISSING_KEY,
  inline, literal, utf8Database, likelyStored, interval, settings, problem, readKey, principalOf, pathOf, boundScope,
  storedResponse, answerTo, claimArgs, leaseMs, recordFields, claimOf,
};
