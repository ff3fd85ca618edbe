/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The per-database background worker, which the launcher (launcher.c)
 *	  starts: it purges expired rows and publishes the outbox.
 *
 * A worker publishes ready outbox rows whenever it wakes (a commit that
 * enqueued rows of a routed topic, or every idempotency.naptime: publish.c),
 * and once an idempotency.purge_interval purges expired keys, processed
 * events past retention and published outbox rows past retention, and
 * vacuums a table at once when a pass deleted a large share of it
 * (purge.c).  Each batch is a transaction of its own (worker_xact.c); an
 * ERROR in one is logged and the work is tried again next round, so one bad
 * row never stops the worker.  A commit that enqueued rows of a topic the
 * worker publishes sets its latch, so publishing starts within
 * milliseconds; otherwise it sleeps idempotency.naptime.
 *
 * Owns: a worker's loop, its pinned settings and its slot in shared memory.
 * May call: worker/purge.h, outbox/publish.h, infra/ (the cursor, its
 *	  transactions, settings, shared memory).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <signal.h>

#include "commands/dbcommands.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "infra/maintenance.h"
#include "outbox/publish.h"
#include "worker/purge.h"
#include "infra/worker_xact.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PGDLLEXPORT void idem_worker_main(Datum main_arg);

static IdemDatabaseSlot *my_slot = NULL;
static char *my_database_name = NULL;

static void
detach_worker(int code, Datum arg)
{
	LWLockAcquire(idem_shmem_lock(), LW_EXCLUSIVE);
	if (my_slot->worker_pid == MyProcPid)
	{
		my_slot->worker_pid = 0;
		my_slot->worker_latch = NULL;
	}
	LWLockRelease(idem_shmem_lock());
}

/*
 * Settings a database or role could give the worker that would weaken what
 * it promises: an asynchronous commit lets a NOTIFY out before the commit
 * that removes its row is durable, so a crash would publish the row twice;
 * the others would make batches fail or time out.
 */
static void
pin_worker_settings(void)
{
	static const char *const pinned[][2] = {
		{"synchronous_commit", "on"},
		{"default_transaction_isolation", "read committed"},
		{"default_transaction_read_only", "off"},
		{"statement_timeout", "0"},
		{"lock_timeout", "0"},
		{"idle_in_transaction_session_timeout", "0"},
	};

	for (size_t i = 0; i < lengthof(pinned); i++)
		SetConfigOption(pinned[i][0], pinned[i][1], PGC_SUSET, PGC_S_OVERRIDE);
}

/* Every message of the worker says which database it serves. */
static void
worker_error_context(void *arg)
{
	if (my_database_name != NULL)
		errcontext("idempotency worker for database \"%s\"", my_database_name);
}

/* extension_installed's unit */
static bool
extension_installed_unit(void *arg)
{
	if (my_database_name == NULL)
		my_database_name = MemoryContextStrdup(TopMemoryContext,
											   get_database_name(MyDatabaseId));
	return OidIsValid(get_extension_oid("idempotency", true));
}

/*
 * Is the extension (still) installed here?  Also learns the database's
 * name.  An ERROR ends the worker: the launcher starts it again.
 */
static bool
extension_installed(void)
{
	return worker_run_unit(NULL, WORKER_UNIT_SNAPSHOT | WORKER_UNIT_ERROR_EXITS,
						   extension_installed_unit, NULL, NULL);
}

void
idem_worker_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	ErrorContextCallback error_context;
	MaintenanceCursor cursor;
	TimestampTz last_purge = 0;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	/*
	 * One worker per database: leave if another one already serves it, or
	 * if the database is being dropped.
	 */
	my_slot = idem_database_slot(dboid, true);
	if (my_slot == NULL)
		proc_exit(0);
	LWLockAcquire(idem_shmem_lock(), LW_EXCLUSIVE);
	if ((my_slot->worker_pid != 0 && kill(my_slot->worker_pid, 0) == 0) ||
		my_slot->paused_until > GetCurrentTimestamp())
	{
		LWLockRelease(idem_shmem_lock());
		proc_exit(0);
	}
	my_slot->worker_pid = MyProcPid;
	my_slot->worker_latch = MyLatch;
	my_slot->extension_absent = false;
	LWLockRelease(idem_shmem_lock());
	before_shmem_exit(detach_worker, (Datum) 0);

	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);
	pgstat_report_appname(MyBgworkerEntry->bgw_name);	/* names the database */
	pin_worker_settings();

	error_context.callback = worker_error_context;
	error_context.arg = NULL;
	error_context.previous = error_context_stack;
	error_context_stack = &error_context;

	maintenance_cursor_init(&cursor);
	for (;;)
	{
		long		sleep_ms;
		uint32		generation;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}

		LWLockAcquire(idem_shmem_lock(), LW_SHARED);
		generation = my_slot->extension_generation;
		LWLockRelease(idem_shmem_lock());
		if (!extension_installed())
		{
			bool		created_meanwhile;

			/*
			 * Gone, unless a CREATE EXTENSION committed after our look (it
			 * bumps the generation): then look again rather than leave the
			 * database unserved.
			 */
			LWLockAcquire(idem_shmem_lock(), LW_EXCLUSIVE);
			created_meanwhile = my_slot->extension_generation != generation;
			if (!created_meanwhile)
				my_slot->extension_absent = true;
			LWLockRelease(idem_shmem_lock());
			if (created_meanwhile)
				continue;
			proc_exit(0);
		}

		/*
		 * Publish on every wake-up (a commit that enqueued rows of a routed
		 * topic sets the latch, or the naptime passed); purge once a
		 * purge_interval.
		 */
		publish_all(&cursor);
		if (TimestampDifferenceExceeds(last_purge, GetCurrentTimestamp(), idem_purge_interval_ms))
		{
			purge_all(&cursor);
			last_purge = GetCurrentTimestamp();

			LWLockAcquire(idem_shmem_lock(), LW_EXCLUSIVE);
			my_slot->last_round = last_purge;
			LWLockRelease(idem_shmem_lock());
		}
		pgstat_report_stat(false);

		sleep_ms = Min(idem_naptime_ms,
					   idem_purge_interval_ms -
					   TimestampDifferenceMilliseconds(last_purge, GetCurrentTimestamp()));
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Max(sleep_ms, 1), PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}
