-- What the two editions must share: every table, view, sequence, index,
-- type, column, constraint, comment and grant of schema idempotency, and
-- every function's signature, defaults, result, volatility, strictness,
-- parallel safety, ROWS, comment and grants.  One line per fact, owners
-- written as OWNER (the C edition's objects belong to the superuser that
-- created the extension, the SQL edition's to the role that ran its script).
-- Not compared, as doc/internals.md says: a function's language, body,
-- SECURITY DEFINER and SET search_path; the schema's comment; and the SQL
-- edition's own helpers, whose names start with an underscore (listed
-- apart, each revoked from PUBLIC).
\pset tuples_only on
\pset format unaligned
SELECT line FROM (
	SELECT 'schema acl ' || coalesce(regexp_replace(nspacl::text, '(^|[,{])' || pg_get_userbyid(nspowner) || '=', '\1OWNER=', 'g'), 'default') AS line
	FROM pg_namespace WHERE nspname = 'idempotency'
	UNION ALL
	SELECT format('relation %s kind %s options %s acl %s comment %s', c.relname, c.relkind, c.reloptions,
				  regexp_replace(regexp_replace(coalesce(c.relacl::text, 'default'), '(^|[,{])' || pg_get_userbyid(c.relowner) || '=', '\1OWNER=', 'g'),
								 '/' || pg_get_userbyid(c.relowner) || '([,}])', '/OWNER\1', 'g'),
				  obj_description(c.oid, 'pg_class'))
	FROM pg_class c WHERE c.relnamespace = 'idempotency'::regnamespace
	UNION ALL
	SELECT format('column %s.%s %s %s notnull %s collation %s default %s comment %s', c.relname, a.attnum, a.attname,
				  format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attcollation::regcollation,
				  pg_get_expr(d.adbin, d.adrelid), col_description(c.oid, a.attnum))
	FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
	LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
	WHERE c.relnamespace = 'idempotency'::regnamespace
	UNION ALL
	SELECT format('constraint %s.%s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
	FROM pg_constraint WHERE connamespace = 'idempotency'::regnamespace
	UNION ALL
	SELECT format('index %s', pg_get_indexdef(indexrelid)) FROM pg_index
	WHERE indrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace)
	UNION ALL
	SELECT format('view %s %s', c.relname, pg_get_viewdef(c.oid)) FROM pg_class c
	WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'v'
	UNION ALL
	SELECT format('sequence %s %s %s %s %s %s', seqrelid::regclass, seqtypid::regtype, seqstart, seqincrement, seqmax, seqcache)
	FROM pg_sequence WHERE seqrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace)
	UNION ALL
	SELECT format('type %s %s comment %s', t.typname, t.typtype, obj_description(t.oid, 'pg_type'))
	FROM pg_type t WHERE t.typnamespace = 'idempotency'::regnamespace AND t.typtype <> 'b'
		AND NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = t.typrelid AND c.relkind <> 'c')
	UNION ALL
	SELECT format('function %s(%s) returns %s %s strict %s parallel %s retset %s rows %s kind %s comment %s acl %s',
				  p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
				  p.provolatile, p.proisstrict, p.proparallel, p.proretset, p.prorows, p.prokind,
				  obj_description(p.oid, 'pg_proc'),
				  regexp_replace(regexp_replace(coalesce(p.proacl::text, 'default'), '(^|[,{])' || pg_get_userbyid(p.proowner) || '=', '\1OWNER=', 'g'),
								 '/' || pg_get_userbyid(p.proowner) || '([,}])', '/OWNER\1', 'g'))
	FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname NOT LIKE '\_%'
	UNION ALL
	SELECT format('helper %s public-execute %s', p.oid::regprocedure, has_function_privilege('public', p.oid, 'EXECUTE'))
	FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname LIKE '\_%'
) AS lines ORDER BY line COLLATE "C";
