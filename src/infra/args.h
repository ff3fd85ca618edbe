/*-------------------------------------------------------------------------
 *
 * args.h
 *	  The extension's own SQLSTATEs, and the checks that SQL-callable
 *	  functions make of their arguments (args.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_ARGS_H
#define IDEMPOTENCY_ARGS_H

#include "fmgr.h"
#include "datatype/timestamp.h"

/*
 * Our own SQLSTATEs, in class 22 (data exception) with subclasses starting
 * with "I", a range the SQL standard leaves to implementations.  Drivers that
 * map errors by class (psycopg's DataError, for one) still classify them.
 */
#define ERRCODE_IDEM_KEY_NOT_CLAIMED	MAKE_SQLSTATE('2','2','I','0','1')
#define ERRCODE_IDEM_KEY_COMPLETED		MAKE_SQLSTATE('2','2','I','0','2')
#define ERRCODE_IDEM_STALE_ATTEMPT		MAKE_SQLSTATE('2','2','I','0','3')

/* The longest key, scope, consumer or event id, in bytes. */
#define IDEM_MAX_IDENTIFIER_BYTES	255

extern text *idem_arg_identifier(FunctionCallInfo fcinfo, int argno,
								 const char *name, int min_bytes);
extern void idem_check_identifier(const text *value, int min_bytes,
								  const char *name, const int *subscript);
extern text *idem_arg_text_or_null(FunctionCallInfo fcinfo, int argno);
extern Interval *idem_arg_duration(FunctionCallInfo fcinfo, int argno,
								   const char *name, int64 default_ms);
extern void idem_require_writable(const char *function_name);

extern TimestampTz idem_timestamp_plus(TimestampTz t, const Interval *span);

#endif							/* IDEMPOTENCY_ARGS_H */
