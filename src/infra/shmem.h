/*-------------------------------------------------------------------------
 *
 * shmem.h
 *	  State shared by every process of the cluster: the registry of
 *	  databases the background workers serve, and the cumulative counters.
 *
 * Only there when the library is in shared_preload_libraries; every
 * function here is a no-op (or answers "nothing") without it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_SHMEM_H
#define IDEMPOTENCY_SHMEM_H

#include "datatype/timestamp.h"
#include "nodes/nodes.h"
#include "nodes/pg_list.h"
#include "port/atomics.h"
#include "storage/latch.h"
#include "storage/lwlock.h"

/* Cumulative counters, per database, in the manner of pg_stat_*. */
typedef enum IdemCounter
{
	IDEM_COUNTER_CLAIMS,		/* idem_claim answered claimed */
	IDEM_COUNTER_REPLAYS,		/* ... replay */
	IDEM_COUNTER_CONFLICTS,		/* ... in_progress */
	IDEM_COUNTER_MISMATCHES,	/* ... mismatch */
	IDEM_COUNTER_TAKEOVERS,		/* claimed with attempt > 1 */
	IDEM_COUNTER_RELEASED,		/* released by idem_complete or idem_release */
	IDEM_COUNTER_PURGED,		/* rows deleted by maintenance */
	IDEM_COUNTER_PUBLISHED,		/* outbox rows published by maintenance */
	IDEM_COUNTER_PUBLISH_FAILURES,	/* failed publish attempts */
	IDEM_COUNTER_PURGE_YIELDS,	/* rests a purge took while others wrote */
	IDEM_NUM_COUNTERS
} IdemCounter;

/*
 * One database: its worker, if any, and its counters.  A slot is taken the
 * first time anything counts in the database or the launcher serves it, and
 * freed when the launcher sees the database gone.
 */
typedef struct IdemDatabaseSlot
{
	Oid			dboid;			/* InvalidOid: the slot is free */
	pid_t		worker_pid;		/* the database's worker, or 0 */
	Latch	   *worker_latch;	/* its latch: set to wake it at once */
	bool		extension_absent;	/* its worker found no extension here */
	uint32		extension_generation;	/* bumped by each CREATE EXTENSION */
	TimestampTz paused_until;	/* no worker before this (DROP DATABASE) */
	TimestampTz last_round;		/* when the worker last finished a round */
	pg_atomic_uint32 routes_version;	/* bumped by each commit that routes */
	/* the smallest outbox id committed since the worker last looked (ENQUEUED_NONE) */
	pg_atomic_uint64 enqueued_from;

	/*
	 * Written by nearly every call, so on cache lines of their own: the
	 * fields above are read by every call.
	 */
	pg_atomic_uint64 counters[IDEM_NUM_COUNTERS] pg_attribute_aligned(PG_CACHE_LINE_SIZE);
} IdemDatabaseSlot;

extern void idem_shmem_register(void);
extern LWLock *idem_shmem_lock(void);
extern void idem_shmem_utility(Node *statement);

extern IdemDatabaseSlot *idem_database_slot(Oid dboid, bool create);
extern void idem_count(IdemCounter counter, uint64 n);

/* The launcher's side of the registry. */
extern void idem_launcher_attach(void);
extern void idem_launcher_free_slots_except(List *present_oids);
extern int	idem_max_databases_slots(void);

/* Ask, from any backend, for something to happen when its transaction commits. */
extern void idem_wake_worker_at_commit(int64 first_id);
extern int64 idem_take_enqueued_from(void);
extern void idem_routes_changed_at_commit(void);
extern bool idem_routes_changed_in_transaction(void);

/*
 * This database's routes version, which moves with each commit that routes
 * and each CREATE EXTENSION: false without shared memory.
 */
extern bool idem_routes_version(uint64 *version);

#endif							/* IDEMPOTENCY_SHMEM_H */
