'use strict';
// The Express 5 middleware: app.use(idempotency.express({ pool })), or on
// a router or a route. The response is held back (res.writeHead, res.write
// and res.end are intercepted until the handler's res.end) and reaches the
// client only once the key's answer is committed.

const P = require('./protocol');
const { Attempt, problemAnswer } = require('./attempt');

// Set on a request that a middleware of this package has claimed for, so
// that a second one (app-wide, then on the route) lets it through
const HANDLED = Symbol('pg-idempotency.handled');

function express(options) {
  const s = P.settings(options);
  return async function idempotency(req, res, next) {
    if (req[HANDLED] || !s.methods.has(req.method)) return next();
    const read = P.readKey(req.headers['idempotency-key']);
    if (read.missing) {
      if (s.required) return send(res, problemAnswer(400, 'Idempotency-Key required', 'This request requires an Idempotency-Key header.'));
      return next();
    }
    if (read.error) return send(res, { status: 400, headers: { 'content-type': 'application/problem+json' }, body: read.error });
    req[HANDLED] = true;

    let attempt;
    try {
      const body = await rawBody(req, s.limit);
      if (body === null) {
        return send(res, problemAnswer(413, 'Request body too large', `The request body is larger than ${s.limit} bytes.`));
      }
      const scope = P.boundScope(s.scope
        ? s.scope(req)
        : `${P.principalOf(req.user)}:${req.method} ${P.pathOf(req.originalUrl)}`);
      attempt = new Attempt(s, scope, read.key, s.fingerprint(req, body) ?? null);
      const answer = await attempt.claim();
      if (answer) return send(res, answer);
    } catch (error) {
      return next(error);
    }
    req.idempotency = {
      get db() { return attempt.db; },
      key: attempt.key,
      scope: attempt.scope,
      attempt: attempt.attempt,
      recoveryPoint: attempt.recoveryPoint,
      checkpoint: (point) => attempt.checkpoint(point),
    };
    holdResponse(res, attempt);
    return next();
  };
}

// The request body's bytes: those a body parser kept (keepRawBody), or the
// stream's, read here when nothing has read it yet; null above the limit
async function rawBody(req, limit) {
  if (Buffer.isBuffer(req.rawBody)) return req.rawBody;
  if (typeof req.rawBody === 'string') return Buffer.from(req.rawBody);
  if (req.readableEnded || (req.complete && !req.readable)) {
    throw new Error('pg-idempotency: a body parser read the request body without keeping its bytes; '
      + 'pass { verify: keepRawBody } to express.json() (or put the middleware before the parser)');
  }
  const chunks = [];
  let length = 0;
  for await (const chunk of req) {
    length += chunk.length;
    if (length > limit) return null;
    chunks.push(chunk);
  }
  req.rawBody = Buffer.concat(chunks);
  return req.rawBody;
}

// For express.json({ verify: keepRawBody }) and the other body parsers
function keepRawBody(req, res, buf) {
  req.rawBody = buf;
}

function send(res, { status, headers, body }) {
  res.statusCode = status;
  for (const [name, value] of Object.entries(headers)) res.setHeader(name, value);
  res.end(body);
}

// Buffers the handler's response until res.end, then has the attempt store
// it and commit, and only then sends it (or the answer the attempt gives
// instead, when it could not commit)
function holdResponse(res, attempt) {
  const { writeHead, write, end } = res;
  const chunks = [];
  let ended = false;
  const toBuffer = (chunk, encoding) =>
    (Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8'));

  res.writeHead = function heldWriteHead(status, reason, headers) {
    if (typeof reason !== 'string') {
      headers = reason;
      reason = undefined;
    }
    res.statusCode = status;
    if (reason) res.statusMessage = reason;
    if (Array.isArray(headers)) {
      // [name, value, name, value, ...] or [[name, value], ...]
      const pairs = Array.isArray(headers[0]) ? headers : [];
      if (!pairs.length) for (let i = 0; i < headers.length; i += 2) pairs.push([headers[i], headers[i + 1]]);
      for (const [name, value] of pairs) res.setHeader(name, value);
    } else if (headers) {
      for (const [name, value] of Object.entries(headers)) res.setHeader(name, value);
    }
    return res;
  };
  res.write = function heldWrite(chunk, encoding, callback) {
    if (typeof encoding === 'function') callback = encoding;
    if (chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
    if (callback) process.nextTick(callback);
    return true;
  };
  res.end = function heldEnd(chunk, encoding, callback) {
    if (typeof chunk === 'function') [callback, chunk] = [chunk, undefined];
    if (typeof encoding === 'function') [callback, encoding] = [encoding, undefined];
    if (ended) return res;
    ended = true;
    if (chunk !== undefined && chunk !== null) chunks.push(toBuffer(chunk, encoding));
    const body = Buffer.concat(chunks);
    attempt.finish(res.statusCode, res.getHeaders(), body)
      .catch((error) => {
        // logged, not sent: the client learns nothing of the server's insides
        attempt.settings.log(`pg-idempotency: the response to key "${attempt.key}" was not stored: ${error.message}`);
        return problemAnswer(500, 'Response not stored',
          'The request could not be completed; nothing was kept, and it may be retried.');
      })
      .then((answer) => {
        res.writeHead = writeHead;
        res.write = write;
        res.end = end;
        if (!answer) return res.end(body, callback);
        for (const name of res.getHeaderNames()) res.removeHeader(name);
        return send(res, answer);
      });
    return res;
  };
}

module.exports = { express, keepRawBody };
