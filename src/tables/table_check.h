/*-------------------------------------------------------------------------
 *
 * table_check.h
 *	  What the direct path requires of the extension's tables, and the check
 *	  that refuses a table which no longer meets it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_TABLE_CHECK_H
#define IDEMPOTENCY_TABLE_CHECK_H

#include "utils/relcache.h"

/*
 * What the C code expects of each column: its name and type; whether it is
 * NOT NULL (the C code fills exactly those; a NOT NULL added by hand would
 * go unenforced); and, for text, whether it compares byte by byte (COLLATE
 * "C", which the primary key and the probes' equality rely on).
 */
typedef struct ExpectedColumn
{
	const char *name;
	Oid			type;
	bool		not_null;
	bool		c_collated;
} ExpectedColumn;

/*
 * What the C code expects of each table.  The primary key is pkey_columns,
 * in that order, compared with pkey_eq; checks are the names of the CHECK
 * constraints the script creates, which the C code enforces itself.
 */
typedef struct ExpectedTable
{
	const char *name;
	int			ncolumns;
	const ExpectedColumn *columns;
	int			npkey;
	const AttrNumber *pkey_columns;
	const Oid  *pkey_eq;
	const char *const *checks;	/* NULL-terminated */
	AttrNumber	expires_column; /* rows past this instant are purged */
	int			noptional;		/* the last columns, which a database at an
								 * earlier version lacks */
	const AttrNumber *pkey_columns_before;	/* or NULL: the same columns in
											 * the order of a database at an
											 * earlier version, also accepted
											 * (a table never probed) */
} ExpectedTable;

extern void idem_check_table(Relation heap, const ExpectedTable *def);
extern Oid	idem_primary_key_index(Relation heap);

#endif							/* IDEMPOTENCY_TABLE_CHECK_H */
