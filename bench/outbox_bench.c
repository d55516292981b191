/*
 * outbox_bench: outboxd against the raw limits of its own servers (issue
 * 6).  Measures what RabbitMQ and PostgreSQL can do alone, then outboxd's
 * drain rate, latency, footprint and scaling, and prints one table.
 * bench/run.sh starts the private servers and runs it; see
 * docs/PERFORMANCE.md for what the figures mean.
 */
#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_tcp_socket.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "log.h"
#include "store.h"
#include "util.h"

#define BODY_SIZE 1024		/* the issue's message size */
#define MAX_QUEUES 4
#define MAX_CONNS 4
#define QUEUE_PREFIX "bench.q"
#define LAT_QUEUE "bench.lat"
#define CH 1			/* every AMQP connection here uses one */

/* Targets of the issue. */
#define TARGET_DRAIN_RATIO 0.95
#define TARGET_P50_MS 2.0
#define TARGET_P99_MS 10.0
#define TARGET_RSS_KIB (16 * 1024)
#define TARGET_IDLE_PCT 0.5	/* "about 0": below half a percent */
#define TARGET_SCALE_SLOWDOWN 0.05

/* ---- options ------------------------------------------------------------ */

struct opts {
	const char *outboxd;	/* the daemon under test */
	const char *dir;	/* servers' directory (tests/servers.sh) */
	const char *conninfo;
	int amqp_port, redis_port, http_port;
	long rows;		/* per drain */
	long backlog;		/* the scale phase's table */
	int latency_s, idle_s, raw_s;
	int batch;		/* outboxd's relay.batch_size */
	int workers;		/* outboxd's relay.workers */
	const char *pipeline;	/* outboxd's relay.pipeline; NULL: default */
	int window;		/* raw publisher's confirm window */
	const char *only;	/* comma list of phases, NULL = all */
	bool sweep;		/* drain once per batch size as well */
	int repeat;		/* runs per raw and drain figure; best kept */
	int pairs;		/* the scale phase's alternating drains */
	const char *queue_arg;	/* "x-name=value" for queue.declare, or NULL */
};

static struct opts O = {
	.rows = 200000, .backlog = 1000000, .latency_s = 30, .idle_s = 30,
	.raw_s = 6, .batch = 1000, .workers = 2, .window = 2000,
	.repeat = 1, .pairs = 5,
};

/* ---- the table ---------------------------------------------------------- */

struct row {
	char figure[64];
	char value[96];
	char ref[400];		/* reference, ratio or breakdown */
	char target[40];
	char verdict[8];	/* PASS, MISS, info, FAIL (sanity) */
	char check[128];	/* sanity: counts, states */
};

static struct row table[64];
static size_t nrows;
static bool sanity_failed;

static struct row *
row_add(const char *figure)
{
	struct row *r;

	if (nrows == ARRAY_LEN(table)) {
		fprintf(stderr, "outbox_bench: too many table rows\n");
		exit(1);
	}
	r = &table[nrows++];
	memset(r, 0, sizeof(*r));
	strfmt(r->figure, sizeof(r->figure), "%s", figure);
	strfmt(r->verdict, sizeof(r->verdict), "info");
	return r;
}

/* ---- small helpers ------------------------------------------------------ */

static pid_t child_pid = -1;	/* the running outboxd, killed on exit */

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2),
    noreturn));

static void
die(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "outbox_bench: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

static void note(const char *fmt, ...) __attribute__((format(printf, 1,
    2)));

/* Progress on stderr, so that stdout holds the table alone. */
static void
note(const char *fmt, ...)
{
	va_list ap;
	time_t t = time(NULL);
	char ts[16];

	strftime(ts, sizeof(ts), "%H:%M:%S", localtime(&t));
	fprintf(stderr, "[%s] ", ts);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

static int64_t
us_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t
us_wall(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void
nap_us(int64_t us)
{
	struct timespec ts = { us / 1000000, (long)(us % 1000000) * 1000 };

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

static bool
phase_on(const char *name)
{
	size_t len = strlen(name);
	const char *p = O.only;

	if (p == NULL)
		return true;
	while ((p = strstr(p, name)) != NULL) {
		if ((p == O.only || p[-1] == ',') &&
		    (p[len] == '\0' || p[len] == ','))
			return true;
		p += len;
	}
	return false;
}

static const char *
env_need(const char *name)
{
	const char *v = getenv(name);

	if (v == NULL || *v == '\0')
		die("%s is not set: run me through bench/run.sh", name);
	return v;
}

/* ---- CPU and memory from /proc ------------------------------------------ */

struct pstat {
	int64_t ticks;		/* utime + stime */
	int64_t sys_ticks;	/* stime: in the kernel */
	long rss_kib, hwm_kib;
	long anon_kib, file_kib; /* heap and stacks; mapped libraries */
	long vcsw, nvcsw;	/* context switches: wake-ups */
};

static bool
proc_read(pid_t pid, struct pstat *p)
{
	char path[64], buf[2048], *q;
	unsigned long ut = 0, st = 0;
	FILE *f;
	size_t n;

	memset(p, 0, sizeof(*p));
	if (pid <= 0)
		return false;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if ((f = fopen(path, "r")) == NULL)
		return false;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	/* The command name may hold anything: fields start after ')'. */
	if ((q = strrchr(buf, ')')) == NULL || sscanf(q + 2, "%*c %*d %*d "
	    "%*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
		return false;
	p->ticks = (int64_t)(ut + st);
	p->sys_ticks = (int64_t)st;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	if ((f = fopen(path, "r")) == NULL)
		return false;
	while (fgets(buf, sizeof(buf), f) != NULL) {
		sscanf(buf, "VmRSS: %ld", &p->rss_kib);
		sscanf(buf, "VmHWM: %ld", &p->hwm_kib);
		sscanf(buf, "RssAnon: %ld", &p->anon_kib);
		sscanf(buf, "RssFile: %ld", &p->file_kib);
		sscanf(buf, "voluntary_ctxt_switches: %ld", &p->vcsw);
		sscanf(buf, "nonvoluntary_ctxt_switches: %ld", &p->nvcsw);
	}
	fclose(f);
	return true;
}

/* Busy and total jiffies of the whole machine. */
static void
machine_read(int64_t *busy, int64_t *total)
{
	unsigned long long v[8] = { 0 };
	FILE *f = fopen("/proc/stat", "r");

	*busy = *total = 0;
	if (f == NULL)
		return;
	if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0],
	    &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) == 8) {
		for (int i = 0; i < 8; i++)
			*total += (int64_t)v[i];
		*busy = *total - (int64_t)(v[3] + v[4]);
	}
	fclose(f);
}

static pid_t
pid_from_file(const char *path)
{
	FILE *f = fopen(path, "r");
	int pid = -1;

	if (f == NULL)
		return -1;
	if (fscanf(f, "%d", &pid) != 1)
		pid = -1;
	fclose(f);
	return pid;
}

/*
 * CPU of the processes that matter over an interval: outboxd, the
 * RabbitMQ node, outboxd's PostgreSQL backend, and the whole machine
 * (shared with other work: the context for every figure).
 */
struct cpu_mark {
	int64_t t_us;
	struct pstat relay, beam;
	int64_t backend_ticks;	/* all of outboxd's sessions */
	int64_t m_busy, m_total;
};

struct cpu_use {
	double relay, beam, backend;	/* % of one core */
	double relay_sys;		/* outboxd's, in the kernel */
	double machine;			/* cores busy */
};

/* outboxd's PostgreSQL backends: one per relay worker. */
#define MAX_BACKENDS 32
static pid_t beam_pid = -1, backend_pids[MAX_BACKENDS];
static int n_backends;

static void
cpu_mark(struct cpu_mark *m, pid_t relay)
{
	m->t_us = us_now();
	proc_read(relay, &m->relay);
	proc_read(beam_pid, &m->beam);
	m->backend_ticks = 0;
	for (int i = 0; i < n_backends; i++) {
		struct pstat ps;

		if (proc_read(backend_pids[i], &ps))
			m->backend_ticks += ps.ticks;
	}
	machine_read(&m->m_busy, &m->m_total);
}

static void
cpu_since(const struct cpu_mark *a, pid_t relay, struct cpu_use *u)
{
	struct cpu_mark b;
	double secs, hz = (double)sysconf(_SC_CLK_TCK);
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

	cpu_mark(&b, relay);
	secs = (double)(b.t_us - a->t_us) / 1e6;
	if (secs <= 0)
		secs = 1e-6;
	u->relay = 100.0 * (double)(b.relay.ticks - a->relay.ticks) / hz /
	    secs;
	u->relay_sys = 100.0 * (double)(b.relay.sys_ticks -
	    a->relay.sys_ticks) / hz / secs;
	u->beam = 100.0 * (double)(b.beam.ticks - a->beam.ticks) / hz / secs;
	u->backend = 100.0 * (double)(b.backend_ticks - a->backend_ticks) /
	    hz / secs;
	u->machine = b.m_total > a->m_total ? (double)ncpu *
	    (double)(b.m_busy - a->m_busy) / (double)(b.m_total -
	    a->m_total) : 0;
}

/* ---- PostgreSQL --------------------------------------------------------- */

static PGconn *
pg_open(void)
{
	PGconn *c = PQconnectdb(O.conninfo);

	if (PQstatus(c) != CONNECTION_OK)
		die("postgres: %s", PQerrorMessage(c));
	PQclear(PQexec(c, "SET client_min_messages = warning"));
	return c;
}

static void pg_do(PGconn *, const char *fmt, ...) __attribute__((format(
    printf, 2, 3)));

static void
pg_do(PGconn *c, const char *fmt, ...)
{
	char sql[1024];
	va_list ap;
	PGresult *res;

	va_start(ap, fmt);
	vsnprintf(sql, sizeof(sql), fmt, ap);
	va_end(ap);
	res = PQexec(c, sql);
	if (PQresultStatus(res) != PGRES_COMMAND_OK &&
	    PQresultStatus(res) != PGRES_TUPLES_OK)
		die("postgres: %s: %s", sql, PQerrorMessage(c));
	PQclear(res);
}

static long long pg_int(PGconn *, const char *fmt, ...) __attribute__((
    format(printf, 2, 3)));

/* The first value of the first row; NULL reads as -1. */
static long long
pg_int(PGconn *c, const char *fmt, ...)
{
	char sql[1024];
	va_list ap;
	PGresult *res;
	long long v = -1;

	va_start(ap, fmt);
	vsnprintf(sql, sizeof(sql), fmt, ap);
	va_end(ap);
	res = PQexec(c, sql);
	if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) < 1)
		die("postgres: %s: %s", sql, PQerrorMessage(c));
	if (!PQgetisnull(res, 0, 0))
		v = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
	PQclear(res);
	return v;
}

static void
reset_tables(PGconn *c)
{
	pg_do(c, "TRUNCATE t_transactional_message,"
	    " t_transactional_message_content RESTART IDENTITY CASCADE");
}

/* A binary COPY stream, sent in chunks. */
struct copybuf {
	PGconn *c;
	char *p;
	size_t len, cap;
};

static void
cb_add(struct copybuf *b, const void *d, size_t n)
{
	if (b->len + n > b->cap) {
		b->cap = (b->len + n) * 2;
		b->p = xrealloc(b->p, b->cap);
	}
	memcpy(b->p + b->len, d, n);
	b->len += n;
}

static void
cb_flush(struct copybuf *b)
{
	if (b->len > 0 && PQputCopyData(b->c, b->p, (int)b->len) != 1)
		die("copy: %s", PQerrorMessage(b->c));
	b->len = 0;
}

static void
cb_u16(struct copybuf *b, uint16_t v)
{
	unsigned char x[2] = { (unsigned char)(v >> 8), (unsigned char)v };

	cb_add(b, x, 2);
}

static void
cb_u32(struct copybuf *b, uint32_t v)
{
	unsigned char x[4] = { (unsigned char)(v >> 24),
		(unsigned char)(v >> 16), (unsigned char)(v >> 8),
		(unsigned char)v };

	cb_add(b, x, 4);
}

static void
cb_i64(struct copybuf *b, int64_t v)
{
	cb_u32(b, 8);
	cb_u32(b, (uint32_t)((uint64_t)v >> 32));
	cb_u32(b, (uint32_t)v);
}

static void
cb_text(struct copybuf *b, const void *s, size_t n)
{
	cb_u32(b, (uint32_t)n);
	cb_add(b, s, n);
}

static void
copy_begin(struct copybuf *b, const char *sql)
{
	static const char sig[11] = "PGCOPY\n\377\r\n";
	PGresult *res = PQexec(b->c, sql);

	if (PQresultStatus(res) != PGRES_COPY_IN)
		die("%s: %s", sql, PQerrorMessage(b->c));
	PQclear(res);
	cb_add(b, sig, sizeof(sig));
	cb_u32(b, 0);		/* flags */
	cb_u32(b, 0);		/* header extension */
}

static void
copy_end(struct copybuf *b)
{
	PGresult *res;

	cb_u16(b, 0xffff);
	cb_flush(b);
	if (PQputCopyEnd(b->c, NULL) != 1)
		die("copy end: %s", PQerrorMessage(b->c));
	while ((res = PQgetResult(b->c)) != NULL) {
		if (PQresultStatus(res) != PGRES_COMMAND_OK)
			die("copy: %s", PQerrorMessage(b->c));
		PQclear(res);
	}
}

/* The 1 KiB body of message id: its id, then filler. */
static void
fill_body(char *body, int64_t id)
{
	int n = snprintf(body, BODY_SIZE, "{\"id\":%" PRId64 ",\"pad\":\"",
	    id);

	memset(body + n, 'x', BODY_SIZE - (size_t)n - 2);
	memcpy(body + BODY_SIZE - 2, "\"}", 2);
}

/*
 * Loads n due rows with ids first.. in one transaction with binary COPY,
 * spread round-robin over nq queues, each with a 1 KiB body, the
 * business_module and business_key a producer would set.  Returns when
 * the transaction has committed.
 */
static void
load_rows(PGconn *c, int64_t first, long n, int nq)
{
	struct copybuf b = { .c = c };
	char body[BODY_SIZE], q[32], key[32];

	pg_do(c, "BEGIN");
	copy_begin(&b, "COPY t_transactional_message (id, queue_name,"
	    " business_module, business_key) FROM STDIN (FORMAT binary)");
	for (long i = 0; i < n; i++) {
		int64_t id = first + i;
		int kl = snprintf(key, sizeof(key), "k%" PRId64, id);
		int ql = snprintf(q, sizeof(q), QUEUE_PREFIX "%ld", i % nq);

		cb_u16(&b, 4);
		cb_i64(&b, id);
		cb_text(&b, q, (size_t)ql);
		cb_text(&b, "bench", 5);
		cb_text(&b, key, (size_t)kl);
		if (b.len > (1 << 20))
			cb_flush(&b);
	}
	copy_end(&b);
	copy_begin(&b, "COPY t_transactional_message_content (message_id,"
	    " content) FROM STDIN (FORMAT binary)");
	for (long i = 0; i < n; i++) {
		fill_body(body, first + i);
		cb_u16(&b, 2);
		cb_i64(&b, first + i);
		cb_text(&b, body, BODY_SIZE);
		if (b.len > (1 << 20))
			cb_flush(&b);
	}
	copy_end(&b);
	pg_do(c, "COMMIT");
	/* Producers after us take ids from the sequence. */
	pg_do(c, "SELECT setval(pg_get_serial_sequence("
	    "'t_transactional_message', 'id'), %" PRId64 ")", first + n - 1);
	free(b.p);
}

/* ---- RabbitMQ ----------------------------------------------------------- */

static void
mq_check(amqp_rpc_reply_t r, const char *what)
{
	if (r.reply_type == AMQP_RESPONSE_NORMAL)
		return;
	if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
		die("amqp %s: %s", what, amqp_error_string2(r.library_error));
	die("amqp %s: refused by the broker (method 0x%08x)", what,
	    (unsigned)r.reply.id);
}

static amqp_connection_state_t
mq_open(void)
{
	amqp_connection_state_t c = amqp_new_connection();
	amqp_socket_t *s = amqp_tcp_socket_new(c);
	int one = 1;

	if (s == NULL || amqp_socket_open(s, "127.0.0.1", O.amqp_port) !=
	    AMQP_STATUS_OK)
		die("amqp: cannot connect to 127.0.0.1:%d", O.amqp_port);
	(void)setsockopt(amqp_get_sockfd(c), IPPROTO_TCP, TCP_NODELAY, &one,
	    sizeof(one));
	mq_check(amqp_login(c, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN,
	    "guest", "guest"), "login");
	amqp_channel_open(c, CH);
	mq_check(amqp_get_rpc_reply(c), "channel.open");
	return c;
}

static void
mq_close(amqp_connection_state_t c)
{
	(void)amqp_channel_close(c, CH, AMQP_REPLY_SUCCESS);
	(void)amqp_connection_close(c, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(c);
}

/*
 * The queue argument of --queue-arg ("x-queue-mode=lazy",
 * "x-queue-version=2"): a value of digits is an integer, as RabbitMQ
 * wants for the version.  Empty without the option.
 */
static amqp_table_t
queue_args(void)
{
	static char key[64];
	static amqp_table_entry_t entry;
	amqp_table_t t = amqp_empty_table;
	const char *eq;

	/* The option's parser has checked for the '='. */
	if (O.queue_arg == NULL || (eq = strchr(O.queue_arg, '=')) == NULL)
		return t;
	snprintf(key, sizeof(key), "%.*s", (int)(eq - O.queue_arg),
	    O.queue_arg);
	entry.key = amqp_cstring_bytes(key);
	if (eq[1] != '\0' && strspn(eq + 1, "0123456789") == strlen(eq + 1)) {
		entry.value.kind = AMQP_FIELD_KIND_I32;
		entry.value.value.i32 = atoi(eq + 1);
	} else {
		entry.value.kind = AMQP_FIELD_KIND_UTF8;
		entry.value.value.bytes = amqp_cstring_bytes(eq + 1);
	}
	t.num_entries = 1;
	t.entries = &entry;
	return t;
}

/* Declares durable classic queues (with --queue-arg's argument) and
 * empties them. */
static void
mq_fresh_queues(const char *const *names, int n)
{
	amqp_connection_state_t c = mq_open();

	for (int i = 0; i < n; i++) {
		amqp_queue_declare(c, CH, amqp_cstring_bytes(names[i]), 0, 1,
		    0, 0, queue_args());
		mq_check(amqp_get_rpc_reply(c), "queue.declare");
		amqp_queue_purge(c, CH, amqp_cstring_bytes(names[i]));
		mq_check(amqp_get_rpc_reply(c), "queue.purge");
	}
	mq_close(c);
}

static const char *const bench_queues[MAX_QUEUES] = {
	QUEUE_PREFIX "0", QUEUE_PREFIX "1", QUEUE_PREFIX "2", QUEUE_PREFIX "3",
};

/*
 * The consumer: counts what arrives on its queues (auto-ack), checks the
 * message ids against the range it expects, and keeps receipt times for
 * latency.  One thread with its own connection.
 */
struct consumer {
	pthread_t th;
	const char *queues[MAX_QUEUES];
	int nq;
	int64_t lo, n;		/* expected ids lo..lo+n-1; n = 0: count */
	unsigned char *seen;
	int64_t *recv_us;	/* per id, or NULL */
	atomic_llong delivered, distinct;
	atomic_bool stop, ready;
	int64_t dups, strays, last_us;
	char err[256];
};

static void
consumer_got(struct consumer *k, const amqp_envelope_t *env, int64_t t)
{
	const amqp_basic_properties_t *p = &env->message.properties;
	int64_t id;

	k->last_us = t;
	atomic_fetch_add(&k->delivered, 1);
	if (k->n == 0) {
		atomic_fetch_add(&k->distinct, 1);
		return;
	}
	if (!(p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG) ||
	    !int64_parse(p->message_id.bytes, p->message_id.len, &id) ||
	    id < k->lo || id >= k->lo + k->n) {
		k->strays++;
		return;
	}
	if (k->seen[id - k->lo]) {
		k->dups++;
		return;
	}
	k->seen[id - k->lo] = 1;
	if (k->recv_us != NULL)
		k->recv_us[id - k->lo] = t;
	atomic_fetch_add(&k->distinct, 1);
}

static void *
consumer_main(void *arg)
{
	struct consumer *k = arg;
	amqp_connection_state_t c = mq_open();

	for (int i = 0; i < k->nq; i++) {
		amqp_basic_consume(c, CH, amqp_cstring_bytes(k->queues[i]),
		    amqp_empty_bytes, 0, 1, 0, amqp_empty_table);
		mq_check(amqp_get_rpc_reply(c), "basic.consume");
	}
	atomic_store(&k->ready, true);
	while (!atomic_load(&k->stop)) {
		struct timeval tv = { 0, 100000 };
		amqp_envelope_t env;
		amqp_rpc_reply_t r;
		amqp_frame_t f;

		amqp_maybe_release_buffers(c);
		r = amqp_consume_message(c, &env, &tv, 0);
		if (r.reply_type == AMQP_RESPONSE_NORMAL) {
			consumer_got(k, &env, us_now());
			amqp_destroy_envelope(&env);
			continue;
		}
		if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
		    r.library_error == AMQP_STATUS_TIMEOUT)
			continue;
		if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
		    r.library_error == AMQP_STATUS_UNEXPECTED_STATE) {
			/* A frame other than a delivery: nothing expected. */
			tv.tv_usec = 0;
			if (amqp_simple_wait_frame_noblock(c, &f, &tv) ==
			    AMQP_STATUS_OK && f.frame_type ==
			    AMQP_FRAME_METHOD && (f.payload.method.id ==
			    AMQP_CHANNEL_CLOSE_METHOD || f.payload.method.id ==
			    AMQP_CONNECTION_CLOSE_METHOD)) {
				strfmt(k->err, sizeof(k->err), "consumer: "
				    "closed by the broker");
				break;
			}
			continue;
		}
		strfmt(k->err, sizeof(k->err), "consumer: %s",
		    r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION ?
		    amqp_error_string2(r.library_error) : "bad reply");
		break;
	}
	mq_close(c);
	return NULL;
}

static void
consumer_start(struct consumer *k, const char *const *queues, int nq,
    int64_t lo, int64_t n, bool latency)
{
	memset(k, 0, sizeof(*k));
	for (int i = 0; i < nq; i++)
		k->queues[i] = queues[i];
	k->nq = nq;
	k->lo = lo;
	k->n = n;
	if (n > 0)
		k->seen = xcalloc((size_t)n, 1);
	if (latency)
		k->recv_us = xcalloc((size_t)n, sizeof(*k->recv_us));
	atomic_init(&k->delivered, 0);
	atomic_init(&k->distinct, 0);
	atomic_init(&k->stop, false);
	atomic_init(&k->ready, false);
	if (pthread_create(&k->th, NULL, consumer_main, k) != 0)
		die("pthread_create failed");
	for (int64_t end = us_now() + 10000000; !atomic_load(&k->ready);) {
		if (us_now() > end)
			die("the consumer did not start");
		nap_us(1000);
	}
}

/* Waits until want distinct messages arrived or deadline_us passed. */
static bool
consumer_wait(struct consumer *k, int64_t want, int64_t deadline_us)
{
	while (atomic_load(&k->distinct) < want) {
		if (us_now() > deadline_us || k->err[0] != '\0')
			return false;
		nap_us(2000);
	}
	return true;
}

/* Stops the thread after a quiet grace period that catches duplicates. */
static void
consumer_stop(struct consumer *k, int64_t grace_us)
{
	nap_us(grace_us);
	atomic_store(&k->stop, true);
	pthread_join(k->th, NULL);
}

static void
consumer_free(struct consumer *k)
{
	free(k->seen);
	free(k->recv_us);
	k->seen = NULL;
	k->recv_us = NULL;
}

/* ---- publishing with confirms ------------------------------------------- */

/*
 * A publisher on its own connection: persistent messages with the same
 * properties and headers as outboxd's, mandatory, with confirms, and a
 * window of up to cap unconfirmed messages.  Delivery tags live in a
 * ring; lo is the lowest one not yet confirmed.
 */
struct mqpub {
	amqp_connection_state_t c;
	unsigned char *done;
	size_t cap;
	uint64_t lo, next;
	int64_t acked, nacked, returned;
	char err[256];
};

static void
mqpub_open(struct mqpub *p, size_t cap)
{
	memset(p, 0, sizeof(*p));
	p->c = mq_open();
	p->cap = cap;
	p->done = xcalloc(cap, 1);
	p->lo = p->next = 1;
	amqp_confirm_select(p->c, CH);
	mq_check(amqp_get_rpc_reply(p->c), "confirm.select");
}

static void
mqpub_close(struct mqpub *p)
{
	mq_close(p->c);
	free(p->done);
	p->done = NULL;
}

static bool
mqpub_full(const struct mqpub *p)
{
	return p->next - p->lo >= p->cap;
}

static void
mqpub_ack(struct mqpub *p, uint64_t tag, bool multiple, bool ack)
{
	if (tag >= p->next || tag < p->lo)
		return;
	for (uint64_t t = multiple ? p->lo : tag; t <= tag; t++) {
		if (p->done[t % p->cap])
			continue;
		p->done[t % p->cap] = 1;
		if (ack)
			p->acked++;
		else
			p->nacked++;
	}
	while (p->lo < p->next && p->done[p->lo % p->cap])
		p->done[p->lo++ % p->cap] = 0;
}

/*
 * Reads one frame, waiting up to wait_us for it, and books it: 0 one
 * was handled, 1 none came, -1 the connection failed (p->err).
 */
static int
mqpub_read(struct mqpub *p, int64_t wait_us)
{
	struct timeval tv = { 0, 0 };
	amqp_frame_t f;
	int st;

	/* Frames already read into the library never wake poll(). */
	if (wait_us > 0 && !amqp_frames_enqueued(p->c) &&
	    !amqp_data_in_buffer(p->c))
		tv = (struct timeval){ wait_us / 1000000, wait_us % 1000000 };
	st = amqp_simple_wait_frame_noblock(p->c, &f, &tv);
	if (st == AMQP_STATUS_TIMEOUT)
		return 1;
	if (st != AMQP_STATUS_OK) {
		strfmt(p->err, sizeof(p->err), "publisher: %s",
		    amqp_error_string2(st));
		return -1;
	}
	if (f.frame_type == AMQP_FRAME_METHOD) {
		const amqp_basic_ack_t *a = f.payload.method.decoded;
		const amqp_basic_nack_t *na = f.payload.method.decoded;

		switch (f.payload.method.id) {
		case AMQP_BASIC_ACK_METHOD:
			mqpub_ack(p, a->delivery_tag, a->multiple, true);
			break;
		case AMQP_BASIC_NACK_METHOD:
			mqpub_ack(p, na->delivery_tag, na->multiple, false);
			break;
		case AMQP_BASIC_RETURN_METHOD:
			p->returned++;
			break;
		case AMQP_CHANNEL_CLOSE_METHOD:
		case AMQP_CONNECTION_CLOSE_METHOD:
			strfmt(p->err, sizeof(p->err), "publisher: closed by "
			    "the broker");
			return -1;
		default:
			break;
		}
	}
	amqp_maybe_release_buffers_on_channel(p->c, f.channel);
	return 0;
}

/* Publishes one message; the window must have room.  Reads the acks
 * that are there every 64 messages, as outboxd does. */
static int
mqpub_send(struct mqpub *p, const char *routing_key, int64_t id,
    const char *business_key, const void *body, size_t len)
{
	amqp_table_entry_t h[3];
	amqp_basic_properties_t props;
	char idtext[24];

	snprintf(idtext, sizeof(idtext), "%" PRId64, id);
	h[0].key = amqp_cstring_bytes("business_module");
	h[0].value.kind = AMQP_FIELD_KIND_UTF8;
	h[0].value.value.bytes = amqp_cstring_bytes("bench");
	h[1].key = amqp_cstring_bytes("business_key");
	h[1].value.kind = AMQP_FIELD_KIND_UTF8;
	h[1].value.value.bytes = amqp_cstring_bytes(business_key);
	h[2].key = amqp_cstring_bytes("attempt");
	h[2].value.kind = AMQP_FIELD_KIND_I32;
	h[2].value.value.i32 = 1;
	memset(&props, 0, sizeof(props));
	props._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_HEADERS_FLAG |
	    AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG |
	    AMQP_BASIC_TIMESTAMP_FLAG;
	props.content_type = amqp_cstring_bytes("application/json");
	props.headers.num_entries = 3;
	props.headers.entries = h;
	props.delivery_mode = AMQP_DELIVERY_PERSISTENT;
	props.message_id = amqp_cstring_bytes(idtext);
	props.timestamp = (uint64_t)(us_wall() / 1000000);
	if (amqp_basic_publish(p->c, CH, amqp_cstring_bytes(""),
	    amqp_cstring_bytes(routing_key), 1, 0, &props,
	    (amqp_bytes_t){ len, (void *)body }) != AMQP_STATUS_OK) {
		strfmt(p->err, sizeof(p->err), "publish failed");
		return -1;
	}
	if (++p->next % 64 == 0) {
		int rc;

		while ((rc = mqpub_read(p, 0)) == 0)
			;
		if (rc == -1)
			return -1;
	}
	return 0;
}

/* Waits until every tag below upto is confirmed, or the deadline. */
static int
mqpub_wait(struct mqpub *p, uint64_t upto, int64_t deadline_us)
{
	while (p->lo < upto) {
		if (us_now() > deadline_us) {
			strfmt(p->err, sizeof(p->err), "%" PRIu64 " confirms "
			    "missing", upto - p->lo);
			return -1;
		}
		if (mqpub_read(p, 100000) == -1)
			return -1;
	}
	return 0;
}

/* ---- raw broker limit --------------------------------------------------- */

/* One connection publishing as fast as its window allows. */
struct publisher {
	pthread_t th;
	const char *queues[MAX_QUEUES];
	int nq;
	pthread_barrier_t *start;
	int64_t stop_us;	/* publish until then, set before the barrier */
	int64_t limit;		/* or until this many went out, if > 0 */
	int64_t seq;		/* message ids from seq up */
	int64_t confirmed, nacked, returned, last_us;
	char err[256];
};

/* Whether the publisher goes on: before its stop time, and below its
 * message limit when it has one (tags start at 1). */
static bool
publishing(const struct publisher *pb, const struct mqpub *p)
{
	return us_now() < pb->stop_us &&
	    (pb->limit == 0 || (int64_t)p->next <= pb->limit);
}

static void *
publisher_main(void *arg)
{
	struct publisher *pb = arg;
	struct mqpub p;
	char body[BODY_SIZE], key[32];
	long k = 0;

	mqpub_open(&p, (size_t)O.window);
	fill_body(body, 0);
	pthread_barrier_wait(pb->start);
	while (publishing(pb, &p)) {
		while (!mqpub_full(&p) && publishing(pb, &p)) {
			int64_t id = pb->seq++;

			snprintf(key, sizeof(key), "k%" PRId64, id);
			if (mqpub_send(&p, pb->queues[k++ % pb->nq], id, key,
			    body, BODY_SIZE) == -1)
				goto out;
		}
		if (mqpub_read(&p, 100000) == -1)
			goto out;
	}
	/* The tail: every confirm of what went out. */
	if (mqpub_wait(&p, p.next, us_now() + 30000000) == -1)
		goto out;
	pb->last_us = us_now();
out:
	strfmt(pb->err, sizeof(pb->err), "%s", p.err);
	pb->confirmed = p.acked;
	pb->nacked = p.nacked;
	pb->returned = p.returned;
	mqpub_close(&p);
	return NULL;
}

struct raw_result {
	double rate;
	double pg_rate;		/* rows/s claimed and marked beside it */
	long pg_rows;
	double beam_pct, machine;
	int64_t confirmed, consumed;
	bool ok;
};

/* Messages ready in queue q (a passive declare). */
static int64_t
mq_count(amqp_connection_state_t c, const char *q)
{
	amqp_queue_declare_ok_t *ok = amqp_queue_declare(c, CH,
	    amqp_cstring_bytes(q), 1, 0, 0, 0, amqp_empty_table);

	mq_check(amqp_get_rpc_reply(c), "queue.declare");
	return ok->message_count;
}

/* Waits until the queues hold want messages (the count lags behind the
 * confirms for a moment), or until it stops moving. */
static int64_t
mq_wait_count(const char *const *queues, int nq, int64_t want)
{
	amqp_connection_state_t c = mq_open();
	int64_t n = -1, prev = -2, end = us_now() + 30000000, still = 0;

	while (us_now() < end) {
		n = 0;
		for (int i = 0; i < nq; i++)
			n += mq_count(c, queues[i]);
		if (n == want)
			break;
		if (n == prev && ++still > 20)
			break;
		if (n != prev)
			still = 0;
		prev = n;
		nap_us(50000);
	}
	mq_close(c);
	return n;
}

/* Claims a batch and marks every row sent: the database's work for one
 * batch without a broker.  Returns the rows, 0 when none were due. */
static long
claim_mark_batch(struct store *s, const struct store_claim_opts *co,
    struct store_mark *marks)
{
	struct store_batch batch;
	size_t n;

	if (store_claim(s, co, &batch) == -1)
		die("claim: %s", store_error(s));
	n = batch.n;	/* store_finish() releases the batch */
	for (size_t i = 0; i < n; i++) {
		marks[i].id = batch.rows[i].id;
		marks[i].kind = MARK_SUCCESS;
	}
	if (n > 0 && store_finish(s, &batch, marks, n) == -1)
		die("mark: %s", store_error(s));
	return (long)n;
}

/*
 * The database's share of a drain without the broker: outboxd's claim
 * and mark on rows loaded beforehand, paced to rate rows/s, until stop.
 * Run beside a raw publisher it shows what the broker gets from a machine
 * that also does the database's work.
 */
struct pgload {
	pthread_t th;
	long rate;
	atomic_bool stop;
	long done;
};

static void *
pgload_main(void *arg)
{
	struct pgload *l = arg;
	struct store_conf sc = { .conninfo = (char *)O.conninfo,
		.connect_timeout_ms = 5000, .application_name = "bench-pgload",
		.index_plans = true };
	struct store_claim_opts co = { .limit = 1000, .include_retries = true };
	struct store_mark *marks = xcalloc(1000, sizeof(*marks));
	struct store *s = store_new(&sc);
	int64_t t0;
	long n;

	if (store_connect(s) == -1)
		die("store: %s", store_error(s));
	t0 = us_now();
	while (!atomic_load(&l->stop)) {
		int64_t due = t0 + (int64_t)((double)l->done * 1e6 /
		    (double)l->rate);

		if (us_now() < due) {
			nap_us(due - us_now() > 2000 ? 2000 : due - us_now());
			continue;
		}
		n = claim_mark_batch(s, &co, marks);
		if (n == 0)
			break;
		l->done += n;
	}
	store_free(s);
	free(marks);
	return NULL;
}

/*
 * Rows to load for a database load paced at rate rows/s beside a raw
 * run: enough to outlast it with room to spare, since a load that ran
 * out early would flatter the broker.  A timed run lasts O.raw_s; one of
 * limit messages is paced by outboxd's drain of as many rows, which took
 * limit / rate seconds, and the broker beside the database may be
 * slower than that drain (by up to a third, here).
 */
static long
pgload_rows(long rate, int64_t limit)
{
	if (limit > 0)
		return (long)(limit * 3 / 2) + rate * 4;
	return rate * (O.raw_s + 4);
}

/*
 * Publishes for O.raw_s seconds over nconn connections to nq queues
 * (more queues than connections: a share each; fewer: they take turns
 * on them); or, with limit > 0, limit messages shared out among the
 * connections.  live: one consumer empties the queues meanwhile, as
 * during a drain; otherwise the queues fill, are counted afterwards and
 * purged.  pg_rate > 0: PostgreSQL claims and marks that many rows/s
 * meanwhile.
 */
static void
raw_run(int nconn, int nq, bool live, long pg_rate, int64_t limit,
    struct raw_result *r)
{
	struct publisher pubs[MAX_CONNS];
	pthread_barrier_t start;
	struct consumer k;
	struct cpu_mark m;
	struct cpu_use u;
	int64_t t0, last = 0;

	memset(r, 0, sizeof(*r));
	memset(pubs, 0, sizeof(pubs));
	struct pgload pl = { .rate = pg_rate };

	mq_fresh_queues(bench_queues, nq);
	if (pl.rate > 0) {
		PGconn *c = pg_open();

		reset_tables(c);
		load_rows(c, 1, pgload_rows(pl.rate, limit), 1);
		pg_do(c, "CHECKPOINT");
		PQfinish(c);
	}
	if (live)
		consumer_start(&k, bench_queues, nq, 0, 0, false);
	pthread_barrier_init(&start, NULL, (unsigned)nconn + 1);
	t0 = us_now();
	for (int i = 0; i < nconn; i++) {
		struct publisher *p = &pubs[i];

		if (nq >= nconn) {
			for (int q = i; q < nq; q += nconn)
				p->queues[p->nq++] = bench_queues[q];
		} else {
			p->queues[p->nq++] = bench_queues[i % nq];
		}
		p->start = &start;
		p->seq = (int64_t)i * 1000000000;
		p->stop_us = t0 + 2000000 + (limit > 0 ? 300000000 :
		    (int64_t)O.raw_s * 1000000);
		p->limit = limit / nconn + (i < limit % nconn);
		if (pthread_create(&p->th, NULL, publisher_main, p) != 0)
			die("pthread_create failed");
	}
	pthread_barrier_wait(&start);
	/* Connecting took a moment: run for raw_s from here. */
	t0 = us_now();
	if (pl.rate > 0 && pthread_create(&pl.th, NULL, pgload_main, &pl) != 0)
		die("pthread_create failed");
	cpu_mark(&m, -1);
	for (int i = 0; i < nconn; i++) {
		pthread_join(pubs[i].th, NULL);
		if (pubs[i].err[0] != '\0')
			die("raw publish: %s", pubs[i].err);
		if (pubs[i].nacked > 0 || pubs[i].returned > 0)
			die("raw publish: %" PRId64 " nacked, %" PRId64
			    " returned", pubs[i].nacked, pubs[i].returned);
		r->confirmed += pubs[i].confirmed;
		if (pubs[i].last_us > last)
			last = pubs[i].last_us;
	}
	cpu_since(&m, -1, &u);
	if (pl.rate > 0) {
		atomic_store(&pl.stop, true);
		pthread_join(pl.th, NULL);
		r->pg_rows = pl.done;
		r->pg_rate = (double)pl.done / ((double)(us_now() - t0) / 1e6);
	}
	pthread_barrier_destroy(&start);
	r->rate = (double)r->confirmed / ((double)(last - t0) / 1e6);
	r->beam_pct = u.beam;
	r->machine = u.machine;
	if (!live) {
		r->consumed = mq_wait_count(bench_queues, nq, r->confirmed);
		r->ok = r->consumed == r->confirmed;
		mq_fresh_queues(bench_queues, nq);
		return;
	}
	r->ok = consumer_wait(&k, r->confirmed, us_now() + 30000000);
	consumer_stop(&k, 200000);
	r->consumed = atomic_load(&k.delivered);
	r->ok = r->ok && r->consumed == r->confirmed;
	consumer_free(&k);
}

/*
 * Fills the queues with n messages over one connection, untimed, and
 * purges them.  Whoever publishes, a classic queue usually confirms
 * more slowly on its first fill after a live-consumer run (in 10 of 12
 * alternating pairs, by 4-28%) or after the broker started (by about a
 * quarter) than on a fill right after another fill and purge: the
 * queue-fills run that came first after the live ones used to lose
 * (docs/PERFORMANCE-LOG.md, "The first fill after a live run").  Every
 * queue-fills figure, raw or drain, starts after one of these.
 */
static void
fills_warm_up(int nq, long n)
{
	struct raw_result r;

	raw_run(1, nq, false, 0, n, &r);
	if (!r.ok || r.confirmed != n)
		die("warm-up publish: %" PRId64 " of %ld confirmed, %" PRId64
		    " in the queues", r.confirmed, n, r.consumed);
}

/* Best raw rate by [live][queue count]. */
static double raw_best[2][MAX_QUEUES + 1];
/* Machine CPU per message in microseconds (all processes, every core):
 * of the best raw run, and of PostgreSQL alone. */
static double raw_cpu_us[2][MAX_QUEUES + 1], pg_cpu_us;

static const char *
regime(bool live)
{
	return live ? "live consumer" : "queue fills";
}

/* The raw runs of one figure: 1, 2 and 4 connections, each the best of
 * O.repeat; the best of them is the figure. */
struct raw_series {
	char parts[128];	/* "1c R, 2c R, 4c R" */
	struct raw_result best;
	int64_t confirmed, consumed;	/* over every run */
	bool ok;
};

/*
 * With a live consumer a run is timed (O.raw_s).  With the queues
 * filling, a run publishes as many messages as a drain has rows, so the
 * queues grow as deep as a drain leaves them: a classic queue confirms
 * more slowly the more it holds (6-24% more slowly filling to 400,000
 * messages than to 60,000, in alternating runs; docs/PERFORMANCE-LOG.md),
 * so a timed run stopped at a shallower depth measured a faster broker
 * than any drain meets.
 */
static void
raw_series(int nq, bool live, long pg_rate, struct raw_series *sr)
{
	static const int nconns[] = { 1, 2, 4 };
	int64_t limit = live ? 0 : O.rows;

	memset(sr, 0, sizeof(*sr));
	sr->ok = true;
	if (!live)
		fills_warm_up(nq, O.rows);
	for (size_t b = 0; b < ARRAY_LEN(nconns); b++) {
		struct raw_result r, again;
		size_t len = strlen(sr->parts);

		raw_run(nconns[b], nq, live, pg_rate, limit, &r);
		for (int i = 1; i < O.repeat; i++) {
			raw_run(nconns[b], nq, live, pg_rate, limit, &again);
			if (again.rate > r.rate)
				r = again;
		}
		note("raw broker%s, %s: %d queue(s), %d connection(s): %.0f "
		    "msg/s (broker %.0f%% of a core, machine %.2f cores busy"
		    "; database %.0f rows/s)", pg_rate > 0 ? " beside the "
		    "database" : "", regime(live), nq, nconns[b], r.rate,
		    r.beam_pct, r.machine, r.pg_rate);
		snprintf(sr->parts + len, sizeof(sr->parts) - len, "%s%dc %.0f",
		    len ? ", " : "", nconns[b], r.rate);
		sr->ok = sr->ok && r.ok;
		sr->confirmed += r.confirmed;
		sr->consumed += r.consumed;
		if (r.rate > sr->best.rate)
			sr->best = r;
	}
}

static struct row *
raw_row(const char *figure, const struct raw_series *sr, bool live)
{
	struct row *row = row_add(figure);

	strfmt(row->value, sizeof(row->value), "%.0f msg/s", sr->best.rate);
	strfmt(row->target, sizeof(row->target), "reference");
	strfmt(row->check, sizeof(row->check), "%" PRId64 " confirmed, %"
	    PRId64 " %s", sr->confirmed, sr->consumed, live ? "consumed" :
	    "counted");
	if (!sr->ok) {
		strfmt(row->verdict, sizeof(row->verdict), "FAIL");
		sanity_failed = true;
	}
	return row;
}

static void
phase_raw(void)
{
	static const int nqs[] = { 1, 4 };

	for (int live = 1; live >= 0; live--) {
		for (size_t a = 0; a < ARRAY_LEN(nqs); a++) {
			struct raw_series sr;
			struct row *row;
			char fig[64];

			raw_series(nqs[a], live, 0, &sr);
			raw_best[live][nqs[a]] = sr.best.rate;
			raw_cpu_us[live][nqs[a]] = sr.best.rate > 0 ?
			    sr.best.machine * 1e6 / sr.best.rate : 0;
			snprintf(fig, sizeof(fig), "raw RabbitMQ, %d queue%s, "
			    "%s", nqs[a], nqs[a] > 1 ? "s" : "", regime(live));
			row = raw_row(fig, &sr, live);
			strfmt(row->ref, sizeof(row->ref), "%s; broker %.0f%% "
			    "core, machine %.1f cores", sr.parts,
			    sr.best.beam_pct, sr.best.machine);
		}
	}
}

/* ---- raw PostgreSQL claim + mark ---------------------------------------- */

/* outboxd's own claim and mark statements (the store module), with every
 * row marked sent at once: what the database allows without a broker. */
/*
 * What the machine allows at most with a live consumer, where the raw
 * run keeps every core busy: a drain must pay for the broker's path (the
 * raw run's CPU per message: broker, publisher, consumer) and for the
 * database's (claim and mark), and both share the same cores.  Any relay
 * on this machine stays below this, however it is built.
 */
static void
ceiling_rows(void)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

	for (int nq = 1; nq <= 4; nq += 3) {
		double per_msg = raw_cpu_us[1][nq] + pg_cpu_us, ceiling;
		struct row *row;
		char fig[64];

		if (raw_cpu_us[1][nq] <= 0 || pg_cpu_us <= 0)
			continue;
		ceiling = (double)ncpu * 1e6 / per_msg;
		snprintf(fig, sizeof(fig), "CPU ceiling, %d queue%s, live "
		    "consumer", nq, nq > 1 ? "s" : "");
		row = row_add(fig);
		strfmt(row->value, sizeof(row->value), "%.0f msg/s", ceiling);
		strfmt(row->ref, sizeof(row->ref), "%.1f%% of raw %.0f: %ld "
		    "cores / (broker path %.1f us + database %.1f us per msg)",
		    100 * ceiling / raw_best[1][nq], raw_best[1][nq], ncpu,
		    raw_cpu_us[1][nq], pg_cpu_us);
		strfmt(row->target, sizeof(row->target), "bound");
		strfmt(row->verdict, sizeof(row->verdict), "info");
	}
}

static void
phase_pg(void)
{
	struct store_conf sc = { .conninfo = (char *)O.conninfo,
		.connect_timeout_ms = 5000, .application_name = "bench",
		.index_plans = true };
	struct store_claim_opts co = { .limit = O.batch,
		.include_retries = true };
	struct store_mark *marks = xcalloc((size_t)O.batch, sizeof(*marks));
	struct store *s = store_new(&sc);
	PGconn *c = pg_open();
	struct cpu_mark m;
	struct cpu_use cpu;
	struct row *row;
	long done = 0;
	int64_t t0, t1, end;
	long long sent;

	note("postgres alone: loading %ld rows", O.rows);
	reset_tables(c);
	load_rows(c, 1, O.rows, 1);
	pg_do(c, "CHECKPOINT");
	if (store_connect(s) == -1)
		die("store: %s", store_error(s));
	t0 = us_now();
	cpu_mark(&m, -1);
	end = t0 + 600 * 1000000LL;
	while (done < O.rows && us_now() < end) {
		long n = claim_mark_batch(s, &co, marks);

		if (n == 0)
			break;
		done += n;
	}
	t1 = us_now();
	cpu_since(&m, -1, &cpu);
	store_free(s);
	free(marks);
	sent = pg_int(c, "SELECT count(*) FROM t_transactional_message"
	    " WHERE message_status = 1");
	row = row_add("PostgreSQL alone: claim+mark");
	strfmt(row->value, sizeof(row->value), "%.0f rows/s",
	    (double)done / ((double)(t1 - t0) / 1e6));
	pg_cpu_us = done > 0 ? cpu.machine * ((double)(t1 - t0) / 1e6) * 1e6 /
	    (double)done : 0;
	strfmt(row->ref, sizeof(row->ref), "batches of %d, outboxd's SQL; "
	    "machine %.1f cores, %.1f us per row", O.batch, cpu.machine,
	    pg_cpu_us);
	strfmt(row->target, sizeof(row->target), "reference");
	strfmt(row->check, sizeof(row->check), "%ld claimed, %lld SUCCESS",
	    done, sent);
	if (done != O.rows || sent != O.rows) {
		strfmt(row->verdict, sizeof(row->verdict), "FAIL");
		sanity_failed = true;
	}
	note("postgres alone: %s", row->value);
	PQfinish(c);
	ceiling_rows();
}

/* ---- outboxd as a child ------------------------------------------------- */

/* GET path from outboxd's http endpoint into buf; the status or -1. */
static int
http_get(const char *path, char *buf, size_t size)
{
	struct sockaddr_in sa = { .sin_family = AF_INET,
		.sin_port = htons((uint16_t)O.http_port),
		.sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct timeval tv = { 2, 0 };
	char req[128];
	size_t len = 0;
	int fd, status = -1;
	ssize_t n;

	if ((fd = socket(AF_INET, SOCK_STREAM, 0)) == -1)
		return -1;
	(void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	(void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == -1)
		goto out;
	n = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\n\r\n", path);
	if (write(fd, req, (size_t)n) != n)
		goto out;
	while (len + 1 < size && (n = read(fd, buf + len, size - len - 1)) >
	    0)
		len += (size_t)n;
	buf[len] = '\0';
	if (sscanf(buf, "HTTP/%*s %d", &status) != 1)
		status = -1;
out:
	close(fd);
	return status;
}

/* A metric's value from the Prometheus text, or -1. */
static double
metric(const char *text, const char *name)
{
	size_t len = strlen(name);

	for (const char *p = text; (p = strstr(p, name)) != NULL; p += len) {
		if ((p == text || p[-1] == '\n') && p[len] == ' ')
			return strtod(p + len + 1, NULL);
	}
	return -1;
}

/* pipeline: relay.pipeline's value, or NULL for outboxd's default. */
static void
outboxd_config(const char *path, int batch, int workers,
    const char *pipeline)
{
	FILE *f = fopen(path, "w");

	if (f == NULL)
		die("%s: %s", path, strerror(errno));
	fprintf(f, "# written by outbox_bench\n"
	    "log:\n  level: warn\n"
	    "postgres:\n  conninfo: \"%s\"\n"
	    "rabbitmq:\n  nodes: [\"127.0.0.1:%d\"]\n"
	    "redis:\n  address: \"127.0.0.1:%d\"\n"
	    "relay:\n  batch_size: %d\n  workers: %d\n  poll_interval: 5s\n"
	    "%s%s%s"
	    "http:\n  listen: \"127.0.0.1:%d\"\n",
	    O.conninfo, O.amqp_port, O.redis_port, batch, workers,
	    pipeline ? "  pipeline: " : "", pipeline ? pipeline : "",
	    pipeline ? "\n" : "", O.http_port);
	fclose(f);
}

/* Finds outboxd's PostgreSQL backends, for their CPU: one per worker,
 * each connecting on its own thread (healthz speaks for the first). */
static void
find_backends(int workers)
{
	PGconn *c = pg_open();
	int64_t end = us_now() + 10000000;
	PGresult *res;

	n_backends = 0;
	for (;;) {
		res = PQexec(c, "SELECT pid FROM pg_stat_activity WHERE"
		    " application_name = 'outboxd'");
		if (PQresultStatus(res) != PGRES_TUPLES_OK)
			die("pg_stat_activity: %s", PQerrorMessage(c));
		if (PQntuples(res) >= workers || us_now() > end)
			break;
		PQclear(res);
		nap_us(10000);
	}
	for (int i = 0; i < PQntuples(res) && i < MAX_BACKENDS; i++)
		backend_pids[n_backends++] = (pid_t)atoi(PQgetvalue(res, i, 0));
	if (n_backends < workers)
		note("only %d of %d outboxd sessions found", n_backends,
		    workers);
	PQclear(res);
	PQfinish(c);
}

/* Runs `outboxd -c cfg command` as a child, its output in log. */
static pid_t
outboxd_spawn(const char *cfg, const char *command, const char *log)
{
	pid_t pid = fork();

	if (pid == -1)
		die("fork: %s", strerror(errno));
	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		/* Never outlive the benchmark. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
			close(fd);
		}
		execl(O.outboxd, "outboxd", "-c", cfg, command, (char *)NULL);
		_exit(127);
	}
	return pid;
}

/* Starts `outboxd run` and waits until /healthz says it is connected. */
static pid_t
outboxd_start(const char *tag, int batch, int workers, const char *pipeline)
{
	char cfg[512], log[512], buf[4096];
	int64_t end = us_now() + 30000000;
	pid_t pid;

	snprintf(cfg, sizeof(cfg), "%s/bench-outboxd.yml", O.dir);
	snprintf(log, sizeof(log), "%s/outboxd-%s.log", O.dir, tag);
	outboxd_config(cfg, batch, workers, pipeline);
	pid = outboxd_spawn(cfg, "run", log);
	child_pid = pid;
	for (;;) {
		int st;

		if (waitpid(pid, &st, WNOHANG) == pid) {
			child_pid = -1;
			die("outboxd exited at start-up; see %s", log);
		}
		if (http_get("/healthz", buf, sizeof(buf)) == 200)
			break;
		if (us_now() > end)
			die("outboxd not healthy after 30 s; see %s", log);
		nap_us(10000);
	}
	/* A pipelined relay has two sessions. */
	find_backends(pipeline != NULL && strcmp(pipeline, "true") == 0 ?
	    2 * workers : workers);
	return pid;
}

static void
outboxd_stop(pid_t pid)
{
	int64_t end = us_now() + 30000000;
	int st;

	kill(pid, SIGTERM);
	while (waitpid(pid, &st, WNOHANG) != pid) {
		if (us_now() > end) {
			kill(pid, SIGKILL);
			waitpid(pid, &st, 0);
			break;
		}
		nap_us(10000);
	}
	child_pid = -1;
	n_backends = 0;
}

static void
kill_child(void)
{
	if (child_pid > 0) {
		kill(child_pid, SIGKILL);
		waitpid(child_pid, NULL, 0);
	}
}

/* ---- drain -------------------------------------------------------------- */

enum relay_kind {
	RELAY_OUTBOXD,
	RELAY_REF_SEQ,		/* the bench's own loop, one step at a time */
	RELAY_REF_PIPE,		/* the same with the database work overlapped */
	RELAY_REF_WINDOW,	/* pipelined, two batches unconfirmed at once */
};

struct drain_spec {
	const char *tag;
	long n;
	int nq;
	int64_t lo;		/* first id */
	int batch;
	int workers;		/* 0: O.workers */
	const char *pipeline;	/* relay.pipeline; NULL: O.pipeline */
	bool backlog;		/* rows loaded before the relay starts */
	bool live;		/* the consumer runs during the drain */
	enum relay_kind relay;
	struct cpu_use *idle;	/* outboxd: measure idle CPU afterwards */
};

struct drain_result {
	struct drain_spec spec;
	double secs, rate;
	struct cpu_use cpu;
	long hwm_kib, anon_kib, file_kib;
	int64_t delivered, distinct, dups, strays;
	long long success;
	double batch_s, confirm_s, batches;	/* from /metrics */
	int64_t confirm_us, db_us;		/* reference loops */
	long long key_idx_scans;	/* see index_scans() */
	bool ok;
};

/*
 * Scans of the per-key ordering index.  The claim should walk the due
 * index; with stale statistics ("nothing is due") the planner may take
 * the ordering index instead, reading and sorting every unsent row for
 * each batch.  Counting its scans during a drain shows that plan.
 */
static long long
index_scans(PGconn *c)
{
	/* Counters reach the view when a session reports: be patient. */
	pg_do(c, "SELECT pg_stat_clear_snapshot()");
	return pg_int(c, "SELECT coalesce(sum(idx_scan), 0) FROM"
	    " pg_stat_user_indexes WHERE indexrelname ="
	    " 't_transactional_message_unsent_key_idx'");
}

/* Waits until no row in lo..hi is unsent; false at the deadline. */
static bool
rows_all_sent(PGconn *c, int64_t lo, int64_t hi, int64_t deadline_us)
{
	while (pg_int(c, "SELECT count(*) FROM t_transactional_message"
	    " WHERE message_status IN (0, 2) AND NOT deleted AND id BETWEEN"
	    " %" PRId64 " AND %" PRId64, lo, hi) != 0) {
		if (us_now() > deadline_us)
			return false;
		nap_us(5000);
	}
	return true;
}

/*
 * The reference loops: outboxd's own claim and mark statements (the store
 * module) around the plain confirm-window publisher above, with nothing
 * else (no failure handling, no metrics, no leader).  They show what the
 * cycle's shape allows on this machine, apart from outboxd's code.
 */
struct ref_side {
	struct store *s;
	struct store_batch b;
	uint64_t end;		/* tag after the batch's last message */
};

static void
ref_claim(struct ref_side *x, int batch)
{
	struct store_claim_opts co = { .limit = batch,
		.include_retries = true };

	if (store_claim(x->s, &co, &x->b) == -1)
		die("ref claim: %s", store_error(x->s));
}

static void
ref_publish(struct mqpub *p, struct ref_side *x)
{
	for (size_t i = 0; i < x->b.n; i++) {
		const struct outbox_row *row = &x->b.rows[i];

		if (mqpub_send(p, row->routing_key, row->id,
		    row->business_key, row->content, row->content_len) == -1)
			die("ref publish: %s", p->err);
	}
	x->end = p->next;
}

static size_t
ref_finish(struct ref_side *x, struct store_mark *marks)
{
	size_t n = x->b.n;

	for (size_t i = 0; i < n; i++) {
		marks[i].id = x->b.rows[i].id;
		marks[i].kind = MARK_SUCCESS;
	}
	if (store_finish(x->s, &x->b, marks, n) == -1)
		die("ref mark: %s", store_error(x->s));
	return n;
}

/*
 * Sequential: claim, publish, await every confirm, mark, commit.
 * Pipelined: two database sessions take turns, so that one batch's
 * confirms are awaited while the next is claimed, and one batch is
 * marked and committed while the broker works on the next.  Only one
 * batch is ever unconfirmed at the broker.
 */
static long
ref_loop(const struct drain_spec *sp, int64_t deadline,
    struct drain_result *r)
{
	struct store_conf sc = { .conninfo = (char *)O.conninfo,
		.connect_timeout_ms = 5000, .application_name = "bench-ref",
		.index_plans = true };
	struct store_mark *marks = xcalloc((size_t)sp->batch, sizeof(*marks));
	bool window = sp->relay == RELAY_REF_WINDOW;
	bool pipe = sp->relay == RELAY_REF_PIPE || window;
	struct ref_side side[2];
	struct mqpub p;
	long done = 0;
	int64_t t;
	int x = 0;

	memset(side, 0, sizeof(side));
	mqpub_open(&p, 2 * (size_t)sp->batch + 1);
	for (int i = 0; i < (pipe ? 2 : 1); i++) {
		side[i].s = store_new(&sc);
		if (store_connect(side[i].s) == -1)
			die("ref: %s", store_error(side[i].s));
	}
	/* The same split of the wall time as outboxd's metrics: from the
	 * first publish to the last confirm, and the database work. */
	t = us_now();
	ref_claim(&side[0], sp->batch);
	r->db_us += us_now() - t;
	t = us_now();
	ref_publish(&p, &side[0]);
	r->confirm_us += us_now() - t;
	while (window && side[x].b.n > 0) {
		struct ref_side *cur = &side[x], *nxt = &side[1 - x];

		/* The next batch goes out before this one's confirms are in:
		 * the broker never waits for the relay. */
		t = us_now();
		ref_claim(nxt, sp->batch);
		r->db_us += us_now() - t;
		t = us_now();
		if (nxt->b.n > 0)
			ref_publish(&p, nxt);
		if (mqpub_wait(&p, cur->end, deadline) == -1)
			die("ref: %s", p.err);
		r->confirm_us += us_now() - t;
		t = us_now();
		done += (long)ref_finish(cur, marks);
		r->db_us += us_now() - t;
		x = 1 - x;
	}
	while (!window && side[x].b.n > 0) {
		struct ref_side *cur = &side[x], *nxt = &side[pipe ? 1 - x : x];

		t = us_now();
		if (pipe)
			ref_claim(nxt, sp->batch);
		r->db_us += us_now() - t;
		t = us_now();
		if (mqpub_wait(&p, cur->end, deadline) == -1)
			die("ref: %s", p.err);
		if (pipe && nxt->b.n > 0)
			ref_publish(&p, nxt);
		r->confirm_us += us_now() - t;
		t = us_now();
		done += (long)ref_finish(cur, marks);
		if (!pipe)
			ref_claim(cur, sp->batch);
		r->db_us += us_now() - t;
		t = us_now();
		if (pipe)
			x = 1 - x;
		else
			ref_publish(&p, cur);
		r->confirm_us += us_now() - t;
	}
	if (p.nacked > 0 || p.returned > 0)
		die("ref: %" PRId64 " nacked, %" PRId64 " returned", p.nacked,
		    p.returned);
	mqpub_close(&p);
	for (int i = 0; i < 2; i++)
		store_free(side[i].s);
	free(marks);
	return done;
}

static void
drain_idle(pid_t pid, struct cpu_use *idle)
{
	struct pstat a, b;
	struct cpu_mark m;

	note("idle: measuring outboxd for %d s", O.idle_s);
	nap_us(2000000);	/* let the last batch settle */
	proc_read(pid, &a);
	cpu_mark(&m, pid);
	nap_us((int64_t)O.idle_s * 1000000);
	cpu_since(&m, pid, idle);
	proc_read(pid, &b);
	/* Wake-ups per second ride in the machine field. */
	idle->machine = (double)(b.vcsw + b.nvcsw - a.vcsw - a.nvcsw) /
	    O.idle_s;
	note("idle: outboxd %.2f%% core, %.1f wake-ups/s, pg backend %.2f%%",
	    idle->relay, idle->machine, idle->backend);
}

/*
 * Drains sp->n rows.  Rows loaded while the relay runs: the clock starts
 * when their COPY commits (its NOTIFY wakes outboxd).  A backlog: the rows
 * are there first and the clock starts with the relay.  It stops when
 * every row is SUCCESS and, with a live consumer, every message has
 * arrived; otherwise the consumer counts them afterwards.
 */
/*
 * Waits until outboxd counts want messages published (it counts them as
 * their confirms arrive, just before it marks them).  Polling the table
 * instead (a count over the unsent rows every few ms) took a third of a
 * core from the servers and slowed the drain it was timing.  Polling
 * /metrics every 10 ms still cost a filling drain about a tenth of its
 * rate (docs/PERFORMANCE-LOG.md, "The benchmark's own polling"): it
 * polls at most every 100 ms now, and more often only when the rate so
 * far says the end is near, so the end is still timed to a few ms.
 */
#define POLL_MIN_US 5000
#define POLL_MAX_US 100000

static bool
published_wait(int64_t want, int64_t deadline_us)
{
	char *text = xmalloc(65536);
	int64_t t0 = us_now(), t;
	bool ok = false;

	while ((t = us_now()) < deadline_us) {
		double got = -1, left_us = POLL_MAX_US;

		if (http_get("/metrics", text, 65536) == 200)
			got = metric(text, "outboxd_messages_published_total");
		if (got >= (double)want) {
			ok = true;
			break;
		}
		/* Half the time the rate so far needs for the rest. */
		if (got > 0 && t > t0)
			left_us = ((double)want - got) / (got / (double)(t - t0))
			    / 2;
		nap_us(left_us < POLL_MIN_US ? POLL_MIN_US :
		    left_us > POLL_MAX_US ? POLL_MAX_US : (int64_t)left_us);
	}
	free(text);
	return ok;
}

static void
drain(const struct drain_spec *sp, struct drain_result *r)
{
	bool outboxd = sp->relay == RELAY_OUTBOXD;
	PGconn *c = pg_open();
	char *text = xmalloc(65536);
	struct consumer k;
	struct cpu_mark m;
	struct pstat ps;
	int64_t t0, t1, deadline;
	pid_t pid = -1;

	memset(r, 0, sizeof(*r));
	r->spec = *sp;
	if (!sp->live)
		fills_warm_up(sp->nq, sp->n);
	mq_fresh_queues(bench_queues, sp->nq);
	if (sp->live)
		consumer_start(&k, bench_queues, sp->nq, sp->lo, sp->n, false);
	/* Every drain starts without checkpoint debt. */
	pg_do(c, "CHECKPOINT");
	r->key_idx_scans = index_scans(c);
	if (sp->backlog) {
		note("%s: loading a backlog of %ld rows", sp->tag, sp->n);
		load_rows(c, sp->lo, sp->n, sp->nq);
		pg_do(c, "CHECKPOINT");
		t0 = us_now();
		if (outboxd)
			pid = outboxd_start(sp->tag, sp->batch,
			    sp->workers > 0 ? sp->workers : O.workers,
			    sp->pipeline ? sp->pipeline : O.pipeline);
	} else {
		if (outboxd)
			pid = outboxd_start(sp->tag, sp->batch,
			    sp->workers > 0 ? sp->workers : O.workers,
			    sp->pipeline ? sp->pipeline : O.pipeline);
		note("%s: loading %ld rows%s", sp->tag, sp->n, outboxd ?
		    " while outboxd waits" : "");
		load_rows(c, sp->lo, sp->n, sp->nq);
		t0 = us_now();
	}
	cpu_mark(&m, pid);
	m.t_us = t0;
	/* Generous: a thousand messages a second at worst. */
	deadline = t0 + 60000000 + (int64_t)sp->n * 1000;
	if (!outboxd && ref_loop(sp, deadline, r) != sp->n)
		note("%s: the loop did not send every row", sp->tag);
	r->ok = !sp->live || consumer_wait(&k, sp->n, deadline);
	if (outboxd && !sp->live)
		r->ok = published_wait(sp->n, deadline) && r->ok;
	r->ok = rows_all_sent(c, sp->lo, sp->lo + sp->n - 1, deadline) &&
	    r->ok;
	t1 = us_now();
	cpu_since(&m, pid, &r->cpu);
	proc_read(pid, &ps);
	r->hwm_kib = ps.hwm_kib;
	r->anon_kib = ps.anon_kib;
	r->file_kib = ps.file_kib;
	r->secs = (double)(t1 - t0) / 1e6;
	r->rate = (double)sp->n / r->secs;
	nap_us(1000000);	/* stats are flushed about once a second */
	r->key_idx_scans = index_scans(c) - r->key_idx_scans;
	if (outboxd && http_get("/metrics", text, 65536) == 200) {
		r->batch_s = metric(text, "outboxd_batch_duration_seconds_sum");
		r->confirm_s = metric(text,
		    "outboxd_confirm_duration_seconds_sum");
		r->batches = metric(text,
		    "outboxd_batch_duration_seconds_count");
	}
	note("%s: %ld rows in %.2f s = %.0f msg/s; outboxd %.0f%% core, "
	    "broker %.0f%%, its pg backend %.0f%%, machine %.2f cores, "
	    "peak RSS %ld KiB; %lld scans of the ordering index", sp->tag,
	    sp->n, r->secs, r->rate, r->cpu.relay, r->cpu.beam,
	    r->cpu.backend, r->cpu.machine, r->hwm_kib, r->key_idx_scans);
	if (!sp->live) {
		/* Count what the queues hold, outside the clock. */
		consumer_start(&k, bench_queues, sp->nq, sp->lo, sp->n, false);
		r->ok = consumer_wait(&k, sp->n, us_now() + 120000000) &&
		    r->ok;
	}
	if (outboxd && sp->idle != NULL)
		drain_idle(pid, sp->idle);
	if (outboxd)
		outboxd_stop(pid);
	consumer_stop(&k, 500000);
	r->delivered = atomic_load(&k.delivered);
	r->distinct = atomic_load(&k.distinct);
	r->dups = k.dups;
	r->strays = k.strays;
	r->success = pg_int(c, "SELECT count(*) FROM t_transactional_message"
	    " WHERE message_status = 1 AND id BETWEEN %" PRId64 " AND %"
	    PRId64, sp->lo, sp->lo + sp->n - 1);
	r->ok = r->ok && r->distinct == sp->n && r->strays == 0 &&
	    r->success == sp->n && k.err[0] == '\0';
	consumer_free(&k);
	free(text);
	PQfinish(c);
}

static void
drain_check(struct row *row, const struct drain_result *r)
{
	strfmt(row->check, sizeof(row->check), "%ld rows: %" PRId64
	    " msgs, %" PRId64 " dup, %lld SUCCESS", r->spec.n, r->delivered,
	    r->dups, r->success);
	/* A few scans come from compensation; many mean the claim ran the
	 * plan that reads and sorts every unsent row. */
	if (r->key_idx_scans > 20) {
		size_t len = strlen(row->check);

		snprintf(row->check + len, sizeof(row->check) - len, "; %lld "
		    "claims read every unsent row", r->key_idx_scans);
	}
	if (!r->ok) {
		strfmt(row->verdict, sizeof(row->verdict), "FAIL");
		sanity_failed = true;
	}
}

/* Where a drain's wall time went, from outboxd's own histograms. */
static void
drain_breakdown(char *buf, size_t size, const struct drain_result *r)
{
	if (r->spec.relay != RELAY_OUTBOXD) {
		strfmt(buf, size, "publish to confirm %.0f%%, db %.0f%% of "
		    "wall; broker %.0f%% core, machine %.1f cores",
		    (double)r->confirm_us / 1e4 / r->secs,
		    (double)r->db_us / 1e4 / r->secs, r->cpu.beam,
		    r->cpu.machine);
		return;
	}
	if (r->batches <= 0) {
		strfmt(buf, size, "no metrics");
		return;
	}
	strfmt(buf, size, "publish to confirm %.0f%%, db %.0f%% of wall; "
	    "outboxd %.0f%% core, broker %.0f%%, machine %.1f cores",
	    100 * r->confirm_s / r->secs,
	    100 * (r->batch_s - r->confirm_s) / r->secs, r->cpu.relay,
	    r->cpu.beam, r->cpu.machine);
}

/* A drain's row: its rate against the raw figure of its regime. */
static void
drain_row(const char *figure, const struct drain_result *r, bool target)
{
	struct row *row = row_add(figure);
	double raw = raw_best[r->spec.live][r->spec.nq];
	char extra[128];

	strfmt(row->value, sizeof(row->value), "%.0f msg/s (%.1f s)",
	    r->rate, r->secs);
	drain_breakdown(extra, sizeof(extra), r);
	if (raw > 0) {
		double ratio = r->rate / raw;

		strfmt(row->ref, sizeof(row->ref), "%.1f%% of raw %.0f; %s",
		    100 * ratio, raw, extra);
		if (target)
			strfmt(row->verdict, sizeof(row->verdict), "%s",
			    ratio >= TARGET_DRAIN_RATIO ? "PASS" : "MISS");
	} else {
		strfmt(row->ref, sizeof(row->ref), "no raw figure; %s", extra);
		if (target)	/* the raw phase did not run */
			strfmt(row->verdict, sizeof(row->verdict), "n/a");
	}
	strfmt(row->target, sizeof(row->target), "%s", target ?
	    ">= 95% of raw" : "-");
	drain_check(row, r);
}

static double drain_1q_rate[2];		/* by live */

/* One drain on truncated tables. */
static void
drain_empty(const struct drain_spec *sp, struct drain_result *r)
{
	PGconn *c = pg_open();

	reset_tables(c);
	PQfinish(c);
	drain(sp, r);
}

/* Drains on an empty table, O.repeat times; keeps the fastest run. */
static void
drain_fresh(struct drain_spec *sp, struct drain_result *r)
{
	struct drain_result again;
	int runs = sp->backlog || sp->idle ? 1 : O.repeat;

	drain_empty(sp, r);
	for (int i = 1; i < runs; i++) {
		drain_empty(sp, &again);
		/* A failed check must show, whatever the rate. */
		if (!again.ok || again.rate > r->rate)
			*r = again;
	}
}

static void
phase_drain(void)
{
	struct drain_result drain1 = { 0 };	/* 1 queue, live: RSS, CPU */
	struct row *row;
	double us_per_pct;

	for (int live = 1; live >= 0; live--) {
		for (int nq = 1; nq <= 4; nq += 3) {
			struct drain_spec sp = { .n = O.rows, .nq = nq,
				.lo = 1, .batch = O.batch, .live = live };
			struct drain_result r;
			char tag[32], fig[64];

			snprintf(tag, sizeof(tag), "drain-%dq-%s", nq,
			    live ? "live" : "fills");
			sp.tag = tag;
			drain_fresh(&sp, &r);
			snprintf(fig, sizeof(fig), "outboxd drain, %d queue%s, "
			    "%s", nq, nq > 1 ? "s" : "", regime(live));
			drain_row(fig, &r, true);
			if (nq == 1)
				drain_1q_rate[live] = r.rate;
			if (live && nq == 1)
				drain1 = r;
		}
	}
	row = row_add("outboxd peak RSS, drain");
	strfmt(row->value, sizeof(row->value), "%.1f MiB",
	    (double)drain1.hwm_kib / 1024);
	strfmt(row->ref, sizeof(row->ref), "VmHWM; at the end %.1f MiB heap "
	    "+ %.1f MiB mapped files; batch_size %d",
	    (double)drain1.anon_kib / 1024, (double)drain1.file_kib / 1024,
	    O.batch);
	strfmt(row->target, sizeof(row->target), "<= 16 MiB");
	strfmt(row->verdict, sizeof(row->verdict), "%s",
	    drain1.hwm_kib <= TARGET_RSS_KIB ? "PASS" : "MISS");
	/* % of a core -> microseconds of CPU per message */
	us_per_pct = drain1.secs * 1e6 / 100 / (double)drain1.spec.n;
	row = row_add("outboxd CPU, drain");
	strfmt(row->value, sizeof(row->value), "%.0f%% of a core",
	    drain1.cpu.relay);
	strfmt(row->ref, sizeof(row->ref), "%.1f us per message, %.1f of "
	    "them in the kernel; its pg backend %.0f%%", drain1.cpu.relay *
	    us_per_pct, drain1.cpu.relay_sys * us_per_pct,
	    drain1.cpu.backend);
	strfmt(row->target, sizeof(row->target), "-");
}

/*
 * The raw broker on a machine that also does the database's work: the
 * raw runs again (one queue, 1, 2 and 4 connections) while PostgreSQL
 * claims and marks at the pace outboxd drained that regime.  The raw
 * figures above have the machine to themselves; a relay never does, and
 * this separates what sharing the cores costs from what the relay costs.
 */
static void
phase_shared(void)
{
	for (int live = 1; live >= 0; live--) {
		double pace = drain_1q_rate[live], alone = raw_best[live][1];
		char fig[80], vs[96] = "";
		struct raw_series sr;
		struct row *row;

		if (pace <= 0) {
			note("shared: no outboxd drain of one queue (%s) to "
			    "pace the database by; skipped", regime(live));
			continue;
		}
		raw_series(1, live, (long)pace, &sr);
		snprintf(fig, sizeof(fig), "raw RabbitMQ beside the database's "
		    "work, 1 queue, %s", regime(live));
		row = raw_row(fig, &sr, live);
		if (alone > 0)
			snprintf(vs, sizeof(vs), ", %.1f%% of raw alone",
			    100 * pace / alone);
		strfmt(row->ref, sizeof(row->ref), "%s; database %.0f rows/s "
		    "meanwhile (outboxd's pace); outboxd's drain %.0f = %.1f%% "
		    "of this%s; broker %.0f%% core, machine %.1f cores",
		    sr.parts, sr.best.pg_rate, pace, 100 * pace / sr.best.rate,
		    vs, sr.best.beam_pct, sr.best.machine);
		/* A database that fell behind its pace would flatter the
		 * broker: the comparison would not hold. */
		if (sr.best.pg_rate < 0.9 * pace) {
			strfmt(row->verdict, sizeof(row->verdict), "FAIL");
			sanity_failed = true;
		}
	}
}

/* The reference loops, one queue, in both regimes. */
static void
phase_ref(void)
{
	for (int live = 1; live >= 0; live--) {
		for (int kind = RELAY_REF_SEQ; kind <= RELAY_REF_WINDOW; kind++) {
			struct drain_spec sp = { .n = O.rows, .nq = 1,
				.lo = 1, .batch = O.batch, .live = live,
				.relay = (enum relay_kind)kind };
			struct drain_result r;
			char tag[32], fig[80];

			static const char *const tags[] = { "", "seq",
				"pipe", "window" };
			static const char *const names[] = { "",
				"sequential", "pipelined",
				"two batches in flight" };

			snprintf(tag, sizeof(tag), "ref-%s-%s", tags[kind],
			    live ? "live" : "fills");
			sp.tag = tag;
			drain_fresh(&sp, &r);
			snprintf(fig, sizeof(fig), "reference loop, %s, 1 "
			    "queue, %s", names[kind], regime(live));
			drain_row(fig, &r, false);
		}
	}
}

/*
 * Drains one queue with 1 to 4 relay workers, then pipelined
 * (relay.pipeline: true) with one worker, which holds as many sessions
 * as the default two plain ones, and with the default workers: what
 * overlapping buys.
 */
static void
phase_workers(void)
{
	for (int live = 1; live >= 0; live--) {
		for (int n = 1; n <= 6; n++) {
			bool pipe = n >= 5;
			struct drain_spec sp = { .n = O.rows, .nq = 1,
				.lo = 1, .batch = O.batch,
				.workers = n == 5 ? 1 : n == 6 ? O.workers : n,
				.live = live, .pipeline = pipe ? "true" : NULL };
			struct drain_result r;
			char fig[80], tag[32];

			snprintf(tag, sizeof(tag), "workers-%d%s-%s",
			    sp.workers, pipe ? "-pipelined" : "",
			    live ? "live" : "fills");
			sp.tag = tag;
			drain_fresh(&sp, &r);
			snprintf(fig, sizeof(fig), "outboxd drain, %d worker%s%s, "
			    "1 queue, %s", sp.workers, sp.workers > 1 ? "s" : "",
			    pipe ? " pipelined" : "", regime(live));
			drain_row(fig, &r, true);
		}
	}
}

/* Sweeps batch_size on the one-queue drains: what is best here. */
static void
phase_sweep(void)
{
	static const int sizes[] = { 250, 500, 1000, 2000, 5000 };

	for (int live = 1; live >= 0; live--) {
		for (size_t i = 0; i < ARRAY_LEN(sizes); i++) {
			struct drain_spec sp = { .n = O.rows, .nq = 1,
				.lo = 1, .batch = sizes[i], .live = live };
			struct drain_result r;
			char fig[64], tag[32];

			snprintf(tag, sizeof(tag), "sweep-%d-%s", sizes[i],
			    live ? "live" : "fills");
			sp.tag = tag;
			drain_fresh(&sp, &r);
			snprintf(fig, sizeof(fig), "outboxd drain, batch %d, "
			    "%s", sizes[i], regime(live));
			drain_row(fig, &r, false);
		}
	}
}

/* ---- idle --------------------------------------------------------------- */

static void
phase_idle(void)
{
	struct cpu_use idle;
	struct drain_spec sp = { .tag = "idle", .nq = 1, .lo = 1,
		.batch = O.batch, .live = true, .idle = &idle };
	struct drain_result r;
	struct row *row;

	/* A short drain first, so that idle means "after work". */
	sp.n = O.rows / 10 > 1000 ? O.rows / 10 : 1000;
	drain_fresh(&sp, &r);
	row = row_add("outboxd CPU, idle");
	strfmt(row->value, sizeof(row->value), "%.2f%% of a core",
	    idle.relay);
	strfmt(row->ref, sizeof(row->ref), "over %d s: %.1f wake-ups/s; its "
	    "pg backend %.2f%%", O.idle_s, idle.machine, idle.backend);
	strfmt(row->target, sizeof(row->target), "about 0 (< %.1f%%)",
	    TARGET_IDLE_PCT);
	strfmt(row->verdict, sizeof(row->verdict), "%s",
	    idle.relay < TARGET_IDLE_PCT ? "PASS" : "MISS");
	drain_check(row, &r);
}

/* ---- latency ------------------------------------------------------------ */

static int
cmp_i64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

	return x < y ? -1 : x > y;
}

static double
pct_ms(const int64_t *sorted, size_t n, double p)
{
	size_t i = (size_t)(p * (double)(n - 1) + 0.5);

	return n == 0 ? 0 : (double)sorted[i] / 1000.0;
}

/*
 * Producers commit one message per transaction (outbox_enqueue in
 * autocommit) on a steady schedule; together they offer `rate` messages
 * a second.  Each keeps the moment its commit returned, by outbox id.
 */
#define PRODUCER_RATE 500	/* per connection: a commit takes ~1 ms */

struct producer {
	pthread_t th;
	int64_t t0, period, offset, count;	/* schedule, us */
	int64_t *commit_us;	/* shared, indexed by id - 1 */
	int64_t cap;
	int64_t sent, late, last_id;
	char err[256];
};

static void *
producer_main(void *arg)
{
	struct producer *p = arg;
	int lens[1] = { BODY_SIZE }, fmts[1] = { 1 };
	const char *params[1];
	char body[BODY_SIZE];
	PGconn *c = pg_open();
	PGresult *res;

	res = PQprepare(c, "enq", "SELECT outbox_enqueue('', '" LAT_QUEUE
	    "', $1::bytea, business_module => 'bench', business_key => 'lat')",
	    1, NULL);
	if (PQresultStatus(res) != PGRES_COMMAND_OK)
		strfmt(p->err, sizeof(p->err), "prepare: %s",
		    PQerrorMessage(c));
	PQclear(res);
	fill_body(body, 0);
	params[0] = body;
	for (int64_t i = 0; i < p->count && p->err[0] == '\0'; i++) {
		int64_t due = p->t0 + p->offset + i * p->period, now = us_now();
		struct timespec ts;
		int64_t id;

		if (due > now) {
			ts.tv_sec = due / 1000000;
			ts.tv_nsec = (long)(due % 1000000) * 1000;
			while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME,
			    &ts, NULL) == EINTR)
				;
		} else if (now - due > 1000) {
			p->late++;	/* behind schedule by over 1 ms */
		}
		/* For consumers elsewhere: the wall clock at sending. */
		snprintf(body, 24, "%-23" PRId64, us_wall());
		res = PQexecPrepared(c, "enq", 1, params, lens, fmts, 0);
		if (PQresultStatus(res) != PGRES_TUPLES_OK) {
			strfmt(p->err, sizeof(p->err), "enqueue: %s",
			    PQerrorMessage(c));
			PQclear(res);
			break;
		}
		id = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
		PQclear(res);
		if (id < 1 || id > p->cap) {
			strfmt(p->err, sizeof(p->err), "unexpected id %" PRId64,
			    id);
			break;
		}
		p->commit_us[id - 1] = us_now();
		if (id > p->last_id)
			p->last_id = id;
		p->sent++;
	}
	PQfinish(c);
	return NULL;
}

/* Latency from the moment a commit returned to the consumer's receipt. */
static void
latency_run(pid_t pid, int rate)
{
	int nprod = (rate + PRODUCER_RATE - 1) / PRODUCER_RATE;
	int64_t cap = (int64_t)rate * O.latency_s + 1000;
	int64_t *commit_us = xcalloc((size_t)cap, sizeof(*commit_us));
	int64_t *lat = xcalloc((size_t)cap, sizeof(*lat));
	struct producer *prods = xcalloc((size_t)nprod, sizeof(*prods));
	const char *const q[1] = { LAT_QUEUE };
	PGconn *c = pg_open();
	struct consumer k;
	struct cpu_mark m;
	struct cpu_use u;
	struct row *row;
	int64_t t0, t_end, sent = 0, nlat = 0, neg = 0, last_id = 0, late = 0;
	long long success;
	bool ok;
	char fig[64];

	reset_tables(c);
	mq_fresh_queues(q, 1);
	consumer_start(&k, q, 1, 1, cap, true);
	note("latency: %d msg/s for %d s from %d connection(s)", rate,
	    O.latency_s, nprod);
	nap_us(500000);
	cpu_mark(&m, pid);
	t0 = us_now() + 100000;	/* time for the producers to connect */
	for (int i = 0; i < nprod; i++) {
		struct producer *p = &prods[i];

		/* Interleaved: together, one message every 1/rate s. */
		p->t0 = t0;
		p->period = 1000000LL * nprod / rate;
		p->offset = 1000000LL * i / rate;
		p->count = (int64_t)rate * O.latency_s / nprod;
		p->commit_us = commit_us;
		p->cap = cap;
		if (pthread_create(&p->th, NULL, producer_main, p) != 0)
			die("pthread_create failed");
	}
	for (int i = 0; i < nprod; i++) {
		pthread_join(prods[i].th, NULL);
		if (prods[i].err[0] != '\0')
			die("producer: %s", prods[i].err);
		sent += prods[i].sent;
		late += prods[i].late;
		if (prods[i].last_id > last_id)
			last_id = prods[i].last_id;
	}
	t_end = us_now();
	ok = consumer_wait(&k, sent, us_now() + 30000000);
	cpu_since(&m, pid, &u);
	ok = rows_all_sent(c, 1, last_id, us_now() + 30000000) && ok;
	consumer_stop(&k, 300000);
	for (int64_t i = 0; i < last_id; i++) {
		int64_t d;

		if (commit_us[i] == 0 || k.recv_us[i] == 0)
			continue;
		d = k.recv_us[i] - commit_us[i];
		if (d < 0) {	/* seen before the commit's reply came */
			neg++;
			d = 0;
		}
		lat[nlat++] = d;
	}
	qsort(lat, (size_t)nlat, sizeof(*lat), cmp_i64);
	success = pg_int(c, "SELECT count(*) FROM t_transactional_message"
	    " WHERE message_status = 1");
	snprintf(fig, sizeof(fig), "latency at %d msg/s", rate);
	row = row_add(fig);
	strfmt(row->value, sizeof(row->value), "p50 %.2f, p95 %.2f, p99 "
	    "%.2f, max %.1f ms", pct_ms(lat, (size_t)nlat, 0.50),
	    pct_ms(lat, (size_t)nlat, 0.95), pct_ms(lat, (size_t)nlat, 0.99),
	    nlat ? (double)lat[nlat - 1] / 1000 : 0);
	strfmt(row->ref, sizeof(row->ref), "commit -> receipt; offered "
	    "%.0f/s by %d conn (%" PRId64 " sent over 1 ms late); outboxd "
	    "%.1f%% core", (double)sent / ((double)(t_end - t0) / 1e6), nprod,
	    late, u.relay);
	if (rate >= 1000) {
		bool pass = pct_ms(lat, (size_t)nlat, 0.50) <= TARGET_P50_MS &&
		    pct_ms(lat, (size_t)nlat, 0.99) <= TARGET_P99_MS;

		strfmt(row->target, sizeof(row->target), "p50 <= 2, p99 <= 10"
		    " ms");
		strfmt(row->verdict, sizeof(row->verdict), "%s",
		    pass ? "PASS" : "MISS");
	} else {
		strfmt(row->target, sizeof(row->target), "-");
	}
	strfmt(row->check, sizeof(row->check), "%" PRId64 " sent: %lld "
	    "received, %" PRId64 " dup, %lld SUCCESS", sent,
	    (long long)atomic_load(&k.distinct), k.dups, success);
	if (!ok || atomic_load(&k.distinct) != sent || success != sent ||
	    k.strays != 0) {
		strfmt(row->verdict, sizeof(row->verdict), "FAIL");
		sanity_failed = true;
	}
	note("latency: %d msg/s: %s (%" PRId64 " before the commit reply)",
	    rate, row->value, neg);
	consumer_free(&k);
	free(commit_us);
	free(lat);
	free(prods);
	PQfinish(c);
}

static void
phase_latency(void)
{
	PGconn *c = pg_open();
	pid_t pid;

	reset_tables(c);
	PQfinish(c);
	pid = outboxd_start("latency", O.batch, O.workers, O.pipeline);
	latency_run(pid, 200);
	latency_run(pid, 1000);
	outboxd_stop(pid);
}

/* ---- scale -------------------------------------------------------------- */

/* Runs `outboxd migrate` against O.conninfo and waits for it. */
static void
outboxd_migrate(void)
{
	char cfg[512], log[512];
	pid_t pid;
	int st;

	snprintf(cfg, sizeof(cfg), "%s/bench-outboxd.yml", O.dir);
	snprintf(log, sizeof(log), "%s/outboxd-migrate.log", O.dir);
	outboxd_config(cfg, O.batch, O.workers, O.pipeline);
	pid = outboxd_spawn(cfg, "migrate", log);
	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) ||
	    WEXITSTATUS(st) != 0)
		die("outboxd migrate failed; see %s", log);
}

static int
cmp_rate(const void *a, const void *b)
{
	double x = ((const struct drain_result *)a)->rate;
	double y = ((const struct drain_result *)b)->rate;

	return (x > y) - (x < y);
}

#define MAX_PAIRS 20

/* CPU time per message, in microseconds, from % of a core and msg/s. */
static double
cpu_us_per_msg(double pct, double rate)
{
	return rate > 0 ? pct / 100 / rate * 1e6 : 0;
}

/* Autovacuum on or off for the outbox tables of both databases
 * (conninfo strings).  Off during the scale phase: a vacuum or analyze
 * that starts at its own moment falls into one side's timed drain or
 * the other's (the server's log showed both, in one run).  The sent
 * side's maintenance is done before each of its drains instead, outside
 * the timing; the empty side is truncated. */
static void
autovacuum(bool on, const char *db1, const char *db2)
{
	const char *saved = O.conninfo;
	const char *const dbs[] = { db1, db2 };

	for (size_t i = 0; i < 2; i++) {
		PGconn *c;

		O.conninfo = dbs[i];	/* pg_open()'s database */
		c = pg_open();
		pg_do(c, "ALTER TABLE t_transactional_message %s",
		    on ? "RESET (autovacuum_enabled)" :
		    "SET (autovacuum_enabled = off)");
		pg_do(c, "ALTER TABLE t_transactional_message_content %s",
		    on ? "RESET (autovacuum_enabled)" :
		    "SET (autovacuum_enabled = off)");
		PQfinish(c);
	}
	O.conninfo = saved;
}

static void
vacuum_analyze(void)
{
	PGconn *c = pg_open();

	note("scale: vacuum analyze");
	pg_do(c, "VACUUM ANALYZE t_transactional_message");
	pg_do(c, "VACUUM ANALYZE t_transactional_message_content");
	PQfinish(c);
}

/*
 * The backlog (O.backlog rows) is drained from a cold start, for the peak
 * RSS with a big backlog, and leaves that many SUCCESS rows.  Then sent
 * rows against an empty table, in two databases of the same
 * server: outbox (truncated before each drain) and outbox_scale, which
 * keeps the backlog's rows once they are sent.  The drains alternate
 * between the two, the order flipping from pair to pair, so that the
 * drift of live drains through a run (20-30% on a shared machine)
 * falls on both sides alike.  Comparing with the drain phase's figure,
 * taken ten minutes earlier, measured that drift instead.  Single pairs
 * still differ by +-13 points, so the row gives each pair's slowdown and
 * their standard error (--pairs, 5 by default).
 */
static void
phase_scale(void)
{
	const char *empty_db = O.conninfo;
	char scale_db[512];
	struct drain_spec big_sp = { .tag = "backlog", .n = O.backlog,
		.nq = 1, .lo = 1, .batch = O.batch, .backlog = true,
		.live = true };
	struct drain_spec empty_sp = { .tag = "scale-empty", .n = O.rows,
		.nq = 1, .lo = 1, .batch = O.batch, .live = true };
	struct drain_spec sent_sp = { .tag = "scale-sent", .n = O.rows,
		.nq = 1, .lo = O.backlog + 1, .batch = O.batch, .live = true };
	struct drain_result big, empty[MAX_PAIRS], sent[MAX_PAIRS];
	double empty_sum = 0, sent_sum = 0, slow, pair[MAX_PAIRS];
	double mean = 0, var = 0;
	double db_us[2] = { 0, 0 }, broker_us[2] = { 0, 0 };	/* sent, empty */
	char pairs_text[160] = "";
	size_t len = 0;
	const int n = O.pairs;
	long long key_scans = 0;
	long max_hwm = 0;
	struct row *row;
	PGconn *c;

	snprintf(scale_db, sizeof(scale_db), "%s dbname=outbox_scale",
	    empty_db);	/* libpq: the last dbname wins */
	c = pg_open();
	pg_do(c, "DROP DATABASE IF EXISTS outbox_scale");
	pg_do(c, "CREATE DATABASE outbox_scale");
	PQfinish(c);
	O.conninfo = scale_db;
	outboxd_migrate();
	autovacuum(false, empty_db, scale_db);
	drain_fresh(&big_sp, &big);
	/* The backlog's million dead row versions, cleared now: left to
	 * autovacuum, they could be cleared during the first pair's drains. */
	vacuum_analyze();
	O.conninfo = empty_db;

	for (int i = 0; i < n; i++) {
		bool sent_first = i % 2 == 1;	/* the order flips per pair */

		for (int j = 0; j < 2; j++) {
			if ((j == 0) != sent_first) {
				/* One drain, not drain_fresh()'s best of
				 * --repeat: both sides get one per pair. */
				drain_empty(&empty_sp, &empty[i]);
				continue;
			}
			/* What autovacuum would have done by now. */
			O.conninfo = scale_db;
			vacuum_analyze();
			drain(&sent_sp, &sent[i]);
			sent_sp.lo += O.rows;
			O.conninfo = empty_db;
		}
		empty_sum += empty[i].rate;
		if (empty[i].hwm_kib > max_hwm)
			max_hwm = empty[i].hwm_kib;
		sent_sum += sent[i].rate;
		key_scans += sent[i].key_idx_scans;
		/* Each pair's own slowdown: its two drains ran a minute
		 * apart, so the pairs' spread is the figure's noise. */
		pair[i] = 1 - sent[i].rate / empty[i].rate;
		mean += pair[i] / n;
		/* CPU per message: the database's is what the sent rows can
		 * change; the broker's shows the machine's drift. */
		db_us[0] += cpu_us_per_msg(sent[i].cpu.backend, sent[i].rate) / n;
		db_us[1] += cpu_us_per_msg(empty[i].cpu.backend,
		    empty[i].rate) / n;
		broker_us[0] += cpu_us_per_msg(sent[i].cpu.beam, sent[i].rate) /
		    n;
		broker_us[1] += cpu_us_per_msg(empty[i].cpu.beam,
		    empty[i].rate) / n;
		len += (size_t)snprintf(pairs_text + len, len <
		    sizeof(pairs_text) ? sizeof(pairs_text) - len : 0,
		    "%s%+.1f", i > 0 ? " / " : "", 100 * pair[i]);
	}
	for (int i = 0; i < n; i++)
		var += (pair[i] - mean) * (pair[i] - mean) /
		    (n > 1 ? n - 1 : 1);
	autovacuum(true, empty_db, scale_db);
	slow = 1 - sent_sum / empty_sum;
	qsort(empty, (size_t)n, sizeof(*empty), cmp_rate);
	qsort(sent, (size_t)n, sizeof(*sent), cmp_rate);
	row = row_add("outboxd peak RSS, backlog");
	strfmt(row->value, sizeof(row->value), "%.1f MiB",
	    (double)big.hwm_kib / 1024);
	strfmt(row->ref, sizeof(row->ref), "%ld-row backlog, drained at %.0f "
	    "msg/s; %.1f MiB for %ld rows on an empty table",
	    O.backlog, big.rate, (double)max_hwm / 1024, O.rows);
	strfmt(row->target, sizeof(row->target), "<= 16 MiB, flat");
	strfmt(row->verdict, sizeof(row->verdict), "%s",
	    big.hwm_kib <= TARGET_RSS_KIB && big.hwm_kib <= max_hwm + 1024 ?
	    "PASS" : "MISS");
	drain_check(row, &big);
	drain_row("outboxd drain, 1 queue, live, empty (median)",
	    &empty[n / 2], false);
	drain_row("outboxd drain, 1 queue, live, after backlog (median)",
	    &sent[n / 2], false);
	for (int i = 0; i < n; i++) {
		/* Every drain is checked, not only the medians shown. */
		if (!empty[i].ok || !sent[i].ok)
			drain_check(row_add("a scale drain failed its check"),
			    !empty[i].ok ? &empty[i] : &sent[i]);
	}
	row = row_add("slowdown from sent rows");
	strfmt(row->value, sizeof(row->value), "%+.1f%%", 100 * slow);
	strfmt(row->ref, sizeof(row->ref), "%d alternating pairs, each "
	    "pair's slowdown %s%%: mean %+.1f%%, standard error %.1f points; "
	    "with >= %ld SUCCESS rows %.0f-%.0f msg/s, empty %.0f-%.0f; "
	    "CPU per message, sent rows vs empty: database %.1f vs %.1f us, "
	    "broker %.1f vs %.1f us; claims by the key index: %lld", n,
	    pairs_text, 100 * mean, 100 * sqrt(var / n), O.backlog,
	    sent[0].rate, sent[n - 1].rate, empty[0].rate, empty[n - 1].rate,
	    db_us[0], db_us[1], broker_us[0], broker_us[1], key_scans);
	strfmt(row->target, sizeof(row->target), "< 5%%");
	strfmt(row->verdict, sizeof(row->verdict), "%s",
	    slow < TARGET_SCALE_SLOWDOWN ? "PASS" : "MISS");
}

/* ---- main --------------------------------------------------------------- */

static void
print_table(void)
{
	bool missed = false;
	size_t unjudged = 0;

	printf("\n| # | figure | measured | reference / ratio / where the time "
	    "goes | target | result | sanity |\n");
	printf("|---|---|---|---|---|---|---|\n");
	for (size_t i = 0; i < nrows; i++) {
		const struct row *r = &table[i];

		printf("| %zu | %s | %s | %s | %s | %s | %s |\n", i + 1,
		    r->figure, r->value, r->ref, r->target, r->verdict,
		    r->check[0] ? r->check : "-");
		missed = missed || strcmp(r->verdict, "MISS") == 0;
		unjudged += strcmp(r->verdict, "n/a") == 0;
	}
	/* "All met" only of what was judged: a run without the raw phase
	 * cannot judge its drains. */
	printf("\nsanity: %s; targets: %s", sanity_failed ? "FAILED" : "ok",
	    missed ? "some MISSED" : "all met");
	if (unjudged > 0)
		printf(" (%zu not judged: no raw figure in this run)", unjudged);
	printf("\n");
}

/* The load average, to judge how much the machine was shared. */
static void
note_load(const char *when)
{
	char buf[64] = "?";
	FILE *f = fopen("/proc/loadavg", "r");

	if (f != NULL) {
		if (fgets(buf, sizeof(buf), f) == NULL)
			strfmt(buf, sizeof(buf), "?");
		fclose(f);
	}
	buf[strcspn(buf, "\n")] = '\0';
	note("load average %s: %s", when, buf);
}

static void
usage(FILE *out)
{
	fprintf(out,
	    "usage: outbox_bench [options]   (run through bench/run.sh)\n"
	    "  --rows N             rows per drain (200000)\n"
	    "  --backlog N          rows of the scale phase (1000000)\n"
	    "  --latency-seconds S  per producer rate (30)\n"
	    "  --idle-seconds S     idle CPU window (30)\n"
	    "  --raw-seconds S      per raw broker run, live consumer (6)\n"
	    "  --batch N            outboxd relay.batch_size (1000)\n"
	    "  --workers N          outboxd relay.workers (2)\n"
	    "  --window N           raw publisher confirm window (2000)\n"
	    "  --pipeline BOOL      outboxd relay.pipeline (its default)\n"
	    "  --quick              50000 rows, 200000 backlog, 10 s windows,"
	    " 3 s raw runs\n"
	    "  --only LIST          phases: raw,pg,drain,shared,workers,ref,"
	    "idle,latency,scale\n"
	    "  --sweep              also drain once per batch size\n"
	    "  --repeat N           run each raw and drain figure N times, "
	    "keep the best (1)\n"
	    "  --pairs N            scale phase: alternating drain pairs (5)\n"
	    "  --queue-arg K=V      declare the queues with this argument, e.g."
	    " x-queue-mode=lazy\n");
}

static long
num_arg(const char *s, long min, long max)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno != 0 || *end != '\0' || v < min || v > max)
		die("bad number '%s' (%ld to %ld)", s, min, max);
	return v;
}

int
main(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "rows", required_argument, NULL, 'r' },
		{ "backlog", required_argument, NULL, 'b' },
		{ "latency-seconds", required_argument, NULL, 'l' },
		{ "idle-seconds", required_argument, NULL, 'i' },
		{ "raw-seconds", required_argument, NULL, 'R' },
		{ "batch", required_argument, NULL, 'B' },
		{ "workers", required_argument, NULL, 'W' },
		{ "window", required_argument, NULL, 'w' },
		{ "pipeline", required_argument, NULL, 'p' },
		{ "quick", no_argument, NULL, 'q' },
		{ "only", required_argument, NULL, 'o' },
		{ "sweep", no_argument, NULL, 's' },
		{ "repeat", required_argument, NULL, 'n' },
		{ "pairs", required_argument, NULL, 'P' },
		{ "queue-arg", required_argument, NULL, 'Q' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	char path[600];
	int opt;
	int64_t t0 = us_now();

	while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (opt) {
		case 'r': O.rows = num_arg(optarg, 1000, 100000000); break;
		case 'b': O.backlog = num_arg(optarg, 1000, 100000000); break;
		case 'l': O.latency_s = (int)num_arg(optarg, 1, 3600); break;
		case 'i': O.idle_s = (int)num_arg(optarg, 1, 3600); break;
		case 'R': O.raw_s = (int)num_arg(optarg, 1, 600); break;
		case 'B': O.batch = (int)num_arg(optarg, 1, 10000); break;
		case 'W': O.workers = (int)num_arg(optarg, 1, 16); break;
		case 'w': O.window = (int)num_arg(optarg, 1, 1000000); break;
		case 'p':
			if (strcmp(optarg, "true") != 0 &&
			    strcmp(optarg, "false") != 0)
				die("--pipeline wants true or false");
			O.pipeline = optarg;
			break;
		case 'q':
			O.rows = 50000;
			O.backlog = 200000;
			O.latency_s = O.idle_s = 10;
			O.raw_s = 3;
			break;
		case 'o': O.only = optarg; break;
		case 's': O.sweep = true; break;
		case 'n': O.repeat = (int)num_arg(optarg, 1, 10); break;
		case 'P': O.pairs = (int)num_arg(optarg, 1, MAX_PAIRS); break;
		case 'Q':
			if (strchr(optarg, '=') == NULL || optarg[0] == '=' ||
			    strchr(optarg, '=') - optarg >= 64)
				die("--queue-arg wants NAME=VALUE, got '%s'",
				    optarg);
			O.queue_arg = optarg;
			break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind < argc) {
		usage(stderr);
		return 2;
	}
	O.outboxd = env_need("OUTBOXD_BIN");
	O.dir = env_need("OUTBOXD_SERVERS_DIR");
	O.conninfo = env_need("OUTBOXD_PG_CONNINFO");
	O.amqp_port = atoi(env_need("OUTBOXD_AMQP_PORT"));
	O.redis_port = atoi(env_need("OUTBOXD_REDIS_PORT"));
	O.http_port = atoi(env_need("OUTBOXD_HTTP_PORT"));
	snprintf(path, sizeof(path), "%s/rabbitmq/rabbitmq.pid", O.dir);
	beam_pid = pid_from_file(path);
	log_set_level(LOG_WARN);
	signal(SIGPIPE, SIG_IGN);
	atexit(kill_child);
	note("rows %ld, backlog %ld, batch %d, workers %d, latency %d s, "
	    "idle %d s, raw %d s, window %d, queue argument %s", O.rows,
	    O.backlog, O.batch, O.workers, O.latency_s, O.idle_s, O.raw_s,
	    O.window, O.queue_arg ? O.queue_arg : "none");
	note_load("at the start");
	if (phase_on("raw"))
		phase_raw();
	if (phase_on("pg"))
		phase_pg();
	if (phase_on("drain"))
		phase_drain();
	if (phase_on("shared"))
		phase_shared();
	if (phase_on("workers"))
		phase_workers();
	if (phase_on("ref"))
		phase_ref();
	if (O.sweep)
		phase_sweep();
	if (phase_on("idle"))
		phase_idle();
	if (phase_on("latency"))
		phase_latency();
	if (phase_on("scale"))
		phase_scale();
	note_load("at the end");
	note("done in %.0f s", (double)(us_now() - t0) / 1e6);
	print_table();
	return sanity_failed ? 1 : 0;
}
