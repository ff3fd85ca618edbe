/*-------------------------------------------------------------------------
 *
 * claim_wait.c
 *	  idem_claim's wait argument: sleep until the request that holds the key
 *	  finishes, instead of answering in_progress at once.
 *
 * Owns: the wait slots in shared memory (sized from infra/shmem.c's hooks),
 *	  the waiter's sleep, and the wake-up that a transaction which changed a
 *	  key sends when it ends.  keys/keys.c decides when to wait (an answer
 *	  that would be in_progress) and looks at the key again after each
 *	  wake-up; nothing here reads a table.
 * May call: infra/args.h (idem_timestamp_plus), infra/guc.h, compat.h.
 *
 * A wait slot is a (database, hash of scope and key) with the list of the
 * backends waiting for that key.  The slots are split into WAIT_PARTITIONS
 * partitions by the hash, each a fixed run of slots under an LWLock of its
 * own; idempotency.wait_slots sizes them (by default twice MaxBackends,
 * which backends waiting for at most one key each cannot exhaust unless
 * their hashes crowd one partition).  A waiter that finds no free slot in
 * its partition, or a server without the library preloaded, polls instead:
 * a short latch sleep and another look.  Two keys with the same hash share
 * a slot, which only costs a spurious wake-up.
 *
 * The waiter: registers in its key's slot (its entry in waiters[], by
 * process number, linked into the slot's list), and only then looks at the
 * key again (the caller's next probe), so that a holder committing between
 * the first look and the registration is either seen by that look or finds
 * the waiter registered and sets its latch.  It then sleeps on its own
 * latch until the earliest of its deadline, the holder's lease expiry (a
 * committed claim, two-transaction mode) and RECHECK_MS, and looks again
 * after each wake-up; a latch set while it looks makes the next sleep
 * return at once.  It holds no lock while it sleeps: no row lock, no tuple
 * lock, no lock on the key, and no buffer pin; only the relation locks
 * every statement on the table keeps until its transaction ends.  WaitLatch
 * answers cancel and statement_timeout at once.
 *
 * The holder: each idem_claim that claims and each idem_complete,
 * idem_release or idem_checkpoint remembers the key's hash in this
 * backend.  When the transaction commits or aborts, or a subtransaction
 * aborts, and anyone waits at all (one atomic counter, read after a
 * memory barrier), it takes the remembered keys' waiters off their slots'
 * lists, under the partitions' locks, and sets their latches once it has
 * let go of the locks.  Its commit is visible to others by then (the
 * callbacks run after ProcArrayEndTransaction), so a woken waiter's next
 * look sees it.  With no waiter anywhere the cost is a hash per changed
 * key and one atomic read per transaction.
 *
 * Why not a condition variable: a hundred waiters of one key, woken
 * together, would each take its spinlock twice more (to put themselves
 * back on its list, then to leave it), and on a machine with fewer cores
 * than waiters a spinlock holder that loses its core sends the others into
 * spin delays of a millisecond and more.  Here a woken waiter that has its
 * answer touches no lock at all; one that must wait again registers anew.
 *
 * Changes that name no key wake every waiter of the database
 * (claim_wait_all_changed): COMMIT PREPARED and ROLLBACK PREPARED, from the
 * utility hook, since a prepared transaction's keys were forgotten at its
 * PREPARE; and a purge that deleted expired keys, one of which a claim may
 * have found being deleted.  RECHECK_MS bounds a sleep that nothing
 * announces: a key changed by plain SQL.  It is long because a thousand
 * parked waiters that each looked again every second would cost unrelated
 * claims a thousand probes a second.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "common/hashfn.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "storage/proc.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "infra/args.h"
#include "infra/claim_wait.h"
#include "infra/guc.h"

#define WAIT_TRANCHE_NAME	"idempotency claim waits"
#define WAIT_PARTITIONS		16

/* A waiter without a slot looks again this often. */
#define POLL_MS				10

/* The longest sleep between two looks at the key. */
#define RECHECK_MS			10000

/* Keys a transaction remembers one by one; past that, it wakes them all. */
#define MAX_CHANGED_KEYS	64

#define NO_WAITER			(-1)

/* A slot: one key and the backends that wait for it. */
typedef struct ClaimWaitSlot
{
	Oid			dboid;			/* the key's database */
	uint32		nwaiters;		/* backends registered here; 0: free */
	uint64		keyhash;		/* the key's hash (see key_hash) */
	int			first_waiter;	/* index in waiters[], or NO_WAITER */
} ClaimWaitSlot;

/* A backend, by process number, while it waits in a slot. */
typedef struct ClaimWaiter
{
	int			next_waiter;	/* the slot's next waiter, or NO_WAITER */
	Latch	   *latch;			/* set to wake it */
	pg_atomic_uint32 in_slot;	/* 1 while on a slot's list; 0 once woken */
} ClaimWaiter;

/*
 * The slots and the waiters' entries are protected by the lock of the
 * slot's partition; nwaiters is read without it.
 */
typedef struct ClaimWaitShared
{
	pg_atomic_uint32 nwaiters;	/* waiters registered in any slot */
	int			slots_per_partition;
	int			nwaiter_entries;	/* MaxBackends */
	LWLockPadded *locks;		/* WAIT_PARTITIONS, one per partition */
	ClaimWaiter *waiters;		/* nwaiter_entries, after the slots */
	ClaimWaitSlot slots[FLEXIBLE_ARRAY_MEMBER];
} ClaimWaitShared;

static ClaimWaitShared *wait_shared = NULL;

static void register_callbacks(void);

/* The keys this transaction changed, by hash; see claim_wait_key_changed. */
static uint64 changed_keys[MAX_CHANGED_KEYS];
static int	nchanged_keys = 0;
static bool changed_keys_overflowed = false;
static bool callbacks_registered = false;

/* The slot this backend waits in, so that an error or exit leaves it. */
static ClaimWaitSlot *registered_slot = NULL;

/* The latches a wake-up sets, gathered under a lock and set after it. */
static Latch **latches_to_set = NULL;

static int
slots_per_partition(void)
{
	int			nslots = idem_wait_slots >= 0 ? idem_wait_slots : 2 * MaxBackends;

	return (nslots + WAIT_PARTITIONS - 1) / WAIT_PARTITIONS;
}

static Size
slots_size(void)
{
	return add_size(offsetof(ClaimWaitShared, slots),
					mul_size(mul_size(WAIT_PARTITIONS, slots_per_partition()),
							 sizeof(ClaimWaitSlot)));
}

static Size
wait_shared_size(void)
{
	return add_size(MAXALIGN(slots_size()), mul_size(MaxBackends, sizeof(ClaimWaiter)));
}

/* From shmem.c's shmem_request_hook: MaxBackends is known by then. */
void
idem_claim_wait_shmem_request(void)
{
	RequestAddinShmemSpace(wait_shared_size());
	RequestNamedLWLockTranche(WAIT_TRANCHE_NAME, WAIT_PARTITIONS);
}

/* From shmem.c's shmem_startup_hook, holding AddinShmemInitLock. */
void
idem_claim_wait_shmem_init(void)
{
	bool		found;

	wait_shared = ShmemInitStruct("idempotency claim waits", wait_shared_size(), &found);
	if (found)
		return;
	pg_atomic_init_u32(&wait_shared->nwaiters, 0);
	wait_shared->slots_per_partition = slots_per_partition();
	wait_shared->nwaiter_entries = MaxBackends;
	wait_shared->locks = GetNamedLWLockTranche(WAIT_TRANCHE_NAME);
	wait_shared->waiters = (ClaimWaiter *) ((char *) wait_shared + MAXALIGN(slots_size()));
	for (int i = 0; i < WAIT_PARTITIONS * wait_shared->slots_per_partition; i++)
	{
		wait_shared->slots[i].dboid = InvalidOid;
		wait_shared->slots[i].nwaiters = 0;
		wait_shared->slots[i].keyhash = 0;
		wait_shared->slots[i].first_waiter = NO_WAITER;
	}
	for (int i = 0; i < wait_shared->nwaiter_entries; i++)
	{
		wait_shared->waiters[i].next_waiter = NO_WAITER;
		wait_shared->waiters[i].latch = NULL;
		pg_atomic_init_u32(&wait_shared->waiters[i].in_slot, 0);
	}
}

/* The key's hash: scope and key, each with its length, in this database. */
static uint64
key_hash(text *scope, text *key)
{
	uint64		h;

	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
							VARSIZE_ANY_EXHDR(scope), 0);
	h = hash_combine64(h, VARSIZE_ANY_EXHDR(scope));
	return hash_combine64(h, hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
												 VARSIZE_ANY_EXHDR(key), 0));
}

static int
partition_of(uint64 keyhash)
{
	return (int) (keyhash % WAIT_PARTITIONS);
}

static LWLock *
partition_lock(int partition)
{
	return &wait_shared->locks[partition].lock;
}

static ClaimWaitSlot *
partition_slots(int partition)
{
	return &wait_shared->slots[partition * wait_shared->slots_per_partition];
}

/* The wait event pg_stat_activity shows while a claim waits. */
static uint32
wait_event(void)
{
	static uint32 event = 0;

	if (event == 0)
		event = compat_wait_event_extension("IdempotencyClaimWait");
	return event;
}

/* This backend's entry in waiters[], or -1 if it has none. */
static int
my_waiter_index(void)
{
	int			procno = compat_my_proc_number();

	return procno >= 0 && procno < wait_shared->nwaiter_entries ? procno : -1;
}

/* Has a wake-up taken this backend off its slot's list? */
static bool
woken(void)
{
	if (pg_atomic_read_u32(&wait_shared->waiters[my_waiter_index()].in_slot) != 0)
		return false;
	/* what we write to our entry from now on comes after the waker is done */
	pg_memory_barrier();
	return true;
}

/*
 * Leave the slot this backend is registered in, if any.  A waiter that was
 * woken is off the list already, which is what lets a hundred waiters of
 * one key answer without taking any lock.
 */
static void
leave_slot(void)
{
	ClaimWaitSlot *slot = registered_slot;
	int			me;
	int			partition;

	/* not registered; without the library preloaded, never (no slots) */
	if (slot == NULL)
		return;
	me = my_waiter_index();
	registered_slot = NULL;
	if (woken())
		return;

	partition = (int) ((slot - wait_shared->slots) / wait_shared->slots_per_partition);
	LWLockAcquire(partition_lock(partition), LW_EXCLUSIVE);
	/* the only one who takes it off besides us holds this lock to do so */
	if (!woken())
	{
		for (int *link = &slot->first_waiter; *link != NO_WAITER;
			 link = &wait_shared->waiters[*link].next_waiter)
		{
			if (*link == me)
			{
				*link = wait_shared->waiters[me].next_waiter;
				break;
			}
		}
		pg_atomic_write_u32(&wait_shared->waiters[me].in_slot, 0);
		Assert(slot->nwaiters > 0);
		if (--slot->nwaiters == 0)
			slot->dboid = InvalidOid;
		pg_atomic_fetch_sub_u32(&wait_shared->nwaiters, 1);
	}
	LWLockRelease(partition_lock(partition));
}

static void
leave_slot_at_exit(int code, Datum arg)
{
	leave_slot();
}

/*
 * Register in the key's slot: the one already waited in, or a free one of
 * its partition.  NULL when the partition has none free.
 */
static ClaimWaitSlot *
enter_slot(uint64 keyhash)
{
	int			partition = partition_of(keyhash);
	ClaimWaitSlot *slots = partition_slots(partition);
	ClaimWaitSlot *slot = NULL;
	int			me = my_waiter_index();

	Assert(registered_slot == NULL);
	if (me < 0)
		return NULL;
	register_callbacks();

	LWLockAcquire(partition_lock(partition), LW_EXCLUSIVE);
	for (int i = 0; i < wait_shared->slots_per_partition; i++)
	{
		if (slots[i].nwaiters > 0 && slots[i].dboid == MyDatabaseId &&
			slots[i].keyhash == keyhash)
		{
			slot = &slots[i];
			break;
		}
		if (slot == NULL && slots[i].nwaiters == 0)
			slot = &slots[i];
	}
	if (slot != NULL)
	{
		if (slot->nwaiters == 0)
			slot->first_waiter = NO_WAITER;
		slot->dboid = MyDatabaseId;
		slot->keyhash = keyhash;
		slot->nwaiters++;
		wait_shared->waiters[me].latch = MyLatch;
		wait_shared->waiters[me].next_waiter = slot->first_waiter;
		pg_atomic_write_u32(&wait_shared->waiters[me].in_slot, 1);
		slot->first_waiter = me;
		registered_slot = slot;
		/* a full barrier: see wake_changed_keys */
		pg_atomic_fetch_add_u32(&wait_shared->nwaiters, 1);
	}
	LWLockRelease(partition_lock(partition));
	return slot;
}

/*
 * Read idem_claim's wait argument (wait_argno, when the SQL function has it)
 * and get ready to wait.  NULL or zero: never wait.  Negative: an error.
 */
void
claim_wait_start(ClaimWait *wait, FunctionCallInfo fcinfo, int wait_argno,
				 text *scope, text *key)
{
	memset(wait, 0, sizeof(ClaimWait));
	if (PG_NARGS() > wait_argno && !PG_ARGISNULL(wait_argno))
	{
		Interval   *span = PG_GETARG_INTERVAL_P(wait_argno);
		TimestampTz now = GetCurrentTimestamp();
		TimestampTz deadline = idem_timestamp_plus(now, span);

		if (deadline < now)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("wait must not be negative"),
					 errdetail("The value given was \"%s\".",
							   DatumGetCString(DirectFunctionCall1(interval_out,
																   IntervalPGetDatum(span)))),
					 errhint("Give 0 or NULL to answer in_progress at once.")));
		if (deadline > idem_timestamp_plus(now, idem_interval_from_ms(idem_max_wait_ms)))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("wait must not exceed idempotency.max_wait (%s)",
							GetConfigOptionByName("idempotency.max_wait", NULL, false)),
					 errdetail("The value given was \"%s\".",
							   DatumGetCString(DirectFunctionCall1(interval_out,
																   IntervalPGetDatum(span)))),
					 errhint("A waiting claim holds its connection: wait less and let the client retry, or raise the setting.")));
		if (deadline > now)
			wait->deadline = deadline;
	}
	if (wait->deadline != 0)
		wait->keyhash = key_hash(scope, key);
}

/*
 * The key is held by another request.  Wait for it, until the earliest of
 * the deadline and holder_lease_end (0: none): true to look at the key
 * again, false when the wait has run out (or there is none) and the answer
 * is in_progress.
 *
 * The first call registers and returns at once, for the look that closes
 * the race with a holder that ended meanwhile; each later one sleeps.
 */
bool
claim_wait_sleep(ClaimWait *wait, TimestampTz holder_lease_end)
{
	TimestampTz now;
	TimestampTz wake_at;
	long		timeout_ms;

	if (wait->deadline == 0)
		return false;
	now = GetCurrentTimestamp();
	if (now >= wait->deadline)
		return false;

	/*
	 * Register before the first sleep, and again after a wake-up that found
	 * the key still held (a wake-up takes the waiters off the list); then
	 * look at the key once more before sleeping.
	 */
	if (!wait->started || (wait->slot != NULL && woken()))
	{
		wait->started = true;
		leave_slot();
		wait->slot = NULL;
		if (wait_shared != NULL && wait_shared->slots_per_partition > 0)
			wait->slot = enter_slot(wait->keyhash);
		return true;
	}

	wake_at = wait->deadline;
	if (holder_lease_end != 0 && holder_lease_end < wake_at)
		wake_at = holder_lease_end;
	timeout_ms = TimestampDifferenceMilliseconds(now, wake_at);
	/* a lease that ends within the millisecond: look again after it */
	timeout_ms = Max(timeout_ms, 1);
	timeout_ms = Min(timeout_ms, wait->slot != NULL ? RECHECK_MS : POLL_MS);

	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 timeout_ms, wait_event());
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
	return true;
}

/* The claim has its answer: leave the slot. */
void
claim_wait_end(ClaimWait *wait)
{
	if (wait->slot != NULL)
		leave_slot();
	wait->slot = NULL;
}

/*
 * Take every waiter off a slot's list, which frees the slot, and add their
 * latches to latches_to_set; the caller holds the partition's lock
 * exclusively, and sets the latches once it has let go of it.
 */
static void
detach_waiters(ClaimWaitSlot *slot, int *nlatches)
{
	int			next;

	for (int w = slot->first_waiter; w != NO_WAITER; w = next)
	{
		/*
		 * Read the entry before letting its backend go: once in_slot is 0 it
		 * may register elsewhere, under another partition's lock, and
		 * rewrite it (the exchange is a full barrier).
		 */
		next = wait_shared->waiters[w].next_waiter;
		latches_to_set[(*nlatches)++] = wait_shared->waiters[w].latch;
		(void) pg_atomic_exchange_u32(&wait_shared->waiters[w].in_slot, 0);
	}
	pg_atomic_fetch_sub_u32(&wait_shared->nwaiters, slot->nwaiters);
	slot->first_waiter = NO_WAITER;
	slot->nwaiters = 0;
	slot->dboid = InvalidOid;
}

static void
set_latches(int nlatches)
{
	for (int i = 0; i < nlatches; i++)
		SetLatch(latches_to_set[i]);
}

/* Wake the waiters of the keys this transaction changed, if anyone waits. */
static void
wake_changed_keys(void)
{
	/*
	 * Pairs with the waiter's atomic increment before its look at the key:
	 * either this read sees the waiter, or the waiter's look sees what this
	 * transaction did.
	 */
	pg_memory_barrier();
	if (pg_atomic_read_u32(&wait_shared->nwaiters) == 0)
		return;

	if (changed_keys_overflowed)
	{
		for (int partition = 0; partition < WAIT_PARTITIONS; partition++)
		{
			ClaimWaitSlot *slots = partition_slots(partition);
			int			nlatches = 0;

			LWLockAcquire(partition_lock(partition), LW_EXCLUSIVE);
			for (int i = 0; i < wait_shared->slots_per_partition; i++)
				if (slots[i].nwaiters > 0 && slots[i].dboid == MyDatabaseId)
					detach_waiters(&slots[i], &nlatches);
			LWLockRelease(partition_lock(partition));
			set_latches(nlatches);
		}
		return;
	}

	for (int k = 0; k < nchanged_keys; k++)
	{
		int			partition = partition_of(changed_keys[k]);
		ClaimWaitSlot *slots = partition_slots(partition);
		int			nlatches = 0;

		LWLockAcquire(partition_lock(partition), LW_EXCLUSIVE);
		for (int i = 0; i < wait_shared->slots_per_partition; i++)
		{
			if (slots[i].nwaiters > 0 && slots[i].dboid == MyDatabaseId &&
				slots[i].keyhash == changed_keys[k])
			{
				detach_waiters(&slots[i], &nlatches);
				break;
			}
		}
		LWLockRelease(partition_lock(partition));
		set_latches(nlatches);
	}
}

static void
forget_changed_keys(void)
{
	nchanged_keys = 0;
	changed_keys_overflowed = false;
}

/*
 * At the end of a transaction, committed or not, wake the waiters of the
 * keys it changed; and leave a slot that an error left registered.
 */
static void
claim_wait_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			leave_slot();
			if (nchanged_keys > 0 || changed_keys_overflowed)
				wake_changed_keys();
			forget_changed_keys();
			break;
		case XACT_EVENT_PREPARE:
			/* COMMIT PREPARED comes from elsewhere: the utility hook wakes all */
			forget_changed_keys();
			break;
		default:
			break;
	}
}

/*
 * A subtransaction that aborts undoes its claims now, not at the end of the
 * transaction: wake their waiters then.  Its changes cannot be told apart
 * from the rest of the transaction's, so every key changed so far is woken
 * (and still remembered: the transaction's own end wakes them again).
 */
static void
claim_wait_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
							SubTransactionId parentSubid, void *arg)
{
	if (event != SUBXACT_EVENT_ABORT_SUB)
		return;
	leave_slot();
	if (nchanged_keys > 0 || changed_keys_overflowed)
		wake_changed_keys();
}

/*
 * The transaction's end wakes the waiters of the keys it changed, and
 * leaves the slot of a wait that an error ended; the backend's exit leaves
 * it after a FATAL error (pg_terminate_backend), which does not unwind.
 */
static void
register_callbacks(void)
{
	if (callbacks_registered)
		return;
	/* now, not in a callback at abort, where allocating could fail */
	latches_to_set = MemoryContextAlloc(TopMemoryContext,
										sizeof(Latch *) * wait_shared->nwaiter_entries);
	RegisterXactCallback(claim_wait_xact_callback, NULL);
	RegisterSubXactCallback(claim_wait_subxact_callback, NULL);
	before_shmem_exit(leave_slot_at_exit, (Datum) 0);
	callbacks_registered = true;
}

/*
 * This transaction may have changed any key of the database, without
 * saying which: COMMIT PREPARED or ROLLBACK PREPARED of a transaction that
 * claimed, or the purge of expired keys.  Its end wakes every waiter of
 * the database, who look at their keys again.
 */
void
claim_wait_all_changed(void)
{
	if (wait_shared == NULL)
		return;
	register_callbacks();
	changed_keys_overflowed = true;
}

/*
 * This transaction claimed, completed, released or checkpointed the key:
 * remember it, for the wake-up at the transaction's end.  A transaction
 * that changes more than MAX_CHANGED_KEYS keys wakes every waiter of its
 * database instead.
 */
void
claim_wait_key_changed(text *scope, text *key)
{
	uint64		keyhash;

	if (wait_shared == NULL || changed_keys_overflowed)
		return;
	register_callbacks();

	keyhash = key_hash(scope, key);
	for (int k = 0; k < nchanged_keys; k++)
		if (changed_keys[k] == keyhash)
			return;
	if (nchanged_keys == MAX_CHANGED_KEYS)
		changed_keys_overflowed = true;
	else
		changed_keys[nchanged_keys++] = keyhash;
}
