/*-------------------------------------------------------------------------
 *
 * worker_xact.c
 *	  The background workers' own transactions, written once: each unit of
 *	  work in a transaction of its own (worker_run_unit), the way
 *	  PostgreSQL's worker_spi does it, with what every unit of ours adds:
 *	  the extension's lock first, an ERROR reported and swallowed so that
 *	  the worker goes on, and its transaction ID counted (for the purge's
 *	  "do other sessions write?").
 *
 * Owns: the count of the worker's own transaction IDs.
 * May call: the server only.  Called by worker/launcher.c, worker/worker.c,
 *	  outbox/publish.c, worker/purge.c.
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
#include "utils/memutils.h"
#include "utils/snapmgr.h"

#include "infra/worker_xact.h"

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
static void
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
 * whether other sessions write (see others_write in worker/purge.c).
 */
static uint64 own_xids = 0;

/* Before the end of a transaction of the worker's own. */
static void
worker_count_own_xid(void)
{
	if (TransactionIdIsValid(GetTopTransactionIdIfAny()))
		own_xids++;
}

/*
 * In the PG_CATCH of a unit: log the error, abort the transaction, and go
 * on.  With error, the error is copied first, into context.
 */
static void
worker_report_and_abort(MemoryContext context, ErrorData **error)
{
	HOLD_INTERRUPTS();
	worker_count_own_xid();
	if (error != NULL)
	{
		MemoryContextSwitchTo(context);
		*error = CopyErrorData();
	}
	EmitErrorReport();
	AbortCurrentTransaction();
	FlushErrorState();
	RESUME_INTERRUPTS();
}

/* A unit's body, from the extension's lock to the commit: see worker_run_unit. */
static bool
work_and_commit(int flags, WorkerUnitWork work, void *arg)
{
	bool		result;

	if (flags & WORKER_UNIT_EXTENSION)
		worker_lock_extension();
	result = work(arg);
	if (flags & WORKER_UNIT_SNAPSHOT)
		PopActiveSnapshot();
	worker_count_own_xid();
	CommitTransactionCommand();
	return result;
}

/*
 * Run work(arg) as one unit of work, in a transaction of its own, as
 * worker_spi does: the statement's start time set, the transaction
 * started, then, with WORKER_UNIT_SNAPSHOT, an active snapshot pushed (the
 * work's statements run under it); activity shown in pg_stat_activity
 * meanwhile (NULL: left as it is, and not set back to idle at the end).
 * With WORKER_UNIT_EXTENSION, the extension's lock is taken before work
 * runs (see worker_lock_extension).  Then the snapshot is popped, and the
 * transaction commits, its transaction ID counted.
 *
 * An ERROR (in work, or at commit) is reported, the transaction aborted,
 * and worker_run_unit returns false, with the error copied into the
 * caller's memory context if error is given (*error is NULL otherwise):
 * one bad unit never stops the worker, which tries again later.  With
 * WORKER_UNIT_ERROR_EXITS it is not caught, and ends the process, for the
 * units whose failure leaves nothing sensible to go on with.  Otherwise
 * returns what work returned.
 */
bool
worker_run_unit(const char *activity, int flags, WorkerUnitWork work, void *arg,
				ErrorData **error)
{
	MemoryContext context = CurrentMemoryContext;
	volatile bool result = false;

	if (error != NULL)
		*error = NULL;
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (flags & WORKER_UNIT_SNAPSHOT)
		PushActiveSnapshot(GetTransactionSnapshot());
	if (activity != NULL)
		pgstat_report_activity(STATE_RUNNING, activity);

	if (flags & WORKER_UNIT_ERROR_EXITS)
		result = work_and_commit(flags, work, arg);
	else
	{
		PG_TRY();
		{
			result = work_and_commit(flags, work, arg);
		}
		PG_CATCH();
		{
			worker_report_and_abort(context, error);
			result = false;
		}
		PG_END_TRY();
	}
	MemoryContextSwitchTo(context);

	if (activity != NULL)
		pgstat_report_activity(STATE_IDLE, NULL);
	return result;
}

/* The count above, which starts again from 0. */
uint64
worker_take_own_xids(void)
{
	uint64		taken = own_xids;

	own_xids = 0;
	return taken;
}
