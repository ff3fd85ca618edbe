/*-------------------------------------------------------------------------
 *
 * launcher.c
 *	  The launcher: finds every database where the extension is installed,
 *	  and starts (and restarts) one worker per such database (worker.c),
 *	  which purges expired rows and publishes the outbox.
 *
 * States of a database, as the launcher sees them:
 *
 *	 unknown --start worker--> checking --extension found--> served
 *	    ^                        |                            |
 *	    |                        | no extension               | worker exits
 *	    |                        v                            | (SIGTERM, crash,
 *	    +--CREATE EXTENSION-- absent <---DROP EXTENSION-------+  error): started
 *	                                                              again after a
 *	                                                              delay
 *
 * The launcher connects to no database; it reads pg_database every second
 * (so a database created after start is found without configuration) and
 * starts a worker for each connectable, non-template database on the
 * idempotency.databases allow-list that has none.  A worker that finds no
 * extension says so in shared memory and exits; the launcher then leaves the
 * database alone until a CREATE EXTENSION there tells it otherwise (see the
 * utility hook in shmem.c).  Workers are dynamic background workers that are
 * never restarted by the postmaster: the launcher restarts them, so that
 * pg_terminate_backend() stops a worker but does not unregister it for good.
 * The launcher itself is restarted by the postmaster.
 *
 * It starts once recovery has finished, so on a hot standby nothing runs
 * until promotion.
 *
 * Owns: the launcher's view of the databases, the start and restart of
 *	  workers.
 * May call: infra/worker_xact.h (its transaction), infra/ (settings, the
 *	  registry in shared memory).  Starts idem_worker_main (worker.c) by
 *	  name, through the postmaster.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <signal.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_database.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "worker/launcher.h"
#include "infra/worker_xact.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PGDLLEXPORT void idem_launcher_main(Datum main_arg);

/* How often the launcher looks at pg_database. */
#define LAUNCHER_INTERVAL_MS	1000

/* A worker that stopped on its own is started again after this, doubling. */
#define RESTART_DELAY_MIN_MS	1000
#define RESTART_DELAY_MAX_MS	60000

/* A database the launcher knows about. */
typedef struct KnownDatabase
{
	Oid			dboid;
	char		name[NAMEDATALEN];
	BackgroundWorkerHandle *handle; /* the worker we started, if any */
	TimestampTz started_at;
	TimestampTz restart_after;	/* not before: it stopped recently */
	int			restart_delay_ms;
	uint32		generation;		/* the slot's extension_generation at start */
	bool		present;		/* in the latest look at pg_database */
	bool		warned;			/* we said we cannot serve it */
} KnownDatabase;

static List *known_databases = NIL;

void
idem_register_launcher(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = 5;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_launcher_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency launcher");
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency launcher");
	RegisterBackgroundWorker(&worker);
}

/* Is the database on idempotency.databases (or is the list empty)? */
static bool
database_allowed(const char *name)
{
	char	   *copy;
	List	   *names;
	ListCell   *lc;
	bool		allowed = false;

	if (idem_databases == NULL || idem_databases[0] == '\0')
		return true;

	copy = pstrdup(idem_databases);
	if (!SplitIdentifierString(copy, ',', &names))
	{
		ereport(WARNING,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency.databases is not a list of database names: \"%s\"",
						idem_databases),
				 errhint("Separate the names with commas; quote a name that has commas or spaces.")));
		return false;
	}
	foreach(lc, names)
		allowed |= strcmp((char *) lfirst(lc), name) == 0;
	list_free(names);
	pfree(copy);
	return allowed;
}

static KnownDatabase *
known_database(Oid dboid)
{
	ListCell   *lc;

	foreach(lc, known_databases)
	{
		KnownDatabase *db = (KnownDatabase *) lfirst(lc);

		if (db->dboid == dboid)
			return db;
	}
	return NULL;
}

/* scan_databases's unit */
static bool
scan_databases_unit(void *arg)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;
	List	   *present_oids = NIL;

	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while ((tuple = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		Form_pg_database pgdb = (Form_pg_database) GETSTRUCT(tuple);
		KnownDatabase *db;

		present_oids = lappend_oid(present_oids, pgdb->oid);

		/* datconnlimit -2 marks a database an interrupted DROP left invalid */
		if (!pgdb->datallowconn || pgdb->datistemplate || pgdb->datconnlimit == -2 ||
			!database_allowed(NameStr(pgdb->datname)))
			continue;

		db = known_database(pgdb->oid);
		if (db == NULL)
		{
			MemoryContext oldcontext = MemoryContextSwitchTo(TopMemoryContext);

			db = palloc0(sizeof(KnownDatabase));
			db->dboid = pgdb->oid;
			db->restart_delay_ms = RESTART_DELAY_MIN_MS;
			known_databases = lappend(known_databases, db);
			MemoryContextSwitchTo(oldcontext);
		}
		strlcpy(db->name, NameStr(pgdb->datname), NAMEDATALEN);
		db->present = true;
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);

	/* counters of databases that are gone, wherever they came from */
	idem_launcher_free_slots_except(present_oids);
	return true;				/* the commit frees present_oids with the rest */
}

/*
 * Look at pg_database: mark every database the launcher should serve as
 * present, adding those it did not know.  Template databases are never
 * served, since a worker connected to one would make CREATE DATABASE fail.
 * An ERROR ends the launcher, which the postmaster starts again
 * (bgw_restart_time).
 */
static void
scan_databases(void)
{
	ListCell   *lc;

	foreach(lc, known_databases)
		((KnownDatabase *) lfirst(lc))->present = false;
	(void) worker_run_unit("looking for databases",
						   WORKER_UNIT_SNAPSHOT | WORKER_UNIT_ERROR_EXITS,
						   scan_databases_unit, NULL, NULL);
}

static void
start_worker(KnownDatabase *db, uint32 generation, TimestampTz now)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	worker.bgw_main_arg = ObjectIdGetDatum(db->dboid);
	worker.bgw_notify_pid = MyProcPid;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "idempotency");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "idem_worker_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency worker for database %s", db->name);
	/* one type for every worker (backend_type); the name says the database */
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency worker");

	if (!RegisterDynamicBackgroundWorker(&worker, &db->handle))
	{
		db->handle = NULL;
		db->restart_after = TimestampTzPlusMilliseconds(now, RESTART_DELAY_MAX_MS);
		ereport(WARNING,
				(errmsg("idempotency: could not start a worker for database \"%s\"", db->name),
				 errdetail("No background worker slot is free."),
				 errhint("Raise max_worker_processes (now %d): the idempotency launcher takes one slot and each database it serves another.",
						 max_worker_processes)));
		return;
	}
	db->started_at = now;
	db->generation = generation;
}

/*
 * The worker we started has stopped.  One that left because the extension
 * is not (or no longer, or not yet again) installed did what it should: the
 * next CREATE EXTENSION starts another at once.  Any other stop (SIGTERM, an
 * ERROR, a crash) is delayed, the delay doubling while the workers keep
 * stopping within a minute of their start.
 */
static void
worker_stopped(KnownDatabase *db, TimestampTz now)
{
	IdemDatabaseSlot *slot = idem_database_slot(db->dboid, false);
	bool		left_for_no_extension = false;

	pfree(db->handle);
	db->handle = NULL;
	if (slot != NULL)
	{
		LWLockAcquire(idem_shmem_lock(), LW_SHARED);
		left_for_no_extension = slot->extension_absent ||
			slot->extension_generation != db->generation;
		LWLockRelease(idem_shmem_lock());
	}
	if (left_for_no_extension)
	{
		db->restart_after = 0;
		db->restart_delay_ms = RESTART_DELAY_MIN_MS;
		return;
	}

	/* a worker that ran a good while earns a prompt restart */
	if (TimestampDifferenceExceeds(db->started_at, now, RESTART_DELAY_MAX_MS))
		db->restart_delay_ms = RESTART_DELAY_MIN_MS;
	db->restart_after = TimestampTzPlusMilliseconds(now, db->restart_delay_ms);
	ereport(LOG,
			(errmsg("idempotency: the worker for database \"%s\" stopped; the next starts in %d ms",
					db->name, db->restart_delay_ms)));
	db->restart_delay_ms = Min(db->restart_delay_ms * 2, RESTART_DELAY_MAX_MS);
}

/*
 * One look at every known database: notice workers that stopped, start
 * those that are wanted, and forget databases that are gone.
 */
static void
tend_databases(void)
{
	TimestampTz now = GetCurrentTimestamp();
	ListCell   *lc;

	foreach(lc, known_databases)
	{
		KnownDatabase *db = (KnownDatabase *) lfirst(lc);
		IdemDatabaseSlot *slot;
		pid_t		pid;
		bool		absent;
		TimestampTz paused_until;
		pid_t		worker_pid;
		uint32		generation;

		if (db->handle != NULL &&
			GetBackgroundWorkerPid(db->handle, &pid) == BGWH_STOPPED)
			worker_stopped(db, now);

		if (!db->present)
		{
			if (db->handle != NULL)
				TerminateBackgroundWorker(db->handle);	/* taken off the allow-list */
			continue;
		}
		if (db->handle != NULL)
			continue;

		slot = idem_database_slot(db->dboid, true);
		if (slot == NULL)
		{
			if (!db->warned)
				ereport(WARNING,
						(errmsg("idempotency: database \"%s\" is not served", db->name),
						 errdetail("All %d database slots are taken.", idem_max_databases_slots()),
						 errhint("Raise idempotency.max_databases, or list the databases to serve in idempotency.databases.")));
			db->warned = true;
			continue;
		}

		LWLockAcquire(idem_shmem_lock(), LW_SHARED);
		absent = slot->extension_absent;
		paused_until = slot->paused_until;
		worker_pid = slot->worker_pid;
		generation = slot->extension_generation;
		LWLockRelease(idem_shmem_lock());

		/*
		 * A worker we have no handle for (the launcher restarted) still
		 * serves the database; so does a database being dropped.
		 */
		if (absent || worker_pid != 0 || paused_until > now || db->restart_after > now)
			continue;
		start_worker(db, generation, now);
	}

	/*
	 * Forget databases that are gone (or off the allow-list) once their
	 * workers have stopped; scan_databases frees the slots of those gone.
	 */
	foreach(lc, known_databases)
	{
		KnownDatabase *db = (KnownDatabase *) lfirst(lc);

		if (!db->present && db->handle == NULL)
		{
			known_databases = foreach_delete_current(known_databases, lc);
			pfree(db);
		}
	}
}

void
idem_launcher_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	idem_launcher_attach();
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	ereport(LOG, (errmsg("idempotency launcher started")));

	for (;;)
	{
		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}

		scan_databases();
		tend_databases();

		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 LAUNCHER_INTERVAL_MS, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}
