# What the TAP tests share.
#
# The edition a TAP test runs against, for the tests that both editions
# pass: the C edition (the default) or, with IDEM_EDITION=sql, the SQL
# edition's script (IDEM_SQL_SCRIPT, built by make dist), installed as the
# SQL edition is on a managed service, by a role that only holds CREATE on
# the database, on a server that preloads nothing of ours
# (scripts/check-sql-edition.sh runs them so, from a server tree without
# the C edition's files).  What the editions do differently is decided
# here, each a function a test asserts with, not a skip.
package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use PostgreSQL::Test::Utils;

our @EXPORT = qw(edition preload install_idempotency waiting_claim extension_objects_query);

sub edition
{
	my $edition = $ENV{IDEM_EDITION} // 'c';
	die "IDEM_EDITION is c or sql, not $edition" unless $edition =~ /^(c|sql)$/;
	return $edition;
}

# the shared_preload_libraries line for a node: the C edition's library
# (the SQL edition has none), and the other libraries given
sub preload
{
	my @libraries = ((edition() eq 'c' ? ('idempotency') : ()), @_);
	return "shared_preload_libraries = '" . join(',', @libraries) . "'";
}

# install the edition in a database of a started node
sub install_idempotency
{
	my ($node, $db) = @_;
	$db //= 'postgres';
	if (edition() eq 'c')
	{
		$node->safe_psql($db, 'CREATE EXTENSION idempotency');
		return;
	}
	my $script = $ENV{IDEM_SQL_SCRIPT}
	  or die 'IDEM_SQL_SCRIPT names no script (make dist builds it)';
	$node->safe_psql($db, qq{
		DO \$\$ BEGIN
			IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idem_owner') THEN
				CREATE ROLE idem_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
			END IF;
		END \$\$;
		GRANT CREATE ON DATABASE "$db" TO idem_owner;
	});
	my ($ret, $out, $err) = $node->psql($db, undef,
		extra_params => [ '-U', 'idem_owner', '-v', 'ON_ERROR_STOP=1', '-f', $script ]);
	die "the SQL edition's script failed as idem_owner: $err" if $ret != 0;
	return;
}

# a condition on pg_stat_activity that holds for a session whose claim
# waits for a key held by another transaction: the C edition sleeps in its
# wait slot (wait event IdempotencyClaimWait, or Extension on 15 and 16);
# the SQL edition waits for the holder's lock (the key's advisory lock, or
# the row a purge deletes) or sleeps between two looks at a lease
sub waiting_claim
{
	return edition() eq 'c'
	  ? q{(wait_event_type = 'Extension' AND wait_event IN ('IdempotencyClaimWait', 'Extension'))}
	  : q{(wait_event_type = 'Lock' OR wait_event = 'PgSleep')};
}

# a query that lists the objects of the extension idempotency in the
# database it runs in, one line each, with what makes two installs differ:
# a function's definition, a type's or table's columns, a table's
# constraints and indexes, the comment, the initial privileges (the
# update tests compare an updated database with a fresh install)
sub extension_objects_query
{
	return q{
	SELECT string_agg(o, E'\n' ORDER BY o) FROM (
		SELECT pg_describe_object(d.classid, d.objid, 0) || ': '
		       || coalesce(CASE d.classid
		            WHEN 'pg_proc'::regclass THEN pg_get_functiondef(d.objid)
		            WHEN 'pg_type'::regclass THEN
		              (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', '
		                                 ORDER BY a.attnum)
		               FROM pg_type t JOIN pg_attribute a ON a.attrelid = t.typrelid
		               WHERE t.oid = d.objid AND a.attnum > 0 AND NOT a.attisdropped)
		            WHEN 'pg_class'::regclass THEN
		              (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
		                                 || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END, ', '
		                                 ORDER BY a.attnum)
		               FROM pg_attribute a
		               WHERE a.attrelid = d.objid AND a.attnum > 0 AND NOT a.attisdropped)
		              || ' ' || coalesce((SELECT string_agg(conname || ' ' || pg_get_constraintdef(oid)
		                                                    || ' ' || convalidated, ', ' ORDER BY conname)
		                                  FROM pg_constraint WHERE conrelid = d.objid), '')
		              || ' ' || coalesce((SELECT string_agg(pg_get_indexdef(indexrelid), ', '
		                                                    ORDER BY pg_get_indexdef(indexrelid))
		                                  FROM pg_index WHERE indrelid = d.objid), '')
		          END, '')
		       || ' / ' || coalesce(obj_description(d.objid, d.classid::regclass::name), '')
		       || ' / ' || coalesce((SELECT initprivs::text FROM pg_init_privs i
		                             WHERE i.objoid = d.objid AND i.classoid = d.classid
		                               AND i.objsubid = 0), '') AS o
		FROM pg_depend d
		WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
		  AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
	) objects};
}

1;
