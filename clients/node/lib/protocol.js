'use strict';
// The Idempotency-Key protocol of doc/http.md, apart from any framework:
// reading the key, the scope and the fingerprint, the calls to the
// extension, and the stored form of a response. lib/express.js and
// lib/fastify.js put it on a request's lifecycle.

const { createHash } = require('node:crypto');
const { isUtf8 } = require('node:buffer');

const MAX_BYTES = 255;
const BODY_ENCODING = ':idem-body-encoding';
const DEFAULT_STORE_HEADERS = [
  'content-type', 'content-location', 'location', 'etag',
  'last-modified', 'cache-control', 'vary',
];

const CLAIM = `SELECT c.outcome, c.status_code, c.body, c.headers, c.attempt, c.recovery_point,
       (extract(epoch FROM c.lease_expires_at - clock_timestamp()) * 1000)::float8 AS lease_left_ms
FROM idempotency.idem_claim($1, $2, $3, $4::interval, $5::interval, $6::interval) AS c`;
const COMPLETE = 'SELECT idempotency.idem_complete($1, $2, $3, $4, $5, $6) AS done';
// One-transaction mode: COMMIT follows in the same query string, and must
// not run when the answer was released instead of stored (SQLSTATE RELEASED)
const COMPLETE_OR_ABORT = `SELECT 1 / (idempotency.idem_complete($1, $2, $3, $4, $5::jsonb, $6) = 'stored')::int`;
const RELEASED = '22012';
const RELEASE = 'SELECT idempotency.idem_release($1, $2, $3)';
const CHECKPOINT = 'SELECT idempotency.idem_checkpoint($1, $2, $3, $4)';
const EXTEND = 'SELECT idempotency.idem_extend_lease($1, $2, $3, $4::interval)';

// A claim that another attempt took over, or that ended meanwhile
const LOST_CLAIM = new Set(['22I01', '22I02', '22I03']);

// A statement with its $n parameters as literals, for a query string of
// several statements (node-postgres sends those by the simple protocol)
function inline(client, sql, args) {
  return sql.replace(/\$(\d+)/g, (_, n) => {
    const value = args[n - 1];
    if (value === null || value === undefined) return 'NULL';
    if (typeof value === 'number') return String(value);
    return client.escapeLiteral(String(value));
  });
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
// or { error } (a problem to answer with 400)
function readKey(header) {
  if (header === undefined) return { missing: true };
  let key = Array.isArray(header) ? header.join(', ') : String(header);
  // a structured-field string ("..."), as the IETF draft writes the key
  if (key.length >= 2 && key.startsWith('"') && key.endsWith('"')) {
    key = key.slice(1, -1).replace(/\\(["\\])/g, '$1');
  }
  if (key === '') return { error: problem(400, 'Invalid Idempotency-Key', 'The Idempotency-Key header is empty.') };
  if (Buffer.byteLength(key) > MAX_BYTES) {
    return { error: problem(400, 'Invalid Idempotency-Key', `The Idempotency-Key header is longer than ${MAX_BYTES} bytes.`) };
  }
  return { key };
}

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
  if (Buffer.byteLength(scope) <= MAX_BYTES) return scope;
  return 'sha256:' + createHash('sha256').update(scope, 'utf8').digest('hex');
}

// METHOD, path with query, body bytes
function defaultFingerprint(req, body) {
  return createHash('sha256')
    .update(`${req.method} ${req.originalUrl ?? req.url}\n`, 'utf8')
    .update(body)
    .digest('hex');
}

// Seconds until the holder's lease runs out, rounded up, at least 1
function retryAfter(claim) {
  if (claim.lease_left_ms === null) return 1;
  return Math.max(1, Math.ceil(claim.lease_left_ms / 1000));
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
function answerTo(claim) {
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
        headers: { 'content-type': 'application/problem+json', 'retry-after': String(retryAfter(claim)) },
        body: problem(409, 'Request in progress',
          'A request with this Idempotency-Key is still being processed; retry later.'),
      };
  }
}

module.exports = {
  CLAIM, COMPLETE, COMPLETE_OR_ABORT, RELEASED, RELEASE, CHECKPOINT, EXTEND, LOST_CLAIM, MISSING_KEY,
  inline, interval, settings, problem, readKey, principalOf, pathOf, boundScope,
  storedResponse, answerTo, claimArgs,
};
