/*
 * The metrics registry: one mutex guards one struct, so a scrape sees a
 * consistent snapshot (a histogram's buckets, sum and count agree).
 */
#include "metrics.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "util.h"

/* Upper bounds in seconds, 1 ms to 30 s; +Inf is implied. */
static const double hist_bounds[] = {
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 30,
};
#define HIST_BUCKETS ARRAY_LEN(hist_bounds)

struct histogram {
	/* Per bucket, not cumulative; the last one is (30 s, +Inf). */
	uint64_t buckets[HIST_BUCKETS + 1];
	uint64_t count;
	double sum;
};

struct registry {
	char version[64];
	int64_t start_ms;	/* now_mono_ms() at metrics_init; 0 = never */
	uint64_t published;
	uint64_t failed[METRICS_FAIL_COUNT];
	uint64_t dead;
	uint64_t released;
	uint64_t rows_pending, rows_due, rows_dead;
	int64_t rows_counted_at;	/* epoch s; 0 never */
	double oldest_due_age;
	struct histogram batch, confirm;
	bool leader;
	enum metrics_backend backend;
	bool conn_up[METRICS_SERVER_COUNT];
	unsigned relays, relays_connected, relays_blocked;
	uint64_t reconnects[METRICS_SERVER_COUNT];
	bool healthy;
	char health_reason[128];
	int64_t health_at_ms;	/* of the last metrics_set_health; 0 never */
	int64_t stall_limit_ms;	/* 0: no limit */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct registry reg = {
	.version = "unknown",
	.health_reason = "starting",
};

static const char *const failure_names[] = {
	[METRICS_FAIL_NACKED] = "nacked",
	[METRICS_FAIL_UNROUTABLE] = "unroutable",
	[METRICS_FAIL_REJECTED] = "rejected",
	[METRICS_FAIL_NO_CONTENT] = "no_content",
	[METRICS_FAIL_BAD_ROW] = "bad_row",
	[METRICS_FAIL_OVERSIZED] = "oversized",
	[METRICS_FAIL_CONNECTION_LOST] = "connection_lost",
	[METRICS_FAIL_MARK_REFUSED] = "mark_refused",
};

static const char *const server_names[] = {
	[METRICS_SERVER_POSTGRES] = "postgres",
	[METRICS_SERVER_RABBITMQ] = "rabbitmq",
	[METRICS_SERVER_REDIS] = "redis",
};

static const char *const backend_names[] = {
	[METRICS_BACKEND_NONE] = "none",
	[METRICS_BACKEND_REDIS] = "redis",
	[METRICS_BACKEND_POSTGRES] = "postgres",
};

const char *
metrics_failure_name(enum metrics_failure f)
{
	if ((unsigned)f >= METRICS_FAIL_COUNT)
		return "unknown";
	return failure_names[f];
}

const char *
metrics_server_name(enum metrics_server s)
{
	if ((unsigned)s >= METRICS_SERVER_COUNT)
		return "unknown";
	return server_names[s];
}

const char *
metrics_backend_name(enum metrics_backend b)
{
	if ((unsigned)b >= METRICS_BACKEND_COUNT)
		return "unknown";
	return backend_names[b];
}

/*
 * A mutex that fails to lock is a corrupted process; pthread on Linux
 * cannot fail here for a default mutex, so the results are not checked.
 */
static void
reg_lock(void)
{
	(void)pthread_mutex_lock(&lock);
}

static void
reg_unlock(void)
{
	(void)pthread_mutex_unlock(&lock);
}

void
metrics_init(const char *version)
{
	reg_lock();
	memset(&reg, 0, sizeof(reg));
	strfmt(reg.version, sizeof(reg.version), "%s",
	    version != NULL ? version : "unknown");
	reg.start_ms = now_mono_ms();
	reg.backend = METRICS_BACKEND_NONE;
	strfmt(reg.health_reason, sizeof(reg.health_reason), "starting");
	reg_unlock();
}

void
metrics_inc_published(uint64_t n)
{
	reg_lock();
	reg.published += n;
	reg_unlock();
}

void
metrics_inc_failed(enum metrics_failure f, uint64_t n)
{
	if ((unsigned)f >= METRICS_FAIL_COUNT)
		return;
	reg_lock();
	reg.failed[f] += n;
	reg_unlock();
}

void
metrics_inc_dead(uint64_t n)
{
	reg_lock();
	reg.dead += n;
	reg_unlock();
}

void
metrics_inc_released(uint64_t n)
{
	reg_lock();
	reg.released += n;
	reg_unlock();
}

void
metrics_set_rows(uint64_t pending, uint64_t due, uint64_t dead,
    double oldest_due_age_s, int64_t counted_at_s)
{
	/* A clock step can make the age negative; show 0, not nonsense. */
	if (!isfinite(oldest_due_age_s) || oldest_due_age_s < 0)
		oldest_due_age_s = 0;
	reg_lock();
	reg.rows_pending = pending;
	reg.rows_due = due;
	reg.rows_dead = dead;
	reg.oldest_due_age = oldest_due_age_s;
	reg.rows_counted_at = counted_at_s > 0 ? counted_at_s : 0;
	reg_unlock();
}

static void
hist_observe(struct histogram *h, double v)
{
	size_t i;

	if (isnan(v) || isinf(v))
		return;
	if (v < 0)
		v = 0;
	for (i = 0; i < HIST_BUCKETS; i++)
		if (v <= hist_bounds[i])
			break;
	reg_lock();
	h->buckets[i]++;
	h->count++;
	h->sum += v;
	reg_unlock();
}

void
metrics_observe_batch(double seconds)
{
	hist_observe(&reg.batch, seconds);
}

void
metrics_observe_confirm(double seconds)
{
	hist_observe(&reg.confirm, seconds);
}

void
metrics_set_leader(bool leader, enum metrics_backend b)
{
	if ((unsigned)b >= METRICS_BACKEND_COUNT)
		b = METRICS_BACKEND_NONE;
	reg_lock();
	reg.leader = leader;
	reg.backend = b;
	reg_unlock();
}

void
metrics_set_connection(enum metrics_server s, bool up)
{
	if ((unsigned)s >= METRICS_SERVER_COUNT)
		return;
	reg_lock();
	reg.conn_up[s] = up;
	reg_unlock();
}

void
metrics_set_relays(unsigned connected, unsigned blocked, unsigned total)
{
	reg_lock();
	reg.relays = total;
	reg.relays_connected = connected < total ? connected : total;
	reg.relays_blocked = blocked < total ? blocked : total;
	reg_unlock();
}

void
metrics_inc_reconnect(enum metrics_server s)
{
	if ((unsigned)s >= METRICS_SERVER_COUNT)
		return;
	reg_lock();
	reg.reconnects[s]++;
	reg_unlock();
}

void
metrics_set_health(bool ok, const char *reason)
{
	char clean[sizeof(reg.health_reason)];

	/* The reason ends up in an HTTP body line: keep it on one line. */
	strfmt(clean, sizeof(clean), "%s", reason != NULL ? reason : "");
	str_replace_controls(clean, ' ');
	reg_lock();
	reg.healthy = ok;
	memcpy(reg.health_reason, clean, sizeof(clean));
	reg.health_at_ms = now_mono_ms();
	reg_unlock();
}

bool
metrics_health(char *reason, size_t size)
{
	int64_t silent;
	bool ok;

	reg_lock();
	ok = reg.healthy;
	silent = reg.health_at_ms > 0 ? now_mono_ms() - reg.health_at_ms : 0;
	if (reg.stall_limit_ms > 0 && silent > reg.stall_limit_ms) {
		ok = false;
		if (reason != NULL && size > 0)
			strfmt(reason, size, "stalled: the main loop has not "
			    "reported for %" PRId64 " s", silent / 1000);
	} else if (reason != NULL && size > 0)
		strfmt(reason, size, "%s", reg.health_reason);
	reg_unlock();
	return ok;
}

void
metrics_set_stall_limit(int64_t ms)
{
	reg_lock();
	reg.stall_limit_ms = ms > 0 ? ms : 0;
	reg_unlock();
}

/*
 * Rendering.  The text is appended snprintf-style: once the buffer is
 * full, formatting goes on only to count, so the caller learns the size
 * it needs in one pass.
 */
struct out {
	char *buf;
	size_t size;
	size_t len;
};

static void out_printf(struct out *, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void
out_printf(struct out *o, const char *fmt, ...)
{
	va_list ap;
	int n;

	va_start(ap, fmt);
	if (o->len < o->size)
		n = vsnprintf(o->buf + o->len, o->size - o->len, fmt, ap);
	else
		n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	if (n > 0)
		o->len += (size_t)n;
}

static void
out_header(struct out *o, const char *name, const char *type,
    const char *help)
{
	out_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Label values escape backslash, double quote and newline. */
static void
out_label_value(struct out *o, const char *s)
{
	for (; *s != '\0'; s++) {
		if (*s == '\\')
			out_printf(o, "\\\\");
		else if (*s == '"')
			out_printf(o, "\\\"");
		else if (*s == '\n')
			out_printf(o, "\\n");
		else
			out_printf(o, "%c", *s);
	}
}

static void
out_histogram(struct out *o, const char *name, const char *help,
    const struct histogram *h)
{
	uint64_t cumulative = 0;
	size_t i;

	out_header(o, name, "histogram", help);
	for (i = 0; i < HIST_BUCKETS; i++) {
		cumulative += h->buckets[i];
		out_printf(o, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name,
		    hist_bounds[i], cumulative);
	}
	/* +Inf always equals _count: every observation lands somewhere. */
	out_printf(o, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, h->count);
	out_printf(o, "%s_sum %.6f\n", name, h->sum);
	out_printf(o, "%s_count %" PRIu64 "\n", name, h->count);
}

size_t
metrics_render(char *buf, size_t size)
{
	struct out o = { buf, size, 0 };
	struct registry r;
	double up;
	size_t i;

	/* Copy under the lock, format outside it: the main loop never
	 * waits for a slow formatter. */
	reg_lock();
	r = reg;
	reg_unlock();
	if (buf == NULL)
		o.size = 0;
	up = r.start_ms != 0 ? (double)(now_mono_ms() - r.start_ms) / 1000 : 0;

	out_header(&o, "outboxd_build_info", "gauge",
	    "Build information; the value is always 1.");
	out_printf(&o, "outboxd_build_info{version=\"");
	out_label_value(&o, r.version);
	out_printf(&o, "\"} 1\n");
	out_header(&o, "outboxd_up_seconds", "gauge",
	    "Seconds since outboxd started.");
	out_printf(&o, "outboxd_up_seconds %.3f\n", up);

	out_header(&o, "outboxd_messages_published_total", "counter",
	    "Messages confirmed by the broker and marked sent.");
	out_printf(&o, "outboxd_messages_published_total %" PRIu64 "\n",
	    r.published);
	out_header(&o, "outboxd_messages_failed_total", "counter",
	    "Publish attempts that failed, by reason.");
	for (i = 0; i < METRICS_FAIL_COUNT; i++)
		out_printf(&o,
		    "outboxd_messages_failed_total{reason=\"%s\"} %" PRIu64
		    "\n", failure_names[i], r.failed[i]);
	out_header(&o, "outboxd_messages_dead_total", "counter",
	    "Rows whose retries ran out; they wait for a manual replay.");
	out_printf(&o, "outboxd_messages_dead_total %" PRIu64 "\n", r.dead);
	out_header(&o, "outboxd_messages_released_total", "counter",
	    "Rows sent whose outcome stayed unknown (connection lost, or "
	    "no confirm while blocked), left due to publish again.");
	out_printf(&o, "outboxd_messages_released_total %" PRIu64 "\n",
	    r.released);

	out_header(&o, "outboxd_rows_pending", "gauge",
	    "Unsent rows that are not dead, as last counted.");
	out_printf(&o, "outboxd_rows_pending %" PRIu64 "\n", r.rows_pending);
	out_header(&o, "outboxd_rows_due", "gauge",
	    "Unsent rows due now, as last counted.");
	out_printf(&o, "outboxd_rows_due %" PRIu64 "\n", r.rows_due);
	out_header(&o, "outboxd_rows_dead", "gauge",
	    "Rows whose retries are exhausted, as last counted.");
	out_printf(&o, "outboxd_rows_dead %" PRIu64 "\n", r.rows_dead);
	out_header(&o, "outboxd_oldest_due_age_seconds", "gauge",
	    "How long the oldest due row has been due; 0 when none is.");
	out_printf(&o, "outboxd_oldest_due_age_seconds %.3f\n",
	    r.oldest_due_age);
	out_header(&o, "outboxd_rows_counted_timestamp_seconds", "gauge",
	    "When the row gauges were last counted (0: not by this "
	    "instance); they keep their values while counting fails.");
	out_printf(&o, "outboxd_rows_counted_timestamp_seconds %" PRId64 "\n",
	    r.rows_counted_at);

	out_histogram(&o, "outboxd_batch_duration_seconds",
	    "Time for one batch: claim, publish, confirms, mark.", &r.batch);
	out_histogram(&o, "outboxd_confirm_duration_seconds",
	    "Time from publishing a batch to its last confirm.", &r.confirm);

	out_header(&o, "outboxd_leader", "gauge",
	    "1 when this instance holds the compensation lock.");
	out_printf(&o, "outboxd_leader %d\n", r.leader ? 1 : 0);
	out_header(&o, "outboxd_leader_backend", "gauge",
	    "The leader election backend in use (1) and the others (0).");
	for (i = 0; i < METRICS_BACKEND_COUNT; i++)
		out_printf(&o, "outboxd_leader_backend{backend=\"%s\"} %d\n",
		    backend_names[i], r.backend == i ? 1 : 0);
	out_header(&o, "outboxd_connection_up", "gauge",
	    "1 when the connection to the server is up.");
	for (i = 0; i < METRICS_SERVER_COUNT; i++)
		out_printf(&o, "outboxd_connection_up{server=\"%s\"} %d\n",
		    server_names[i], r.conn_up[i] ? 1 : 0);
	/* outboxd_connection_up follows the main relay; a worker that
	 * cannot connect (max_connections reached, say) shows here. */
	out_header(&o, "outboxd_relays", "gauge",
	    "Relays running: the main one and its workers (relay.workers).");
	out_printf(&o, "outboxd_relays %u\n", r.relays);
	out_header(&o, "outboxd_relays_connected", "gauge",
	    "Relays whose PostgreSQL and RabbitMQ connections are both up.");
	out_printf(&o, "outboxd_relays_connected %u\n", r.relays_connected);
	out_header(&o, "outboxd_relays_blocked", "gauge",
	    "Relays whose publishing RabbitMQ blocks (a resource alarm).");
	out_printf(&o, "outboxd_relays_blocked %u\n", r.relays_blocked);
	out_header(&o, "outboxd_reconnects_total", "counter",
	    "Connections established again after a loss.");
	for (i = 0; i < METRICS_SERVER_COUNT; i++)
		out_printf(&o,
		    "outboxd_reconnects_total{server=\"%s\"} %" PRIu64 "\n",
		    server_names[i], r.reconnects[i]);

	/* snprintf semantics: a truncated text is still a C string. */
	if (o.size > 0 && o.len >= o.size)
		o.buf[o.size - 1] = '\0';
	return o.len;
}
