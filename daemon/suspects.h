/*
 * Suspects: rows whose messages were at the broker, unconfirmed, when
 * its connection was lost.  A lost connection says nothing about the
 * rows in flight, so it counts no attempt (RELIABILITY.md); but a
 * message that breaks every connection by itself (too large for the
 * confirm timeout, a body a middlebox cuts) would then be sent again
 * without end, and the rest of its batch with it.  The relay sends a
 * suspect apart from the others: after one loss with the rest of the
 * suspects, after two alone, and a loss with a message alone in flight
 * counts an attempt for it.
 *
 * One table serves every relay of the process (rows move between their
 * claims); every function is thread-safe.
 */
#ifndef OUTBOXD_SUSPECTS_H
#define OUTBOXD_SUSPECTS_H

#include <stddef.h>
#include <stdint.h>

/* What a row's level means to the relay. */
enum suspect_level {
	SUSPECT_NONE = 0,	/* sent with its batch */
	SUSPECT_GROUP = 1,	/* lost once: sent after the batch, with the
				 * other suspects */
	SUSPECT_ALONE = 2,	/* lost again: sent alone */
};

/* A suspect whose last loss is older than this is forgotten: the
 * connections that carried it since went through (another relay or
 * instance delivered it), or what broke them is long over. */
#define SUSPECT_FORGET_MS (15 * 60 * 1000)

struct suspects;

/* A table of at most cap rows; when it is full, the row lost longest
 * ago makes room. */
struct suspects *suspects_new(size_t cap);
void suspects_free(struct suspects *);

/* Whether any row is a suspect: one atomic read, so that a batch with
 * none pays nothing more. */
int suspects_any(const struct suspects *);
/* id's level (0 when it is not a suspect, or is forgotten by now_ms). */
enum suspect_level suspects_level(struct suspects *, int64_t id,
    int64_t now_ms);
/* id was in flight, unconfirmed, when the connection was lost: one level
 * up (at most SUSPECT_ALONE).  Returns the level it had before. */
enum suspect_level suspects_lost(struct suspects *, int64_t id,
    int64_t now_ms);
/* id's message was confirmed or refused for a reason of its own: not a
 * suspect any more. */
void suspects_clear(struct suspects *, int64_t id);
size_t suspects_count(const struct suspects *);

#endif
