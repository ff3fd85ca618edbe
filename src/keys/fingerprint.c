/*-------------------------------------------------------------------------
 *
 * fingerprint.c
 *	  idem_fingerprint: the hex SHA-256 of a request, for idem_claim.
 *
 * For jsonb, what is hashed is the value's canonical text, jsonb's own
 * output: object keys sorted and unique (the last of duplicates wins), one
 * space after each colon and comma, numbers as numeric prints them (so 1 and
 * 1.0 differ, 1e2 and 100 do not).  Two requests that differ only in key
 * order, duplicate keys or white space therefore have equal fingerprints.
 * For text and bytea, the bytes as given.
 *
 * Owns: idem_fingerprint.
 * May call: the server only.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/jsonb.h"

PG_FUNCTION_INFO_V1(idem_fingerprint_jsonb);
PG_FUNCTION_INFO_V1(idem_fingerprint_bytes);

#define SHA256_BYTES 32

/*
 * Hash a varlena's bytes with the server's own sha256() (available in every
 * supported version, OpenSSL or not) and return them as 64 hex digits.
 */
static text *
sha256_hex(Datum bytes)
{
	bytea	   *digest = DatumGetByteaPP(DirectFunctionCall1(sha256_bytea, bytes));
	text	   *result = (text *) palloc(VARHDRSZ + SHA256_BYTES * 2);

	Assert(VARSIZE_ANY_EXHDR(digest) == SHA256_BYTES);
	hex_encode(VARDATA_ANY(digest), SHA256_BYTES, VARDATA(result));
	SET_VARSIZE(result, VARHDRSZ + SHA256_BYTES * 2);
	return result;
}

Datum
idem_fingerprint_jsonb(PG_FUNCTION_ARGS)
{
	Jsonb	   *request = PG_GETARG_JSONB_P(0);
	StringInfoData canonical;

	initStringInfo(&canonical);
	JsonbToCString(&canonical, &request->root, VARSIZE(request));
	PG_RETURN_TEXT_P(sha256_hex(PointerGetDatum(cstring_to_text_with_len(canonical.data,
																		 canonical.len))));
}

/* text and bytea share this: both are varlenas of bytes */
Datum
idem_fingerprint_bytes(PG_FUNCTION_ARGS)
{
	PG_RETURN_TEXT_P(sha256_hex(PG_GETARG_DATUM(0)));
}
