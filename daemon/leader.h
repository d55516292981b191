/*
 * Leader: decides whether this instance runs compensation — via the
 * Redis lock, or a PostgreSQL advisory lock while Redis is unreachable
 * or not configured — and runs it: sweep exhausted rows to DEAD, purge
 * old SUCCESS rows, refresh the row gauges.
 */
#ifndef OUTBOXD_LEADER_H
#define OUTBOXD_LEADER_H

#include <stdbool.h>
#include <stdint.h>

#include "lock.h"
#include "relay.h"
#include "store.h"

enum leader_backend {
	LEADER_BACKEND_NONE,	/* no election: PostgreSQL is down too */
	LEADER_BACKEND_REDIS,
	LEADER_BACKEND_POSTGRES, /* degraded: Redis down or disabled */
};

struct leader_gauges {
	struct store_counts counts;
	bool valid;		/* counts were read at the last compensation */
	int64_t counted_at_s;	/* when they were last read, epoch s; 0 never */
};

struct leader;

/* Uses, but does not own, the store (its connection carries the
 * advisory lock and the compensation queries). */
struct leader *leader_new(const struct lock_conf *, const struct relay_conf *,
    struct store *);
void leader_free(struct leader *);
void leader_set_conf(struct leader *, const struct relay_conf *);

/* Renews or seeks leadership and, when leader and due, compensates.
 * Returns whether this instance is the leader now. */
bool leader_tick(struct leader *);
bool leader_is_leader(const struct leader *);
/* What this instance elects the leader with, whether or not it leads:
 * so that "no leader anywhere, though elections run" can be seen. */
enum leader_backend leader_backend(const struct leader *);
const char *leader_backend_name(enum leader_backend);
bool leader_redis_up(const struct leader *);
/* Redis connections established after the first (0 without Redis). */
uint64_t leader_redis_reconnects(const struct leader *);
/* Milliseconds until leader_tick has work (a renewal, a retry). */
int64_t leader_next_tick_ms(const struct leader *);
const struct leader_gauges *leader_gauges(const struct leader *);
/* The wait after a compensation that took took_ms: poll_interval_ms, or
 * longer when counting a huge backlog was slow, so that compensation
 * never holds the relay's session more than 1/20 of the time. */
int64_t leader_compensation_interval_ms(int64_t poll_interval_ms,
    int64_t took_ms);
/* The wait after a pass that took took_ms and left rows to sweep or
 * purge: four times as long (at least 100 ms), so that such passes hold
 * the session at most a fifth of the time. */
int64_t leader_backlog_interval_ms(int64_t took_ms);
/* Gives leadership up (shutdown): compare-and-delete in Redis, unlock
 * in PostgreSQL. */
void leader_release(struct leader *);

#endif
