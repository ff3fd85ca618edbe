/*-------------------------------------------------------------------------
 *
 * keys.c
 *	  Idempotency keys: idem_claim, idem_complete, idem_release,
 *	  idem_checkpoint and idem_extend_lease.
 *
 * A row of idempotency.keys is in progress while status_code is NULL and
 * completed once a response is stored.  idem_claim decides, from one probe
 * of the primary key under a dirty snapshot (see tables.c), between:
 *
 *	 no row, or an expired one		-> insert / reset it: claimed, attempt 1
 *	 a row being inserted now		-> in_progress (its transaction owns it)
 *	 other fingerprint				-> mismatch
 *	 completed						-> replay
 *	 being modified now				-> in_progress (its owner is finishing)
 *	 in progress, lease running		-> in_progress
 *	 in progress, lease run out		-> take over: claimed, attempt + 1
 *
 * and never waits on a lock: the only writes it makes are an insert that
 * gives up on a duplicate and an update that gives up on a locked row.  So
 * a claim that does not answer "claimed" holds no lock and no row that
 * anyone could wait for, however long its transaction stays open.  With a
 * positive wait argument, an answer that would be in_progress (another
 * request holds the key) sleeps instead (claim_wait.c, which holds nothing
 * either) and decides again when the holder ends or the wait runs out.
 *
 * Uniqueness comes from the primary key alone, which is what makes two
 * "claimed" answers for one key impossible to commit together at any
 * isolation level.  Under REPEATABLE READ and SERIALIZABLE, a row that the
 * transaction's snapshot cannot see is not overwritten: that raises a
 * serialization failure, as an UPDATE would.
 *
 * Times are wall-clock (GetCurrentTimestamp), not transaction start: a lease
 * or a ttl counts from the moment the claim or the completion happens.
 *
 * Owns: where a claim is decided (claimed, replay, in_progress, mismatch),
 *	  completion, release and checkpoints.
 * May call: tables/tables.h (probe, insert, update), infra/ (argument
 *	  checks, settings, counters, claim_wait.h's waiting and wake-ups).
 *	  Called by keys/claim_scan.c.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "common/int.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "keys/keys.h"
#include "tables/tables.h"
#include "infra/args.h"
#include "infra/claim_wait.h"
#include "infra/guc.h"
#include "infra/run_as.h"
#include "infra/shmem.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_extend_lease);

/* Columns of idempotency.claim_result. */
enum
{
	RESULT_OUTCOME,
	RESULT_STATUS_CODE,
	RESULT_BODY,
	RESULT_HEADERS,
	RESULT_ATTEMPT,
	RESULT_RECOVERY_POINT,
	RESULT_CREATED_AT,
	/* from 1.1 on */
	RESULT_LEASE_EXPIRES_AT,
	RESULT_EXPIRES_AT
};

StaticAssertDecl(RESULT_CREATED_AT + 1 == IDEM_CLAIM_RESULT_NATTS_1_0,
				 "claim_result's columns at 1.0");
StaticAssertDecl(RESULT_EXPIRES_AT + 1 == IDEM_CLAIM_RESULT_NATTS,
				 "claim_result's columns");

/* claim_result's column types, in order */
const Oid	idem_claim_result_types[IDEM_CLAIM_RESULT_NATTS] = {
	TEXTOID, INT4OID, TEXTOID, JSONBOID, INT4OID, TEXTOID, TIMESTAMPTZOID,
	TIMESTAMPTZOID, TIMESTAMPTZOID
};

/* A row of idempotency.keys, deformed. */
typedef struct KeyRow
{
	Datum		values[Natts_keys];
	bool		nulls[Natts_keys];
} KeyRow;

#define KEY_VALUE(row, col)		((row)->values[(col) - 1])
#define KEY_ISNULL(row, col)	((row)->nulls[(col) - 1])
#define KEY_SET(row, col, v)	((row)->values[(col) - 1] = (v), (row)->nulls[(col) - 1] = false)
#define KEY_SET_NULL(row, col)	((row)->values[(col) - 1] = (Datum) 0, (row)->nulls[(col) - 1] = true)

static void
deform_key_row(IdemRelation *rel, const ProbeResult *found, KeyRow *row)
{
	heap_deform_tuple(found->tuple, RelationGetDescr(rel->heap),
					  row->values, row->nulls);
}

static bool
key_row_completed(const KeyRow *row)
{
	return !KEY_ISNULL(row, Anum_keys_status_code);
}

static bool
key_row_expired(const KeyRow *row, TimestampTz now)
{
	return DatumGetTimestampTz(KEY_VALUE(row, Anum_keys_expires_at)) <= now;
}

/* Fingerprints are compared byte for byte, whatever the collation. */
static bool
bytes_equal(text *a, text *b)
{
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

static const char *
text_for_message(text *t)
{
	return text_to_cstring(t);
}

/*
 * How many of claim_result's columns a row type has: 7 for the type as 1.0
 * declares it, 9 as 1.1 does, and -1 for anything else (a type altered by
 * hand, which this code does not know how to fill).
 */
int
idem_claim_result_natts(TupleDesc desc)
{
	if (desc->natts != IDEM_CLAIM_RESULT_NATTS_1_0 &&
		desc->natts != IDEM_CLAIM_RESULT_NATTS)
		return -1;
	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);

		if (attr->attisdropped || attr->atttypid != idem_claim_result_types[i])
			return -1;
	}
	return desc->natts;
}

/*
 * The result type's descriptor, from the type cache (release it with
 * ReleaseTupleDesc): the database's claim_result, with 7 columns or 9 (see
 * keys.h), checked.  A call site's fn_extra would not do: a statement's
 * function call is set up anew each time the statement runs, prepared or
 * not, and get_call_result_type costs a catalog lookup.
 */
static TupleDesc
claim_result_desc(FunctionCallInfo fcinfo)
{
	Oid			typid = get_fn_expr_rettype(fcinfo->flinfo);
	TupleDesc	desc;

	if (!OidIsValid(typid))
	{
		if (get_call_result_type(fcinfo, &typid, &desc) != TYPEFUNC_COMPOSITE)
			elog(ERROR, "idem_claim must return idempotency.claim_result");
	}
	desc = lookup_rowtype_tupdesc(typid, -1);
	if (idem_claim_result_natts(desc) < 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("type %s does not have the columns this version of idempotency expects",
						format_type_be(typid)),
				 errdetail("It should have the 7 columns of version 1.0 or the 9 of version 1.1, of their types."),
				 errhint("Do not alter the extension's types; reinstall the extension with DROP EXTENSION and CREATE EXTENSION.")));
	return desc;
}

/* idem_claim's answers, each with the counter it bumps (see idempotency.stats). */
typedef enum ClaimOutcome
{
	OUTCOME_CLAIMED,
	OUTCOME_REPLAY,
	OUTCOME_IN_PROGRESS,
	OUTCOME_MISMATCH,
	NUM_OUTCOMES
} ClaimOutcome;

static const struct
{
	const char *name;
	IdemCounter counter;
}			outcomes[NUM_OUTCOMES] = {
	[OUTCOME_CLAIMED] = {"claimed", IDEM_COUNTER_CLAIMS},
	[OUTCOME_REPLAY] = {"replay", IDEM_COUNTER_REPLAYS},
	[OUTCOME_IN_PROGRESS] = {"in_progress", IDEM_COUNTER_CONFLICTS},
	[OUTCOME_MISMATCH] = {"mismatch", IDEM_COUNTER_MISMATCHES},
};

/* The outcome as text, made once per backend. */
static Datum
outcome_datum(ClaimOutcome outcome)
{
	static text *texts[NUM_OUTCOMES];

	if (texts[outcome] == NULL)
	{
		MemoryContext oldcxt = MemoryContextSwitchTo(TopMemoryContext);

		texts[outcome] = cstring_to_text(outcomes[outcome].name);
		MemoryContextSwitchTo(oldcxt);
	}
	return PointerGetDatum(texts[outcome]);
}

/*
 * Fill the columns of claim_result: the outcome, and for every outcome but
 * "claimed" of a new key, what the stored row says.  Of the row's times,
 * "claimed" and "in_progress" say when its lease runs out, "replay" when
 * the stored response expires (an "in_progress" whose holder's lease is
 * not known to run, see holder_lease_known, has its lease_expires_at set
 * back to NULL by the caller).
 */
static void
claim_columns(ClaimOutcome outcome, const KeyRow *row, Datum *values, bool *nulls)
{
	memset(values, 0, sizeof(Datum) * IDEM_CLAIM_RESULT_NATTS);
	memset(nulls, true, sizeof(bool) * IDEM_CLAIM_RESULT_NATTS);
	idem_count(outcomes[outcome].counter, 1);
	values[RESULT_OUTCOME] = outcome_datum(outcome);
	nulls[RESULT_OUTCOME] = false;

	if (row != NULL)
	{
		static const struct
		{
			int			result_column;
			int			key_column;
		}			copied[] = {
			{RESULT_STATUS_CODE, Anum_keys_status_code},
			{RESULT_BODY, Anum_keys_body},
			{RESULT_HEADERS, Anum_keys_headers},
			{RESULT_ATTEMPT, Anum_keys_attempt},
			{RESULT_RECOVERY_POINT, Anum_keys_recovery_point},
			{RESULT_CREATED_AT, Anum_keys_created_at},
		};

		for (size_t i = 0; i < lengthof(copied); i++)
		{
			values[copied[i].result_column] = KEY_VALUE(row, copied[i].key_column);
			nulls[copied[i].result_column] = KEY_ISNULL(row, copied[i].key_column);
		}
		if (outcome == OUTCOME_CLAIMED || outcome == OUTCOME_IN_PROGRESS)
		{
			values[RESULT_LEASE_EXPIRES_AT] = KEY_VALUE(row, Anum_keys_lease_expires_at);
			nulls[RESULT_LEASE_EXPIRES_AT] = KEY_ISNULL(row, Anum_keys_lease_expires_at);
		}
		if (outcome == OUTCOME_REPLAY)
		{
			values[RESULT_EXPIRES_AT] = KEY_VALUE(row, Anum_keys_expires_at);
			nulls[RESULT_EXPIRES_AT] = false;
		}
	}
}

/*
 * For an "in_progress" answer from a settled row: is the holder's claim
 * committed, with a lease still running?  Then its lease_expires_at is
 * when a takeover becomes possible.  Not for a claim this transaction made
 * itself (nobody else sees it before it commits), nor for a row whose lease
 * ran out or that expired while another transaction changes it (a takeover
 * or a new claim is under way, with a lease not known yet).
 */
static bool
holder_lease_known(const KeyRow *row, bool written_by_us, TimestampTz now)
{
	return !written_by_us && !key_row_expired(row, now) &&
		!KEY_ISNULL(row, Anum_keys_lease_expires_at) &&
		DatumGetTimestampTz(KEY_VALUE(row, Anum_keys_lease_expires_at)) > now;
}

/*
 * Make row a fresh in-progress claim: attempt 1 for a new or expired key,
 * attempt + 1 (keeping recovery point, fingerprint and creation time) for a
 * takeover.
 */
static void
start_claim(KeyRow *row, bool takeover, text *fingerprint,
			Interval *ttl, Interval *lease, TimestampTz now)
{
	TimestampTz lease_expires = idem_timestamp_plus(now, lease);

	if (takeover)
	{
		int32		attempt;

		if (pg_add_s32_overflow(DatumGetInt32(KEY_VALUE(row, Anum_keys_attempt)), 1, &attempt))
			ereport(ERROR,
					(errcode(ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE),
					 errmsg("key has been taken over too many times"),
					 errdetail("Its attempt number is already %d.", PG_INT32_MAX),
					 errhint("Release the key with idem_release, or let it expire.")));
		KEY_SET(row, Anum_keys_attempt, Int32GetDatum(attempt));
		if (KEY_ISNULL(row, Anum_keys_fingerprint) && fingerprint != NULL)
			KEY_SET(row, Anum_keys_fingerprint, PointerGetDatum(fingerprint));
	}
	else
	{
		KEY_SET(row, Anum_keys_attempt, Int32GetDatum(1));
		KEY_SET_NULL(row, Anum_keys_recovery_point);
		KEY_SET(row, Anum_keys_created_at, TimestampTzGetDatum(now));
		if (fingerprint != NULL)
			KEY_SET(row, Anum_keys_fingerprint, PointerGetDatum(fingerprint));
		else
			KEY_SET_NULL(row, Anum_keys_fingerprint);
	}
	KEY_SET(row, Anum_keys_lease_expires_at, TimestampTzGetDatum(lease_expires));
	KEY_SET_NULL(row, Anum_keys_status_code);
	KEY_SET_NULL(row, Anum_keys_body);
	KEY_SET_NULL(row, Anum_keys_headers);
	KEY_SET(row, Anum_keys_ttl, IntervalPGetDatum(ttl));
	KEY_SET_NULL(row, Anum_keys_completed_at);
	/* an abandoned claim is kept for a takeover until lease + ttl */
	KEY_SET(row, Anum_keys_expires_at,
			TimestampTzGetDatum(idem_timestamp_plus(lease_expires, ttl)));
}

/*
 * Serialization check for REPEATABLE READ and SERIALIZABLE: refuse to
 * overwrite a row version the transaction's snapshot does not see.
 */
static void
check_serializable_write(IdemRelation *rel, const ProbeResult *found)
{
	if (IsolationUsesXactSnapshot() && !idem_row_visible_to_snapshot(rel, found))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update"),
				 errdetail("The idempotency key was changed by a transaction that committed after this transaction's snapshot was taken."),
				 errhint("Retry the transaction.")));
}

/* What idem_claim does with a settled row; see the table at the top. */
typedef enum ClaimDecision
{
	CLAIM_RESET,				/* expired: counts as absent, claim it afresh */
	CLAIM_TAKE_OVER,			/* in progress, lease run out */
	CLAIM_MISMATCH,
	CLAIM_REPLAY,
	CLAIM_IN_PROGRESS
} ClaimDecision;

static ClaimDecision
decide_claim(const KeyRow *row, bool being_modified, bool written_by_us,
			 text *fingerprint, TimestampTz now)
{
	if (key_row_expired(row, now))
		return being_modified ? CLAIM_IN_PROGRESS : CLAIM_RESET;

	/* a NULL fingerprint, stored or given, matches anything */
	if (!KEY_ISNULL(row, Anum_keys_fingerprint) && fingerprint != NULL &&
		!bytes_equal(DatumGetTextPP(KEY_VALUE(row, Anum_keys_fingerprint)), fingerprint))
		return CLAIM_MISMATCH;

	if (key_row_completed(row))
		return CLAIM_REPLAY;

	/* its owner is completing or releasing it, or another is taking it over */
	if (being_modified)
		return CLAIM_IN_PROGRESS;

	/* a claim of this transaction's own is never taken over by itself */
	if (written_by_us ||
		DatumGetTimestampTz(KEY_VALUE(row, Anum_keys_lease_expires_at)) > now)
		return CLAIM_IN_PROGRESS;

	return CLAIM_TAKE_OVER;
}

/*
 * When a key held by another request frees up, if the claim waits for it:
 * the end of the holder's lease when that is what holds it (a committed
 * claim, not being changed), else 0 (the holder's transaction ends it).
 */
static TimestampTz
holder_lease_end(const KeyRow *row, const ProbeResult *found)
{
	if (found->being_modified || key_row_completed(row) ||
		KEY_ISNULL(row, Anum_keys_lease_expires_at))
		return 0;
	return DatumGetTimestampTz(KEY_VALUE(row, Anum_keys_lease_expires_at));
}

static void claim_columns_spi(FunctionCallInfo fcinfo, text *scope, text *key,
							  text *fingerprint, Interval *ttl, Interval *lease,
							  Datum *values, bool *nulls);

/*
 * What idem_claim(scope, key, fingerprint, ttl, lease[, wait]) does, its
 * answer put in the IDEM_CLAIM_RESULT_NATTS columns of claim_result
 * (values, nulls), which point into the stored row and live in the current
 * memory context.  The arguments are fcinfo's (wait only where the SQL
 * function has it: 1.0's has five arguments); its flinfo is not used.
 */
void
idem_claim_columns(FunctionCallInfo fcinfo, Datum *values, bool *nulls)
{
	text	   *scope = idem_arg_identifier(fcinfo, 0, "scope", 0);
	text	   *key = idem_arg_identifier(fcinfo, 1, "key", 1);
	text	   *fingerprint = idem_arg_text_or_null(fcinfo, 2);
	Interval   *ttl = idem_arg_duration(fcinfo, 3, "ttl", (int64) idem_key_ttl_s * 1000);
	Interval   *lease = idem_arg_duration(fcinfo, 4, "lease", idem_lease_ms);
	Datum		pkey[2] = {PointerGetDatum(scope), PointerGetDatum(key)};
	IdemRelation rel;
	ClaimWait	wait;

	if (idem_keys_spi)
	{
		claim_columns_spi(fcinfo, scope, key, fingerprint, ttl, lease, values, nulls);
		return;
	}
	claim_wait_start(&wait, fcinfo, IDEM_CLAIM_WAIT_ARGNO, scope, key);
	idem_require_writable("idem_claim()");
	idem_relation_open(&rel, IDEM_TABLE_KEYS, RowExclusiveLock, scope, "idem_claim()");

	for (;;)
	{
		ProbeResult found;
		KeyRow		row;
		TimestampTz now;
		ClaimDecision decision;
		TM_Result	tm;

		CHECK_FOR_INTERRUPTS();
		idem_probe(&rel, pkey, &found);
		now = GetCurrentTimestamp();

		if (found.outcome == PROBE_ABSENT)
		{
			memset(&row, 0, sizeof(row));
			KEY_SET(&row, Anum_keys_scope, PointerGetDatum(scope));
			KEY_SET(&row, Anum_keys_key, PointerGetDatum(key));
			start_claim(&row, false, fingerprint, ttl, lease, now);
			if (idem_insert_unique(&rel, row.values, row.nulls))
			{
				claim_wait_key_changed(scope, key);
				claim_columns(OUTCOME_CLAIMED, &row, values, nulls);
				break;
			}
			continue;			/* lost a race: look again */
		}

		if (found.outcome == PROBE_INSERTING)
		{
			/*
			 * An uncommitted claim by another transaction.  If it is still
			 * in the middle of its speculative insertion, it will know in a
			 * moment whether it won: wait for that (never for its
			 * transaction) and look again.
			 */
			if (found.speculative_token != 0)
			{
				SpeculativeInsertionWait(found.inserting_xid, found.speculative_token);
				continue;
			}
			/* its transaction's end wakes us */
			if (claim_wait_sleep(&wait, 0))
				continue;
			claim_columns(OUTCOME_IN_PROGRESS, NULL, values, nulls);
			break;
		}

		deform_key_row(&rel, &found, &row);
		decision = decide_claim(&row, found.being_modified, found.written_by_us,
								fingerprint, now);
		if (decision == CLAIM_MISMATCH)
		{
			claim_columns(OUTCOME_MISMATCH, NULL, values, nulls);
			break;
		}
		if (decision == CLAIM_REPLAY)
		{
			claim_columns(OUTCOME_REPLAY, &row, values, nulls);
			break;
		}
		if (decision == CLAIM_IN_PROGRESS)
		{
			/* never for a claim of this transaction's own: it would wait for itself */
			if (!found.written_by_us &&
				claim_wait_sleep(&wait, holder_lease_end(&row, &found)))
				continue;
			claim_columns(OUTCOME_IN_PROGRESS, &row, values, nulls);
			if (!holder_lease_known(&row, found.written_by_us, now))
				nulls[RESULT_LEASE_EXPIRES_AT] = true;
			break;
		}

		check_serializable_write(&rel, &found);
		start_claim(&row, decision == CLAIM_TAKE_OVER, fingerprint, ttl, lease, now);
		tm = idem_update(&rel, &found.tid, row.values, row.nulls, false);
		if (tm == TM_Ok)
		{
			if (decision == CLAIM_TAKE_OVER)
				idem_count(IDEM_COUNTER_TAKEOVERS, 1);
			claim_wait_key_changed(scope, key);
			claim_columns(OUTCOME_CLAIMED, &row, values, nulls);
			break;
		}
		if (tm == TM_BeingModified || tm == TM_WouldBlock)
		{
			/* someone else is taking it over, or holds a lock on it */
			if (claim_wait_sleep(&wait, 0))
				continue;
			claim_columns(OUTCOME_IN_PROGRESS, NULL, values, nulls);
			break;
		}
		if (tm != TM_Updated && tm != TM_Deleted)
			elog(ERROR, "unexpected result %d updating an idempotency key", (int) tm);
		/* it changed since the probe: look again */
	}

	claim_wait_end(&wait);
	idem_relation_close(&rel);
}

/*
 * idem_claim(scope, key, fingerprint, ttl, lease [, wait]) -> claim_result
 *
 * Called in FROM, as it usually is, the planner puts a direct scan in the
 * place of this function (claim_scan.c); everywhere else, this runs.  The
 * result has the columns of the database's claim_result: 7 at 1.0, 9 from
 * 1.1 on (heap_form_tuple reads as many of ours as the type has).
 */
Datum
idem_claim(PG_FUNCTION_ARGS)
{
	Datum		values[IDEM_CLAIM_RESULT_NATTS];
	bool		nulls[IDEM_CLAIM_RESULT_NATTS];
	TupleDesc	desc;
	HeapTuple	tuple;

	idem_claim_columns(fcinfo, values, nulls);

	/* HeapTupleGetDatum inlines any TOASTed body, as a composite must */
	desc = claim_result_desc(fcinfo);
	tuple = heap_form_tuple(desc, values, nulls);
	ReleaseTupleDesc(desc);
	PG_RETURN_DATUM(HeapTupleGetDatum(tuple));
}

/*
 * The error raised when the key's only row is another transaction's claim
 * that has not committed yet.
 */
static void
raise_claim_uncommitted(text *scope, text *key)
{
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_KEY_NOT_CLAIMED),
			 errmsg("idempotency key \"%s\" in scope \"%s\" is not claimed by this transaction",
					text_for_message(key), text_for_message(scope)),
			 errdetail("Another transaction's claim of the key has not committed yet.")));
}

/*
 * Raise the error that says why row (NULL: no row) is not the in-progress
 * claim (of attempt, if check_attempt) that idem_complete, idem_release,
 * idem_checkpoint and idem_extend_lease act on; return if it is.
 */
static void
check_claim(text *scope, text *key, const KeyRow *row,
			bool check_attempt, int32 attempt)
{
	int32		current_attempt;

	if (row == NULL || key_row_expired(row, GetCurrentTimestamp()))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_KEY_NOT_CLAIMED),
				 errmsg("idempotency key \"%s\" in scope \"%s\" is not claimed",
						text_for_message(key), text_for_message(scope)),
				 errhint("Call idem_claim first; a claim also ends when it is released or expires.")));

	if (key_row_completed(row))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_KEY_COMPLETED),
				 errmsg("idempotency key \"%s\" in scope \"%s\" is already completed",
						text_for_message(key), text_for_message(scope)),
				 errdetail("Its response (status %d) is stored and is replayed to every retry.",
						   DatumGetInt32(KEY_VALUE(row, Anum_keys_status_code)))));

	current_attempt = DatumGetInt32(KEY_VALUE(row, Anum_keys_attempt));
	if (check_attempt && attempt != current_attempt)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_STALE_ATTEMPT),
				 errmsg("idempotency key \"%s\" in scope \"%s\" is held by attempt %d, not %d",
						text_for_message(key), text_for_message(scope),
						current_attempt, attempt),
				 attempt < current_attempt ?
				 errhint("The claim's lease ran out and a retry took the key over; this attempt must stop without side effects.") : 0));
}

/*
 * Find the in-progress claim that idem_complete, idem_release or
 * idem_checkpoint acts on, or raise the error that says why there is none.
 * With an attempt, the claim must be that attempt: a caller whose claim was
 * taken over gets an error instead of overwriting the new owner's work.
 */
static void
find_claim(IdemRelation *rel, text *scope, text *key,
		   bool check_attempt, int32 attempt,
		   ProbeResult *found, KeyRow *row)
{
	Datum		pkey[2] = {PointerGetDatum(scope), PointerGetDatum(key)};

	idem_probe(rel, pkey, found);

	if (found->outcome == PROBE_INSERTING)
		raise_claim_uncommitted(scope, key);

	if (found->outcome == PROBE_FOUND)
		deform_key_row(rel, found, row);

	check_claim(scope, key, found->outcome == PROBE_FOUND ? row : NULL,
				check_attempt, attempt);
	check_serializable_write(rel, found);
}

/*
 * Common driver of the three functions that change a claim: find it, apply
 * change (which fills row for an update, or returns false to delete), and
 * start over if the row changed under us while we waited for its lock.
 */
typedef bool (*ClaimChange) (KeyRow *row, void *arg);

/*
 * ---- The SPI path (issue 29 item 2) ----
 *
 * The same decisions through kept SPI plans, without a dirty snapshot, as
 * the SQL edition makes them (sql-edition/keys.sql, doc/internals.md "Keys
 * without a dirty snapshot"): every write of a key is preceded by a
 * transaction-level advisory lock on a 64-bit hash of the key (the SQL
 * edition's _lock_id, so that both take the same lock), taken here with
 * LockAcquire; idem_claim reads the key with a plain SELECT, and writes
 * with INSERT ... ON CONFLICT DO NOTHING or an UPDATE of the version read
 * (ctid and xmin).  A claim that cannot take the lock answers in_progress
 * (its holder is writing the key); a write that finds the key changed
 * since the read lets the lock go and decides again.  The functions that
 * change a claim check the committed row first, then wait for the lock
 * (as the direct path waits for the row) and check again.
 *
 * Chosen by idempotency.keys_spi (off: the direct path), for make bench's
 * pairs that measure one against the other.
 */
typedef enum KeyStatement
{
	KEY_SELECT,
	KEY_INSERT,
	KEY_UPDATE,
	KEY_DELETE,
	NUM_KEY_STATEMENTS
} KeyStatement;

#define KEY_COLUMNS_SQL \
	"scope, key, fingerprint, attempt, recovery_point, lease_expires_at," \
	" status_code, body, headers, ttl, created_at, completed_at, expires_at"
#define KEY_ARGTYPES \
	TEXTOID, TEXTOID, TEXTOID, INT4OID, TEXTOID, TIMESTAMPTZOID, \
	INT4OID, TEXTOID, JSONBOID, INTERVALOID, TIMESTAMPTZOID, TIMESTAMPTZOID, \
	TIMESTAMPTZOID

static const struct
{
	const char *sql;
	int			nargs;
	Oid			argtypes[Natts_keys + 2];
}			key_statements[NUM_KEY_STATEMENTS] = {
	[KEY_SELECT] = {
		"SELECT " KEY_COLUMNS_SQL ", xmin, ctid FROM idempotency.keys"
		" WHERE scope = $1 AND key = $2",
		2, {TEXTOID, TEXTOID}
	},
	[KEY_INSERT] = {
		"INSERT INTO idempotency.keys (" KEY_COLUMNS_SQL ")"
		" VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
		" ON CONFLICT DO NOTHING",
		Natts_keys, {KEY_ARGTYPES}
	},
	[KEY_UPDATE] = {
		"UPDATE idempotency.keys SET fingerprint = $3, attempt = $4,"
		" recovery_point = $5, lease_expires_at = $6, status_code = $7,"
		" body = $8, headers = $9, ttl = $10, created_at = $11,"
		" completed_at = $12, expires_at = $13"
		" WHERE ctid = $14 AND xmin = $15 AND scope = $1 AND key = $2",
		Natts_keys + 2, {KEY_ARGTYPES, TIDOID, XIDOID}
	},
	[KEY_DELETE] = {
		"DELETE FROM idempotency.keys"
		" WHERE ctid = $3 AND xmin = $4 AND scope = $1 AND key = $2",
		4, {TEXTOID, TEXTOID, TIDOID, XIDOID}
	},
};

static SPIPlanPtr key_plans[NUM_KEY_STATEMENTS];

/* Where the version read is: its ctid and xmin, for the write's WHERE. */
typedef struct KeyVersion
{
	ItemPointerData tid;
	TransactionId xmin;
} KeyVersion;

/* The role that owns idempotency.keys, which the statements run as. */
static Oid
keys_owner(void)
{
	Oid			nsp = get_namespace_oid("idempotency", true);
	Oid			relid = OidIsValid(nsp) ? get_relname_relid("keys", nsp) : InvalidOid;
	HeapTuple	tuple;
	Oid			owner;

	if (!OidIsValid(relid) ||
		!HeapTupleIsValid(tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(relid))))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("table \"idempotency.keys\" does not exist"),
				 errhint("Run CREATE EXTENSION idempotency in this database.")));
	owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
	ReleaseSysCache(tuple);
	return owner;
}

/* As the owner of the table, with search_path pinned, connected to SPI. */
static void
key_sql_begin(IdemRunAs *run_as)
{
	idem_run_as_begin(run_as, keys_owner(), SECURITY_LOCAL_USERID_CHANGE);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
}

static void
key_sql_end(IdemRunAs *run_as)
{
	SPI_finish();
	idem_run_as_end(run_as, true);
}

/* Run one of the statements, prepared and kept on first use. */
static uint64
key_sql_run(KeyStatement statement, Datum *values, const char *nulls)
{
	int			ret;

	if (key_plans[statement] == NULL)
	{
		SPIPlanPtr	plan = SPI_prepare(key_statements[statement].sql,
									   key_statements[statement].nargs,
									   (Oid *) key_statements[statement].argtypes);

		if (plan == NULL)
			elog(ERROR, "could not prepare key statement %d: %s",
				 (int) statement, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "could not keep key statement %d", (int) statement);
		key_plans[statement] = plan;
	}
	ret = SPI_execute_plan(key_plans[statement], values, nulls, false,
						   statement == KEY_SELECT ? 1 : 0);
	if (ret < 0)
		elog(ERROR, "key statement %d failed: %s",
			 (int) statement, SPI_result_code_string(ret));
	return SPI_processed;
}

/*
 * Read the key: false if no row is visible, else its columns into row
 * (pointing into a copy that outlives SPI) and where it is into version.
 */
static bool
key_read(text *scope, text *key, KeyRow *row, KeyVersion *version)
{
	Datum		args[2] = {PointerGetDatum(scope), PointerGetDatum(key)};
	Datum		values[Natts_keys + 2];
	bool		nulls[Natts_keys + 2];
	HeapTuple	tuple;

	if (key_sql_run(KEY_SELECT, args, NULL) == 0)
		return false;
	tuple = SPI_copytuple(SPI_tuptable->vals[0]);
	heap_deform_tuple(tuple, SPI_tuptable->tupdesc, values, nulls);
	memcpy(row->values, values, sizeof(row->values));
	memcpy(row->nulls, nulls, sizeof(row->nulls));
	version->xmin = DatumGetTransactionId(values[Natts_keys]);
	ItemPointerCopy((ItemPointer) DatumGetPointer(values[Natts_keys + 1]), &version->tid);
	return true;
}

/* Write row: a new one (version NULL), else over the version read. */
static bool
key_write(const KeyRow *row, const KeyVersion *version)
{
	Datum		values[Natts_keys + 2];
	char		nulls[Natts_keys + 2];

	for (int i = 0; i < Natts_keys; i++)
	{
		values[i] = row->values[i];
		nulls[i] = row->nulls[i] ? 'n' : ' ';
	}
	if (version == NULL)
		return key_sql_run(KEY_INSERT, values, nulls) == 1;
	values[Natts_keys] = PointerGetDatum(&version->tid);
	values[Natts_keys + 1] = TransactionIdGetDatum(version->xmin);
	nulls[Natts_keys] = nulls[Natts_keys + 1] = ' ';
	return key_sql_run(KEY_UPDATE, values, nulls) == 1;
}

static bool
key_delete(text *scope, text *key, const KeyVersion *version)
{
	Datum		values[4] = {PointerGetDatum(scope), PointerGetDatum(key),
		PointerGetDatum(&version->tid), TransactionIdGetDatum(version->xmin)};

	return key_sql_run(KEY_DELETE, values, NULL) == 1;
}

/*
 * The key's advisory lock: the SQL edition's _lock_id('k', scope, key),
 * hashtextextended('k' || octet_length(scope) || ':' || scope || key, 7211),
 * as pg_advisory_xact_lock(bigint) tags it.
 */
static void
key_lock_tag(LOCKTAG *tag, text *scope, text *key)
{
	StringInfoData buf;
	uint64		hash;

	initStringInfo(&buf);
	appendStringInfo(&buf, "k%d:", (int) VARSIZE_ANY_EXHDR(scope));
	appendBinaryStringInfo(&buf, VARDATA_ANY(scope), VARSIZE_ANY_EXHDR(scope));
	appendBinaryStringInfo(&buf, VARDATA_ANY(key), VARSIZE_ANY_EXHDR(key));
	hash = hash_bytes_extended((const unsigned char *) buf.data, buf.len, 7211);
	pfree(buf.data);
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (hash >> 32), (uint32) hash, 1);
}

/* idem_claim_columns through SPI: see above. */
static void
claim_columns_spi(FunctionCallInfo fcinfo, text *scope, text *key,
				  text *fingerprint, Interval *ttl, Interval *lease,
				  Datum *values, bool *nulls)
{
	ClaimWait	wait;
	LOCKTAG		tag;
	IdemRunAs	run_as;

	claim_wait_start(&wait, fcinfo, IDEM_CLAIM_WAIT_ARGNO, scope, key);
	idem_require_writable("idem_claim()");
	key_lock_tag(&tag, scope, key);
	key_sql_begin(&run_as);

	for (;;)
	{
		KeyRow		row;
		KeyVersion	version;
		bool		found;
		bool		mine = false;
		ClaimDecision decision = CLAIM_RESET;
		TimestampTz now;

		CHECK_FOR_INTERRUPTS();
		found = key_read(scope, key, &row, &version);
		now = GetCurrentTimestamp();

		if (found)
		{
			mine = TransactionIdIsCurrentTransactionId(version.xmin);
			decision = decide_claim(&row, false, mine, fingerprint, now);
			if (decision == CLAIM_MISMATCH)
			{
				claim_columns(OUTCOME_MISMATCH, NULL, values, nulls);
				break;
			}
			if (decision == CLAIM_REPLAY)
			{
				claim_columns(OUTCOME_REPLAY, &row, values, nulls);
				break;
			}
			if (decision == CLAIM_IN_PROGRESS)
			{
				if (!mine &&
					claim_wait_sleep(&wait,
									 KEY_ISNULL(&row, Anum_keys_lease_expires_at) ? 0 :
									 DatumGetTimestampTz(KEY_VALUE(&row, Anum_keys_lease_expires_at))))
					continue;
				claim_columns(OUTCOME_IN_PROGRESS, &row, values, nulls);
				if (!holder_lease_known(&row, mine, now))
					nulls[RESULT_LEASE_EXPIRES_AT] = true;
				break;
			}
		}

		if (LockAcquire(&tag, ExclusiveLock, false, true) == LOCKACQUIRE_NOT_AVAIL)
		{
			/* another transaction is writing the key: its end wakes us */
			if (claim_wait_sleep(&wait, 0))
				continue;
			if (!found)
				claim_columns(OUTCOME_IN_PROGRESS, NULL, values, nulls);
			else
			{
				claim_columns(OUTCOME_IN_PROGRESS, &row, values, nulls);
				nulls[RESULT_LEASE_EXPIRES_AT] = true;
			}
			break;
		}

		if (!found)
		{
			memset(&row, 0, sizeof(row));
			KEY_SET(&row, Anum_keys_scope, PointerGetDatum(scope));
			KEY_SET(&row, Anum_keys_key, PointerGetDatum(key));
		}
		start_claim(&row, decision == CLAIM_TAKE_OVER, fingerprint, ttl, lease, now);
		if (key_write(&row, found ? &version : NULL))
		{
			if (decision == CLAIM_TAKE_OVER)
				idem_count(IDEM_COUNTER_TAKEOVERS, 1);
			claim_wait_key_changed(scope, key);
			claim_columns(OUTCOME_CLAIMED, &row, values, nulls);
			break;
		}
		/* the key changed since it was read: let the lock go, look again */
		LockRelease(&tag, ExclusiveLock, false);
	}

	key_sql_end(&run_as);
	claim_wait_end(&wait);
}

/* change_claim through SPI: see above. */
static void
change_claim_spi(const char *function_name, text *scope, text *key,
				 bool check_attempt, int32 attempt, ClaimChange change, void *arg)
{
	LOCKTAG		tag;
	IdemRunAs	run_as;
	bool		locked;

	idem_require_writable(function_name);
	key_lock_tag(&tag, scope, key);
	locked = LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
	key_sql_begin(&run_as);

	for (;;)
	{
		KeyRow		row;
		KeyVersion	version;
		bool		found;
		bool		written;

		CHECK_FOR_INTERRUPTS();
		found = key_read(scope, key, &row, &version);
		/* nothing committed, and the lock held: a claim in flight */
		if (!found && !locked)
			raise_claim_uncommitted(scope, key);
		check_claim(scope, key, found ? &row : NULL, check_attempt, attempt);
		if (!locked)
		{
			/* the holder is changing it: wait for its end, then look again */
			(void) LockAcquire(&tag, ExclusiveLock, false, false);
			locked = true;
			continue;
		}
		if (change(&row, arg))
			written = key_write(&row, &version);
		else
			written = key_delete(scope, key, &version);
		if (written)
		{
			claim_wait_key_changed(scope, key);
			break;
		}
		/* deleted since it was read (the purge): decide anew */
	}

	key_sql_end(&run_as);
}

static void
change_claim(const char *function_name, FunctionCallInfo fcinfo,
			 int attempt_argno, ClaimChange change, void *arg)
{
	text	   *scope = idem_arg_identifier(fcinfo, 0, "scope", 0);
	text	   *key = idem_arg_identifier(fcinfo, 1, "key", 1);
	bool		check_attempt = !PG_ARGISNULL(attempt_argno);
	int32		attempt = check_attempt ? PG_GETARG_INT32(attempt_argno) : 0;
	IdemRelation rel;

	if (idem_keys_spi)
	{
		change_claim_spi(function_name, scope, key, check_attempt, attempt, change, arg);
		return;
	}
	idem_require_writable(function_name);
	idem_relation_open(&rel, IDEM_TABLE_KEYS, RowExclusiveLock, scope, function_name);

	for (;;)
	{
		ProbeResult found;
		KeyRow		row;
		TM_Result	tm;

		CHECK_FOR_INTERRUPTS();
		find_claim(&rel, scope, key, check_attempt, attempt, &found, &row);
		if (change(&row, arg))
			tm = idem_update(&rel, &found.tid, row.values, row.nulls, true);
		else
			tm = idem_delete(&rel, &found.tid, true);

		if (tm == TM_Ok)
		{
			claim_wait_key_changed(scope, key);
			break;
		}
		if (tm != TM_Updated && tm != TM_Deleted)
			elog(ERROR, "unexpected result %d changing an idempotency key", (int) tm);
		/* changed by a transaction we waited for: find_claim decides anew */
	}

	idem_relation_close(&rel);
}

typedef struct Completion
{
	int32		status_code;
	text	   *body;
	Jsonb	   *headers;
	bool		released;
} Completion;

static bool
complete_row(KeyRow *row, void *arg)
{
	Completion *completion = (Completion *) arg;
	TimestampTz now;

	if (completion->released)
		return false;

	now = GetCurrentTimestamp();
	KEY_SET(row, Anum_keys_status_code, Int32GetDatum(completion->status_code));
	if (completion->body != NULL)
		KEY_SET(row, Anum_keys_body, PointerGetDatum(completion->body));
	else
		KEY_SET_NULL(row, Anum_keys_body);
	if (completion->headers != NULL)
		KEY_SET(row, Anum_keys_headers, JsonbPGetDatum(completion->headers));
	else
		KEY_SET_NULL(row, Anum_keys_headers);
	KEY_SET_NULL(row, Anum_keys_lease_expires_at);
	KEY_SET(row, Anum_keys_completed_at, TimestampTzGetDatum(now));
	KEY_SET(row, Anum_keys_expires_at,
			TimestampTzGetDatum(idem_timestamp_plus(now,
													DatumGetIntervalP(KEY_VALUE(row, Anum_keys_ttl)))));
	return true;
}

/*
 * A body to store must fit idempotency.max_response_bytes.  Measured before
 * it is detoasted, so that a body too large is refused without being read
 * whole; refused before anything is written.
 */
static void
check_body_size(Datum body)
{
	Size		size = toast_raw_datum_size(body) - VARHDRSZ;

	if (size > (Size) idem_max_response_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response body is too large to store"),
				 errdetail("It is %zu bytes long; the limit, idempotency.max_response_bytes, is %s.",
						   size, GetConfigOptionByName("idempotency.max_response_bytes", NULL, false)),
				 errhint("Release the key with idem_release and answer without storing, or raise the setting.")));
}

/*
 * idem_complete(scope, key, status_code, body, headers, attempt) -> text
 *
 * Final answers (those not in idempotency.release_statuses) are stored and
 * replayed from now on; transient ones release the key.
 */
Datum
idem_complete(PG_FUNCTION_ARGS)
{
	Completion	completion;

	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status_code must not be null")));
	completion.status_code = PG_GETARG_INT32(2);
	if (completion.status_code < 100 || completion.status_code > 599)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status_code %d is not an HTTP status code",
						completion.status_code),
				 errdetail("HTTP status codes are between 100 and 599.")));
	completion.released = idem_status_is_released(completion.status_code);
	/* a released answer is not stored: its body is not counted */
	if (!completion.released && !PG_ARGISNULL(3))
		check_body_size(PG_GETARG_DATUM(3));
	completion.body = idem_arg_text_or_null(fcinfo, 3);
	completion.headers = PG_ARGISNULL(4) ? NULL : PG_GETARG_JSONB_P(4);

	change_claim("idem_complete()", fcinfo, 5, complete_row, &completion);
	if (completion.released)
		idem_count(IDEM_COUNTER_RELEASED, 1);

	PG_RETURN_TEXT_P(cstring_to_text(completion.released ? "released" : "stored"));
}

static bool
release_row(KeyRow *row, void *arg)
{
	return false;
}

/*
 * idem_release(scope, key, attempt) -> boolean
 *
 * Drops an in-progress claim; true once it is gone.  A key that is not
 * claimed, or already completed, is an error (see find_claim).
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	change_claim("idem_release()", fcinfo, 2, release_row, NULL);
	idem_count(IDEM_COUNTER_RELEASED, 1);
	PG_RETURN_BOOL(true);
}

static bool
checkpoint_row(KeyRow *row, void *arg)
{
	text	   *recovery_point = (text *) arg;

	if (recovery_point != NULL)
		KEY_SET(row, Anum_keys_recovery_point, PointerGetDatum(recovery_point));
	else
		KEY_SET_NULL(row, Anum_keys_recovery_point);
	return true;
}

/*
 * idem_checkpoint(scope, key, recovery_point, attempt) -> void
 */
Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	change_claim("idem_checkpoint()", fcinfo, 3, checkpoint_row,
				 idem_arg_text_or_null(fcinfo, 2));
	PG_RETURN_VOID();
}

typedef struct LeaseExtension
{
	Interval   *lease;
	TimestampTz lease_expires_at;	/* out: the new one */
} LeaseExtension;

static bool
extend_lease_row(KeyRow *row, void *arg)
{
	LeaseExtension *extension = (LeaseExtension *) arg;

	extension->lease_expires_at = idem_timestamp_plus(GetCurrentTimestamp(),
													  extension->lease);
	KEY_SET(row, Anum_keys_lease_expires_at,
			TimestampTzGetDatum(extension->lease_expires_at));
	/* kept for a takeover until lease + ttl, as start_claim counts it */
	KEY_SET(row, Anum_keys_expires_at,
			TimestampTzGetDatum(idem_timestamp_plus(extension->lease_expires_at,
													DatumGetIntervalP(KEY_VALUE(row, Anum_keys_ttl)))));
	return true;
}

/*
 * idem_extend_lease(scope, key, attempt, lease) -> timestamptz
 *
 * The holder of a claim says it is still at work: its lease runs for lease
 * (idempotency.lease by default) from now, and the new lease_expires_at is
 * returned.  Fenced by attempt, which is required: a holder whose claim was
 * taken over gets 22I03 and changes nothing.  The errors are
 * idem_checkpoint's (see find_claim).
 */
Datum
idem_extend_lease(PG_FUNCTION_ARGS)
{
	LeaseExtension extension;

	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("attempt must not be null"),
				 errhint("Pass the attempt that idem_claim returned with \"claimed\".")));
	extension.lease = idem_arg_duration(fcinfo, 3, "lease", idem_lease_ms);
	change_claim("idem_extend_lease()", fcinfo, 2, extend_lease_row, &extension);
	PG_RETURN_TIMESTAMPTZ(extension.lease_expires_at);
}
