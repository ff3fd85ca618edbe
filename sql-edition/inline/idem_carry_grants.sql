$inline$
/*
 * The C edition's idem_carry_grants gives the roles that may execute the
 * old function EXECUTE on the new one.  Here the installing role owns both
 * and grants as itself; a fresh install has no grant to carry.
 */
DECLARE
	grant_row record;
BEGIN
	FOR grant_row IN
		SELECT a.grantee, a.is_grantable
		FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
		WHERE p.oid = old AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
	LOOP
		EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s', new,
			CASE WHEN grant_row.grantee = 0 THEN 'PUBLIC' ELSE grant_row.grantee::regrole::text END,
			CASE WHEN grant_row.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
	END LOOP;
END
$inline$
