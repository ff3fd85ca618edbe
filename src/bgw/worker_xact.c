/*-------------------------------------------------------------------------
 *
 * worker_xact.c
 *	  The per-database worker's own transactions: what each unit of work
 *	  does first (lock the extension), on an ERROR (report it, abort, go
 *	  on), and before it ends (count its transaction ID, for the purge's
 *	  "do other sessions write?").
 *
 * Owns: the count of the worker's own transaction IDs.
 * May call: the server only.  Called by bgw/publish.c, bgw/purge.c.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_extension.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/lmgr.h"
#include "utils/snapmgr.h"

#include "bgw/worker_xact.h"

/*
 * Begin a unit of the worker's work: a transaction of its own, with a
 * snapshot, shown in pg_stat_activity as activity (NULL: left as it is).
 * The unit then takes the extension's lock (worker_lock_extension) in its
 * PG_TRY, and ends with PopActiveSnapshot and a commit, or in
 * worker_report_and_abort.
 */
void
worker_begin_unit(const char *activity)
{
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (activity != NULL)
		pgstat_report_activity(STATE_RUNNING, activity);
}

/*
 * Hold the extension for the rest of this transaction, before touching any
 * of its tables.  DROP EXTENSION locks the extension before it drops a
 * member, in an order of its own (keys first); the worker's statements lock
 * the outbox and the routes.  With the extension's lock taken first on both
 * sides, a drop and a unit of work wait for one another in that order and
 * never deadlock.  The extension is looked up again once the lock is ours:
 * a drop that committed meanwhile has removed it, and the unit ends in an
 * ERROR, after which the main loop sees the extension gone and leaves.
 */
void
worker_lock_extension(void)
{
	Oid			extension = get_extension_oid("idempotency", true);

	if (OidIsValid(extension))
	{
		LockDatabaseObject(ExtensionRelationId, extension, 0, AccessShareLock);
		if (get_extension_oid("idempotency", true) == extension)
			return;
	}
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("extension \"idempotency\" is no longer installed in this database")));
}

/*
 * Transaction IDs the worker's own transactions took since the last look at
 * whether other sessions write (see others_write in bgw/purge.c).
 */
static uint64 own_xids = 0;

/* Before the end of a transaction of the worker's own. */
void
worker_count_own_xid(void)
{
	if (TransactionIdIsValid(GetTopTransactionIdIfAny()))
		own_xids++;
}

/*
 * In a PG_CATCH of the worker's own transaction: log the error, abort the
 * transaction, and go on.
 */
void
worker_report_and_abort(void)
{
	HOLD_INTERRUPTS();
	worker_count_own_xid();
	EmitErrorReport();
	AbortCurrentTransaction();
	FlushErrorState();
	RESUME_INTERRUPTS();
}

/* The count above, which starts again from 0. */
uint64
worker_take_own_xids(void)
{
	uint64		taken = own_xids;

	own_xids = 0;
	return taken;
}
