/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Differences between the server versions we build against (13 to 17),
 *	  in one place, so that the rest of the code reads as if there were one.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "access/genam.h"
#include "access/tableam.h"
#include "utils/guc.h"

#if PG_VERSION_NUM < 130000
#error "idempotency needs PostgreSQL 13 or later"
#endif

/*
 * index_insert() gained the indexUnchanged hint (bottom-up deletion) in 14.
 */
#if PG_VERSION_NUM >= 140000
#define compat_index_insert(index, values, isnull, tid, heap, check, unchanged, info) \
	index_insert((index), (values), (isnull), (tid), (heap), (check), (unchanged), (info))
#else
#define compat_index_insert(index, values, isnull, tid, heap, check, unchanged, info) \
	index_insert((index), (values), (isnull), (tid), (heap), (check), (info))
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
 * MarkGUCPrefixReserved() is 15's name; older servers call it
 * EmitWarningsOnPlaceholders().
 */
#if PG_VERSION_NUM < 150000
#define MarkGUCPrefixReserved(prefix) EmitWarningsOnPlaceholders(prefix)
#endif

/*
 * ProcessUtility_hook gained readOnlyTree in 14.
 */
#if PG_VERSION_NUM >= 140000
#define COMPAT_PROCESS_UTILITY_ARGS \
	PlannedStmt *pstmt, const char *queryString, bool readOnlyTree, \
	ProcessUtilityContext context, ParamListInfo params, \
	QueryEnvironment *queryEnv, DestReceiver *dest, QueryCompletion *qc
#define COMPAT_PROCESS_UTILITY_CALL \
	pstmt, queryString, readOnlyTree, context, params, queryEnv, dest, qc
#else
#define COMPAT_PROCESS_UTILITY_ARGS \
	PlannedStmt *pstmt, const char *queryString, \
	ProcessUtilityContext context, ParamListInfo params, \
	QueryEnvironment *queryEnv, DestReceiver *dest, QueryCompletion *qc
#define COMPAT_PROCESS_UTILITY_CALL \
	pstmt, queryString, context, params, queryEnv, dest, qc
#endif

/*
 * The oldest transaction ID that some snapshot may still see as running:
 * GetOldestXmin() up to 13, GetOldestNonRemovableTransactionId() from 14.
 */
#if PG_VERSION_NUM >= 140000
#define compat_oldest_nonremovable_xid() GetOldestNonRemovableTransactionId(NULL)
#else
#define compat_oldest_nonremovable_xid() GetOldestXmin(NULL, PROCARRAY_FLAGS_VACUUM)
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
 * Before 15, a process that commits NOTIFYs outside the normal client loop
 * (a background worker) must signal the listeners itself.
 */
#if PG_VERSION_NUM < 150000
#include "commands/async.h"
#define compat_process_completed_notifies() ProcessCompletedNotifies()
#else
#define compat_process_completed_notifies() ((void) 0)
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
 * InitMaterializedSRF() (15.1; 15.0 called it SetSingleFuncCall) sets up a
 * set-returning function's tuplestore; older servers get the same, spelled
 * out.
 */
#if PG_VERSION_NUM < 150001
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/tuplestore.h"

#define MAT_SRF_USE_EXPECTED_DESC	0x01

static inline void
InitMaterializedSRF(FunctionCallInfo fcinfo, bits32 flags)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	MemoryContext oldcontext;

	if (rsinfo == NULL || !IsA(rsinfo, ReturnSetInfo) ||
		(rsinfo->allowedModes & SFRM_Materialize) == 0 ||
		rsinfo->expectedDesc == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("set-valued function called in context that cannot accept a set")));

	oldcontext = MemoryContextSwitchTo(rsinfo->econtext->ecxt_per_query_memory);
	rsinfo->setDesc = CreateTupleDescCopy(rsinfo->expectedDesc);
	rsinfo->setResult = tuplestore_begin_heap(true, false, work_mem);
	rsinfo->returnMode = SFRM_Materialize;
	MemoryContextSwitchTo(oldcontext);
}
#endif

#endif							/* IDEMPOTENCY_COMPAT_H */
