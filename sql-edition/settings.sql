/*
 * Settings, without C.  The C edition defines its settings when the library
 * loads, so that SET checks a value when it is set; without C they cannot
 * be defined, so a SET idempotency.x stores any text (a placeholder), and
 * the edition reads it with current_setting(name, true) where it is used,
 * checking it there with the errors the C edition's SET gives.  Unset, or
 * set to '' (which RESET leaves, and which SQL cannot tell from unset), a
 * setting has its default.
 *
 * The helpers here (and the underscore functions of the other files) have
 * no SET search_path of their own: they run inside the API functions,
 * whose search_path is pinned to pg_catalog, pg_temp, and a SET clause
 * would cost each call a save and restore of the setting (and keep the SQL
 * functions from being inlined).  Only the owner could call them directly.
 */

/*
 * A setting's value with an optional unit, as PostgreSQL reads an integer
 * setting that has units: a number, fractions included, then a unit among
 * scale's keys; the amount in base_unit (the unit a value without one is
 * in), not yet rounded.  The errors are those of the C edition's SET.
 */
CREATE FUNCTION idempotency._setting_amount(name text, value text, scale jsonb,
											 base_unit text, units_hint text)
RETURNS double precision
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
	parts text[] := regexp_match(value,
		'^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$');
BEGIN
	IF parts IS NULL THEN
		RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF parts[2] <> '' AND NOT scale ? parts[2] THEN
		RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = 'Valid units for this parameter are ' || units_hint || '.';
	END IF;
	RETURN parts[1]::double precision
		* (scale ->> coalesce(nullif(parts[2], ''), base_unit))::double precision
		/ (scale ->> base_unit)::double precision;
END
$$;

/*
 * A duration setting as an interval: name's value in base_unit ('ms' or
 * 's'), the C edition's default when unset, within min_units (1 unless
 * given) .. 2147483647 units.
 * Accepts what PostgreSQL accepts for an integer setting with a unit: a
 * number, fractions included (rounded to the base unit as rint() rounds),
 * with an optional unit among us, ms, s, min, h, d.
 */
CREATE FUNCTION idempotency._duration_setting(name text, base_unit text, default_units bigint,
											   min_units bigint DEFAULT 1)
RETURNS interval
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
	value text := current_setting(name, true);
	units double precision;
	/* typed, so that the constant is parsed once a backend, not at each call */
	scale constant jsonb := '{"us": 0.001, "ms": 1, "s": 1000, "min": 60000, "h": 3600000, "d": 86400000}'::jsonb;
BEGIN
	IF value IS NULL OR value = '' THEN
		units := default_units;
	ELSE
		units := round(idempotency._setting_amount(name, value, scale, base_unit,
					   '"us", "ms", "s", "min", "h", and "d"'));		/* rint(), as the server rounds a setting */
		IF units NOT BETWEEN -2147483648 AND 2147483647 THEN
			RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
				USING ERRCODE = 'invalid_parameter_value',
					  HINT = 'Value exceeds integer range.';
		END IF;
		IF units < min_units THEN
			RAISE EXCEPTION '% % is outside the valid range for parameter "%" (% .. 2147483647)',
				units::bigint, base_unit, name, min_units
				USING ERRCODE = 'invalid_parameter_value';
		END IF;
	END IF;
	/* as the C edition makes it: a span of time, no days or months */
	RETURN make_interval(secs => units * (scale ->> base_unit)::double precision / 1000);
END
$$;

/*
 * Is status_code one that idem_complete releases instead of storing
 * (idempotency.release_statuses)?  The list is parsed as the C edition's
 * check hook parses it, with its errors: codes and inclusive ranges within
 * 100..599, comma-separated, white space allowed around them.  A value of
 * white space only is an empty list, which releases nothing (the C edition
 * reads ' ' the same way; '' here means unset).
 */
CREATE FUNCTION idempotency._status_is_released(status_code integer)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
	value text := current_setting('idempotency.release_statuses', true);
	rest text;
	item text;
	parts text[];
	first integer;
	last integer;
	released boolean := false;
	bad text;
	tail text;
BEGIN
	IF value IS NULL OR value = '' THEN
		RETURN status_code IN (408, 425, 429) OR status_code BETWEEN 500 AND 599;
	END IF;
	rest := ltrim(value, E' \t\n\r\f\v');
	WHILE rest <> '' LOOP
		item := substring(rest FROM '^[^,]*');
		/* a code: 1 to 4 digits, not followed by a fifth */
		parts := regexp_match(rest, '^([0-9]{1,4})(?![0-9])\s*(.*)$', 's');
		IF parts IS NULL OR parts[1]::integer NOT BETWEEN 100 AND 599 THEN
			bad := format('"%s" is not an HTTP status code between 100 and 599.', item);
		ELSE
			first := parts[1]::integer;
			last := first;
			tail := parts[2];
			IF left(tail, 1) = '-' THEN
				parts := regexp_match(substr(tail, 2), '^\s*([0-9]{1,4})(?![0-9])\s*(.*)$', 's');
				IF parts IS NULL OR parts[1]::integer NOT BETWEEN 100 AND 599 OR parts[1]::integer < first THEN
					bad := format('"%s" is not a range of HTTP status codes between 100 and 599.', item);
				ELSE
					last := parts[1]::integer;
					tail := parts[2];
				END IF;
			END IF;
			IF bad IS NULL THEN
				IF left(tail, 1) = ',' THEN
					tail := ltrim(substr(tail, 2), E' \t\n\r\f\v');
					IF tail = '' THEN
						bad := 'The list ends with a comma.';
					END IF;
				ELSIF tail <> '' THEN
					bad := format('Expected a comma after "%s".', left(rest, length(rest) - length(tail)));
				END IF;
			END IF;
		END IF;
		IF bad IS NOT NULL THEN
			RAISE EXCEPTION 'invalid value for parameter "idempotency.release_statuses": "%"', value
				USING ERRCODE = 'invalid_parameter_value', DETAIL = bad;
		END IF;
		released := released OR status_code BETWEEN first AND last;
		rest := tail;
	END LOOP;
	RETURN released;
END
$$;

/*
 * The checks every function makes of a key, scope, consumer or event id
 * (or, with subscript, an element of an array of them): not NULL, and
 * min_bytes to 255 bytes, counted in bytes so that the limit holds in every
 * encoding.  The callers test the common case inline and call this only to
 * raise the error.
 */
CREATE FUNCTION idempotency._check_identifier(value text, name text, min_bytes integer,
											  subscript integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
	what text := CASE WHEN subscript IS NULL THEN name ELSE format('%s[%s]', name, subscript) END;
BEGIN
	IF value IS NULL THEN
		RAISE EXCEPTION '% must not be null', what USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF octet_length(value) < min_bytes THEN
		RAISE EXCEPTION '% must not be empty', what USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF octet_length(value) > 255 THEN
		RAISE EXCEPTION '% is too long', what
			USING ERRCODE = 'string_data_right_truncation',
				  DETAIL = format('It is %s bytes long; the limit is 255 bytes.', octet_length(value));
	END IF;
END
$$;

/*
 * A ttl, lease or retention argument: NULL means the setting's default
 * (setting, in base_unit, default_units when unset); otherwise it must move
 * the transaction's start forward, as in the C edition.
 */
CREATE FUNCTION idempotency._duration_arg(span interval, name text, setting text,
										  base_unit text, default_units bigint)
RETURNS interval
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
BEGIN
	IF span IS NULL THEN
		RETURN idempotency._duration_setting(setting, base_unit, default_units);
	END IF;
	IF now() + span <= now() THEN
		RAISE EXCEPTION '% must be positive', name
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = format('The value given was "%s".', span);
	END IF;
	RETURN span;
END
$$;

/*
 * The functions that write check this first, so that a read-only
 * transaction or a standby gets the C edition's error, naming the function.
 */
CREATE FUNCTION idempotency._require_writable(function_name text)
RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
BEGIN
	IF current_setting('transaction_read_only') = 'on' THEN
		RAISE EXCEPTION 'cannot execute % in a read-only transaction', function_name
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;
END
$$;

/*
 * (Every function in the body is immutable, text || text rather than the
 * stable text || anynonarray, so that the planner inlines it: called as a
 * function, a SQL function's body is planned again for each statement that
 * calls it, which made a lock cost more than the insert it guards.)
 *
 * The advisory lock of a key or an event: a 64-bit hash of what it is and
 * of its two parts, length-prefixed so that no two pairs hash the same
 * text.  Advisory locks are per database; the lock space is shared with the
 * application's own bigint advisory locks, which a 64-bit hash makes
 * practically disjoint.
 */
CREATE FUNCTION idempotency._lock_id(kind text, a text, b text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
RETURN pg_catalog.hashtextextended(kind || pg_catalog.octet_length(a)::text || ':' || a || b, 7211);

/*
 * Was this row version written by the current transaction (or one of its
 * subtransactions)?  A visible row whose inserting transaction is still in
 * progress can only be ours.
 */
CREATE FUNCTION idempotency._written_by_us(row_xmin xid)
RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL SAFE STRICT
BEGIN ATOMIC
	/* the full (epoch-qualified) id nearest the snapshot's xmax */
	SELECT pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL
		AND row_xmin::text::bigint >= 3		/* not frozen, nor bootstrap */
		AND pg_catalog.pg_xact_status((CASE WHEN x.f > x.t + 2147483648 THEN x.f - 4294967296
											WHEN x.f <= x.t - 2147483648 THEN x.f + 4294967296
											ELSE x.f END)::text::xid8) = 'in progress'
	FROM (SELECT pg_catalog.div(s.t, 4294967296) * 4294967296 + row_xmin::text::bigint AS f, s.t
		  FROM (SELECT pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::numeric AS t) AS s) AS x;
END;

/*
 * A setting's value as SHOW prints it in the C edition, for the messages
 * that quote it: an amount in base units written with the largest unit that
 * divides it exactly (as the server's GUC code does), units being ms, s,
 * min, h, d for durations (base 'ms') and B, kB, MB, GB, TB for sizes
 * (base 'B').
 */
CREATE FUNCTION idempotency._setting_text(amount bigint, base_unit text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
	SELECT CASE WHEN amount = 0 THEN '0' ELSE coalesce(
		(SELECT (amount / u.factor)::text || u.unit
		 FROM (VALUES ('ms', 1::bigint, 'd', 86400000::bigint), ('ms', 1, 'h', 3600000),
					  ('ms', 1, 'min', 60000), ('ms', 1, 's', 1000), ('ms', 1, 'ms', 1),
					  ('B', 1, 'TB', 1099511627776), ('B', 1, 'GB', 1073741824),
					  ('B', 1, 'MB', 1048576), ('B', 1, 'kB', 1024), ('B', 1, 'B', 1))
			  AS u(base, one, unit, factor)
		 WHERE u.base = base_unit AND amount % u.factor = 0
		 ORDER BY u.factor DESC LIMIT 1),
		amount::text) END
$$;

/*
 * A size setting in bytes (the C edition's GUC_UNIT_BYTE): name's value, its
 * default when unset, within 1 .. max_bytes.  Accepts what PostgreSQL accepts
 * for a memory setting: a number with an optional unit among B, kB, MB, GB
 * and TB (multiples of 1024).
 */
CREATE FUNCTION idempotency._bytes_setting(name text, default_bytes bigint, max_bytes bigint)
RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
	value text := current_setting(name, true);
	amount double precision;
	/* typed, as above */
	scale constant jsonb := '{"B": 1, "kB": 1024, "MB": 1048576, "GB": 1073741824, "TB": 1099511627776}'::jsonb;
BEGIN
	IF value IS NULL OR value = '' THEN
		RETURN default_bytes;
	END IF;
	amount := round(idempotency._setting_amount(name, value, scale, 'B',
					'"B", "kB", "MB", "GB", and "TB"'));
	IF amount NOT BETWEEN 1 AND max_bytes THEN
		RAISE EXCEPTION '% B is outside the valid range for parameter "%" (1 .. %)',
			amount::bigint, name, max_bytes
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	RETURN amount::bigint;
END
$$;

/*
 * An integer setting without a unit: name's value, default_value when unset,
 * within min_value .. max_value.  Accepts what PostgreSQL accepts for such a
 * setting: a decimal number, fractions included (rounded as rint() rounds),
 * or a hexadecimal (0x...) or octal (0...) integer, with white space around.
 */
CREATE FUNCTION idempotency._integer_setting(name text, min_value integer, max_value integer,
											 default_value integer)
RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
DECLARE
	value text := current_setting(name, true);
	digits text;
	number numeric;
BEGIN
	IF value IS NULL OR value = '' THEN
		RETURN default_value;
	END IF;
	digits := substring(value FROM '^\s*(.*?)\s*$');
	IF digits ~ '^[-+]?0[xX][0-9a-fA-F]+$' THEN
		number := ('x' || lpad(substring(digits FROM '[0-9a-fA-F]+$'), 16, '0'))::bit(64)::bigint;
		IF left(digits, 1) = '-' THEN number := -number; END IF;
	ELSIF digits ~ '^[-+]?0[0-7]+$' THEN
		number := 0;
		FOR i IN 1 .. length(substring(digits FROM '[0-7]+$')) LOOP
			number := number * 8 + substr(substring(digits FROM '[0-7]+$'), i, 1)::integer;
		END LOOP;
		IF left(digits, 1) = '-' THEN number := -number; END IF;
	ELSIF digits ~ '^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$' AND digits !~ '^[-+]?0[0-9]+$' THEN
		number := round(digits::double precision)::numeric;	/* rint(): half to even */
	ELSE
		RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF number NOT BETWEEN -2147483648 AND 2147483647 THEN
		RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, value
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = 'Value exceeds integer range.';
	END IF;
	IF number NOT BETWEEN min_value AND max_value THEN
		RAISE EXCEPTION '% is outside the valid range for parameter "%" (% .. %)',
			number, name, min_value, max_value
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	RETURN number;
END
$$;
