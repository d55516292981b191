/*
 * The schema migrations of sql/, compiled in by the Makefile so that
 * `outboxd migrate` needs no files at run time.
 */
#ifndef OUTBOXD_MIGRATIONS_H
#define OUTBOXD_MIGRATIONS_H

struct migration {
	const char *name;	/* file name, e.g. "001_outbox_tables.sql" */
	const char *sql;
};

/* In file order; ends with { NULL, NULL }. */
extern const struct migration migrations[];

#endif
