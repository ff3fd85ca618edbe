/*-------------------------------------------------------------------------
 *
 * outbox_ack.c
 *	  The acknowledgement's per-key order check, read from the outbox's
 *	  indexes directly: which of the ids an ack names may be published,
 *	  because no earlier unpublished row of their key is left behind.
 *
 * The check is ACK_BLOCKING's (outbox_sql.c), with the same answer for the
 * same snapshot: for each key among the ids, its first blocking row, the
 * oldest unpublished row of the key that is not taken (among the ids,
 * leased, and under the hand-out named, when fenced), from the topic's
 * oldest unpublished row up to the newest of the key's ids; a row may be
 * acknowledged if it has no key, or comes no later than its key's first
 * blocking row.  Through the executor that was a rescan of a plan per key
 * (a hash join, a limit, an index scan with four runtime keys), which with
 * a hundred keys a batch cost the ack three times its work without keys.
 * Here the topic's unpublished rows are walked in id order from its oldest
 * (outbox_ready), which finds every key's first blocking row at once when
 * the ack's rows lie close together, as a hand-out's do (topic_walk); where
 * the walk would be long, each key is one descent of outbox_key_order
 * (key_blocker).
 *
 * The caller holds and writes the rows let through (outbox/outbox.c's
 * acknowledge_on, the same steps as after the check in SQL), so that what
 * this decides is only which rows are held back by their key, as the
 * snapshot sees them.  It also gives each key's taken rows that it lets
 * through, oldest first (AckChains): the caller locks those that come
 * before another, and leaves out of the write the rows after one that
 * changed since the snapshot (another relay leased it again, or a nack put
 * it back).  When the indexes are not the ones this reads (a database at
 * 1.0 whose predicates name state, an index a user altered), it says so
 * and the caller makes the whole check in SQL instead.
 *
 * Owns: the reading of outbox_pkey (1.1: outbox_id), outbox_ready and outbox_key_order for the
 *	  check, and what it needs of them (open_checked_index).
 * May call: tables/tables.h.  Called by outbox/outbox.c.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/nbtree.h"
#include "access/relscan.h"
#include "access/table.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_opfamily.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "optimizer/optimizer.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "compat.h"
#include "outbox/outbox_ack.h"
#include "tables/tables.h"

/* One row named by the ack, as the snapshot sees it. */
typedef struct AckRow
{
	int64		id;
	text	   *topic;
	text	   *key;			/* NULL: no key */
	int64		blocker;		/* its key's first blocking row, or 0 */
	bool		taken;			/* leased, and under the hand-out named */
} AckRow;

/* An id of the ack and its position in the array, for the fence. */
typedef struct AckId
{
	int64		id;
	int			position;
} AckId;

typedef struct AckCheck
{
	Relation	heap;
	Snapshot	snapshot;
	TupleTableSlot *slot;
	bool		fenced;
	AckId	   *ids;			/* the non-null ids, by id, then position */
	int			nids;
	Datum	   *attempts;
	bool	   *attempts_null;
} AckCheck;

static int
compare_ack_ids(const void *a, const void *b)
{
	const AckId *x = a;
	const AckId *y = b;

	if (x->id != y->id)
		return x->id < y->id ? -1 : 1;
	return x->position - y->position;
}

static int
compare_text(text *a, text *b)
{
	int			la = VARSIZE_ANY_EXHDR(a);
	int			lb = VARSIZE_ANY_EXHDR(b);
	int			cmp = memcmp(VARDATA_ANY(a), VARDATA_ANY(b), Min(la, lb));

	if (cmp != 0)
		return cmp;
	return la < lb ? -1 : la > lb ? 1 : 0;
}

/* Bytewise by topic and key (COLLATE "C", as the index orders them), then id. */
static int
compare_ack_rows(const void *a, const void *b)
{
	const AckRow *x = a;
	const AckRow *y = b;
	int			cmp;

	if ((x->key == NULL) != (y->key == NULL))
		return x->key == NULL ? -1 : 1;
	if (x->key != NULL)
	{
		cmp = compare_text(x->topic, y->topic);
		if (cmp == 0)
			cmp = compare_text(x->key, y->key);
		if (cmp != 0)
			return cmp;
	}
	if (x->id != y->id)
		return x->id < y->id ? -1 : 1;
	return 0;
}

/*
 * Whether the index is too new for this transaction's snapshots, as the
 * planner tells: built over HOT chains broken at the time (indcheckxmin),
 * it may lack the entries an older snapshot needs, until every transaction
 * older than its pg_index row is gone.
 */
static bool
index_too_new(Relation index)
{
	return index->rd_index->indcheckxmin &&
		!TransactionIdPrecedes(HeapTupleHeaderGetXmin(index->rd_indextuple->t_data),
							   TransactionXmin);
}

/*
 * The index of the outbox called name, if it is what the check reads: a
 * valid btree, not too new for the snapshot, on exactly these leading
 * columns, ascending, in the default operator families ("C" for text, as
 * the table's columns are), with no expression, and holding every row with
 * published_at null (and, if keyed, a key), which its predicate must imply.
 * NULL otherwise.
 */
static Relation
open_checked_index(Relation heap, const char *name, int ncolumns,
				   const AttrNumber *columns, bool keyed)
{
	Oid			indexid = get_relname_relid(name, RelationGetNamespace(heap));
	Relation	index;
	List	   *rows = NIL;
	bool		usable;

	/* a superuser may have put a relation of another kind under the name */
	if (!OidIsValid(indexid) || get_rel_relkind(indexid) != RELKIND_INDEX)
		return NULL;
	index = index_open(indexid, AccessShareLock);
	usable = index->rd_rel->relam == BTREE_AM_OID &&
		index->rd_index->indrelid == RelationGetRelid(heap) &&
		index->rd_index->indisvalid && index->rd_index->indisready &&
		index->rd_index->indislive &&
		!index_too_new(index) &&
		IndexRelationGetNumberOfKeyAttributes(index) >= ncolumns &&
		RelationGetIndexExpressions(index) == NIL;
	for (int i = 0; usable && i < ncolumns; i++)
	{
		bool		is_text = TupleDescAttr(RelationGetDescr(heap), columns[i] - 1)->atttypid == TEXTOID;

		usable = index->rd_index->indkey.values[i] == columns[i] &&
			index->rd_indoption[i] == 0 &&
			index->rd_opfamily[i] == (is_text ? TEXT_BTREE_FAM_OID : INTEGER_BTREE_FAM_OID) &&
			index->rd_indcollation[i] == (is_text ? C_COLLATION_OID : InvalidOid);
	}
	if (usable)
	{
		Form_pg_attribute published_at = TupleDescAttr(RelationGetDescr(heap),
													   Anum_outbox_published_at - 1);
		Form_pg_attribute key = TupleDescAttr(RelationGetDescr(heap), Anum_outbox_key - 1);
		NullTest   *test = makeNode(NullTest);

		test->arg = (Expr *) makeVar(1, Anum_outbox_published_at, published_at->atttypid,
									 published_at->atttypmod, published_at->attcollation, 0);
		test->nulltesttype = IS_NULL;
		test->location = -1;
		rows = list_make1(test);
		if (keyed)
		{
			test = makeNode(NullTest);
			test->arg = (Expr *) makeVar(1, Anum_outbox_key, key->atttypid, key->atttypmod,
										 key->attcollation, 0);
			test->nulltesttype = IS_NOT_NULL;
			test->location = -1;
			rows = lappend(rows, test);
		}
		usable = predicate_implied_by(RelationGetIndexPredicate(index), rows, false);
	}
	if (!usable)
	{
		index_close(index, NoLock);
		return NULL;
	}
	return index;
}

static bool
text_is(Datum value, const char *expected)
{
	text	   *t = DatumGetTextPP(value);
	size_t		len = strlen(expected);

	return VARSIZE_ANY_EXHDR(t) == len && memcmp(VARDATA_ANY(t), expected, len) == 0;
}

/* state <> 'published' AND published_at IS NULL, of the row in the slot */
static bool
slot_unpublished(TupleTableSlot *slot)
{
	bool		isnull;
	Datum		state = slot_getattr(slot, Anum_outbox_state, &isnull);

	if (isnull || text_is(state, "published"))
		return false;
	(void) slot_getattr(slot, Anum_outbox_published_at, &isnull);
	return isnull;
}

/*
 * Whether the row in the slot is taken by the ack: among its ids, leased,
 * and, fenced, under the hand-out whose attempts the ack gives at the id's
 * first position (array_position's).
 */
static bool
slot_taken(AckCheck *check, TupleTableSlot *slot, int64 id)
{
	AckId		wanted = {id, -1};
	int			lo = 0;
	int			hi = check->nids;
	bool		isnull;
	Datum		state;

	/* the first entry >= (id, -1): the id's first position, if any */
	while (lo < hi)
	{
		int			mid = (lo + hi) / 2;

		if (compare_ack_ids(&check->ids[mid], &wanted) < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo >= check->nids || check->ids[lo].id != id)
		return false;
	state = slot_getattr(slot, Anum_outbox_state, &isnull);
	if (isnull || !text_is(state, "leased"))
		return false;
	if (check->fenced)
	{
		int			position = check->ids[lo].position;
		Datum		attempts = slot_getattr(slot, Anum_outbox_attempts, &isnull);

		if (isnull || check->attempts_null[position] ||
			DatumGetInt32(attempts) != DatumGetInt32(check->attempts[position]))
			return false;
	}
	return true;
}

/* The first of rows[first..last] (sorted by key) whose key is key, or -1. */
static int
find_key(AckRow *rows, int first, int last, text *key)
{
	int			lo = first;
	int			hi = last + 1;

	while (lo < hi)
	{
		int			mid = (lo + hi) / 2;

		if (compare_text(rows[mid].key, key) < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo <= last && compare_text(rows[lo].key, key) == 0 ? lo : -1;
}

/*
 * The topic's oldest unpublished row, or 0 if it has none, read from
 * outbox_ready; and, while the walk stays short, the first blocking row of
 * each key of rows[first..last] (the ack's keyed rows of the topic, by key,
 * then id), set in the key's first row, with *decided true: walking the
 * topic's unpublished rows in id order on up to the newest of those rows,
 * a key's first blocking row is the first row of the key met that is not
 * taken.  When a hand-out is a run of rows in id order, as a drain's is,
 * that walk reads little more than the ack's own rows, where a descent per
 * key would read each key's part of outbox_key_order.  A walk that would
 * read more than budget rows stops (*decided false), and the keys are left
 * to key_blocker.
 */
static int64
topic_walk(AckCheck *check, Relation ready, AckRow *rows, int first, int last,
		   int budget, bool *decided)
{
	ScanKeyData key;
	IndexScanDesc scan;
	int64		oldest = 0;
	int64		newest = 0;
	bool		stopped = false;

	for (int i = first; i <= last; i++)
		newest = Max(newest, rows[i].id);
	ScanKeyEntryInitialize(&key, 0, 1, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(rows[first].topic));
	scan = compat_index_beginscan(check->heap, ready, check->snapshot, 1, 0);
	index_rescan(scan, &key, 1, NULL, 0);
	while (index_getnext_slot(scan, ForwardScanDirection, check->slot))
	{
		bool		isnull;
		int64		id;
		Datum		row_key;
		int			group;

		CHECK_FOR_INTERRUPTS();
		if (!slot_unpublished(check->slot))
			continue;
		id = DatumGetInt64(slot_getattr(check->slot, Anum_outbox_id, &isnull));
		if (oldest == 0)
			oldest = id;
		if (id >= newest)
			break;
		if (--budget < 0)
		{
			stopped = true;
			break;
		}
		row_key = slot_getattr(check->slot, Anum_outbox_key, &isnull);
		if (isnull || slot_taken(check, check->slot, id))
			continue;
		group = find_key(rows, first, last, DatumGetTextPP(row_key));
		if (group >= 0 && rows[group].blocker == 0)
		{
			int			group_last = group;

			while (group_last < last &&
				   compare_text(rows[group_last + 1].key, rows[group].key) == 0)
				group_last++;
			if (id < rows[group_last].id)
				rows[group].blocker = id;
		}
	}
	index_endscan(scan);
	*decided = !stopped;
	return oldest;
}

/*
 * The key's first blocking row from oldest up to (not including) newest, or
 * 0: one descent of outbox_key_order, then its entries in order to the
 * first unpublished row that is not taken.
 */
static int64
key_blocker(AckCheck *check, IndexScanDesc scan, text *topic, text *key,
			int64 oldest, int64 newest)
{
	ScanKeyData keys[4];

	ScanKeyEntryInitialize(&keys[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(topic));
	ScanKeyEntryInitialize(&keys[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   C_COLLATION_OID, F_TEXTEQ, PointerGetDatum(key));
	ScanKeyEntryInitialize(&keys[2], 0, 3, BTGreaterEqualStrategyNumber, InvalidOid,
						   InvalidOid, F_INT8GE, Int64GetDatum(oldest));
	ScanKeyEntryInitialize(&keys[3], 0, 3, BTLessStrategyNumber, InvalidOid,
						   InvalidOid, F_INT8LT, Int64GetDatum(newest));
	index_rescan(scan, keys, 4, NULL, 0);
	while (index_getnext_slot(scan, ForwardScanDirection, check->slot))
	{
		bool		isnull;
		int64		id = DatumGetInt64(slot_getattr(check->slot, Anum_outbox_id, &isnull));

		CHECK_FOR_INTERRUPTS();
		if (slot_unpublished(check->slot) && !slot_taken(check, check->slot, id))
			return id;
	}
	return 0;
}

/*
 * The ids among ids (an int8[]; attempts an int4[] of the same length when
 * fenced) that their key does not hold back, read under snapshot, as an
 * int8[] in the caller's memory context: every id of a row without a key, or
 * that comes no later than its key's first blocking row.  NULL if the
 * indexes are not the ones this reads, or an id names rows of two topics
 * that get different answers: then the caller checks in SQL.  *chains is
 * set to each key's taken rows that the answer lets through, oldest first,
 * of the keys that have two or more, in the caller's memory context.
 */
ArrayType *
outbox_ack_unblocked(ArrayType *ids, ArrayType *attempts, bool fenced, Snapshot snapshot,
					 AckChains *chains)
{
	static const AttrNumber id_columns[] = {Anum_outbox_id};
	static const AttrNumber ready_columns[] = {Anum_outbox_topic, Anum_outbox_id};
	static const AttrNumber key_columns[] = {Anum_outbox_topic, Anum_outbox_key, Anum_outbox_id};
	MemoryContext caller = CurrentMemoryContext;
	MemoryContext work = AllocSetContextCreate(CurrentMemoryContext, "idempotency ack check",
											   ALLOCSET_DEFAULT_SIZES);
	AckCheck	check = {0};
	Relation	by_id;
	Relation	ready;
	Relation	key_order;
	Datum	   *id_values;
	bool	   *id_nulls;
	int			nelems;
	AckRow	   *rows;
	int			nrows = 0;
	Datum	   *unblocked;
	int			nunblocked = 0;
	int64	   *chain_ids = NULL;
	bool	   *chain_starts = NULL;
	int			nchain = 0;
	bool		usable = true;
	ArrayType  *result = NULL;

	MemoryContextSwitchTo(work);
	check.heap = idem_outbox_open(AccessShareLock);
	/* 1.2's primary key leads with the id; at 1.1, an index of its own */
	by_id = open_checked_index(check.heap, "outbox_pkey", 1, id_columns, false);
	if (by_id == NULL)
		by_id = open_checked_index(check.heap, "outbox_id", 1, id_columns, false);
	ready = open_checked_index(check.heap, "outbox_ready", 2, ready_columns, false);
	key_order = open_checked_index(check.heap, "outbox_key_order", 3, key_columns, true);
	if (by_id == NULL || ready == NULL || key_order == NULL)
		usable = false;
	if (usable)
	{
		check.snapshot = snapshot;
		check.fenced = fenced;
		check.slot = table_slot_create(check.heap, NULL);
		deconstruct_array(ids, INT8OID, sizeof(int64), FLOAT8PASSBYVAL, TYPALIGN_DOUBLE,
						  &id_values, &id_nulls, &nelems);
		if (fenced)
		{
			int			nattempts;

			deconstruct_array(attempts, INT4OID, sizeof(int32), true, TYPALIGN_INT,
							  &check.attempts, &check.attempts_null, &nattempts);
			Assert(nattempts == nelems);
		}
		check.ids = palloc(sizeof(AckId) * Max(nelems, 1));
		for (int i = 0; i < nelems; i++)
			if (!id_nulls[i])
			{
				check.ids[check.nids].id = DatumGetInt64(id_values[i]);
				check.ids[check.nids++].position = i;
			}
		qsort(check.ids, check.nids, sizeof(AckId), compare_ack_ids);

		/* the rows the ids name, once each id */
		rows = palloc(sizeof(AckRow) * Max(check.nids, 1));
		{
			IndexScanDesc scan = compat_index_beginscan(check.heap, by_id, snapshot, 1, 0);

			for (int i = 0; i < check.nids; i++)
			{
				ScanKeyData key;

				if (i > 0 && check.ids[i].id == check.ids[i - 1].id)
					continue;
				CHECK_FOR_INTERRUPTS();
				ScanKeyEntryInitialize(&key, 0, 1, BTEqualStrategyNumber, InvalidOid,
									   InvalidOid, F_INT8EQ, Int64GetDatum(check.ids[i].id));
				index_rescan(scan, &key, 1, NULL, 0);
				while (index_getnext_slot(scan, ForwardScanDirection, check.slot))
				{
					bool		isnull;
					Datum		key_value;

					if (nrows > 0 && rows[nrows - 1].id == check.ids[i].id)
						usable = false; /* one id, two topics: rare, left to SQL */
					rows = repalloc(rows, sizeof(AckRow) * (nrows + 1));
					rows[nrows].id = check.ids[i].id;
					rows[nrows].topic = DatumGetTextPCopy(slot_getattr(check.slot, Anum_outbox_topic, &isnull));
					key_value = slot_getattr(check.slot, Anum_outbox_key, &isnull);
					rows[nrows].key = isnull ? NULL : DatumGetTextPCopy(key_value);
					rows[nrows].taken = slot_taken(&check, check.slot, check.ids[i].id);
					rows[nrows++].blocker = 0;
				}
			}
			index_endscan(scan);
		}

		/*
		 * Each key's first blocking row: from the walk of its topic, or, where
		 * that would be long, one descent per key.
		 */
		if (usable && nrows > 0)
		{
			IndexScanDesc scan = compat_index_beginscan(check.heap, key_order, snapshot, 4, 0);
			int			first = 0;

			qsort(rows, nrows, sizeof(AckRow), compare_ack_rows);
			while (first < nrows && rows[first].key == NULL)
				first++;
			while (first < nrows)
			{
				int			topic_last = first;
				bool		decided;
				int64		oldest;

				while (topic_last + 1 < nrows &&
					   compare_text(rows[topic_last + 1].topic, rows[first].topic) == 0)
					topic_last++;
				oldest = topic_walk(&check, ready, rows, first, topic_last,
									2 * (topic_last - first + 1) + 16, &decided);
				while (first <= topic_last)
				{
					int			last = first;
					int64		blocker = rows[first].blocker;

					while (last < topic_last &&
						   compare_text(rows[last + 1].key, rows[first].key) == 0)
						last++;
					/* nothing unpublished in the topic: nothing can block */
					if (!decided && oldest != 0)
						blocker = key_blocker(&check, scan, rows[first].topic, rows[first].key,
											  oldest, rows[last].id);
					for (int i = first; i <= last; i++)
						rows[i].blocker = blocker;
					first = last + 1;
				}
			}
			index_endscan(scan);
		}

		unblocked = palloc(sizeof(Datum) * Max(nrows, 1));
		for (int i = 0; usable && i < nrows; i++)
			if (rows[i].blocker == 0 || rows[i].id <= rows[i].blocker)
				unblocked[nunblocked++] = Int64GetDatum(rows[i].id);

		/*
		 * Each key's taken rows let through, oldest first, for the keys
		 * that have two or more (the keyed rows are sorted by topic, key,
		 * then id).
		 */
		chain_ids = palloc(sizeof(int64) * Max(nrows, 1));
		chain_starts = palloc(sizeof(bool) * Max(nrows, 1));
		for (int first = 0, last; usable && first < nrows; first = last + 1)
		{
			int			start = nchain;

			last = first;
			if (rows[first].key == NULL)
				continue;
			while (last + 1 < nrows &&
				   compare_text(rows[last + 1].topic, rows[first].topic) == 0 &&
				   compare_text(rows[last + 1].key, rows[first].key) == 0)
				last++;
			for (int i = first; i <= last; i++)
				if (rows[i].taken && (rows[i].blocker == 0 || rows[i].id <= rows[i].blocker))
				{
					chain_starts[nchain] = nchain == start;
					chain_ids[nchain++] = rows[i].id;
				}
			if (nchain - start < 2)
				nchain = start;
		}
		ExecDropSingleTupleTableSlot(check.slot);
	}
	if (by_id != NULL)
		index_close(by_id, NoLock);
	if (ready != NULL)
		index_close(ready, NoLock);
	if (key_order != NULL)
		index_close(key_order, NoLock);
	table_close(check.heap, NoLock);

	MemoryContextSwitchTo(caller);
	chains->nids = 0;
	if (usable)
	{
		result = construct_array(unblocked, nunblocked, INT8OID, sizeof(int64),
								 FLOAT8PASSBYVAL, TYPALIGN_DOUBLE);
		chains->nids = nchain;
		chains->ids = palloc(sizeof(int64) * Max(nchain, 1));
		chains->starts = palloc(sizeof(bool) * Max(nchain, 1));
		if (nchain > 0)
		{
			memcpy(chains->ids, chain_ids, sizeof(int64) * nchain);
			memcpy(chains->starts, chain_starts, sizeof(bool) * nchain);
		}
	}
	MemoryContextDelete(work);
	return result;
}
