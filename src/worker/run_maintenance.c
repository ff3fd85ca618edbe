/*-------------------------------------------------------------------------
 *
 * run_maintenance.c
 *	  idem_run_maintenance(): one batch of each kind of the background
 *	  worker's work, in the caller's transaction, for setups without the
 *	  worker (pg_cron, or any scheduler).
 *
 * Each batch runs in the caller's transaction: the worker gives every batch
 * a transaction of its own, so that no batch holds its row locks for long,
 * while idem_run_maintenance() runs one batch of each kind in the caller's.
 *
 * Owns: nothing but the SQL function.
 * May call: worker/purge.h, outbox/publish.h, infra/ (the cursor, argument
 *	  checks).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "miscadmin.h"

#include "infra/maintenance.h"
#include "outbox/publish.h"
#include "worker/purge.h"
#include "infra/args.h"
#include "infra/guc.h"

PG_FUNCTION_INFO_V1(idem_run_maintenance);

/*
 * idem_run_maintenance() -> (purged_keys, purged_events, purged_outbox,
 *							   published, publish_failures)
 *
 * One batch of each kind of the worker's work, in the caller's transaction:
 * for setups where shared_preload_libraries cannot be set, called by pg_cron
 * or any scheduler.
 */
Datum
idem_run_maintenance(PG_FUNCTION_ARGS)
{
	MaintenanceCursor cursor;
	MaintenanceCounts counts;
	TupleDesc	desc;
	Datum		values[5];
	bool		nulls[5] = {false};

	idem_require_writable("idem_run_maintenance()");
	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "idem_run_maintenance must return a composite type");

	memset(&counts, 0, sizeof(counts));
	maintenance_cursor_init(&cursor);
	for (int unit = 0; unit < NUM_MAINTENANCE_UNITS; unit++)
	{
		if (unit == UNIT_PUBLISH)
			publish_fast_then_carefully(&cursor, &counts);
		else
		{
			/* a batch stops after a bounded stretch of the table: go on */
			while (purge_batch((MaintenanceUnit) unit, &cursor, &counts) &&
				   cursor.purged_in_pass[unit] < (uint64) idem_purge_batch_size)
				CHECK_FOR_INTERRUPTS();
		}
	}

	values[0] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_KEYS]);
	values[1] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_EVENTS]);
	values[2] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_OUTBOX]);
	values[3] = Int64GetDatum((int64) counts.published);
	values[4] = Int64GetDatum((int64) counts.publish_failures);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(desc), values, nulls)));
}
