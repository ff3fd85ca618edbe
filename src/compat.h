/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Differences between the server versions we build against (15 to 18),
 *	  in one place, so that the rest of the code reads as if there were one.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "access/genam.h"
#include "access/tableam.h"
#include "utils/guc.h"
#include "utils/relcache.h"

#if PG_VERSION_NUM < 150000
#error "idempotency needs PostgreSQL 15 or later"
#endif

/*
 * table_tuple_update() reports which indexes need new entries: a bool up to
 * 15, the TU_UpdateIndexes enum from 16 (which adds "summarizing indexes
 * only").  CompatUpdateIndexes hides the type; the two macros say what to do.
 */
#if PG_VERSION_NUM >= 160000
typedef TU_UpdateIndexes CompatUpdateIndexes;
#define COMPAT_UPDATE_NEEDS_ANY_INDEX(u) ((u) != TU_None)
#define COMPAT_UPDATE_NEEDS_INDEX(u, index) \
	((u) == TU_All || ((u) == TU_Summarizing && (index)->rd_indam->amsummarizing))
#else
typedef bool CompatUpdateIndexes;
#define COMPAT_UPDATE_NEEDS_ANY_INDEX(u) (u)
#define COMPAT_UPDATE_NEEDS_INDEX(u, index) (u)
#endif

/*
 * index_beginscan() takes the scan's instrumentation (EXPLAIN's index
 * search counts) from 18; we pass none.
 */
#if PG_VERSION_NUM >= 180000
#define compat_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys))
#else
#define compat_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), (nkeys), (norderbys))
#endif

/*
 * A table's primary key index, computed from the catalogs if the relcache
 * entry does not hold it (a rebuilt entry does not, until its index list is
 * asked for): read rd_pkindex only through this.  From 18 the caller says
 * whether a deferrable key will do; ours take any, and check it themselves.
 */
#if PG_VERSION_NUM >= 180000
#define compat_primary_key_index(rel) RelationGetPrimaryKeyIndex((rel), true)
#else
#define compat_primary_key_index(rel) RelationGetPrimaryKeyIndex(rel)
#endif

/*
 * EXPLAIN's property printers moved from commands/explain.h to
 * commands/explain_format.h in 18.
 */
#if PG_VERSION_NUM >= 180000
#include "commands/explain_format.h"
#endif

/*
 * A GUC check hook's "extra" is freed by the GUC code: with free() up to 15,
 * with guc_free() (GUC's own memory context) from 16, where guc_malloc()
 * must allocate it.  NULL when out of memory, as malloc().
 */
#if PG_VERSION_NUM >= 160000
#define compat_guc_extra_alloc(size) guc_malloc(LOG, (size))
#else
#define compat_guc_extra_alloc(size) malloc(size)
#endif

/*
 * LogLogicalMessage() gained a flush argument in 17.
 */
#if PG_VERSION_NUM >= 170000
#define compat_log_logical_message(prefix, message, size, transactional) \
	LogLogicalMessage((prefix), (message), (size), (transactional), false)
#else
#define compat_log_logical_message(prefix, message, size, transactional) \
	LogLogicalMessage((prefix), (message), (size), (transactional))
#endif

/*
 * Ownership checks on one object went through per-kind functions up to 15
 * and object_ownercheck() from 16.
 */
#if PG_VERSION_NUM >= 160000
#define compat_database_ownercheck(dboid, roleid) \
	object_ownercheck(DatabaseRelationId, (dboid), (roleid))
#else
#define compat_database_ownercheck(dboid, roleid) \
	pg_database_ownercheck((dboid), (roleid))
#endif

/*
 * Privilege checks on one object went through per-kind functions up to 15
 * and object_aclcheck() from 16.
 */
#if PG_VERSION_NUM >= 160000
#define compat_function_aclcheck(funcoid, roleid, mode) \
	object_aclcheck(ProcedureRelationId, (funcoid), (roleid), (mode))
#else
#define compat_function_aclcheck(funcoid, roleid, mode) \
	pg_proc_aclcheck((funcoid), (roleid), (mode))
#endif

/*
 * InitMaterializedSRF() is 15.1's name; 15.0 called it SetSingleFuncCall().
 */
#if PG_VERSION_NUM < 150001
#define InitMaterializedSRF(fcinfo, flags) SetSingleFuncCall((fcinfo), (flags))
#define MAT_SRF_USE_EXPECTED_DESC SRF_SINGLE_USE_EXPECTED
#endif

/*
 * A wait event of one's own, shown by name in pg_stat_activity, from 17;
 * before, every extension's wait is "Extension".
 */
#include "utils/wait_event.h"
#if PG_VERSION_NUM >= 170000
#define compat_wait_event_extension(name) WaitEventExtensionNew(name)
#else
#define compat_wait_event_extension(name) PG_WAIT_EXTENSION
#endif

/*
 * This backend's process number (its PGPROC's index): MyProcNumber from 17,
 * MyProc->pgprocno before.
 */
#if PG_VERSION_NUM >= 170000
#include "storage/procnumber.h"
#define compat_my_proc_number() ((int) MyProcNumber)
#else
#include "storage/proc.h"
#define compat_my_proc_number() (MyProc->pgprocno)
#endif

#endif							/* IDEMPOTENCY_COMPAT_H */
