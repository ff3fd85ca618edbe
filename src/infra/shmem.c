/*-------------------------------------------------------------------------
 *
 * shmem.c
 *	  Shared memory: the registry of served databases (database -> worker
 *	  pid and latch) and the cumulative counters; the commit callback that
 *	  wakes a worker; and, for the utility hook, keeping the workers out of
 *	  the way of DROP DATABASE and telling the launcher about CREATE
 *	  EXTENSION.
 *
 * The registry is a fixed array of idempotency.max_databases slots,
 * protected by one LWLock; the counters in each slot are atomics, bumped
 * without the lock.  A backend finds its database's slot once and keeps a
 * pointer to it.
 *
 * Owns: the shared state, the commit callback that sets a worker's latch,
 *	  what a utility statement means to them (idem_shmem_utility),
 *	  idem_stats_counters().
 * May call: infra/guc.h.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <signal.h>

#include "access/xact.h"
#include "catalog/pg_database.h"
#include "utils/acl.h"
#include "commands/dbcommands.h"
#include "commands/defrem.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "compat.h"
#include "infra/claim_wait.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PG_FUNCTION_INFO_V1(idem_stats_counters);
PG_FUNCTION_INFO_V1(idem_warn_without_preload);

#define TRANCHE_NAME			"idempotency"

/* How long DROP DATABASE waits for a worker to leave, and keeps it away. */
#define WORKER_EXIT_WAIT_MS		5000
#define WORKER_PAUSE_MS			10000

typedef struct IdemShared
{
	LWLock	   *lock;			/* protects everything but the counters */
	pid_t		launcher_pid;	/* 0 when no launcher runs */
	Latch	   *launcher_latch; /* set to make the launcher look again */
	int			nslots;			/* idempotency.max_databases at startup */
	IdemDatabaseSlot slots[FLEXIBLE_ARRAY_MEMBER];
} IdemShared;

static IdemShared *shared = NULL;

static shmem_startup_hook_type prev_shmem_startup_hook = NULL;
#if PG_VERSION_NUM >= 150000
static shmem_request_hook_type prev_shmem_request_hook = NULL;
#endif

/* This backend's database slot, found once. */
static IdemDatabaseSlot *my_slot = NULL;

/* What to do when the current transaction commits. */
static bool wake_worker_at_commit = false;
static int64 wake_worker_from;	/* the smallest id it enqueued or requeued */
static bool wake_launcher_at_commit = false;
static bool routes_changed_at_commit = false;
static bool xact_callback_registered = false;

/*
 * IdemDatabaseSlot.enqueued_from holds an id with its sign bit flipped, so
 * that the order of the codes is the ids' order; ENQUEUED_NONE is
 * PG_INT64_MAX's code.
 */
#define ENQUEUED_NONE PG_UINT64_MAX

static inline uint64
enqueued_code(int64 id)
{
	return (uint64) id ^ (UINT64CONST(1) << 63);
}

static inline int64
enqueued_id(uint64 code)
{
	return (int64) (code ^ (UINT64CONST(1) << 63));
}

static Size
shared_size(void)
{
	return add_size(offsetof(IdemShared, slots),
					mul_size(idem_max_databases, sizeof(IdemDatabaseSlot)));
}

#if PG_VERSION_NUM >= 150000
static void
request_shmem(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(shared_size());
	RequestNamedLWLockTranche(TRANCHE_NAME, 1);
	idem_claim_wait_shmem_request();
}
#endif

static void
startup_shmem(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	shared = ShmemInitStruct("idempotency", shared_size(), &found);
	if (!found)
	{
		shared->lock = &(GetNamedLWLockTranche(TRANCHE_NAME))->lock;
		shared->launcher_pid = 0;
		shared->launcher_latch = NULL;
		shared->nslots = idem_max_databases;
		for (int i = 0; i < shared->nslots; i++)
		{
			IdemDatabaseSlot *slot = &shared->slots[i];

			memset(slot, 0, offsetof(IdemDatabaseSlot, routes_version));
			pg_atomic_init_u32(&slot->routes_version, 0);
			pg_atomic_init_u64(&slot->enqueued_from, ENQUEUED_NONE);
			for (int c = 0; c < IDEM_NUM_COUNTERS; c++)
				pg_atomic_init_u64(&slot->counters[c], 0);
		}
	}
	idem_claim_wait_shmem_init();
	LWLockRelease(AddinShmemInitLock);
}

/*
 * Called from _PG_init while shared_preload_libraries is being processed.
 */
void
idem_shmem_register(void)
{
#if PG_VERSION_NUM >= 150000
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = request_shmem;
#else
	RequestAddinShmemSpace(shared_size());
	RequestNamedLWLockTranche(TRANCHE_NAME, 1);
#endif
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = startup_shmem;
}

LWLock *
idem_shmem_lock(void)
{
	return shared->lock;
}

int
idem_max_databases_slots(void)
{
	return shared != NULL ? shared->nslots : 0;
}

static IdemDatabaseSlot *
find_slot(Oid dboid)
{
	for (int i = 0; i < shared->nslots; i++)
		if (shared->slots[i].dboid == dboid)
			return &shared->slots[i];
	return NULL;
}

/*
 * The slot of a database; with create, take a free one if it has none.
 * NULL without shared memory, or when every slot is taken.
 */
IdemDatabaseSlot *
idem_database_slot(Oid dboid, bool create)
{
	IdemDatabaseSlot *slot;

	if (shared == NULL || !OidIsValid(dboid))
		return NULL;

	LWLockAcquire(shared->lock, LW_SHARED);
	slot = find_slot(dboid);
	LWLockRelease(shared->lock);
	if (slot != NULL || !create)
		return slot;

	LWLockAcquire(shared->lock, LW_EXCLUSIVE);
	slot = find_slot(dboid);
	if (slot == NULL && (slot = find_slot(InvalidOid)) != NULL)
	{
		memset(slot, 0, offsetof(IdemDatabaseSlot, routes_version));
		pg_atomic_write_u32(&slot->routes_version, 0);
		pg_atomic_write_u64(&slot->enqueued_from, ENQUEUED_NONE);
		for (int c = 0; c < IDEM_NUM_COUNTERS; c++)
			pg_atomic_write_u64(&slot->counters[c], 0);
		slot->dboid = dboid;
	}
	LWLockRelease(shared->lock);
	return slot;
}

/* The slot of this backend's database, taken if it has none yet. */
static IdemDatabaseSlot *
my_database_slot(void)
{
	if (my_slot == NULL || my_slot->dboid != MyDatabaseId)
		my_slot = idem_database_slot(MyDatabaseId, true);
	return my_slot;
}

void
idem_count(IdemCounter counter, uint64 n)
{
	if (shared == NULL || n == 0)
		return;
	if (my_database_slot() != NULL)
		pg_atomic_fetch_add_u64(&my_slot->counters[counter], n);
}

/*
 * Routes change rarely; the backends that enqueue keep what they read of
 * them (see outbox.c) for as long as this number stays the same.
 */
bool
idem_routes_version(uint64 *version)
{
	if (shared == NULL || my_database_slot() == NULL)
		return false;
	/* a recreated extension has a new routes table: the generation says so */
	*version = ((uint64) my_slot->extension_generation << 32) |
		pg_atomic_read_u32(&my_slot->routes_version);
	return true;
}

static void
clear_launcher(int code, Datum arg)
{
	LWLockAcquire(shared->lock, LW_EXCLUSIVE);
	shared->launcher_pid = 0;
	shared->launcher_latch = NULL;
	LWLockRelease(shared->lock);
}

void
idem_launcher_attach(void)
{
	LWLockAcquire(shared->lock, LW_EXCLUSIVE);
	shared->launcher_pid = MyProcPid;
	shared->launcher_latch = MyLatch;
	LWLockRelease(shared->lock);
	before_shmem_exit(clear_launcher, (Datum) 0);
}

/*
 * Free the slots of databases that no longer exist (and have no worker):
 * counters are kept by any backend that counts, so slots are taken for
 * databases the launcher never served too.
 */
void
idem_launcher_free_slots_except(List *present_oids)
{
	LWLockAcquire(shared->lock, LW_EXCLUSIVE);
	for (int i = 0; i < shared->nslots; i++)
	{
		IdemDatabaseSlot *slot = &shared->slots[i];

		if (OidIsValid(slot->dboid) && slot->worker_pid == 0 &&
			!list_member_oid(present_oids, slot->dboid))
			slot->dboid = InvalidOid;
	}
	LWLockRelease(shared->lock);
}

static void
at_transaction_end(XactEvent event, void *arg)
{
	bool		committed = event == XACT_EVENT_COMMIT ||
		event == XACT_EVENT_PARALLEL_COMMIT;

	if (event != XACT_EVENT_COMMIT && event != XACT_EVENT_PARALLEL_COMMIT &&
		event != XACT_EVENT_ABORT && event != XACT_EVENT_PARALLEL_ABORT)
		return;

	if (committed && shared != NULL && routes_changed_at_commit && my_database_slot() != NULL)
		pg_atomic_fetch_add_u32(&my_slot->routes_version, 1);

	if (committed && shared != NULL && (wake_worker_at_commit || wake_launcher_at_commit))
	{
		IdemDatabaseSlot *slot = idem_database_slot(MyDatabaseId, wake_launcher_at_commit);
		Latch	   *worker_latch = NULL;
		Latch	   *launcher_latch = NULL;

		LWLockAcquire(shared->lock, wake_launcher_at_commit ? LW_EXCLUSIVE : LW_SHARED);
		if (slot != NULL && wake_worker_at_commit)
		{
			/*
			 * After the commit became visible, so that a worker that takes
			 * this before its next snapshot sees the rows (see
			 * idem_take_enqueued_from)
			 */
			uint64		from = enqueued_code(wake_worker_from);
			uint64		seen = pg_atomic_read_u64(&slot->enqueued_from);

			while (from < seen &&
				   !pg_atomic_compare_exchange_u64(&slot->enqueued_from, &seen, from))
				;
			worker_latch = slot->worker_latch;
		}
		if (slot != NULL && wake_launcher_at_commit)
		{
			/* the extension was just created here: serve this database */
			slot->extension_absent = false;
			slot->extension_generation++;
			launcher_latch = shared->launcher_latch;
		}
		LWLockRelease(shared->lock);

		if (worker_latch != NULL)
			SetLatch(worker_latch);
		if (launcher_latch != NULL)
			SetLatch(launcher_latch);
	}
	wake_worker_at_commit = false;
	wake_launcher_at_commit = false;
	routes_changed_at_commit = false;
}

static void
register_xact_callback(void)
{
	if (!xact_callback_registered)
	{
		RegisterXactCallback(at_transaction_end, NULL);
		xact_callback_registered = true;
	}
}

/*
 * The transaction enqueued (or requeued) outbox rows, first_id the smallest:
 * when it commits, wake the database's worker so that publishing starts
 * within milliseconds instead of at its next nap's end, and tell it how far
 * back to look (PG_INT64_MIN: from each topic's oldest row).
 */
void
idem_wake_worker_at_commit(int64 first_id)
{
	if (shared == NULL)
		return;
	if (!wake_worker_at_commit)
	{
		register_xact_callback();
		wake_worker_at_commit = true;
		wake_worker_from = first_id;
	}
	else
		wake_worker_from = Min(wake_worker_from, first_id);
}

/*
 * For the worker, before each publish batch's snapshot: the smallest id of
 * the rows committed (enqueued or requeued) since it last asked, or
 * PG_INT64_MAX if none.  Rows committed after this call lower it again for
 * the next batch; those committed before are seen by this one's snapshot.
 */
int64
idem_take_enqueued_from(void)
{
	if (shared == NULL || my_database_slot() == NULL)
		return PG_INT64_MIN;
	return enqueued_id(pg_atomic_exchange_u64(&my_slot->enqueued_from, ENQUEUED_NONE));
}

/*
 * The routes changed: tell the backends that keep them, and wake the worker
 * for rows of topics that are routed now.
 */
void
idem_routes_changed_at_commit(void)
{
	if (shared == NULL)
		return;
	/* a topic routed now may have rows from long ago */
	idem_wake_worker_at_commit(PG_INT64_MIN);
	routes_changed_at_commit = true;
}

/* Has the current transaction changed the routes? */
bool
idem_routes_changed_in_transaction(void)
{
	return routes_changed_at_commit;
}

/*
 * DROP DATABASE, ALTER DATABASE ... RENAME or SET TABLESPACE, and CREATE
 * DATABASE ... TEMPLATE need the database to themselves.  Ask its worker to
 * leave, keep the launcher from starting another for a while, and wait
 * (briefly) until it is gone.
 */
static void
pause_worker(const char *dbname)
{
	Oid			dboid = dbname != NULL ? get_database_oid(dbname, true) : InvalidOid;
	IdemDatabaseSlot *slot = idem_database_slot(dboid, false);
	pid_t		pid;

	/*
	 * Only for a command that can succeed: these cannot run in a transaction
	 * block, and need the database's owner (or a superuser).  Anyone else
	 * would only be able to stop the worker.
	 */
	if (slot == NULL || IsTransactionBlock() ||
		!compat_database_ownercheck(dboid, GetUserId()))
		return;

	LWLockAcquire(shared->lock, LW_EXCLUSIVE);
	slot->paused_until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), WORKER_PAUSE_MS);
	pid = slot->worker_pid;
	LWLockRelease(shared->lock);
	if (pid == 0)
		return;

	kill(pid, SIGTERM);
	for (int waited = 0; waited < WORKER_EXIT_WAIT_MS; waited += 10)
	{
		bool		gone;

		LWLockAcquire(shared->lock, LW_SHARED);
		gone = slot->worker_pid != pid;
		LWLockRelease(shared->lock);
		if (gone)
			break;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(10 * 1000L);
	}
}

static const char *
defelem_string(List *options, const char *name)
{
	ListCell   *lc;

	foreach(lc, options)
	{
		DefElem    *option = (DefElem *) lfirst(lc);

		if (strcmp(option->defname, name) == 0 && option->arg != NULL)
			return defGetString(option);
	}
	return NULL;
}

/*
 * What a utility statement means to the shared state, before it runs (the
 * library's utility hook calls this): the launcher told about CREATE
 * EXTENSION at commit, the claims' waiters about a prepared transaction
 * decided, and a database's worker kept away from DROP DATABASE and the
 * statements that need the database to themselves.
 */
void
idem_shmem_utility(Node *statement)
{
	if (shared == NULL)
		return;
	if (IsA(statement, CreateExtensionStmt) &&
		strcmp(((CreateExtensionStmt *) statement)->extname, "idempotency") == 0)
	{
		register_xact_callback();
		wake_launcher_at_commit = true;
	}
	else if (IsA(statement, TransactionStmt) &&
			 (((TransactionStmt *) statement)->kind == TRANS_STMT_COMMIT_PREPARED ||
			  ((TransactionStmt *) statement)->kind == TRANS_STMT_ROLLBACK_PREPARED))
	{
		/* its claims are decided now; which keys it changed, we cannot tell */
		claim_wait_all_changed();
	}
	else if (IsA(statement, DropdbStmt))
		pause_worker(((DropdbStmt *) statement)->dbname);
	else if (IsA(statement, RenameStmt) &&
			 ((RenameStmt *) statement)->renameType == OBJECT_DATABASE)
		pause_worker(((RenameStmt *) statement)->subname);
	else if (IsA(statement, CreatedbStmt))
		pause_worker(defelem_string(((CreatedbStmt *) statement)->options, "template"));
	else if (IsA(statement, AlterDatabaseStmt) &&
			 defelem_string(((AlterDatabaseStmt *) statement)->options, "tablespace") != NULL)
		pause_worker(((AlterDatabaseStmt *) statement)->dbname);
}

/*
 * idem_stats_counters() -> the current database's counters, last round and
 * worker pid; no row without shared memory.
 */
Datum
idem_stats_counters(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemDatabaseSlot *slot;
	Datum		values[IDEM_NUM_COUNTERS + 2];
	bool		nulls[IDEM_NUM_COUNTERS + 2] = {false};

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	slot = idem_database_slot(MyDatabaseId, true);
	if (slot == NULL)
		return (Datum) 0;

	for (int c = 0; c < IDEM_NUM_COUNTERS; c++)
		values[c] = Int64GetDatum((int64) pg_atomic_read_u64(&slot->counters[c]));

	LWLockAcquire(shared->lock, LW_SHARED);
	values[IDEM_NUM_COUNTERS] = TimestampTzGetDatum(slot->last_round);
	nulls[IDEM_NUM_COUNTERS] = slot->last_round == 0;
	values[IDEM_NUM_COUNTERS + 1] = Int32GetDatum(slot->worker_pid);
	nulls[IDEM_NUM_COUNTERS + 1] = slot->worker_pid == 0;
	LWLockRelease(shared->lock);

	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	return (Datum) 0;
}

/*
 * Called once by the extension script: without shared_preload_libraries the
 * functions work, but nothing purges or publishes in the background.
 */
Datum
idem_warn_without_preload(PG_FUNCTION_ARGS)
{
	if (shared == NULL)
		ereport(WARNING,
				(errmsg("idempotency is not in shared_preload_libraries"),
				 errdetail("Every function works, but no background worker purges expired rows or publishes the outbox, and idempotency.stats has no counters."),
				 errhint("Add idempotency to shared_preload_libraries and restart the server, or schedule SELECT idempotency.idem_run_maintenance() with pg_cron.")));
	PG_RETURN_VOID();
}
