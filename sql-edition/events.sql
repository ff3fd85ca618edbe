/*
 * Consumer deduplication: idem_mark_processed, idem_is_processed and their
 * batch forms, with the C edition's answers and errors (src/events/events.c).
 *
 * A mark is INSERT ... ON CONFLICT DO NOTHING, which waits, as the C
 * edition does, for a concurrent mark of the same event and then counts by
 * its outcome: false once it committed, true (inserted now) if it rolled
 * back.  An event past its retention counts as new and its row is renewed
 * in place.  A look reads the committed marks (and the transaction's own).
 * The batch forms mark or look at each distinct id once, in the ids'
 * bytewise order (the columns are COLLATE "C"), so that two batches that
 * overlap never wait for each other in a circle, and answer in the array's
 * order.  They plan each statement for the array they are given
 * (plan_cache_mode = force_custom_plan): a generic plan counts ten elements
 * in any array and can join a large batch to a large table in a nested loop
 * (100,000 ids took over a minute; the differential fuzz found it).
 */

/*
 * The ids of a batch call, checked whole before anything is written, as
 * the C edition checks them: not NULL, one dimension, every element a valid
 * event id named by its subscript.
 */
CREATE FUNCTION idempotency._check_event_ids(event_ids text[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
	lower_bound integer;
	bad text;
	bad_at bigint;
BEGIN
	IF event_ids IS NULL THEN
		RAISE EXCEPTION 'event_ids must not be null'
			USING ERRCODE = 'null_value_not_allowed',
				  HINT = 'Pass an empty array for no events.';
	END IF;
	IF array_ndims(event_ids) > 1 THEN
		RAISE EXCEPTION 'event_ids must be a one-dimensional array'
			USING ERRCODE = 'array_subscript_error',
				  DETAIL = format('It has %s dimensions.', array_ndims(event_ids));
	END IF;
	/* the first bad element, found in one pass (a loop of subscripts would
	 * read the array from its start for each element) */
	SELECT u.e, u.n INTO bad, bad_at
	FROM unnest(event_ids) WITH ORDINALITY AS u (e, n)
	WHERE u.e IS NULL OR octet_length(u.e) NOT BETWEEN 1 AND 255
	ORDER BY u.n LIMIT 1;
	IF FOUND THEN
		lower_bound := coalesce(array_lower(event_ids, 1), 1);
		PERFORM idempotency._check_identifier(bad, 'event_ids', 1, lower_bound + bad_at::integer - 1);
	END IF;
END
$$;

/*
 * Mark one event (the arguments checked): true the first time, false for a
 * duplicate.  Past its retention, the row is renewed; a concurrent renewal
 * is waited for, and then the event is a duplicate.
 */
CREATE FUNCTION idempotency._mark_event(p_consumer text, p_event_id text, p_retention interval)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
AS $$
DECLARE
	now_ts timestamptz;
BEGIN
	LOOP
		now_ts := clock_timestamp();
		INSERT INTO idempotency.processed_events AS e (consumer, event_id, processed_at, expires_at)
		VALUES (p_consumer, p_event_id, now_ts, now_ts + p_retention)
		ON CONFLICT DO NOTHING;
		IF FOUND THEN
			RETURN true;
		END IF;
		/* there, committed: a duplicate unless past its retention */
		now_ts := clock_timestamp();
		PERFORM FROM idempotency.processed_events AS e
		WHERE e.consumer = p_consumer AND e.event_id = p_event_id;
		IF FOUND THEN
			UPDATE idempotency.processed_events AS e
			SET processed_at = now_ts, expires_at = now_ts + p_retention
			WHERE e.consumer = p_consumer AND e.event_id = p_event_id AND e.expires_at <= now_ts;
			RETURN FOUND;
		END IF;
		/* deleted (purged) since: mark it again */
	END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_mark_processed(consumer text, event_id text,
												retention interval DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	p_retention interval;
	now_ts timestamptz;
BEGIN
	IF $1 IS NULL OR $2 IS NULL OR octet_length($1) NOT BETWEEN 1 AND 255
		OR octet_length($2) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier($1, 'consumer', 1);
		PERFORM idempotency._check_identifier($2, 'event_id', 1);
	END IF;
	IF $3 IS NULL AND coalesce(current_setting('idempotency.event_retention', true), '') = '' THEN
		p_retention := interval '336 hours';	/* the default, 14 days, as the C edition makes it */
	ELSE
		p_retention := idempotency._duration_arg($3, 'retention', 'idempotency.event_retention', 's', 1209600);
	END IF;
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_mark_processed()');
	END IF;
	/* the common case inline: a new event */
	now_ts := clock_timestamp();
	INSERT INTO idempotency.processed_events AS e (consumer, event_id, processed_at, expires_at)
	VALUES ($1, $2, now_ts, now_ts + p_retention)
	ON CONFLICT DO NOTHING;
	IF FOUND THEN
		RETURN true;
	END IF;
	RETURN idempotency._mark_event($1, $2, p_retention);
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_is_processed(consumer text, event_id text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL SAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF $1 IS NULL OR $2 IS NULL OR octet_length($1) NOT BETWEEN 1 AND 255
		OR octet_length($2) NOT BETWEEN 1 AND 255 THEN
		PERFORM idempotency._check_identifier($1, 'consumer', 1);
		PERFORM idempotency._check_identifier($2, 'event_id', 1);
	END IF;
	RETURN EXISTS (SELECT FROM idempotency.processed_events AS e
				   WHERE e.consumer = $1 AND e.event_id = $2 AND e.expires_at > clock_timestamp());
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_mark_processed_batch(consumer text, event_ids text[],
													  retention interval DEFAULT NULL)
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL UNSAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
	p_retention interval;
	now_ts timestamptz;
	new_ids text[];
	id text;
BEGIN
	PERFORM idempotency._check_identifier($1, 'consumer', 1);
	PERFORM idempotency._check_event_ids($2);
	p_retention := idempotency._duration_arg($3, 'retention', 'idempotency.event_retention', 's', 1209600);
	IF current_setting('transaction_read_only') = 'on' THEN
		PERFORM idempotency._require_writable('idem_mark_processed_batch()');
	END IF;
	IF cardinality($2) = 0 THEN
		RETURN;
	END IF;
	/* every new id in one statement, inserted in bytewise order */
	now_ts := clock_timestamp();
	WITH inserted AS (
		INSERT INTO idempotency.processed_events AS e (consumer, event_id, processed_at, expires_at)
		SELECT $1, d.id, now_ts, now_ts + p_retention
		FROM (SELECT DISTINCT u.id COLLATE "C" AS id FROM unnest($2) AS u (id) ORDER BY 1) AS d
		ORDER BY d.id
		ON CONFLICT DO NOTHING
		RETURNING e.event_id)
	SELECT coalesce(array_agg(inserted.event_id), '{}') INTO new_ids FROM inserted;
	/*
	 * The rest were there, committed (a mark in flight was waited for): a
	 * duplicate, unless past its retention (or purged since), which is
	 * marked again one by one, in the same order.
	 */
	IF cardinality(new_ids) < (SELECT count(DISTINCT u.id COLLATE "C") FROM unnest($2) AS u (id)) THEN
		now_ts := clock_timestamp();
		FOR id IN
			SELECT d.id
			FROM (SELECT DISTINCT u.id COLLATE "C" AS id FROM unnest($2) AS u (id)) AS d
			LEFT JOIN idempotency.processed_events AS e ON e.consumer = $1 AND e.event_id = d.id
			WHERE (e.event_id IS NULL OR e.expires_at <= now_ts)
				/* a join, not <> ALL, which is quadratic once the plan is generic */
				AND NOT EXISTS (SELECT FROM unnest(new_ids) AS n (id) WHERE n.id = d.id)
			ORDER BY d.id
		LOOP
			IF idempotency._mark_event($1, id, p_retention) THEN
				new_ids := new_ids || id;
			END IF;
		END LOOP;
	END IF;
	/* in the array's order, each id once */
	RETURN QUERY
		SELECT u.id FROM unnest($2) WITH ORDINALITY AS u (id, n)
		WHERE u.id IN (SELECT n.id FROM unnest(new_ids) AS n (id))
		GROUP BY u.id ORDER BY min(u.n);
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_is_processed_batch(consumer text, event_ids text[])
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE CALLED ON NULL INPUT PARALLEL SAFE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
	PERFORM idempotency._check_identifier($1, 'consumer', 1);
	PERFORM idempotency._check_event_ids($2);
	RETURN QUERY
		SELECT u.id FROM unnest($2) WITH ORDINALITY AS u (id, n)
		JOIN idempotency.processed_events AS e
			ON e.consumer = $1 AND e.event_id = u.id AND e.expires_at > clock_timestamp()
		GROUP BY u.id ORDER BY min(u.n);
END
$$;
