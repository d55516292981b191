/*
 * The schema migrations of sql/, compiled in by the Makefile so that
 * `outboxd migrate` needs no files at run time.
 */
#ifndef OUTBOXD_MIGRATIONS_H
#define OUTBOXD_MIGRATIONS_H

struct migration {
	const char *name;	/* file name, e.g. "001_outbox_tables.sql" */
	const char *sql;
	/* The index a migration builds with CREATE INDEX CONCURRENTLY, from
	 * its file's "-- outboxd: online index NAME" line; such a file holds
	 * that one statement, run outside a transaction.  NULL: the file
	 * runs in a transaction. */
	const char *online_index;
};

/* In file order; ends with { NULL, NULL }. */
extern const struct migration migrations[];

#endif
