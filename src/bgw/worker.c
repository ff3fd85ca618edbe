/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The background workers: a launcher that finds every database where
 *	  the extension is installed, and one worker per such database that
 *	  purges expired rows and publishes the outbox.
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
 * A worker publishes ready outbox rows whenever it wakes (a commit that
 * enqueued rows of a routed topic, or every idempotency.naptime), and once an
 * idempotency.purge_interval purges expired keys, processed events past
 * retention and published outbox rows past retention, and vacuums a table
 * at once when a pass deleted a large share of it (see vacuum_after_purge).
 * Each batch is a transaction of its own; an ERROR in one is logged and the
 * work is tried again next round, so one bad row never stops the worker.  A
 * commit that enqueued rows of a topic the worker publishes sets its latch,
 * so publishing starts within milliseconds; otherwise it sleeps
 * idempotency.naptime.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <signal.h>

#include "access/heapam.h"
#include "access/tableam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/pg_database.h"
#include "catalog/pg_extension.h"
#include "commands/dbcommands.h"
#include "commands/extension.h"
#include "commands/vacuum.h"
#include "nodes/makefuncs.h"
#include "parser/parse_node.h"
#include "miscadmin.h"
#include "portability/instr_time.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/procarray.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "bgw/maintenance.h"
#include "bgw/worker.h"
#include "compat.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PGDLLEXPORT void idem_launcher_main(Datum main_arg);
PGDLLEXPORT void idem_worker_main(Datum main_arg);

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

/*
 * Look at pg_database: mark every database the launcher should serve as
 * present, adding those it did not know.  Template databases are never
 * served, since a worker connected to one would make CREATE DATABASE fail.
 */
static void
scan_databases(void)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;
	ListCell   *lc;
	List	   *present_oids = NIL;

	foreach(lc, known_databases)
		((KnownDatabase *) lfirst(lc))->present = false;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "looking for databases");

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

	PopActiveSnapshot();
	CommitTransactionCommand();	/* frees present_oids with the rest */
	pgstat_report_activity(STATE_IDLE, NULL);
}

static void
start_worker(KnownDatabase *db, TimestampTz now)
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
	snprintf(worker.bgw_type, BGW_MAXLEN, "idempotency worker %s", db->name);

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

		if (db->handle != NULL &&
			GetBackgroundWorkerPid(db->handle, &pid) == BGWH_STOPPED)
		{
			pfree(db->handle);
			db->handle = NULL;
			/* a worker that ran a good while earns a prompt restart */
			if (TimestampDifferenceExceeds(db->started_at, now, RESTART_DELAY_MAX_MS))
				db->restart_delay_ms = RESTART_DELAY_MIN_MS;
			db->restart_after = TimestampTzPlusMilliseconds(now, db->restart_delay_ms);
			db->restart_delay_ms = Min(db->restart_delay_ms * 2, RESTART_DELAY_MAX_MS);
		}

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
		LWLockRelease(idem_shmem_lock());

		/*
		 * A worker we have no handle for (the launcher restarted) still
		 * serves the database; so does a database being dropped.
		 */
		if (absent || worker_pid != 0 || paused_until > now || db->restart_after > now)
			continue;
		start_worker(db, now);
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

/*
 * ---------------------------------------------------------------------
 * The per-database worker
 * ---------------------------------------------------------------------
 */

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

/* Is the extension (still) installed here?  Also learns the database's name. */
static bool
extension_installed(void)
{
	bool		installed;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (my_database_name == NULL)
		my_database_name = MemoryContextStrdup(TopMemoryContext,
											   get_database_name(MyDatabaseId));
	installed = OidIsValid(get_extension_oid("idempotency", true));
	PopActiveSnapshot();
	CommitTransactionCommand();
	return installed;
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
static void
lock_extension(void)
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
 * whether other sessions write (see others_write).
 */
static uint64 own_xids = 0;

/* Before the end of a transaction of the worker's own. */
static void
count_own_xid(void)
{
	if (TransactionIdIsValid(GetTopTransactionIdIfAny()))
		own_xids++;
}

/*
 * In a PG_CATCH of the worker's own transaction: log the error, abort the
 * transaction, and go on.
 */
static void
report_and_abort(void)
{
	HOLD_INTERRUPTS();
	count_own_xid();
	EmitErrorReport();
	AbortCurrentTransaction();
	FlushErrorState();
	RESUME_INTERRUPTS();
}

/*
 * One batch of one kind of work, in a transaction of its own.  An ERROR is
 * reported and swallowed: the work is tried again next round.  Returns
 * whether another batch has work to do.  (Publishing has run_publish_batch,
 * which goes on after an ERROR.)
 */
static bool
run_batch(MaintenanceUnit unit, MaintenanceCursor *cursor)
{
	MaintenanceCounts counts;
	bool		more = false;

	/*
	 * A purge batch lost in a crash is simply done again, so its commit
	 * need not wait for the WAL flush, which it would otherwise share with
	 * the foreground's commits.  Publishing keeps synchronous commits (see
	 * pin_worker_settings): the setting is pinned back once the batch is
	 * over, however it ended.  (A SET LOCAL would not do: a value set at the
	 * pinning's override level outlives the transaction.)
	 */
	if (unit != UNIT_PUBLISH)
		SetConfigOption("synchronous_commit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	memset(&counts, 0, sizeof(counts));
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, maintenance_unit_names[unit]);

	PG_TRY();
	{
		lock_extension();
		(void) maintenance_prune(unit, cursor, false);
		more = maintenance_batch(unit, cursor, &counts);
		PopActiveSnapshot();
		count_own_xid();
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		report_and_abort();
		more = false;
	}
	PG_END_TRY();

	if (unit != UNIT_PUBLISH)
		SetConfigOption("synchronous_commit", "on", PGC_SUSET, PGC_S_OVERRIDE);

	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	return more;
}

/*
 * Record, in a transaction of its own, the failed attempt of the row whose
 * own transaction failed with error (see maintenance_publish_failed): that
 * transaction's record of it was undone with the rest.  Returns whether it
 * was recorded.
 */
static bool
blame_row(MaintenanceCursor *cursor, const char *error)
{
	MaintenanceCounts counts;
	volatile bool recorded = false;

	memset(&counts, 0, sizeof(counts));
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	PG_TRY();
	{
		lock_extension();
		recorded = maintenance_publish_blame(cursor, error, &counts);
		PopActiveSnapshot();
		count_own_xid();
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		report_and_abort();
		recorded = false;
	}
	PG_END_TRY();
	return recorded;
}

/*
 * One publish batch, in a transaction of its own, the way the cursor says
 * (see PublishWay).  An ERROR is reported, and the next way is tried at
 * once: a batch that failed the fast way is done again carefully, one that
 * failed carefully row by row, and a row that fails alone has its failed
 * attempt recorded in another transaction, so that no row is tried for
 * ever with its attempts at 0 while the database's other rows wait.  A
 * cancel, a shutdown or no memory stops publishing until the next round.
 * Returns whether another batch has work to do.
 */
static bool
run_publish_batch(MaintenanceCursor *cursor)
{
	MemoryContext context = CurrentMemoryContext;
	MaintenanceCounts counts;
	ErrorData  *volatile error = NULL;
	volatile bool more = false;
	bool		blame;

	memset(&counts, 0, sizeof(counts));
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, maintenance_unit_names[UNIT_PUBLISH]);

	PG_TRY();
	{
		lock_extension();
		more = maintenance_batch(UNIT_PUBLISH, cursor, &counts);
		PopActiveSnapshot();
		count_own_xid();
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		/* report_and_abort, keeping the error (out of the transaction's memory) */
		HOLD_INTERRUPTS();
		count_own_xid();
		MemoryContextSwitchTo(context);
		error = CopyErrorData();
		EmitErrorReport();
		AbortCurrentTransaction();
		FlushErrorState();
		RESUME_INTERRUPTS();
	}
	PG_END_TRY();

	if (error != NULL)
	{
		more = maintenance_publish_failed(cursor, error, &blame);
		if (blame && blame_row(cursor, error->message))
			more = true;
		FreeErrorData(error);
	}

	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	return more;
}

/* Publish until nothing is ready. */
static void
publish_all(MaintenanceCursor *cursor)
{
	while (run_publish_batch(cursor))
		CHECK_FOR_INTERRUPTS();
}

/* Publish now if a commit enqueued rows since we last looked. */
static void
publish_if_woken(MaintenanceCursor *cursor)
{
	if (MyLatch->is_set)
	{
		ResetLatch(MyLatch);
		publish_all(cursor);
	}
}

/*
 * VACUUM (TRUNCATE false) idempotency.<name>, as a top-level command would,
 * in a transaction started here.  ExecVacuum ends that transaction, vacuums
 * in transactions of its own and starts another, which we commit; what it is
 * given must outlive the first transaction, so it lives in vacuum_context,
 * which also parents vacuum's own memory (as a portal's context would).  No
 * truncation: it would take an ACCESS EXCLUSIVE lock that stops every claim,
 * only for the next rows to extend the file again.  An ERROR is reported and
 * swallowed: autovacuum remains.
 */
static void
vacuum_table(const char *name)
{
	static MemoryContext vacuum_context = NULL;
	MemoryContext old;
	VacuumStmt *stmt;

	if (vacuum_context == NULL)
		vacuum_context = AllocSetContextCreate(TopMemoryContext, "idempotency vacuum",
											   ALLOCSET_DEFAULT_SIZES);
	old = MemoryContextSwitchTo(vacuum_context);
	stmt = makeNode(VacuumStmt);
	stmt->options = list_make1(makeDefElem("truncate", (Node *) makeString("false"), -1));
	stmt->rels = list_make1(makeVacuumRelation(makeRangeVar("idempotency", pstrdup(name), -1),
											   InvalidOid, NIL));
	stmt->is_vacuumcmd = true;
	MemoryContextSwitchTo(old);

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	pgstat_report_activity(STATE_RUNNING, "vacuuming after a purge");
	PortalContext = vacuum_context;
	PG_TRY();
	{
		ExecVacuum(make_parsestate(NULL), stmt, true);
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		report_and_abort();
	}
	PG_END_TRY();
	PortalContext = NULL;
	MemoryContextReset(vacuum_context);
	pgstat_report_activity(STATE_IDLE, NULL);
}

/*
 * Did the pass delete a large share of the table?  "Large" is autovacuum's
 * default rule: more than 1000 rows plus a fifth of the table.
 */
static bool
purged_most_of(const char *name, uint64 purged)
{
	bool		large = false;

	if (purged <= 1000)
		return false;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PG_TRY();
	{
		Relation	rel = table_openrv_extended(makeRangeVar("idempotency", (char *) name, -1),
												AccessShareLock, true);

		/* reltuples is -1 for a table never vacuumed nor analyzed */
		large = rel != NULL &&
			(rel->rd_rel->reltuples < 0 || purged > 1000 + 0.2 * rel->rd_rel->reltuples);
		if (rel != NULL)
			table_close(rel, AccessShareLock);
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		report_and_abort();
		large = false;
	}
	PG_END_TRY();
	return large;
}

/*
 * Yielding to other sessions.  A purge writes a great deal of WAL: a record
 * per row, and an image of each page it is the first to change since the
 * last checkpoint, which for rows that expired long after they were written
 * is every page.  A commit of another session waits until the WAL before
 * its own is written and flushed, so a purge run flat out beside a busy
 * foreground costs its commits about a fifth of their rate while it lasts
 * (a million rows: some 250 MB of WAL in a second or two, and 65 MB more
 * for the vacuum after it).  So while other sessions write, the purge runs
 * at most idempotency.purge_busy_share of the time, resting between batches
 * (and publishing while it rests), and the vacuum after it waits for a pass
 * that finds the database quiet; on a server that is never quiet,
 * autovacuum, which paces itself, vacuums instead.  On a quiet server, or
 * with a share of 100, the purge runs flat out.
 *
 * "Other sessions write" is read off transaction IDs: since the last look,
 * the next one moved on by more than the worker's own transactions took,
 * at a rate of more than OTHERS_WRITING_PER_S.  Autovacuum takes none, so
 * it does not count as writing; nor does an occasional transaction.  The
 * looks cover the pass only: a pass begins with one whose answer is not
 * used.
 */
#define OTHERS_WRITING_PER_S	10

static FullTransactionId xid_at_last_look;
static TimestampTz time_of_last_look;

static bool
others_write(void)
{
	FullTransactionId next = ReadNextFullTransactionId();
	TimestampTz now = GetCurrentTimestamp();
	bool		writing = false;

	if (FullTransactionIdIsValid(xid_at_last_look))
	{
		uint64		taken = U64FromFullTransactionId(next) -
			U64FromFullTransactionId(xid_at_last_look);
		double		others = (double) taken - (double) own_xids;
		double		seconds = (double) (now - time_of_last_look) / USECS_PER_SEC;

		writing = others > 0 && others > OTHERS_WRITING_PER_S * seconds;
	}
	xid_at_last_look = next;
	time_of_last_look = now;
	own_xids = 0;
	return writing;
}

/*
 * Sleep up to ms milliseconds; a commit that enqueued rows ends the sleep
 * early, and they are published.
 */
static void
nap_publishing(long ms, MaintenanceCursor *cursor)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	CHECK_FOR_INTERRUPTS();
	publish_if_woken(cursor);
}

/* Nap until then, publishing meanwhile. */
static void
nap_until(TimestampTz until, MaintenanceCursor *cursor)
{
	long		left;

	while ((left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), until)) > 0)
		nap_publishing(left, cursor);
}

/*
 * Rest for as long as lets a purge batch that took "busy" keep to
 * idempotency.purge_busy_share of the time, publishing what commits enqueue
 * meanwhile.  Rests shorter than a millisecond add up until they are not.
 */
static void
yield_after(instr_time busy, MaintenanceCursor *cursor)
{
	static double owed_ms = 0;
	TimestampTz until;

	owed_ms += INSTR_TIME_GET_MILLISEC(busy) *
		(100 - idem_purge_busy_share) / idem_purge_busy_share;
	if (owed_ms < 1)
		return;
	until = GetCurrentTimestamp() + (TimestampTz) (owed_ms * 1000);
	owed_ms = 0;

	idem_count(IDEM_COUNTER_PURGE_YIELDS, 1);
	pgstat_report_activity(STATE_IDLE, "resting between purge batches: other sessions write");
	nap_until(until, cursor);
	pgstat_report_activity(STATE_IDLE, NULL);
}

/*
 * Do other sessions write?  Looked at over the next ms milliseconds, for a
 * pass too short to tell.
 */
static bool
others_write_over(long ms, MaintenanceCursor *cursor)
{
	(void) others_write();
	nap_until(TimestampTzPlusMilliseconds(GetCurrentTimestamp(), ms), cursor);
	return others_write();
}

/*
 * Wait, for a second at most, until no snapshot older than xid remains,
 * publishing what commits enqueue meanwhile.  A longer transaction is not
 * waited for.
 */
static void
wait_for_older_snapshots(TransactionId xid, MaintenanceCursor *cursor)
{
	for (int i = 0; i < 100; i++)
	{
		if (TransactionIdPrecedes(xid, GetOldestNonRemovableTransactionId(NULL)))
			return;
		nap_publishing(10, cursor);
	}
}

/* The table each purge unit deletes from. */
static const char *const purged_tables[NUM_MAINTENANCE_UNITS] = {
	[UNIT_PURGE_KEYS] = "keys",
	[UNIT_PURGE_EVENTS] = "processed_events",
	[UNIT_PURGE_OUTBOX] = "outbox",
};

/*
 * Say at DEBUG1 how many pages a pass pruned and how many it left for the
 * next (what the tests wait for).
 */
static void
report_pruned(MaintenanceUnit unit, MaintenanceCursor *cursor, uint32 left)
{
	if (left == 0)
		ereport(DEBUG1,
				(errmsg_internal("pruned %llu pages of relation \"%s\" in this pass: none left to prune",
								 (unsigned long long) cursor->pruned_in_pass[unit],
								 purged_tables[unit])));
	else
		ereport(DEBUG1,
				(errmsg_internal("pruned %llu pages of relation \"%s\" in this pass: %u left to prune next pass",
								 (unsigned long long) cursor->pruned_in_pass[unit],
								 purged_tables[unit], left)));
}

/*
 * Prune the pages the last two batches of a purge deleted rows on (run_batch
 * prunes those of the batches before), and those an earlier prune could not
 * prune yet, in a transaction of its own, once the snapshots older than the
 * last batch's commit are gone.  Pages still left (a snapshot outlasted the
 * wait, or a page was pinned) are tried again by the next pass's batches and
 * at its end.
 */
static void
prune_after_pass(MaintenanceUnit unit, MaintenanceCursor *cursor)
{
	IdemPurgedPages *last = &cursor->to_prune[unit][1];
	volatile int64 left = -1;	/* unknown after an ERROR */

	if (last->span == 0 && cursor->to_prune[unit][0].span == 0 &&
		cursor->unpruned[unit].span == 0)
	{
		if (cursor->pruned_in_pass[unit] > 0)
			report_pruned(unit, cursor, 0);
		return;
	}
	if (last->span > 0)
		wait_for_older_snapshots(last->xid, cursor);
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	/* which rows are dead to all goes by the horizons of the last snapshot */
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, maintenance_unit_names[unit]);
	PG_TRY();
	{
		lock_extension();
		left = maintenance_prune(unit, cursor, true);
		PopActiveSnapshot();
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		report_and_abort();
	}
	PG_END_TRY();
	pgstat_report_activity(STATE_IDLE, NULL);
	if (left >= 0)
		report_pruned(unit, cursor, (uint32) left);
}

/*
 * After a pass that deleted most of a table, vacuum it now rather than when
 * autovacuum next looks (up to autovacuum_naptime later, and only past its
 * own thresholds): until a vacuum, the deleted rows' space cannot be reused,
 * and the next rows to expire would grow the table instead.  If other
 * sessions wrote during the pass, or do in the tenth of a second after it
 * (a pass can be too short to tell), the vacuum is owed until a pass finds
 * them quiet (see others_write).
 *
 * Twice: the index pages the first vacuum empties and deletes may be reused
 * only once every transaction that could still be reading them has ended,
 * which a transaction ID taken after their deletion proves once every
 * snapshot older than it is gone (a moment's wait for the queries running
 * meanwhile); the second vacuum then finds them safe and hands them to the
 * free space map, where the next rows' index entries find them.  Otherwise
 * the indexes would keep a second copy of their size until some later
 * vacuum.  Rows enqueued meanwhile are published before each vacuum.
 */
static void
vacuum_after_purge(MaintenanceCursor *cursor, MaintenanceUnit unit,
				   bool busy_in_pass)
{
	static bool owed[NUM_MAINTENANCE_UNITS];
	TransactionId burned;

	if (purged_most_of(purged_tables[unit], cursor->purged_in_pass[unit]))
		owed[unit] = true;
	if (!owed[unit] || busy_in_pass ||
		(idem_purge_busy_share < 100 && others_write_over(100, cursor)))
		return;

	publish_if_woken(cursor);
	vacuum_table(purged_tables[unit]);

	StartTransactionCommand();
	burned = GetTopTransactionId();
	count_own_xid();
	CommitTransactionCommand();
	wait_for_older_snapshots(burned, cursor);

	publish_if_woken(cursor);
	vacuum_table(purged_tables[unit]);
	owed[unit] = false;
}

/*
 * Purge each table to the end.  Between purge batches, a commit that
 * enqueued events (our latch is set) gets its rows published first, so that
 * a long purge does not delay them; while other sessions write, the purge
 * yields to them.  Each batch begins by pruning the pages the batch two
 * before it deleted rows on, whose rows the snapshots older than its commit
 * have had a batch's time to stop seeing, and the pass ends by pruning
 * those of its last two; so the rows others write meanwhile reuse the space
 * (see idem_prune_purged).
 */
static void
purge_all(MaintenanceCursor *cursor)
{
	/* what others wrote before the pass began does not count */
	(void) others_write();

	for (int unit = UNIT_PURGE_KEYS; unit <= UNIT_PURGE_OUTBOX; unit++)
	{
		bool		more;
		bool		busy_in_pass = false;

		cursor->purged_in_pass[unit] = 0;
		cursor->pruned_in_pass[unit] = 0;
		do
		{
			instr_time	start;
			instr_time	took;
			bool		busy;

			INSTR_TIME_SET_CURRENT(start);
			more = run_batch((MaintenanceUnit) unit, cursor);
			INSTR_TIME_SET_CURRENT(took);
			INSTR_TIME_SUBTRACT(took, start);

			busy = others_write() && idem_purge_busy_share < 100;
			busy_in_pass |= busy;
			if (more)
			{
				CHECK_FOR_INTERRUPTS();
				if (busy)
					yield_after(took, cursor);
				publish_if_woken(cursor);
			}
		} while (more);
		prune_after_pass((MaintenanceUnit) unit, cursor);
		vacuum_after_purge(cursor, (MaintenanceUnit) unit, busy_in_pass);
	}
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
	pgstat_report_appname("idempotency worker");
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
