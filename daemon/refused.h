/*
 * Refused rows: rows whose every mark the database refuses (a trigger
 * that raises for them, a constraint they break; see store_finish).
 * Such a row stays due, untouched, and the next claim would take it
 * first again, the oldest due row, to meet the same refusal.  Pacing the
 * relay for it held back every other row of a backlog (one batch per
 * reconnect.max); instead the row alone is left out of the claims until
 * its next try, which backs off as a reconnect does.
 *
 * One table serves every relay of the process (any of them may claim
 * the row next); every function is thread-safe.
 */
#ifndef OUTBOXD_REFUSED_H
#define OUTBOXD_REFUSED_H

#include <stddef.h>
#include <stdint.h>

/* A row whose try is this long past without a new refusal is forgotten:
 * no claim met it again (another instance marked it, someone deleted
 * it), or its mark went through on a relay that did not say. */
#define REFUSED_FORGET_MS (2 * 60 * 1000)

struct refused;

/* A table of at most cap rows; when it is full, a new row takes the
 * place of the one whose try is due first. */
struct refused *refused_new(size_t cap);
void refused_free(struct refused *);

/* What refused_hold() found. */
enum refused_entry {
	REFUSED_AGAIN,		/* id was in the table: refused again */
	REFUSED_NEW,		/* id is new to the table */
	REFUSED_EVICTED,	/* new, and the table was full: another row
				 * made room, and comes back at once */
};

/* id's marks were refused (again): it is left out of claims for the
 * next wait, init_ms at first and twice as long each time after, at
 * most max_ms.  Returns that wait; *entry says what the table held. */
int64_t refused_hold(struct refused *, int64_t id, int64_t init_ms,
    int64_t max_ms, int64_t now_ms, enum refused_entry *entry);
/* id was marked: forgotten.  Cheap while the table is empty. */
void refused_clear(struct refused *, int64_t id);
/* Writes the ids to leave out of a claim at now_ms (at most cap) to ids;
 * returns how many. */
size_t refused_held(struct refused *, int64_t now_ms, int64_t *ids,
    size_t cap);
/* Writes the ids whose hold ended by before_ms (at most cap) to ids:
 * rows a claim at before_ms could take.  Returns how many. */
size_t refused_ended(struct refused *, int64_t before_ms, int64_t *ids,
    size_t cap);
/* How long until the first hold ends (at least 1 ms), or 0 when no row
 * is held at now_ms: a row held back is due, yet no claim takes it. */
int64_t refused_wait_ms(struct refused *, int64_t now_ms);
/* Rows in the table, held or waiting to be tried again. */
size_t refused_count(const struct refused *);

#endif
