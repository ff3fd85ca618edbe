/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

/*
 * A route that publishes somewhere names where.  idem_outbox_route never
 * stored a NULL destination for the notify, logical or function targets,
 * but 1.0's CHECK allowed a row written directly with one, which the worker
 * cannot publish (it counts each of its rows' attempts as failed).  The
 * check is valid for every row: a NOT VALID one would keep such a row here,
 * but a dump of the database would not restore (the restore's COPY is
 * checked), so the update refuses to run until the route is set.
 */
DO $$
DECLARE
	topics text;
BEGIN
	SELECT string_agg(quote_literal(topic), ', ' ORDER BY topic) INTO topics
	FROM idempotency.outbox_routes
	WHERE target <> 'none' AND destination IS NULL;
	IF topics IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency cannot be updated while a route has no destination'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('The routes of topics %s publish but name no destination, which the worker cannot publish to.', topics),
				  HINT = 'Set each with idem_outbox_route(topic, target, destination), or make it ''none'', then update again.';
	END IF;
END
$$;

ALTER TABLE idempotency.outbox_routes
	ADD CONSTRAINT outbox_routes_destination_check
	CHECK (target = 'none' OR destination IS NOT NULL);

/* ---------------------------------------------------------------------
 * Idempotency keys: claim_result says when, idem_claim can wait, a holder
 * can extend its lease.
 * ---------------------------------------------------------------------
 */

/*
 * Appended, so that 1.0's columns keep their places: the C code fills the
 * columns of the type as the database declares it, 7 at 1.0 and 9 from
 * here on, so one library serves databases on either side of the update.
 */
ALTER TYPE idempotency.claim_result
	ADD ATTRIBUTE lease_expires_at timestamptz,
	ADD ATTRIBUTE expires_at timestamptz;

COMMENT ON TYPE idempotency.claim_result IS
	'result of idem_claim: outcome is claimed, replay, in_progress or mismatch; lease_expires_at says when a held claim may be taken over, expires_at when a replayed response expires';
COMMENT ON COLUMN idempotency.claim_result.lease_expires_at IS
	'claimed, or in_progress with a committed holder: when its lease runs out and a takeover becomes possible; NULL otherwise';
COMMENT ON COLUMN idempotency.claim_result.expires_at IS
	'replay: when the stored response expires; NULL otherwise';

/*
 * idem_claim gains its sixth argument, wait.  A longer argument list is a
 * new function: it is created, the roles that could execute the 1.0
 * function get EXECUTE on it (idem_carry_grants, in src/infra/upgrade.c, says
 * why this is not a plain GRANT), and the 1.0 function is dropped, since
 * two overloads would make every existing call ambiguous.  A view or a
 * BEGIN ATOMIC function that calls it stops the update with the usual
 * "other objects depend on it": drop it first, and create it again after.
 */
CREATE FUNCTION idempotency.idem_claim(scope text, key text,
									   fingerprint text DEFAULT NULL,
									   ttl interval DEFAULT NULL,
									   lease interval DEFAULT NULL,
									   wait interval DEFAULT NULL)
RETURNS idempotency.claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval) IS
	'claim an idempotency key: claimed (run the operation), replay (stored response), in_progress (409) or mismatch (422); wait: how long to wait for an in-flight holder before answering in_progress (NULL or 0: never blocks)';

REVOKE ALL ON FUNCTION idempotency.idem_claim(text, text, text, interval, interval, interval)
	FROM PUBLIC;

CREATE FUNCTION idempotency._carry_grants(old regprocedure, new regprocedure)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_carry_grants'
LANGUAGE C STRICT;
SELECT idempotency._carry_grants(
	'idempotency.idem_claim(text, text, text, interval, interval)',
	'idempotency.idem_claim(text, text, text, interval, interval, interval)');

DROP FUNCTION idempotency.idem_claim(text, text, text, interval, interval);

/*
 * A holder still at work pushes its lease out; like its siblings, nobody
 * may execute it until granted (see the README's privileges).
 */
CREATE FUNCTION idempotency.idem_extend_lease(scope text, key text,
											  attempt integer,
											  lease interval DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend_lease'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_extend_lease(text, text, integer, interval) IS
	'the holder of a claim pushes its lease out (to lease from now, idempotency.lease by default), fenced by attempt; returns the new lease_expires_at';

REVOKE ALL ON FUNCTION idempotency.idem_extend_lease(text, text, integer, interval)
	FROM PUBLIC;

/* ---------------------------------------------------------------------
 * Consumer deduplication in batches (issue 19, item 1): the ids a broker
 * hands over in one poll, marked or looked up in one call.
 * ---------------------------------------------------------------------
 */

CREATE FUNCTION idempotency.idem_mark_processed_batch(consumer text, event_ids text[],
													  retention interval DEFAULT NULL)
RETURNS SETOF text
AS 'MODULE_PATHNAME', 'idem_mark_processed_batch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_mark_processed_batch(text, text[], interval) IS
	'mark a batch of events processed inside the handler''s transaction: returns the ids new to the consumer (process them), in the array''s order, each once';

CREATE FUNCTION idempotency.idem_is_processed_batch(consumer text, event_ids text[])
RETURNS SETOF text
AS 'MODULE_PATHNAME', 'idem_is_processed_batch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.idem_is_processed_batch(text, text[]) IS
	'which of these events has this consumer processed (committed marks within their retention)?  The ids, in the array''s order, each once.  Only looks';

REVOKE ALL ON FUNCTION idempotency.idem_mark_processed_batch(text, text[], interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_is_processed_batch(text, text[]) FROM PUBLIC;

/* ---------------------------------------------------------------------
 * Outbox (issue 19, items 2-4): batch enqueue, per-key batched fetch,
 * fenced acknowledgements, and a pull path whose hand-out is a HOT update.
 * ---------------------------------------------------------------------
 */

/*
 * A hand-out changes state, attempts, available_at and last_error.  In 1.0
 * three indexes named state in their predicates, so that every hand-out
 * wrote a new entry into each index (a row went out as a non-HOT update),
 * and a relay's next scan waded through the entries the last one left.
 * From 1.1 the partial indexes are told by published_at, which only
 * publishing sets: leasing, nacking and requeueing change no indexed
 * column, and with the room fillfactor leaves on each page they are HOT
 * updates.  The per-key order index holds rows with a key only: a row
 * without one never waits for another.  The statements name both
 * predicates (state and published_at, which agree on every row), so that
 * the planner uses the indexes of a database at 1.0 and at 1.1 alike.
 */
DROP INDEX idempotency.outbox_ready;
CREATE INDEX outbox_ready ON idempotency.outbox (topic, id)
	WHERE published_at IS NULL;
DROP INDEX idempotency.outbox_key_order;
CREATE INDEX outbox_key_order ON idempotency.outbox (topic, key, id)
	WHERE published_at IS NULL AND key IS NOT NULL;
DROP INDEX idempotency.outbox_published;
CREATE INDEX outbox_published ON idempotency.outbox (published_at)
	WHERE published_at IS NOT NULL;
/*
 * Half of each page is left free: a hand-out updates every row of a page it
 * takes, and the new versions of all of them fit beside the old ones, so
 * that each is a HOT update.  At 80 only the first few rows of a page found
 * room, and the rest wrote an entry into each of four indexes: a drain of
 * the pull API cost its backend 1.4-1.7 times the CPU (measured with 1,000
 * keys and without).  The price is room: a backlog takes twice the pages.
 */
ALTER TABLE idempotency.outbox SET (fillfactor = 50);

CREATE FUNCTION idempotency.idem_outbox_enqueue_batch(topic text, payloads jsonb[],
													  keys text[] DEFAULT NULL,
													  headers jsonb[] DEFAULT NULL)
RETURNS SETOF bigint
AS 'MODULE_PATHNAME', 'idem_outbox_enqueue_batch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100;

COMMENT ON FUNCTION idempotency.idem_outbox_enqueue_batch(text, jsonb[], text[], jsonb[]) IS
	'enqueue several events of a topic in one call, inside the business transaction: their ids in array order; rows of one key keep the array''s order';

/*
 * idem_outbox_fetch gains per_key.  As for idem_claim, the longer argument
 * list is a new function: the roles that could execute the 1.0 one get
 * EXECUTE on it (through _carry_grants, as for idem_claim), and the 1.0 one
 * is dropped, since two overloads would make every existing call ambiguous.
 */
CREATE FUNCTION idempotency.idem_outbox_fetch(topic text, batch integer DEFAULT 100,
											  lease interval DEFAULT '30s',
											  per_key integer DEFAULT 1)
RETURNS SETOF idempotency.outbox
AS 'MODULE_PATHNAME', 'idem_outbox_fetch'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE ROWS 100;

COMMENT ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval, integer) IS
	'lease up to batch ready rows of a topic for an external relay, oldest first and gap-safe per key, up to per_key consecutive rows of one key in one hand-out';

REVOKE ALL ON FUNCTION idempotency.idem_outbox_fetch(text, integer, interval, integer) FROM PUBLIC;

SELECT idempotency._carry_grants(
	'idempotency.idem_outbox_fetch(text, integer, interval)',
	'idempotency.idem_outbox_fetch(text, integer, interval, integer)');

DROP FUNCTION idempotency.idem_outbox_fetch(text, integer, interval);

CREATE FUNCTION idempotency.idem_outbox_ack(ids bigint[], attempts integer[])
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_outbox_ack_fenced'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_ack(bigint[], integer[]) IS
	'acknowledge rows still leased under the hand-outs that returned them (attempts as fetched) as published, each together with or after the earlier rows of its key; returns how many were';

CREATE FUNCTION idempotency.idem_outbox_nack(id bigint, error text, attempt integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_outbox_nack_fenced'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency.idem_outbox_nack(bigint, text, integer) IS
	'report a failed publish of a row still leased under the hand-out that returned it (attempt as fetched); the later rows of that hand-out go back to pending';

REVOKE ALL ON FUNCTION idempotency.idem_outbox_enqueue_batch(text, jsonb[], text[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_outbox_ack(bigint[], integer[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_outbox_nack(bigint, text, integer) FROM PUBLIC;


/* ---------------------------------------------------------------------
 * Citus: the tables distributed, the functions delegated to their shards.
 * ---------------------------------------------------------------------
 */

/*
 * One call on the coordinator distributes the extension's tables beside
 * the application's: keys by scope, processed_events by consumer and outbox
 * by topic, in one colocation group (with colocate_with's, when given), the
 * routes as a reference table; and declares each function whose first
 * argument is a distribution value a distributed function of that table,
 * delegated even inside a transaction block (force_delegation), so that a
 * claim, the business writes of the same tenant and the completion run on
 * the node of their shards and commit together there.  The C code finds
 * the shard itself (src/citus/shards.c).  Citus's functions are called by
 * name at run time: without Citus, 55000.
 */
CREATE FUNCTION idempotency.idem_distribute(colocate_with regclass DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	column_name name;
	column_type oid;
	column_collation oid;
	fn record;
BEGIN
	IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
		RAISE EXCEPTION 'idem_distribute() needs the citus extension'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = 'It distributes the extension''s tables and functions with Citus, which is not installed in this database.',
				  HINT = 'Run CREATE EXTENSION citus on the coordinator first, or keep the tables local.';
	END IF;

	IF colocate_with IS NOT NULL THEN
		/* Citus colocates text columns of one collation only: say which */
		SELECT a.attname, a.atttypid, a.attcollation INTO column_name, column_type, column_collation
		FROM pg_dist_partition p
		JOIN pg_attribute a ON a.attrelid = p.logicalrelid
			AND a.attname = column_to_column_name(p.logicalrelid, p.partkey)
		WHERE p.logicalrelid = colocate_with AND p.partmethod = 'h';
		IF NOT FOUND THEN
			RAISE EXCEPTION 'table % is not hash-distributed', colocate_with
				USING ERRCODE = 'invalid_parameter_value',
					  HINT = 'Distribute it first with create_distributed_table(), by its tenant column.';
		END IF;
		IF column_type <> 'pg_catalog.text'::regtype THEN
			RAISE EXCEPTION 'column % of table % must be of type text, not %', column_name, colocate_with,
				format_type(column_type, NULL)
				USING ERRCODE = 'datatype_mismatch',
					  DETAIL = 'The extension''s tables are distributed by text columns of collation "C" (scope, consumer, topic), and Citus colocates only distribution columns of one type and collation.',
					  HINT = 'Distribute the application''s table by a text COLLATE "C" column, or call idem_distribute() without it.';
		END IF;
		IF column_collation <> 'pg_catalog."C"'::regcollation THEN
			RAISE EXCEPTION 'column % of table % must have collation "C"', column_name, colocate_with
				USING ERRCODE = 'collation_mismatch',
					  DETAIL = 'The extension''s tables are distributed by text columns of collation "C" (scope, consumer, topic), and Citus colocates only distribution columns of one collation.',
					  HINT = format('Citus does not alter a distribution column: undistribute the table (SELECT undistribute_table(%L)), ALTER TABLE %s ALTER %s TYPE text COLLATE "C", and distribute it again.',
									colocate_with::text, colocate_with, quote_ident(column_name));
		END IF;
	END IF;

	PERFORM create_distributed_table('idempotency.keys', 'scope',
									 colocate_with => coalesce(colocate_with::text, 'default'));
	PERFORM create_distributed_table('idempotency.processed_events', 'consumer',
									 colocate_with => 'idempotency.keys');
	PERFORM create_distributed_table('idempotency.outbox', 'topic',
									 colocate_with => 'idempotency.keys');
	PERFORM create_reference_table('idempotency.outbox_routes');

	FOR fn IN
		SELECT p.oid::regprocedure AS signature, t.table_name
		FROM pg_proc p
		JOIN (VALUES ('idem_claim', 'idempotency.keys'),
					 ('idem_complete', 'idempotency.keys'),
					 ('idem_release', 'idempotency.keys'),
					 ('idem_checkpoint', 'idempotency.keys'),
					 ('idem_extend_lease', 'idempotency.keys'),
					 ('idem_mark_processed', 'idempotency.processed_events'),
					 ('idem_is_processed', 'idempotency.processed_events'),
					 ('idem_mark_processed_batch', 'idempotency.processed_events'),
					 ('idem_is_processed_batch', 'idempotency.processed_events'),
					 ('idem_outbox_enqueue', 'idempotency.outbox'),
					 ('idem_outbox_enqueue_batch', 'idempotency.outbox'),
					 ('idem_outbox_fetch', 'idempotency.outbox'),
					 ('_outbox_on_shard', 'idempotency.outbox'))
			AS t (function_name, table_name) ON p.proname = t.function_name
		WHERE p.pronamespace = 'idempotency'::regnamespace
		ORDER BY 1
	LOOP
		PERFORM create_distributed_function(fn.signature, '$1',
											colocate_with => fn.table_name,
											force_delegation => true);
	END LOOP;
END
$$;

COMMENT ON FUNCTION idempotency.idem_distribute(regclass) IS
	'Citus: distribute keys, processed_events and outbox (colocated with colocate_with, whose tenant column must be text COLLATE "C"), make outbox_routes a reference table, and delegate the functions to their shards';

REVOKE ALL ON FUNCTION idempotency.idem_distribute(regclass) FROM PUBLIC;

/*
 * On a distributed outbox, the calls that name rows by id (ack, nack,
 * requeue, discard) find the rows' topics and have each topic's part done
 * by this function, which Citus delegates to the node of the topic's shard
 * (see on_the_topics_shards in src/outbox/outbox.c).  Only the owner of the
 * extension's tables runs it: the calls do, once their caller has been
 * allowed to call them.
 */
CREATE FUNCTION idempotency._outbox_on_shard(topic text, call text, ids bigint[],
											 attempts integer[], error text)
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_outbox_on_shard'
LANGUAGE C VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency._outbox_on_shard(text, text, bigint[], integer[], text) IS
	'internal: one topic''s part of an ack, nack, requeue or discard of a distributed outbox, on the node of its shard';

REVOKE ALL ON FUNCTION idempotency._outbox_on_shard(text, text, bigint[], integer[], text) FROM PUBLIC;

/*
 * On Citus, the counters of idempotency.stats are the node's own (each
 * node's shared memory), while its row counts are the cluster's (Citus
 * counts every shard).  This gives every node's counters, read on each
 * node through Citus: a node that does not answer is an error, not a row
 * left out.  The sum of a column is the cluster's.
 */
CREATE FUNCTION idempotency.idem_cluster_counters(OUT nodename text,
												  OUT nodeport integer,
												  OUT claims bigint,
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
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	node record;
BEGIN
	IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
		RAISE EXCEPTION 'idem_cluster_counters() needs the citus extension'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'On one server, idempotency.stats and idempotency.idem_stats_counters() have its counters.';
	END IF;
	FOR node IN EXECUTE
		$q$SELECT n.nodename::text AS nodename, n.nodeport, r.success, r.result
		   FROM run_command_on_all_nodes(
		            'SELECT coalesce(json_agg(c), ''[]'') FROM idempotency.idem_stats_counters() c') r
		   JOIN pg_dist_node n ON n.nodeid = r.nodeid
		   ORDER BY n.nodename, n.nodeport$q$
	LOOP
		IF NOT node.success THEN
			RAISE EXCEPTION 'idem_cluster_counters(): node %:% did not answer', node.nodename, node.nodeport
				USING ERRCODE = 'connection_failure', DETAIL = node.result;
		END IF;
		RETURN QUERY
			SELECT node.nodename, node.nodeport, c.*
			FROM json_to_recordset(node.result::json) AS c (claims bigint, replays bigint,
				conflicts bigint, mismatches bigint, takeovers bigint, released bigint,
				purged bigint, published bigint, publish_failures bigint, purge_yields bigint,
				worker_last_round timestamptz, worker_pid integer);
	END LOOP;
END
$$;

COMMENT ON FUNCTION idempotency.idem_cluster_counters() IS
	'Citus: every node''s cumulative counters and worker state (idem_stats_counters() on each node, through Citus); their sum is the cluster''s';

REVOKE ALL ON FUNCTION idempotency.idem_cluster_counters() FROM PUBLIC;


/* the grants are carried: the helper goes */
DROP FUNCTION idempotency._carry_grants(regprocedure, regprocedure);
