/*
 * outboxd's fixed set of Prometheus metrics and its health flag: written
 * by the main loop, rendered in the text exposition format by the HTTP
 * thread.  Every function is thread-safe; none can fail.
 */
#ifndef OUTBOXD_METRICS_H
#define OUTBOXD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Why a publish failed: the reason label of messages_failed_total. */
enum metrics_failure {
	METRICS_FAIL_NACKED,		/* basic.nack */
	METRICS_FAIL_UNROUTABLE,	/* basic.return (mandatory flag) */
	METRICS_FAIL_REJECTED,		/* channel closed for it: 404, 406 */
	METRICS_FAIL_NO_CONTENT,	/* no t_transactional_message_content */
	METRICS_FAIL_BAD_ROW,		/* row that cannot be published as is */
	METRICS_FAIL_OVERSIZED,		/* payload over the frame limit */
	/* alone in flight at a lost connection, after two more losses
	 * (suspects.h) */
	METRICS_FAIL_CONNECTION_LOST,
	/* the database refused the row's mark (a trigger, a constraint) */
	METRICS_FAIL_MARK_REFUSED,
	METRICS_FAIL_COUNT
};

/* The servers outboxd talks to: the server label. */
enum metrics_server {
	METRICS_SERVER_POSTGRES,
	METRICS_SERVER_RABBITMQ,
	METRICS_SERVER_REDIS,
	METRICS_SERVER_COUNT
};

/* What elects the compensation leader: the backend label. */
enum metrics_backend {
	METRICS_BACKEND_NONE,
	METRICS_BACKEND_REDIS,
	METRICS_BACKEND_POSTGRES,
	METRICS_BACKEND_COUNT
};

/*
 * Resets every metric to zero, marks the start time for up_seconds and
 * records the version for build_info (NULL = "unknown").  Health starts
 * as not ok, reason "starting", until the main loop says otherwise.
 */
void metrics_init(const char *version);

void metrics_inc_published(uint64_t n);
void metrics_inc_failed(enum metrics_failure, uint64_t n);
void metrics_inc_dead(uint64_t n);
/* Rows whose outcome was unknown after a connection loss, left due. */
void metrics_inc_released(uint64_t n);

/*
 * The outbox as last counted: pending = unsent and not dead, due = of
 * those, due now; oldest_due_age_s = now - oldest due next_schedule_time
 * (0 when nothing is due; negative or non-finite is stored as 0);
 * counted_at_s = when, in seconds since the epoch (0: never).
 */
void metrics_set_rows(uint64_t pending, uint64_t due, uint64_t dead,
    double oldest_due_age_s, int64_t counted_at_s);

/* Durations in seconds; negative counts as 0, NaN and inf are dropped. */
void metrics_observe_batch(double seconds);
void metrics_observe_confirm(double seconds);

void metrics_set_leader(bool leader, enum metrics_backend);
void metrics_set_connection(enum metrics_server, bool up);
/* Relays (the main one and its workers) whose PostgreSQL and RabbitMQ
 * connections are both up, and those whose publishing RabbitMQ blocks
 * (connection.blocked), of how many run (relay.workers). */
void metrics_set_relays(unsigned connected, unsigned blocked,
    unsigned total);
/* Call after a lost connection was established again. */
void metrics_inc_reconnect(enum metrics_server);

/*
 * Health as the main loop judges it (postgres and rabbitmq up, progress
 * made recently).  reason (NULL = "") explains a false ok; control bytes
 * become spaces and it is cut at 127 bytes.
 */
void metrics_set_health(bool ok, const char *reason);
/* Returns ok and copies the reason into reason[size] (may be NULL).  Not
 * ok either when the last metrics_set_health() is older than the stall
 * limit: a main loop stuck in a call cannot say so itself. */
bool metrics_health(char *reason, size_t size);
/* The stall limit in ms (0, the default: none). */
void metrics_set_stall_limit(int64_t ms);

/*
 * Writes the exposition text into buf, snprintf-style: at most size
 * bytes including the NUL, and returns the length the whole text needs
 * (without the NUL), so a caller whose buffer was too small can grow it
 * to the returned value + 1 and call again.
 */
size_t metrics_render(char *buf, size_t size);

/* Label values, for logs: "nacked", "rabbitmq", "redis"; "unknown" for
 * a value outside the enum. */
const char *metrics_failure_name(enum metrics_failure);
const char *metrics_server_name(enum metrics_server);
const char *metrics_backend_name(enum metrics_backend);

#endif
