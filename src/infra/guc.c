/*-------------------------------------------------------------------------
 *
 * guc.c
 *	  The extension's settings: definitions, defaults, and the parser that
 *	  turns idempotency.release_statuses into a lookup table.
 *
 * Every setting lives under the prefix "idempotency.", which is reserved so
 * that a misspelt name is reported instead of silently accepted.
 *
 * Owns: every idempotency.* setting.  To add one: its variable here and
 *	  in guc.h, its DefineCustom*Variable in idem_define_gucs, a row in
 *	  doc/reference.md's settings table.
 * May call: compat.h only.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <limits.h>

#include "miscadmin.h"
#include "utils/guc.h"
#include "utils/memutils.h"

#include "compat.h"
#include "infra/guc.h"

#define FIRST_STATUS	100
#define LAST_STATUS		599

int			idem_key_ttl_s = 24 * 60 * 60;
int			idem_lease_ms = 60 * 1000;
int			idem_event_retention_s = 14 * 24 * 60 * 60;
int			idem_outbox_backoff_min_ms = 1000;
int			idem_outbox_backoff_max_ms = 5 * 60 * 1000;
int			idem_outbox_max_attempts = 10;
int			idem_outbox_retention_s = 0;
int			idem_notify_truncated_retention_s = 60 * 60;
int			idem_naptime_ms = 1000;
int			idem_purge_interval_ms = 10000;
int			idem_purge_batch_size = 5000;
int			idem_purge_busy_share = 10;
int			idem_publish_batch_size = 100;
char	   *idem_databases = NULL;
int			idem_max_databases = 32;
int			idem_wait_slots = -1;
int			idem_max_response_bytes = 1024 * 1024;
int			idem_max_wait_ms = 60 * 1000;
bool		idem_keys_spi = false;

static char *release_statuses_string = NULL;

/*
 * The parsed form of idempotency.release_statuses: released[s] is true when
 * status s is transient.  Built by the check hook (as GUC "extra" data, so
 * that a bad value is rejected before anything changes) and installed by the
 * assign hook.
 */
typedef struct ReleaseSet
{
	bool		released[LAST_STATUS + 1];
} ReleaseSet;

static const ReleaseSet *release_set = NULL;

/*
 * Read one status code at *p, advancing it; false if there is none or it is
 * outside 100..599.
 */
static bool
parse_status(const char **p, int *status)
{
	long		value = 0;
	int			digits = 0;

	while (isdigit((unsigned char) **p) && digits < 4)
	{
		value = value * 10 + (**p - '0');
		(*p)++;
		digits++;
	}
	if (digits == 0 || isdigit((unsigned char) **p) ||
		value < FIRST_STATUS || value > LAST_STATUS)
		return false;
	*status = (int) value;
	return true;
}

static void
skip_spaces(const char **p)
{
	while (isspace((unsigned char) **p))
		(*p)++;
}

/*
 * Check hook: parse a list such as "408,425,429,500-599".  Items are status
 * codes or inclusive ranges, separated by commas; white space is allowed
 * around them; an empty list releases nothing.
 */
static bool
check_release_statuses(char **newval, void **extra, GucSource source)
{
	ReleaseSet	set;
	const char *p = *newval;
	ReleaseSet *result;

	memset(&set, 0, sizeof(set));

	skip_spaces(&p);
	while (*p != '\0')
	{
		const char *item = p;
		int			first;
		int			last;

		if (!parse_status(&p, &first))
		{
			GUC_check_errdetail("\"%.*s\" is not an HTTP status code between %d and %d.",
								(int) strcspn(item, ","), item,
								FIRST_STATUS, LAST_STATUS);
			return false;
		}
		last = first;
		skip_spaces(&p);
		if (*p == '-')
		{
			p++;
			skip_spaces(&p);
			if (!parse_status(&p, &last) || last < first)
			{
				GUC_check_errdetail("\"%.*s\" is not a range of HTTP status codes between %d and %d.",
									(int) strcspn(item, ","), item,
									FIRST_STATUS, LAST_STATUS);
				return false;
			}
			skip_spaces(&p);
		}
		for (int status = first; status <= last; status++)
			set.released[status] = true;

		if (*p == ',')
		{
			p++;
			skip_spaces(&p);
			if (*p == '\0')
			{
				GUC_check_errdetail("The list ends with a comma.");
				return false;
			}
		}
		else if (*p != '\0')
		{
			GUC_check_errdetail("Expected a comma after \"%.*s\".",
								(int) (p - item), item);
			return false;
		}
	}

	/* the GUC code frees "extra" data with its own allocator's free */
	result = (ReleaseSet *) compat_guc_extra_alloc(sizeof(ReleaseSet));
	if (result == NULL)
	{
		GUC_check_errcode(ERRCODE_OUT_OF_MEMORY);
		return false;
	}
	memcpy(result, &set, sizeof(ReleaseSet));
	*extra = result;
	return true;
}

static void
assign_release_statuses(const char *newval, void *extra)
{
	release_set = (const ReleaseSet *) extra;
}

bool
idem_status_is_released(int status_code)
{
	Assert(status_code >= FIRST_STATUS && status_code <= LAST_STATUS);
	return release_set != NULL && release_set->released[status_code];
}

Interval *
idem_interval_from_ms(int64 ms)
{
	Interval   *result = (Interval *) palloc0(sizeof(Interval));

	result->time = ms * INT64CONST(1000);
	return result;
}

void
idem_define_gucs(void)
{
	/* temporary: issue 29 item 2's measurement of the keys' SPI path */
	DefineCustomBoolVariable("idempotency.keys_spi",
							 "Runs the key functions through SPI rather than the direct path.",
							 "Temporary, for make bench's direct-vs-SPI pairs.",
							 &idem_keys_spi,
							 false,
							 PGC_USERSET,
							 GUC_NO_SHOW_ALL | GUC_NOT_IN_SAMPLE,
							 NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.key_ttl",
							"How long a completed response is kept.",
							"Counted from completion.  Used when idem_claim is "
							"called without a ttl.  An expired key is claimable "
							"again at once, before the background worker purges it.",
							&idem_key_ttl_s,
							24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.lease",
							"How long a committed in-progress claim is protected.",
							"Used when idem_claim is called without a lease.  "
							"When it runs out before idem_complete or idem_release, "
							"the next claim takes the key over with attempt + 1.",
							&idem_lease_ms,
							60 * 1000, 1, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	/*
	 * A stored body stays in the keys table until its key expires (a day by
	 * default) and is sent again on every replay: one client storing
	 * downloads would bloat the table and every replay's memory.  1MB is
	 * far above a JSON API's answer; the largest a text can be (1GB) lifts
	 * the cap.  PGC_SUSET: the cap protects the server from the application,
	 * so the application's role cannot raise it by itself (ALTER ROLE ... SET
	 * by a superuser, or GRANT SET ON PARAMETER, can).
	 */
	DefineCustomIntVariable("idempotency.max_response_bytes",
							"Largest response body that idem_complete stores.",
							"Counted in bytes of the body as text.  A larger body "
							"to store is refused with SQLSTATE 54000, and nothing "
							"is written; a body that idem_complete releases "
							"(idempotency.release_statuses) is not stored and not "
							"counted.  Range: 1 byte to 1GB.",
							&idem_max_response_bytes,
							1024 * 1024, 1, MaxAllocSize,
							PGC_SUSET,
							GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	/*
	 * A claim that waits keeps its connection busy, and in the one-transaction
	 * mode its transaction open: a pool of a few connections is exhausted by
	 * a few waiters.  A minute, the default lease, is the most a wait needs
	 * by default: a wait ends when the holder's lease runs out anyway, and
	 * HTTP clients and proxies give up on a request after about as long.
	 * PGC_SUSET for the same reason as max_response_bytes.
	 */
	DefineCustomIntVariable("idempotency.max_wait",
							"Longest wait that idem_claim accepts.",
							"A larger wait argument is refused with SQLSTATE 22023.  "
							"Range: 0 (no waiting at all) to 2147483647 ms (24 days).",
							&idem_max_wait_ms,
							60 * 1000, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idempotency.release_statuses",
							   "HTTP status codes that idem_complete releases instead of storing.",
							   "A comma-separated list of codes and inclusive ranges "
							   "between 100 and 599, such as \"408,425,429,500-599\".  "
							   "A released key can be claimed again, so a retry runs "
							   "the operation again.",
							   &release_statuses_string,
							   "408,425,429,500-599",
							   PGC_USERSET,
							   GUC_LIST_INPUT,
							   check_release_statuses,
							   assign_release_statuses,
							   NULL);

	DefineCustomIntVariable("idempotency.event_retention",
							"How long a processed event is remembered.",
							"Used when idem_mark_processed is called without a "
							"retention.  Make it longer than the broker keeps "
							"messages, plus a buffer: a redelivery after it is "
							"processed again.",
							&idem_event_retention_s,
							14 * 24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.outbox_backoff_min",
							"Shortest wait before an outbox row that failed is tried again.",
							"Retries back off exponentially from here, with jitter, "
							"up to idempotency.outbox_backoff_max.",
							&idem_outbox_backoff_min_ms,
							1000, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.outbox_backoff_max",
							"Longest wait before an outbox row that failed is tried again.",
							"When set below idempotency.outbox_backoff_min, the "
							"minimum is used.",
							&idem_outbox_backoff_max_ms,
							5 * 60 * 1000, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.outbox_max_attempts",
							"Failed tries after which an outbox row is dead.",
							"Failed tries are nacks, leases run out and failed "
							"publications (the outbox's failures column; from 1.2, "
							"hand-outs alone do not count).  A dead row keeps holding "
							"back the later rows of its key until idem_outbox_requeue "
							"or idem_outbox_discard.",
							&idem_outbox_max_attempts,
							10, 1, INT_MAX,
							PGC_SUSET,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.outbox_retention",
							"How long a published outbox row is kept.",
							"0 deletes a row as soon as it is published or acknowledged.",
							&idem_outbox_retention_s,
							0, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.notify_truncated_retention",
							"How long an outbox row whose NOTIFY payload was "
							"truncated is kept after it is published.",
							"A row routed to notify whose JSON is 8000 bytes or "
							"more goes out as a reference, {\"id\": ..., "
							"\"truncated\": true, \"read\": ...}, and the listener "
							"reads the row itself, by id.  Such a row is kept at "
							"least this long after it is published, whatever "
							"idempotency.outbox_retention says (the longer of the "
							"two applies).  0 keeps it only as long as "
							"idempotency.outbox_retention keeps the other rows.",
							&idem_notify_truncated_retention_s,
							60 * 60, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.naptime",
							"How long the background worker sleeps between rounds.",
							"A commit that enqueued an outbox row wakes the worker "
							"at once; otherwise it runs a round this often.",
							&idem_naptime_ms,
							1000, 10, 24 * 60 * 60 * 1000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_interval",
							"How often the background worker purges.",
							"Each purge walks the keys and processed_events tables "
							"from end to end (they have no index on their expiry, "
							"so that completing a key stays a HOT update), so it "
							"runs at most this often, however often the worker "
							"wakes to publish.",
							&idem_purge_interval_ms,
							10000, 10, 24 * 60 * 60 * 1000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_batch_size",
							"Rows the background worker purges per transaction.",
							"Expired keys, processed events past retention and "
							"published outbox rows are deleted in batches of at "
							"most this many rows, each batch in a transaction of "
							"its own, so that no lock is held for long.",
							&idem_purge_batch_size,
							5000, 1, 1000000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.purge_busy_share",
							"Percentage of the time the background worker may "
							"spend purging while other sessions write.",
							"A purge writes WAL that other sessions' commits must "
							"wait behind.  While other sessions write, the worker "
							"rests between purge batches so that purging takes at "
							"most this share of the time, and leaves the vacuum "
							"after a purge for a quiet moment; 100 never rests.",
							&idem_purge_busy_share,
							10, 1, 100,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.publish_batch_size",
							"Outbox rows the background worker publishes per transaction.",
							"A batch publishes its rows in one transaction; if one "
							"of them fails, the rows are tried again one "
							"subtransaction each, at most 32 per transaction.",
							&idem_publish_batch_size,
							100, 1, 10000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomStringVariable("idempotency.databases",
							   "Databases the background worker serves (empty: all).",
							   "A comma-separated list of database names.  Empty "
							   "means every database where the extension is installed.",
							   &idem_databases,
							   "",
							   PGC_SIGHUP,
							   GUC_LIST_INPUT,
							   NULL, NULL, NULL);

	/*
	 * Sizes shared memory, so it exists only when the library is preloaded:
	 * a PGC_POSTMASTER setting cannot be defined after startup.
	 */
	if (process_shared_preload_libraries_in_progress)
	{
		DefineCustomIntVariable("idempotency.max_databases",
								"Databases the background workers can serve at once.",
								"Each served database takes one background worker "
								"process, out of max_worker_processes, besides the "
								"launcher's own.  Also the number of databases whose "
								"counters idempotency.stats can keep.",
								&idem_max_databases,
								32, 1, 1024,
								PGC_POSTMASTER,
								0,
								NULL, NULL, NULL);

		DefineCustomIntVariable("idempotency.wait_slots",
								"Keys that idem_claim's waiters can wait for at once "
								"with an immediate wake-up (-1: twice max_connections "
								"and the other backends).",
								"A claim that waits for a key takes a slot in shared "
								"memory, shared with the others that wait for the same "
								"key, and is woken by the holder's commit or rollback.  "
								"When its share of the slots is taken, it looks at the "
								"key every 10 ms instead; 0 makes every wait do that.",
								&idem_wait_slots,
								-1, -1, 1000000,
								PGC_POSTMASTER,
								0,
								NULL, NULL, NULL);
	}

	MarkGUCPrefixReserved("idempotency");
}
