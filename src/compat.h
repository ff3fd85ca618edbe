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

#endif							/* IDEMPOTENCY_COMPAT_H */
