-- test/fuzz/sqlsmith-log.sql: the tables that Debian's sqlsmith (1.4) writes
-- to with --log-to, where scripts/check-fuzz.sh counts its errors by
-- SQLSTATE.  (sqlsmith's own log.sql predates its sqlstate, version and
-- seed columns.)
CREATE TABLE instance (
	id			bigserial PRIMARY KEY,
	rev			text,
	target		text,
	hostname	text,
	version		text,
	seed		text,
	t			timestamptz DEFAULT now()
);
CREATE TABLE error (
	id			bigint REFERENCES instance (id),
	msg			text,
	query		text,
	sqlstate	text,
	t			timestamptz DEFAULT now()
);
CREATE TABLE stat (
	id			bigint REFERENCES instance (id),
	generated	numeric,
	level		numeric,
	nodes		numeric,
	updated		timestamptz,
	retries		numeric,
	impedance	text
);
