/*-------------------------------------------------------------------------
 *
 * tables.h
 *	  Finding and writing rows of the extension's tables without the
 *	  executor: one index probe per lookup, no planner, no SPI.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_TABLES_H
#define IDEMPOTENCY_TABLES_H

#include "access/htup.h"
#include "access/tableam.h"
#include "datatype/timestamp.h"
#include "nodes/execnodes.h"
#include "storage/lockdefs.h"
#include "utils/relcache.h"

#include "tables/table_check.h"

/* The tables the C code reads and writes directly. */
typedef enum IdemTable
{
	IDEM_TABLE_KEYS,
	IDEM_TABLE_EVENTS,
	IDEM_TABLE_OUTBOX,
	IDEM_NUM_TABLES
} IdemTable;

/* Column numbers of idempotency.keys, in the order the script creates them. */
typedef enum KeysColumn
{
	Anum_keys_scope = 1,
	Anum_keys_key,
	Anum_keys_fingerprint,
	Anum_keys_attempt,
	Anum_keys_recovery_point,
	Anum_keys_lease_expires_at,
	Anum_keys_status_code,
	Anum_keys_body,
	Anum_keys_headers,
	Anum_keys_ttl,
	Anum_keys_created_at,
	Anum_keys_completed_at,
	Anum_keys_expires_at,
	Natts_keys = Anum_keys_expires_at
} KeysColumn;

/* Column numbers of idempotency.processed_events. */
typedef enum EventsColumn
{
	Anum_events_consumer = 1,
	Anum_events_event_id,
	Anum_events_processed_at,
	Anum_events_expires_at,
	Natts_events = Anum_events_expires_at
} EventsColumn;

/*
 * Column numbers of idempotency.outbox.  failures came with 1.2: a database
 * still at 1.1 has the first Natts_outbox_1_1 columns only (see
 * OutboxSchema in outbox_sql.h).
 */
typedef enum OutboxColumn
{
	Anum_outbox_id = 1,
	Anum_outbox_topic,
	Anum_outbox_key,
	Anum_outbox_payload,
	Anum_outbox_headers,
	Anum_outbox_created_at,
	Anum_outbox_state,
	Anum_outbox_attempts,
	Anum_outbox_available_at,
	Anum_outbox_last_error,
	Anum_outbox_published_at,
	Anum_outbox_failures,
	Natts_outbox = Anum_outbox_failures,
	Natts_outbox_1_1 = Anum_outbox_published_at
} OutboxColumn;

/* An open table with its primary key (and, once needed, all its indexes). */
typedef struct IdemRelation
{
	IdemTable	table;
	Relation	heap;
	Relation	pkey;
	LOCKMODE	lockmode;
	/*
	 * The context the relation was opened in, which what is built later for
	 * it (below) lives in too, so that a caller may reset a shorter-lived one
	 * between rows.
	 */
	MemoryContext mcxt;
	/* opened by the first write */
	int			nindexes;
	Relation   *indexes;
	IndexInfo **index_info;
	/* the predicates of partial indexes, once one needs checking */
	EState	   *estate;
	ExprState **predicates;

	/*
	 * Between idem_batch_begin and idem_batch_end, the insertions of one
	 * call's batch share one slot and one speculative insertion token, held
	 * from the first insertion to the end, and one CommandCounterIncrement at
	 * the end (see idem_insert_unique).
	 */
	bool		in_batch;
	TupleTableSlot *batch_slot;
	TransactionId batch_xid;	/* the token's, once taken */
	uint32		batch_token;	/* 0 until the batch's first insertion */
	bool		batch_wrote;
} IdemRelation;

/*
 * What a probe of the primary key found, under a dirty snapshot: rows
 * committed or written by this transaction ("settled"), and rows that another
 * transaction is inserting right now.
 */
typedef enum ProbeOutcome
{
	PROBE_ABSENT,				/* no live row and no insertion in flight */
	PROBE_INSERTING,			/* only a row another transaction is inserting */
	PROBE_FOUND					/* a settled row: see tuple */
} ProbeOutcome;

typedef struct ProbeResult
{
	ProbeOutcome outcome;
	/* PROBE_FOUND: a copy of the row, and where it is */
	HeapTuple	tuple;
	ItemPointerData tid;
	/* PROBE_FOUND: another transaction is updating or deleting it */
	bool		being_modified;
	TransactionId modifying_xid;
	/* PROBE_FOUND: this transaction wrote this version */
	bool		written_by_us;
	/* PROBE_INSERTING: the inserter, and its speculative token if any */
	TransactionId inserting_xid;
	uint32		speculative_token;
} ProbeResult;

extern Relation idem_outbox_open(LOCKMODE lockmode);
extern Oid	idem_outbox_owner(int *natts);
extern Oid	idem_table_owner(IdemTable table, text *value, LOCKMODE lockmode,
							 const char *function_name, Oid *shard);
extern const ExpectedTable *idem_table_def(IdemTable table);
extern bool idem_table_distributed(IdemTable table);
extern Oid	idem_table_shard_for(IdemTable table, text *value, LOCKMODE lockmode,
								 const char *function_name);
extern List *idem_table_parts(IdemTable table);
extern Relation idem_table_part_open(IdemTable table, Oid relid,
									 LOCKMODE lockmode);
extern void idem_relation_open(IdemRelation *rel, IdemTable table,
							   LOCKMODE lockmode, text *value,
							   const char *function_name);
extern void idem_relation_close(IdemRelation *rel);

extern void idem_probe(IdemRelation *rel, const Datum *pkey_values,
					   ProbeResult *result);
extern bool idem_row_visible_to_snapshot(IdemRelation *rel,
										 const ProbeResult *found);

extern void idem_batch_begin(IdemRelation *rel);
extern void idem_batch_end(IdemRelation *rel);
extern bool idem_insert_unique(IdemRelation *rel, Datum *values, bool *nulls);
extern int64 idem_outbox_next_id(int64 floor);
extern int64 idem_outbox_last_id(Relation heap, text *topic);
extern TM_Result idem_update(IdemRelation *rel, ItemPointer tid,
							 Datum *values, bool *nulls, bool wait);
extern TM_Result idem_delete(IdemRelation *rel, ItemPointer tid, bool wait);

#endif							/* IDEMPOTENCY_TABLES_H */
