/*
 * Lock: the Redis leader lock (hiredis) that elects the one instance
 * running compensation.  Correctness never depends on it.
 */
#ifndef OUTBOXD_LOCK_H
#define OUTBOXD_LOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "backoff.h"
#include "util.h"

struct lock_conf {
	bool enabled;
	char *host;		/* or "unix:/path/to/socket" */
	int port;
	char *username;		/* Redis 6 ACL user; NULL = default */
	char *password;		/* secret */
	/* redis.password_file, read again before each connection
	 * (secret.h); NULL: the password above is fixed. */
	char *password_file;
	int database;
	char *key;
	int64_t ttl_ms;
	int64_t connect_timeout_ms;
};

enum lock_state {
	LOCK_NOT_HELD,		/* Redis answers; another instance holds it */
	LOCK_HELD,		/* we are the leader until told otherwise */
	LOCK_UNAVAILABLE,	/* Redis unreachable or refusing; not held */
};

/*
 * Timings, all from the time the last successful SET or renewal was
 * *sent* (Redis started its ttl later, so our view ends first):
 *   renew every ttl/3; retry a failed renewal every ttl/6;
 *   held until ttl − ttl/3 (lock_held turns false then); the next
 *   lock_tick renews the key late if it still carries our token (a
 *   stall: nobody can have taken it), and otherwise reports the LOSS,
 *   also when Redis cannot be reached;
 *   not held: try to acquire every ttl/3; a key left with the token of
 *   a lock lost while Redis was away is renewed, not waited out;
 *   unreachable: reconnect after 1 s, doubling to 10 s, unless
 *   lock_set_reconnect says otherwise (the daemon passes reconnect.*).
 * One lock_tick never blocks longer than about connect_timeout_ms (one
 * budget for connect, AUTH, SELECT and the command), except for DNS.
 *
 * When conf->enabled is false there is no Redis at all: the instance is
 * its own leader, lock_tick always returns LOCK_HELD, lock_held is
 * always true and lock_release does nothing.
 *
 * Writes to a socket that Redis closed raise SIGPIPE: the process must
 * ignore it (main does).  Not thread-safe; one thread drives a lock.
 */
struct lock;

/* Copies what it needs from conf (the password too: the caller may wipe
 * its own copy).  Never fails; connects on the first lock_tick. */
struct lock *lock_new(const struct lock_conf *);
/* Frees without releasing (the key then expires after ttl); NULL ok. */
void lock_free(struct lock *);
/* Replaces the reconnect pacing, keeping its attempt count (the default
 * is exponential from 1 s, ×2, capped at 10 s, ±20 %; the daemon sets
 * reconnect.*). */
void lock_set_reconnect(struct lock *, const struct backoff_params *);
/* Connections established after the first one, whatever dropped it. */
uint64_t lock_reconnects(const struct lock *);

/*
 * Does what is due: connect, acquire if not held, renew if held.  Costs
 * one clock read and no Redis round trip when nothing is due.  A loss
 * (renewal found no key or another token, or a renewal could not be
 * made in time) is logged at once ("leader lock lost") and this call
 * returns LOCK_NOT_HELD or LOCK_UNAVAILABLE; the next call, due at once,
 * tries to acquire again with a new token.
 */
enum lock_state lock_tick(struct lock *);
/* Milliseconds until lock_tick has something to do (0 = now), for the
 * caller's wait.  INT64_MAX when the lock is disabled. */
int64_t lock_next_tick_ms(const struct lock *);
/* Held, and the conservative validity has not run out (even if
 * lock_tick has not been called since). */
bool lock_held(const struct lock *);
/* Whether a connection to Redis is open.  A command that fails drops
 * it, so this turns false at the first failure of an outage, while a
 * holder's lock_held stays true for the rest of its validity.  False
 * when the lock is disabled. */
bool lock_redis_up(const struct lock *);
/* Gives the lock up: compare-and-delete if held, or if it was lost
 * while Redis did not answer (the key may have outlived that), so
 * another instance's key is never deleted.  Logs the outcome; when
 * Redis is down the key simply expires after ttl.  A later lock_tick
 * competes again. */
void lock_release(struct lock *);
/* The last error ("connect 127.0.0.1:6379: Connection refused"), or ""
 * while all is well.  Never contains the password. */
const char *lock_error(const struct lock *);
/* The current token (32 hex digits), or "" when not held; for tests. */
const char *lock_token(const struct lock *);
/* How many times a lock we held turned out to be lost, by lock_tick or
 * by a release that found the key no longer ours. */
uint64_t lock_lost_count(const struct lock *);

#endif
