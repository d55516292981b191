/*
 * Relay: one cycle of the spec — claim due rows, publish them, await
 * their confirms, mark them, reschedule failures with backoff — and the
 * loop that runs cycles until asked to stop.
 */
#ifndef OUTBOXD_RELAY_H
#define OUTBOXD_RELAY_H

#include <stdbool.h>
#include <stdint.h>

#include "backoff.h"
#include "broker.h"
#include "store.h"
#include "util.h"

enum relay_mode {
	RELAY_PARALLEL,		/* every instance relays; leader compensates */
	RELAY_SINGLE_ACTIVE,	/* only the lock holder relays */
};

struct relay_conf {
	int batch_size;
	/* Relays running at once, each with its own sessions (workers.h);
	 * read at start only. */
	int workers;
	/* Two PostgreSQL sessions per relay, so that its next batch is
	 * claimed, and its last marked, while the broker confirms (see
	 * relay_pipeline in relay.c); read at start only. */
	bool pipeline;
	int64_t poll_interval_ms;
	int64_t shutdown_timeout_ms;
	enum relay_mode mode;
	bool ordering_by_key;
	int64_t retention_ms;		/* 0 = keep SUCCESS rows forever */
	/* Global backoff for rescheduling rows; per-row init_backoff and
	 * backoff_factor replace init_ms and factor. */
	struct backoff_params backoff;
	/* Backoff between reconnect attempts to any server. */
	struct backoff_params reconnect;
	/* rabbitmq.max_payload, copied by the config loader: a longer
	 * content is not fetched, and its row is DEAD unsent. */
	size_t max_payload;
};

/*
 * A batch ends where its contents pass this many bytes (its first row
 * is always in), whatever relay.batch_size says: 500 rows of 16 MiB
 * made one 8 GiB batch.  A batch of 1 KiB messages is not touched.
 */
#define RELAY_BATCH_BYTES (8u * 1024 * 1024)

/* Counters for logs and metrics; written only by the relay's thread. */
struct relay_stats {
	uint64_t batches;
	uint64_t published;	/* acked by the broker and marked SUCCESS */
	uint64_t retried;	/* failed, rescheduled */
	uint64_t dead;		/* failed for good */
	uint64_t released;	/* outcome unknown, left due */
	uint64_t store_errors;
	uint64_t broker_errors;
	int64_t last_batch_us;	/* claim to commit, last non-empty batch */
	int64_t last_confirm_us; /* publish to last confirm */
	int64_t last_progress_ms; /* monotonic time of the last good cycle */
};

struct relay;

struct suspects;
struct refused;

/* The relay uses, but does not own, its sessions, the broker and the
 * process's suspects (suspects.h).  A second session (pipeline_store;
 * NULL for none) makes it pipelined: see relay.pipeline. */
struct relay *relay_new(const struct relay_conf *, struct store *,
    struct store *pipeline_store, struct broker *, struct suspects *,
    struct refused *);
void relay_free(struct relay *);
/* Applies a reloaded config (batch size, intervals, backoff). */
void relay_set_conf(struct relay *, const struct relay_conf *);
/* Whether this instance also retries FAIL rows (the leader does). */
void relay_set_retries(struct relay *, bool);
/* A descriptor whose readability ends the relay's waits (a worker's
 * stop); -1 (the default) for none: then only a signal does. */
void relay_set_wake_fd(struct relay *, int fd);
/*
 * For a worker: do not LISTEN; wait instead for kick_fd (an eventfd the
 * main relay writes when it finds a backlog, see relay_step), besides the
 * next due row and poll_interval.  A NOTIFY then wakes one relay, not
 * every worker of the process.
 */
void relay_set_kick_fd(struct relay *, int kick_fd);

/*
 * Does one step of work: (re)connects what is down, then runs one cycle,
 * or waits for a NOTIFY, the next due row or the poll interval — never
 * longer than max_wait_ms, so the caller can renew locks and feed the
 * watchdog.  A signal cuts the wait short.  Errors are handled inside
 * (logged, connection dropped, retried with backoff).  Returns true when
 * the cycle found a backlog (a full batch): time to call in the workers.
 */
bool relay_step(struct relay *, int64_t max_wait_ms);

/* Keeps the connections up without claiming (single-active standby). */
void relay_standby(struct relay *, int64_t max_wait_ms);

/* One cycle: claim → publish → await confirms → mark.  Sets *claimed to
 * the batch size; returns -1 when a server failed mid-way. */
int relay_cycle(struct relay *, size_t *claimed) WARN_UNUSED;

const struct relay_stats *relay_stats(const struct relay *);
/* How long claims or marks have failed on a live session (a table
 * locked past postgres.lock_timeout, a missing privilege); 0 while
 * cycles go through. */
int64_t relay_failing_ms(const struct relay *);
/* How long RabbitMQ has blocked this relay's publishing (a resource
 * alarm); 0 when it does not.  Nothing is claimed meanwhile. */
int64_t relay_blocked_ms(const struct relay *);
bool relay_store_up(const struct relay *);
bool relay_broker_up(const struct relay *);

/*
 * What happens to a row whose publish failed (pure; unit-tested):
 * MARK_DEAD when the error is permanent or no retry is left, else
 * MARK_RETRY with *delay_ms from the global backoff and the row's own
 * init_backoff and backoff_factor.  *note is set when the row's values
 * were unusable and the global ones were used instead.
 */
enum mark_kind relay_reschedule(const struct backoff_params *global,
    const struct outbox_row *, bool permanent, struct backoff_rng *,
    int64_t *delay_ms, const char **note);

#endif
