/*-------------------------------------------------------------------------
 *
 * args.c
 *	  The checks that the SQL-callable functions make of their arguments,
 *	  and of the transaction they are called in, before they touch a table.
 *
 * Owns: what a valid identifier and duration are, and the errors (with
 *	  their SQLSTATEs, declared in args.h) a bad one gets.
 * May call: the settings (infra/guc.h) only.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "infra/args.h"
#include "infra/guc.h"

/* An argument's name, or an element's: only built for a message. */
static const char *
identifier_name(const char *name, const int *subscript)
{
	return subscript == NULL ? name : psprintf("%s[%d]", name, *subscript);
}

/*
 * A key, scope, consumer or event id: not NULL, min_bytes to 255 bytes.
 * Lengths are in bytes, not characters, so that the limit holds in every
 * encoding.
 */
text *
idem_arg_identifier(FunctionCallInfo fcinfo, int argno, const char *name,
					int min_bytes)
{
	text	   *value = PG_ARGISNULL(argno) ? NULL : PG_GETARG_TEXT_PP(argno);

	idem_check_identifier(value, min_bytes, name, NULL);
	return value;
}

/*
 * The same checks of a value that is NULL or not, an argument's or, when
 * subscript is given, an element's of an array argument, which messages
 * call by its subscript ("event_ids[3]").
 */
void
idem_check_identifier(const text *value, int min_bytes, const char *name,
					  const int *subscript)
{
	int			len;

	if (value == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", identifier_name(name, subscript))));

	len = VARSIZE_ANY_EXHDR(value);
	if (len < min_bytes)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", identifier_name(name, subscript))));
	if (len > IDEM_MAX_IDENTIFIER_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("%s is too long", identifier_name(name, subscript)),
				 errdetail("It is %d bytes long; the limit is %d bytes.",
						   len, IDEM_MAX_IDENTIFIER_BYTES)));
}

text *
idem_arg_text_or_null(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? NULL : PG_GETARG_TEXT_PP(argno);
}

TimestampTz
idem_timestamp_plus(TimestampTz t, const Interval *span)
{
	return DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												   TimestampTzGetDatum(t),
												   IntervalPGetDatum(span)));
}

/*
 * A ttl, lease or retention: NULL means the setting's default; otherwise it
 * must be positive, that is, move "now" forward.  Months and days count as
 * calendar months and days, as in timestamptz + interval.
 */
Interval *
idem_arg_duration(FunctionCallInfo fcinfo, int argno, const char *name,
				  int64 default_ms)
{
	Interval   *span;
	TimestampTz now;

	if (PG_ARGISNULL(argno))
		return idem_interval_from_ms(default_ms);

	span = PG_GETARG_INTERVAL_P(argno);
	now = GetCurrentTransactionStartTimestamp();
	if (idem_timestamp_plus(now, span) <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name),
				 errdetail("The value given was \"%s\".",
						   DatumGetCString(DirectFunctionCall1(interval_out,
															   IntervalPGetDatum(span))))));
	return span;
}

/*
 * The functions that write check this first, so that a read-only transaction
 * or a hot standby gets the usual clear error rather than a failure deep
 * inside the table access code.
 */
void
idem_require_writable(const char *function_name)
{
	/* made PARALLEL SAFE by hand, a call could land in a parallel worker */
	if (IsInParallelMode())
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TRANSACTION_STATE),
				 errmsg("%s cannot run during a parallel operation", function_name),
				 errhint("The extension's functions are PARALLEL UNSAFE: restore that with ALTER FUNCTION ... PARALLEL UNSAFE.")));
	PreventCommandIfReadOnly(function_name);
	PreventCommandDuringRecovery(function_name);
}
