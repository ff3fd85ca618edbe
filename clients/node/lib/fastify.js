'use strict';
// The Fastify 5 plugin: fastify.register(idempotency.fastify, { pool }).
// Not encapsulated (what fastify-plugin does, by the symbols Fastify reads,
// so the package needs no dependency): its hooks apply to the context it is
// registered in, the whole app when registered on it. Per route:
// config: { idempotency: { required: true, mode: 'two-transaction', ... } },
// or config: { idempotency: false } for a route the plugin leaves alone.
//
//   preParsing  keeps the request body's bytes, for the fingerprint
//   preHandler  claims the key: replay, 409 and 422 are answered here
//   onError     notes a thrown error: the key is released
//   onSend      stores the serialized answer and commits, before it is sent

const { Readable } = require('node:stream');
const P = require('./protocol');
const { Attempt, problemAnswer } = require('./attempt');

const RAW_BODY = Symbol('pg-idempotency.rawBody');
const ATTEMPT = Symbol('pg-idempotency.attempt');
const FAILED = Symbol('pg-idempotency.failed');

async function idempotency(fastify, options) {
  const base = P.settings(options);
  const perRoute = new WeakMap(); // a route's config.idempotency -> its settings
  const settingsOf = (request) => {
    const config = request.routeOptions.config?.idempotency;
    if (config === false) return null; // the route opts out
    if (!config) return base;
    let s = perRoute.get(config);
    if (!s) perRoute.set(config, s = P.settings({ ...options, ...config }));
    return s;
  };

  fastify.decorateRequest('idempotency', null);

  fastify.addHook('preParsing', async (request, reply, payload) => {
    const s = settingsOf(request);
    if (!s?.methods.has(request.method) || request.headers['idempotency-key'] === undefined) return payload;
    const limit = request.routeOptions.bodyLimit ?? s.limit;
    const chunks = [];
    let length = 0;
    for await (const chunk of payload) {
      length += chunk.length;
      if (length > limit) {
        const error = new Error('Request body is too large');
        error.statusCode = 413;
        throw error;
      }
      chunks.push(chunk);
    }
    const body = Buffer.concat(chunks);
    request[RAW_BODY] = body;
    // the parsers read the same bytes again
    const copy = Readable.from([body], { objectMode: false });
    copy.receivedEncodedLength = payload.receivedEncodedLength ?? body.length;
    return copy;
  });

  fastify.addHook('preHandler', async (request, reply) => {
    const s = settingsOf(request);
    if (!s?.methods.has(request.method)) return undefined;
    const read = P.readKey(request.headers['idempotency-key']);
    if (read.missing) {
      if (!s.required) return undefined;
      return send(reply, problemAnswer(400, 'Idempotency-Key required', 'This request requires an Idempotency-Key header.'));
    }
    if (read.error) return send(reply, { status: 400, headers: { 'content-type': 'application/problem+json' }, body: read.error });

    const body = request[RAW_BODY] ?? Buffer.alloc(0);
    const scope = P.boundScope(s.scope
      ? s.scope(request)
      : `${P.principalOf(request.user)}:${request.method} ${P.pathOf(request.url)}`);
    const attempt = new Attempt(s, scope, read.key, s.fingerprint(request, body) ?? null);
    const answer = await attempt.claim();
    if (answer) return send(reply, answer);
    request[ATTEMPT] = attempt;
    request.idempotency = {
      get db() { return attempt.db; },
      key: attempt.key,
      scope: attempt.scope,
      attempt: attempt.attempt,
      recoveryPoint: attempt.recoveryPoint,
      checkpoint: (point) => attempt.checkpoint(point),
    };
    return undefined;
  });

  fastify.addHook('onError', async (request) => {
    request[FAILED] = true;
  });

  fastify.addHook('onSend', async (request, reply, payload) => {
    const attempt = request[ATTEMPT];
    if (!attempt?.open) return payload;
    const body = await toBuffer(payload);
    const answer = await attempt.finish(reply.statusCode, reply.getHeaders(), body, request[FAILED] === true);
    if (!answer) return body;
    for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name);
    reply.code(answer.status).headers(answer.headers);
    return answer.body;
  });

  // A reply that bypassed onSend (reply.hijack()) was sent before any
  // commit, and its answer is unknown: the transaction is rolled back and
  // the key released, which the log says (a route that hijacks its reply
  // opts out with config: { idempotency: false })
  fastify.addHook('onResponse', async (request) => {
    const attempt = request[ATTEMPT];
    if (!attempt?.open) return;
    attempt.settings.log(`pg-idempotency: the reply to key "${attempt.key}" was sent around the plugin `
      + '(reply.hijack()): nothing was stored, and the transaction was rolled back');
    await attempt.abandon();
  });
}

function send(reply, { status, headers, body }) {
  return reply.code(status).headers(headers).send(body);
}

async function toBuffer(payload) {
  if (payload === null || payload === undefined) return Buffer.alloc(0);
  if (Buffer.isBuffer(payload)) return payload;
  if (typeof payload === 'string') return Buffer.from(payload);
  const chunks = [];
  for await (const chunk of payload) chunks.push(Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk));
  return Buffer.concat(chunks);
}

idempotency[Symbol.for('skip-override')] = true;
idempotency[Symbol.for('fastify.display-name')] = 'pg-idempotency';
idempotency[Symbol.for('plugin-meta')] = { name: 'pg-idempotency', fastify: '5.x' };

module.exports = idempotency;
