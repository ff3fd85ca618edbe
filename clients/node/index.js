'use strict';
// pg-idempotency: the idempotency PostgreSQL extension behind Express and
// Fastify (the Idempotency-Key protocol of doc/http.md) and message
// consumers, on node-postgres.

const { express, keepRawBody } = require('./lib/express');
const fastify = require('./lib/fastify');
const { dedup, dedupBatch } = require('./lib/dedup');

module.exports = { express, fastify, keepRawBody, dedup, dedupBatch };
