/*
 * Workers: extra relays, each on a thread of its own with its own
 * PostgreSQL session and RabbitMQ connection.  A relay alone leaves the
 * broker idle while it claims and marks, and the database idle while it
 * awaits confirms; two relays take turns at both, and their batches never
 * overlap (FOR UPDATE SKIP LOCKED).  The main thread keeps its own relay,
 * the leader, signals and reloads, and tells the workers what to do.
 */
#ifndef OUTBOXD_WORKERS_H
#define OUTBOXD_WORKERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "broker.h"
#include "relay.h"
#include "store.h"

struct workers;

/*
 * Starts n worker threads (0 is valid: none), each with a copy of the
 * three confs and the process's suspects and refused rows (shared, not
 * owned); they relay new rows at once when active, else stand by
 * until workers_set_role().  Signals stay with the calling thread.  NULL
 * with err set when a thread cannot be created (the ones started are
 * stopped).
 */
struct workers *workers_start(int n, bool active, const struct relay_conf *,
    const struct store_conf *, const struct broker_conf *,
    struct suspects *, struct refused *, char *err, size_t errlen);
/* Asks every worker to claim nothing more and to stop after its batch,
 * without waiting.  Safe in a signal handler: a stop must not leave the
 * workers claiming while the main relay finishes its own batch. */
void workers_ask_to_stop(struct workers *);
/* Asks every worker to stop, waits for each to finish its batch (its
 * confirms awaited, its rows marked) and adds their counters to *sum
 * (when not NULL); their connections stay open.  NULL, or a second
 * call, is a no-op. */
void workers_join(struct workers *, struct relay_stats *sum);
/* workers_join (unless it ran), then closes the workers' connections
 * and frees them.  NULL is a no-op. */
void workers_stop(struct workers *, struct relay_stats *sum);

/* What the main thread decided this turn: retry FAIL rows (leader), and
 * relay at all (false: single-active standby, connections kept up). */
void workers_set_role(struct workers *, bool retries, bool active);
/* A reloaded relay config; each worker applies it between batches. */
void workers_set_conf(struct workers *, const struct relay_conf *);

/* The main relay found a backlog: wake every waiting worker to claim.
 * Workers do not LISTEN, so that a NOTIFY wakes one relay, not all. */
void workers_kick(struct workers *);
/* What a worker's last step left it in; a worker may be in several. */
enum worker_state {
	WORKER_CONNECTED = 1,	/* both connections up */
	WORKER_FAILING = 2,	/* claims or marks fail (relay_failing_ms) */
	WORKER_BLOCKED = 4,	/* RabbitMQ blocks it (relay_blocked_ms) */
};

/* How many workers were in state (as of their last step). */
int workers_count(const struct workers *, enum worker_state);
/* Milliseconds since the slowest worker last finished a step, for the
 * watchdog: a worker stuck that long is a stuck daemon. */
int64_t workers_stalled_ms(const struct workers *);

#endif
