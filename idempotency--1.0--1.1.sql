/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

/*
 * A route that publishes somewhere names where.  idem_outbox_route never
 * stored a NULL destination for the notify, logical or function targets,
 * but 1.0's CHECK allowed a row written directly with one, which the worker
 * could not publish.  NOT VALID: a database updated from 1.0 keeps whatever
 * rows it has (the worker counts each of their rows' attempts as failed,
 * with "has no destination", until the route is set again); new rows are
 * checked.
 */
ALTER TABLE idempotency.outbox_routes
	ADD CONSTRAINT outbox_routes_destination_check
	CHECK (target = 'none' OR destination IS NOT NULL) NOT VALID;
