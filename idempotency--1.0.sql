/* idempotency--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * Everything lives in the schema idempotency, which CREATE EXTENSION creates
 * (the control file fixes it).  PUBLIC gets no privilege on anything here:
 * new tables grant nothing to PUBLIC, and each function's default EXECUTE
 * for PUBLIC is revoked at the end of this script.  The README lists the
 * GRANT statements that let an application role use the extension.
 *
 * The C functions read and write these tables directly (heap and index
 * access, no executor), so their column order is part of the C code: see
 * src/tables.c, which checks the shape of each table before touching it.
 */

/* ---------------------------------------------------------------------
 * 1. Idempotency keys
 * ---------------------------------------------------------------------
 */

/*
 * One row per (scope, key).  A row is "in progress" while status_code is
 * NULL and "completed" once a response is stored; there is no separate state
 * column to keep in step.  Key and scope use the "C" collation: they are
 * opaque identifiers, compared byte for byte.
 *
 * fillfactor leaves room on each page so that idem_complete's update of a
 * row claimed moments earlier is a HOT update (no indexed column changes).
 */
CREATE TABLE idempotency.keys (
	scope			 text COLLATE "C" NOT NULL,
	key				 text COLLATE "C" NOT NULL,
	fingerprint		 text,
	attempt			 integer NOT NULL,
	recovery_point	 text,
	lease_expires_at timestamptz,
	status_code		 integer CHECK (status_code BETWEEN 100 AND 599),
	body			 text,
	headers			 jsonb,
	ttl				 interval NOT NULL,
	created_at		 timestamptz NOT NULL,
	completed_at	 timestamptz,
	expires_at		 timestamptz NOT NULL,
	PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);

COMMENT ON TABLE idempotency.keys IS
	'idempotency keys: one row per (scope, key), in progress while status_code is NULL, completed once a response is stored';
COMMENT ON COLUMN idempotency.keys.scope IS 'caller''s namespace, typically {user}:{endpoint}';
COMMENT ON COLUMN idempotency.keys.key IS 'the client''s Idempotency-Key';
COMMENT ON COLUMN idempotency.keys.fingerprint IS 'hash of the request (idem_fingerprint); NULL matches anything';
COMMENT ON COLUMN idempotency.keys.attempt IS 'fencing token: 1 for the first claim, +1 for each takeover of a claim whose lease ran out';
COMMENT ON COLUMN idempotency.keys.recovery_point IS 'how far the last attempt got (idem_checkpoint), returned on takeover';
COMMENT ON COLUMN idempotency.keys.lease_expires_at IS 'in progress: when the claim may be taken over; NULL once completed';
COMMENT ON COLUMN idempotency.keys.status_code IS 'stored response status; NULL while in progress';
COMMENT ON COLUMN idempotency.keys.body IS 'stored response body, byte for byte';
COMMENT ON COLUMN idempotency.keys.headers IS 'stored response headers';
COMMENT ON COLUMN idempotency.keys.ttl IS 'how long the completed response is kept, counted from completion';
COMMENT ON COLUMN idempotency.keys.created_at IS 'when the key was first claimed';
COMMENT ON COLUMN idempotency.keys.completed_at IS 'when the response was stored';
COMMENT ON COLUMN idempotency.keys.expires_at IS 'from this instant the row counts as absent and may be purged: completed_at + ttl, or lease_expires_at + ttl while in progress';

SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');

CREATE TYPE idempotency.claim_result AS (
	outcome			text,
	status_code		integer,
	body			text,
	headers			jsonb,
	attempt			integer,
	recovery_point	text,
	created_at		timestamptz
);

COMMENT ON TYPE idempotency.claim_result IS
	'result of idem_claim: outcome is claimed, replay, in_progress or mismatch';

CREATE FUNCTION idempotency.idem_claim(scope text, key text,
									   fingerprint text DEFAULT NULL,
									   ttl interval DEFAULT NULL,
									   lease interval DEFAULT NULL)
RETURNS idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval) IS
	'claim an idempotency key, never blocking: claimed (run the operation), replay (stored response), in_progress (409) or mismatch (422)';

CREATE FUNCTION idempotency.idem_complete(scope text, key text,
										  status_code integer,
										  body text DEFAULT NULL,
										  headers jsonb DEFAULT NULL,
										  attempt integer DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_complete(text, text, integer, text, jsonb, integer) IS
	'store the response of a claimed key (stored), or release the key when the status is transient (released)';

CREATE FUNCTION idempotency.idem_release(scope text, key text,
										 attempt integer DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_release(text, text, integer) IS
	'drop an in-progress claim so that a retry runs the operation from scratch';

CREATE FUNCTION idempotency.idem_checkpoint(scope text, key text,
											recovery_point text,
											attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_checkpoint(text, text, text, integer) IS
	'record how far a multi-step operation got; returned to whoever takes the claim over';

CREATE FUNCTION idempotency.idem_fingerprint(request jsonb)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_jsonb'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(jsonb) IS
	'hex SHA-256 of the canonical text of a jsonb value: key order, duplicate keys and white space do not matter';

CREATE FUNCTION idempotency.idem_fingerprint(request text)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_bytes'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(text) IS
	'hex SHA-256 of the text''s bytes as given';

CREATE FUNCTION idempotency.idem_fingerprint(request bytea)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_fingerprint_bytes'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_fingerprint(bytea) IS
	'hex SHA-256 of the bytes';

/* ---------------------------------------------------------------------
 * 2. Consumer deduplication
 * ---------------------------------------------------------------------
 */

/*
 * One row per event a consumer has processed, kept for the retention given
 * (idempotency.event_retention by default): longer than the broker keeps
 * messages, so that every redelivery finds it.
 */
CREATE TABLE idempotency.processed_events (
	consumer		text COLLATE "C" NOT NULL,
	event_id		text COLLATE "C" NOT NULL,
	processed_at	timestamptz NOT NULL,
	expires_at		timestamptz NOT NULL,
	PRIMARY KEY (consumer, event_id)
);

COMMENT ON TABLE idempotency.processed_events IS
	'events each consumer has processed, for deduplication of redelivered messages';
COMMENT ON COLUMN idempotency.processed_events.consumer IS 'the consuming service or handler';
COMMENT ON COLUMN idempotency.processed_events.event_id IS 'the message''s unique id';
COMMENT ON COLUMN idempotency.processed_events.processed_at IS 'when the handler''s transaction marked it';
COMMENT ON COLUMN idempotency.processed_events.expires_at IS 'from this instant the event counts as not processed and may be purged';

SELECT pg_catalog.pg_extension_config_dump('idempotency.processed_events', '');

CREATE FUNCTION idempotency.idem_mark_processed(consumer text, event_id text,
												retention interval DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_mark_processed'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_mark_processed(text, text, interval) IS
	'mark an event processed inside the handler''s transaction: true the first time (process it), false for a duplicate (skip it)';

CREATE FUNCTION idempotency.idem_is_processed(consumer text, event_id text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_is_processed'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_is_processed(text, text) IS
	'has this consumer processed this event (a committed mark within its retention)?  Only looks';

/* ---------------------------------------------------------------------
 * 3. Transactional outbox
 * ---------------------------------------------------------------------
 */

CREATE SEQUENCE idempotency.outbox_id_seq AS bigint;

/*
 * Events written in the business transaction, published after it commits.
 * A row is pending (ready from available_at), leased (handed out until
 * available_at), dead (failed outbox_max_attempts times; holds back its key)
 * or published (kept for idempotency.outbox_retention, then purged).  The
 * columns map onto Debezium's outbox event router: see doc/integrations/debezium.md.
 */
CREATE TABLE idempotency.outbox (
	id				bigint NOT NULL DEFAULT nextval('idempotency.outbox_id_seq'),
	topic			text COLLATE "C" NOT NULL,
	key				text COLLATE "C",
	payload			jsonb NOT NULL,
	headers			jsonb,
	created_at		timestamptz NOT NULL DEFAULT clock_timestamp(),
	state			text NOT NULL DEFAULT 'pending'
		CHECK (state IN ('pending', 'leased', 'dead', 'published')),
	attempts		integer NOT NULL DEFAULT 0,
	available_at	timestamptz NOT NULL DEFAULT clock_timestamp(),
	last_error		text,
	published_at	timestamptz,
	PRIMARY KEY (topic, id)
);

ALTER SEQUENCE idempotency.outbox_id_seq OWNED BY idempotency.outbox.id;

/*
 * The primary key leads with the topic, so that the table can be distributed
 * by topic (Citus wants every unique index to hold the distribution column);
 * acknowledgements and the rest find a row by id alone through this one.
 */
CREATE INDEX outbox_id ON idempotency.outbox (id);

/* the rows a relay or the worker may take next, per topic, oldest first */
CREATE INDEX outbox_ready ON idempotency.outbox (topic, id)
	WHERE state IN ('pending', 'leased');

/* per-key order: is an earlier row of the same key still unpublished? */
CREATE INDEX outbox_key_order ON idempotency.outbox (topic, key, id)
	WHERE state <> 'published';

/* published rows kept for outbox_retention, for the purge to find */
CREATE INDEX outbox_published ON idempotency.outbox (published_at)
	WHERE state = 'published';

COMMENT ON TABLE idempotency.outbox IS
	'transactional outbox: events enqueued in the business transaction, published after commit, in order per (topic, key)';
COMMENT ON COLUMN idempotency.outbox.id IS 'event id, increasing in enqueue order (Debezium: table.field.event.id)';
COMMENT ON COLUMN idempotency.outbox.topic IS 'where the event goes; selects the route (Debezium: route.by.field)';
COMMENT ON COLUMN idempotency.outbox.key IS 'ordering key: rows of one (topic, key) go out oldest first; NULL rows are independent (Debezium: table.field.event.key)';
COMMENT ON COLUMN idempotency.outbox.payload IS 'the event (Debezium: table.field.event.payload)';
COMMENT ON COLUMN idempotency.outbox.headers IS 'optional message headers, a JSON object';
COMMENT ON COLUMN idempotency.outbox.created_at IS 'when the event was enqueued (Debezium: table.field.event.timestamp)';
COMMENT ON COLUMN idempotency.outbox.state IS 'pending, leased, dead or published';
COMMENT ON COLUMN idempotency.outbox.attempts IS 'how many times the row was handed out or tried';
COMMENT ON COLUMN idempotency.outbox.available_at IS 'pending: not before this instant (backoff); leased: when the lease runs out';
COMMENT ON COLUMN idempotency.outbox.last_error IS 'why the last attempt failed';
COMMENT ON COLUMN idempotency.outbox.published_at IS 'when the row was published or acknowledged';

SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_id_seq', '');

/* Where the background worker publishes each topic; '*' is the default. */
CREATE TABLE idempotency.outbox_routes (
	topic			text COLLATE "C" PRIMARY KEY,
	target			text NOT NULL
		CHECK (target IN ('notify', 'logical', 'function', 'none')),
	destination		text,
	run_as			regrole
);

COMMENT ON TABLE idempotency.outbox_routes IS
	'how the background worker publishes each topic (set with idem_outbox_route); topic ''*'' is the default route';
COMMENT ON COLUMN idempotency.outbox_routes.target IS 'notify, logical, function or none';
COMMENT ON COLUMN idempotency.outbox_routes.destination IS 'the NOTIFY channel, the logical message prefix, or the function';
COMMENT ON COLUMN idempotency.outbox_routes.run_as IS 'function target: the role that set the route, which the function runs as';

SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_routes', '');

CREATE FUNCTION idempotency.idem_outbox_enqueue(topic text, payload jsonb,
												key text DEFAULT NULL,
												headers jsonb DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_outbox_enqueue'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_enqueue(text, jsonb, text, jsonb) IS
	'enqueue an event inside the business transaction: it exists if and only if the transaction commits';

CREATE FUNCTION idempotency.idem_outbox_route(topic text, target text,
											  destination text DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_outbox_route'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_route(text, text, text) IS
	'choose how the background worker publishes a topic (''*'': every topic without a route of its own)';

CREATE FUNCTION idempotency.idem_outbox_fetch(topic text, batch integer DEFAULT 100,
											  lease interval DEFAULT '30s')
RETURNS SETOF idempotency.outbox
AS 'MODULE_PATHNAME', 'idem_outbox_fetch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100;

COMMENT ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval) IS
	'lease up to batch ready rows of a topic for an external relay, oldest first and gap-safe per key';

CREATE FUNCTION idempotency.idem_outbox_ack(ids bigint[])
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_outbox_ack'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_ack(bigint[]) IS
	'acknowledge leased rows as published; returns how many were';

CREATE FUNCTION idempotency.idem_outbox_nack(id bigint, error text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_outbox_nack'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_nack(bigint, text) IS
	'report a failed publish of a leased row: retried later with backoff, dead after outbox_max_attempts';

CREATE FUNCTION idempotency.idem_outbox_requeue(id bigint)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_outbox_requeue'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_requeue(bigint) IS
	'bring a dead row back: pending, attempts reset';

CREATE FUNCTION idempotency.idem_outbox_discard(id bigint)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_outbox_discard'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_discard(bigint) IS
	'drop a dead row, releasing the later rows of its key';

/* ---------------------------------------------------------------------
 * 4. Background work and statistics
 * ---------------------------------------------------------------------
 */

CREATE FUNCTION idempotency.idem_run_maintenance(OUT purged_keys bigint,
												 OUT purged_events bigint,
												 OUT purged_outbox bigint,
												 OUT published bigint,
												 OUT publish_failures bigint)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_run_maintenance'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_run_maintenance() IS
	'one batch of the background worker''s work (purge, publish) in this database, for setups without shared_preload_libraries (pg_cron)';

CREATE FUNCTION idempotency.idem_stats_counters(OUT claims bigint,
												OUT replays bigint,
												OUT conflicts bigint,
												OUT mismatches bigint,
												OUT takeovers bigint,
												OUT released bigint,
												OUT purged bigint,
												OUT published bigint,
												OUT publish_failures bigint,
												OUT purge_yields bigint,
												OUT worker_last_round timestamptz,
												OUT worker_pid integer)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE ROWS 1;

COMMENT ON FUNCTION idempotency.idem_stats_counters() IS
	'this database''s cumulative counters and worker state, from shared memory (no row without shared_preload_libraries)';

/*
 * One row: the state of the tables (counted now, so reading the view scans
 * them) and the cumulative counters since the server started.
 */
CREATE VIEW idempotency.stats AS
SELECT
	(SELECT count(*) FROM idempotency.keys
	 WHERE status_code IS NULL AND expires_at > now()) AS keys_in_progress,
	(SELECT count(*) FROM idempotency.keys
	 WHERE status_code IS NOT NULL AND expires_at > now()) AS keys_completed,
	(SELECT count(*) FROM idempotency.keys WHERE expires_at <= now()) AS keys_expired,
	(SELECT count(*) FROM idempotency.processed_events WHERE expires_at > now()) AS events,
	(SELECT count(*) FROM idempotency.processed_events WHERE expires_at <= now()) AS events_expired,
	(SELECT count(*) FROM idempotency.outbox
	 WHERE state IN ('pending', 'leased')) AS outbox_pending,
	(SELECT count(*) FROM idempotency.outbox WHERE state = 'dead') AS outbox_dead,
	(SELECT now() - min(created_at) FROM idempotency.outbox
	 WHERE state = 'pending' AND available_at <= now()) AS publish_lag,
	c.worker_pid,
	c.worker_last_round,
	c.claims,
	c.replays,
	c.conflicts,
	c.mismatches,
	c.takeovers,
	c.released,
	c.purged,
	c.published,
	c.publish_failures,
	c.purge_yields
FROM (VALUES (1)) AS one (x)
LEFT JOIN idempotency.idem_stats_counters() AS c ON true;

COMMENT ON VIEW idempotency.stats IS
	'keys by state, events, outbox pending/dead, publish lag, the worker''s last round, and cumulative counters';

CREATE FUNCTION idempotency._warn_without_preload()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_warn_without_preload'
LANGUAGE C;
SELECT idempotency._warn_without_preload();
DROP FUNCTION idempotency._warn_without_preload();

/* ---------------------------------------------------------------------
 * Privileges: nothing for PUBLIC.
 * ---------------------------------------------------------------------
 */
REVOKE ALL ON ALL TABLES IN SCHEMA idempotency FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA idempotency FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM PUBLIC;
