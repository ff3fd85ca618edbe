/*-------------------------------------------------------------------------
 *
 * upgrade.c
 *	  What the update scripts need from the library: carrying the grants of
 *	  a function whose signature changes over to its new signature.
 *
 * A function whose argument list grows is a new function: the update
 * creates it and drops the old one (two overloads would make every existing
 * call ambiguous), and the roles that could execute the old one must be
 * able to execute the new one.  GRANT statements in the update script would
 * do that, but PostgreSQL records every privilege set while an extension
 * script runs as the object's initial privileges (pg_init_privs), which
 * pg_dump leaves out of a dump: the operator's grants would then be lost by
 * a dump and restore.  So the update calls idem_carry_grants, which issues
 * the same GRANTs as the roles that made them, with the recording of
 * initial privileges off: the new function's initial privileges stay what
 * the script set (as in a fresh install), and the operator's grants are
 * dumped as grants, as they were before the update.
 *
 * Owns: idem_carry_grants.
 * May call: SPI (the GRANT statements), the catalogs, compat.h.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_proc.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/regproc.h"
#include "utils/syscache.h"

#include "compat.h"

PG_FUNCTION_INFO_V1(idem_carry_grants);

/* A function's ACL (its default one if it has none) and its owner. */
static Acl *
function_acl(Oid funcid, Oid *owner)
{
	HeapTuple	tuple = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	Datum		datum;
	bool		isnull;
	Acl		   *acl;

	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for function %u", funcid);
	*owner = ((Form_pg_proc) GETSTRUCT(tuple))->proowner;
	datum = SysCacheGetAttr(PROCOID, tuple, Anum_pg_proc_proacl, &isnull);
	acl = isnull ? acldefault(OBJECT_FUNCTION, *owner) : DatumGetAclPCopy(datum);
	ReleaseSysCache(tuple);
	return acl;
}

/*
 * One aclitem of the old function, granted on the new one by its grantor
 * (the grants of the old function's owner by the role running the update,
 * which owns the new one).  False if the grantor cannot grant it yet: its
 * own grant option comes from another item, not carried yet.
 */
static bool
carry_grant(const AclItem *item, Oid old_owner, Oid new_funcid,
			const char *new_name, Oid userid, int sec_context)
{
	Oid			grantor = item->ai_grantor == old_owner ? userid : item->ai_grantor;
	Oid			grantee = item->ai_grantee;
	bool		grant_option = (ACLITEM_GET_GOPTIONS(*item) & ACL_EXECUTE) != 0;
	char	   *statement;

	if (grantor != userid &&
		compat_function_aclcheck(new_funcid, grantor,
								 ACL_GRANT_OPTION_FOR(ACL_EXECUTE)) != ACLCHECK_OK)
		return false;

	statement = psprintf("GRANT EXECUTE ON FUNCTION %s TO %s%s", new_name,
						 grantee == ACL_ID_PUBLIC ? "PUBLIC" :
						 quote_identifier(GetUserNameFromId(grantee, false)),
						 grant_option ? " WITH GRANT OPTION" : "");
	SetUserIdAndSecContext(grantor, sec_context | SECURITY_LOCAL_USERID_CHANGE);
	if (SPI_execute(statement, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not run: %s", statement);
	SetUserIdAndSecContext(userid, sec_context);
	return true;
}

/*
 * idem_carry_grants(old regprocedure, new regprocedure) -> void
 *
 * Grant EXECUTE on new to every role that has it on old, with the same
 * grant option and grantor (see the top of this file).  Only an update
 * script may call it; it is created and dropped there.
 */
Datum
idem_carry_grants(PG_FUNCTION_ARGS)
{
	Oid			old_funcid = PG_GETARG_OID(0);
	Oid			new_funcid = PG_GETARG_OID(1);
	Oid			old_owner;
	Oid			new_owner;
	Acl		   *acl;
	AclItem    *items;
	int			nitems;
	bool	   *carried;
	char	   *new_name;
	bool		was_creating_extension = creating_extension;
	Oid			userid;
	int			sec_context;

	if (!creating_extension)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_carry_grants() may only be called by the extension's update script")));

	acl = function_acl(old_funcid, &old_owner);
	(void) function_acl(new_funcid, &new_owner);
	new_name = format_procedure_qualified(new_funcid);
	/* ACL_DAT, without its sign-compare warning: an ACL has no nulls */
	items = (AclItem *) ((char *) acl + ARR_OVERHEAD_NONULLS(ARR_NDIM(acl)));
	nitems = ACL_NUM(acl);
	carried = palloc0(sizeof(bool) * nitems);
	GetUserIdAndSecContext(&userid, &sec_context);

	PG_TRY();
	{
		bool		progress = true;

		/*
		 * Off while the grants run, so that they are not recorded as the
		 * extension's initial privileges (see the top of this file); nothing
		 * is created meanwhile, which would not become a member.
		 */
		creating_extension = false;
		SPI_connect();
		/* a grantor's grant option may come from another item: repeat */
		while (progress)
		{
			progress = false;
			for (int i = 0; i < nitems; i++)
			{
				/* the owner holds every privilege already */
				if (!carried[i] &&
					(items[i].ai_grantee == new_owner ||
					 (ACLITEM_GET_PRIVS(items[i]) & ACL_EXECUTE) == 0))
					carried[i] = true;
				if (!carried[i] &&
					carry_grant(&items[i], old_owner, new_funcid, new_name,
								userid, sec_context))
					carried[i] = progress = true;
			}
		}
		SPI_finish();
	}
	PG_FINALLY();
	{
		creating_extension = was_creating_extension;
		SetUserIdAndSecContext(userid, sec_context);
	}
	PG_END_TRY();

	for (int i = 0; i < nitems; i++)
		if (!carried[i])
			ereport(WARNING,
					(errmsg("EXECUTE on %s granted to role %s by role %s was not carried over to %s",
							format_procedure_qualified(old_funcid),
							items[i].ai_grantee == ACL_ID_PUBLIC ? "PUBLIC" :
							GetUserNameFromId(items[i].ai_grantee, false),
							GetUserNameFromId(items[i].ai_grantor, false), new_name),
					 errhint("Grant it again after the update.")));
	PG_RETURN_VOID();
}
