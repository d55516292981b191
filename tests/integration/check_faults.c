/*
 * Faults mid-stream: outboxd killed with SIGKILL at random moments,
 * RabbitMQ and PostgreSQL restarted, killed or frozen, Redis stopped, an
 * instance hung, a leader killed among three instances, servers left
 * down while outboxd waits for them (it must sleep, not spin).  Rows flow
 * in while it happens; afterwards every row must be SUCCESS and received,
 * duplicates bounded by the batches in flight at the faults, and no row
 * left locked.  FAULTS_SOAK=1 runs longer with more faults; FAULTS_SEED=n
 * replays a run's random moments; FAULTS_ONLY=a,b picks scenarios.
 */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <hiredis/hiredis.h>

#include "testlib.h"
#include "util.h"

#define QUEUE "faults"
#define BATCH 500
/* relay.workers left at its default: batches in flight per instance. */
#define WORKERS 2
#define LEADER_KEY "outboxd:leader"
#define MAX_FAULTS 128
/* Short lock timings, so that a dead leader's key expires quickly. */
#define BASE_YAML "relay.batch_size: 500\nredis.ttl: 3s\n"

/* Sizes of a run: the default fits in about three minutes. */
struct plan {
	bool soak;
	long long rows;		/* per scenario */
	int stream_s;		/* how long the producer takes for them */
	int kills;		/* SIGKILLs of a lone instance */
	int kill_gap_ms;	/* random wait before each kill: [0, gap) */
	int leader_kills;	/* among three instances */
	int restarts;		/* of RabbitMQ and PostgreSQL each */
	int redis_outage_ms;
	int hang_ms;		/* how long an instance stays SIGSTOPped */
};

static struct plan plan;
static uint64_t seed, rng_state;
static PGconn *db;

/* --- small helpers ------------------------------------------------------ */

/*
 * Batches an instance can have sent but not marked: one per relay, two
 * for a pipelined relay (one being marked while the next is at the
 * broker).  The Makefile reruns some suites with OUTBOXD_TEST_YAML set
 * to "relay.pipeline: true".
 */
static int
batches_per_instance(void)
{
	const char *every = getenv("OUTBOXD_TEST_YAML");

	return WORKERS * (every != NULL &&
	    strstr(every, "relay.pipeline: true") != NULL ? 2 : 1);
}

static void
nap_ms(int64_t ms)
{
	struct timespec ts = { (time_t)(ms / 1000),
	    (long)(ms % 1000) * 1000000 };

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

/* splitmix64: the same moments for the same seed on any libc. */
static uint64_t
rng_next(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static int
rng_below(int n)
{
	return n > 0 ? (int)(rng_next() % (uint64_t)n) : 0;
}

/*
 * The first column of a one-row query, or -1 while the server is away:
 * unlike tl_sql_int this never aborts, so it can poll through a
 * PostgreSQL restart (the connection is reset for the next call).
 */
static long long
try_int(PGconn *c, const char *sql)
{
	PGresult *res;
	long long v = -1;

	if (PQstatus(c) != CONNECTION_OK) {
		PQreset(c);
		if (PQstatus(c) != CONNECTION_OK)
			return -1;
	}
	res = PQexec(c, sql);
	if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) > 0 &&
	    !PQgetisnull(res, 0, 0))
		v = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
	PQclear(res);
	return v;
}

#define SENT_SQL "SELECT count(*) FROM t_transactional_message " \
	"WHERE message_status = 1"

static long long
sent_count(void)
{
	return try_int(db, SENT_SQL);
}

/* Polls until sent_count() >= want; returns the last count seen. */
static long long
wait_sent(long long want, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	long long v;

	while ((v = sent_count()) < want && tl_ms() < deadline)
		nap_ms(20);
	return v;
}

/* --- processes we started ----------------------------------------------- */

/*
 * A test that fails half-way leaves its outboxd children running, and
 * they would relay the next test's rows.  Their pids go to a file; the
 * next setup ends those that are still outboxd.
 */
static void
pids_path(char *buf, size_t size)
{
	snprintf(buf, size, "%s/check_faults.pids",
	    tl_env("OUTBOXD_SERVERS_DIR"));
}

static pid_t
start_outboxd(const char *extra)
{
	char path[512];
	pid_t pid = tl_outboxd_start(extra);
	FILE *f;

	pids_path(path, sizeof(path));
	f = fopen(path, "a");
	if (f != NULL) {
		fprintf(f, "%d\n", (int)pid);
		fclose(f);
	}
	return pid;
}

static void
end_leftovers(void)
{
	char path[512], comm[64], procf[64];
	FILE *f, *c;
	int pid;

	pids_path(path, sizeof(path));
	f = fopen(path, "r");
	if (f == NULL)
		return;
	while (fscanf(f, "%d", &pid) == 1) {
		snprintf(procf, sizeof(procf), "/proc/%d/comm", pid);
		c = fopen(procf, "r");
		if (c == NULL)
			continue;
		if (fgets(comm, sizeof(comm), c) != NULL &&
		    strncmp(comm, "outboxd", 7) == 0)
			kill(pid, SIGKILL);
		fclose(c);
	}
	fclose(f);
	unlink(path);
}

static bool
alive(pid_t pid)
{
	return waitpid(pid, NULL, WNOHANG) == 0;
}

/* Lines of pid's log that contain needle, and needle2 unless NULL. */
static int
log_lines(pid_t pid, const char *needle, const char *needle2)
{
	return tl_file_lines(tl_outboxd_log(pid), needle, needle2);
}

/* Waits until pid's log has more than `had` such lines; false on
 * timeout. */
static bool
wait_log_lines(pid_t pid, const char *needle, const char *needle2, int had,
    int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;

	while (log_lines(pid, needle, needle2) <= had) {
		if (tl_ms() >= deadline)
			return false;
		nap_ms(20);
	}
	return true;
}

/* --- Redis ---------------------------------------------------------------- */

static redisContext *
redis_open(void)
{
	struct timeval tv = { 2, 0 };
	redisContext *r = redisConnectWithTimeout("127.0.0.1",
	    atoi(tl_env("OUTBOXD_REDIS_PORT")), tv);

	if (r != NULL && r->err != 0) {
		redisFree(r);
		return NULL;
	}
	return r;
}

/* The leader key's token into buf ("" when unset or unreachable). */
static char *
leader_token(char *buf, size_t size)
{
	redisContext *r = redis_open();
	redisReply *rep;

	buf[0] = '\0';
	if (r == NULL)
		return buf;
	rep = redisCommand(r, "GET %s", LEADER_KEY);
	if (rep != NULL && rep->type == REDIS_REPLY_STRING)
		snprintf(buf, size, "%s", rep->str);
	freeReplyObject(rep);
	redisFree(r);
	return buf;
}

static void
leader_key_delete(void)
{
	redisContext *r = redis_open();

	if (r == NULL)
		return;
	freeReplyObject(redisCommand(r, "DEL %s", LEADER_KEY));
	redisFree(r);
}

/* Which of pids logged "leader lock acquired … token=tok", or -1. */
static int
token_owner(const pid_t *pids, int n, const char *tok)
{
	char needle[128];

	snprintf(needle, sizeof(needle), "token=%s", tok);
	for (int i = 0; i < n; i++) {
		FILE *f = fopen(tl_outboxd_log(pids[i]), "r");
		char line[4096];
		bool found = false;

		if (f == NULL)
			continue;
		while (!found && fgets(line, sizeof(line), f) != NULL)
			found = strstr(line, "leader lock acquired") != NULL &&
			    strstr(line, needle) != NULL;
		fclose(f);
		if (found)
			return i;
	}
	return -1;
}

/* Waits for a leader key other than `not` whose owner is among pids. */
static int
wait_leader(const pid_t *pids, int n, const char *not, char *tok,
    size_t size, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	int who;

	do {
		leader_token(tok, size);
		if (tok[0] != '\0' && strcmp(tok, not) != 0 &&
		    (who = token_owner(pids, n, tok)) >= 0)
			return who;
		nap_ms(50);
	} while (tl_ms() < deadline);
	return -1;
}

/* --- the producer: rows trickle in as applications would write them ---- */

struct producer {
	pthread_t thread;
	long long target;
	int duration_ms;
	atomic_int errors;	/* failed inserts, retried */
	uint64_t rng;		/* its own PRNG state */
	const char *conninfo;
};

/* Connects, through a restart if need be; NULL after two minutes (the
 * row count then tells the test what went wrong). */
static PGconn *
producer_connect(const char *conninfo)
{
	int64_t deadline = tl_ms() + 120000;
	PGconn *c;

	do {
		c = PQconnectdb(conninfo);
		if (PQstatus(c) == CONNECTION_OK)
			return c;
		PQfinish(c);
		nap_ms(100);
	} while (tl_ms() < deadline);
	return NULL;
}

#define MAX_CHUNK 1000
#define TRICKLE_MS 20

/*
 * Inserts target rows over duration_ms at an even pace on average: a
 * trickle of two rows every TRICKLE_MS, and bursts of random size (1 to
 * MAX_CHUNK rows, one statement each) so that faults find batches of
 * every size in flight.  A chunk that fails (PostgreSQL restarting) may
 * or may not have committed: the table's own count says, after a
 * reconnect.
 */
static void *
producer_main(void *arg)
{
	struct producer *p = arg;
	PGconn *c = producer_connect(p->conninfo);
	int64_t t0 = tl_ms(), last = 0;
	long long done = 0, want = 1;

	while (c != NULL && done < p->target) {
		long long due = p->target * (tl_ms() - t0) / p->duration_ms;
		long long k = due - done;
		uint64_t z;
		char sql[512];
		PGresult *res;

		if (k <= 0 || (k < want && due < p->target &&
		    tl_ms() - last < TRICKLE_MS)) {
			nap_ms(5);
			continue;
		}
		if (k < want && due < p->target) {
			/* The trickle: keeps rows arriving between bursts,
			 * so a recovery is seen when it happens. */
			k = k < 2 ? k : 2;
		} else {
			z = (p->rng += 0x9e3779b97f4a7c15ULL);
			z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
			want = 1 + (long long)((z ^ (z >> 27)) % MAX_CHUNK);
		}
		last = tl_ms();
		if (k > MAX_CHUNK)
			k = MAX_CHUNK;
		if (k > p->target - done)
			k = p->target - done;
		snprintf(sql, sizeof(sql), "SELECT count(outbox_enqueue('', "
		    "'" QUEUE "', 'fault row ' || g || ' ' || "
		    "repeat('x', 100))) FROM generate_series(1, %lld) g", k);
		res = PQexec(c, sql);
		if (PQresultStatus(res) == PGRES_TUPLES_OK) {
			done += k;
		} else {
			atomic_fetch_add(&p->errors, 1);
			PQfinish(c);
			c = producer_connect(p->conninfo);
			if (c != NULL)
				done = try_int(c, "SELECT count(*) FROM "
				    "t_transactional_message");
			if (done < 0)
				break;
		}
		PQclear(res);
	}
	PQfinish(c);
	return NULL;
}

static void
producer_start(struct producer *p, long long rows, int duration_ms)
{
	memset(p, 0, sizeof(*p));
	p->target = rows;
	p->duration_ms = duration_ms > 0 ? duration_ms : 1;
	p->rng = rng_next();
	p->conninfo = tl_env("OUTBOXD_PG_CONNINFO");
	ck_assert_int_eq(pthread_create(&p->thread, NULL, producer_main, p),
	    0);
}

static void
producer_join(struct producer *p)
{
	pthread_join(p->thread, NULL);
}

/* --- the consumer: records every delivery, reconnects on its own -------- */

struct seen {
	int64_t id;		/* 0 = empty slot */
	uint32_t fresh;		/* deliveries with redelivered = false */
	uint32_t again;		/* redeliveries (our ack was lost) */
};

struct consumer {
	pthread_t thread;
	int port;
	atomic_int stop;
	pthread_mutex_t mu;
	struct seen *tab;	/* open addressing, power of two */
	size_t mask;
	size_t distinct, deliveries, foreign;
	int reconnects;
	int64_t last_delivery_ms;
};

static struct seen *
seen_slot(struct consumer *c, int64_t id)
{
	size_t i = (size_t)((uint64_t)id * 0x9e3779b97f4a7c15ULL) & c->mask;

	while (c->tab[i].id != 0 && c->tab[i].id != id)
		i = (i + 1) & c->mask;
	return &c->tab[i];
}

/*
 * A delivery marked redelivered is the same broker message again (its
 * ack was lost when our connection dropped): it proves receipt, not a
 * second publish.  Copies published twice by outboxd arrive as separate
 * fresh deliveries.
 */
static void
consumer_record(struct consumer *c, int64_t id, bool redelivered)
{
	struct seen *s;

	pthread_mutex_lock(&c->mu);
	c->deliveries++;
	c->last_delivery_ms = tl_ms();
	if (id <= 0 || c->distinct * 2 > c->mask) {
		c->foreign++;
		pthread_mutex_unlock(&c->mu);
		return;
	}
	s = seen_slot(c, id);
	if (s->id == 0) {
		s->id = id;
		c->distinct++;
	}
	if (redelivered)
		s->again++;
	else
		s->fresh++;
	pthread_mutex_unlock(&c->mu);
}

static bool
reply_ok(amqp_rpc_reply_t r)
{
	return r.reply_type == AMQP_RESPONSE_NORMAL;
}

static amqp_connection_state_t
consumer_connect(struct consumer *c)
{
	amqp_connection_state_t conn = amqp_new_connection();
	amqp_socket_t *sock = amqp_tcp_socket_new(conn);
	struct timeval tv = { 3, 0 };

	if (sock == NULL || amqp_socket_open_noblock(sock, "127.0.0.1",
	    c->port, &tv) != AMQP_STATUS_OK)
		goto fail;
	(void)amqp_set_handshake_timeout(conn, &tv);
	(void)amqp_set_rpc_timeout(conn, &tv);
	if (!reply_ok(amqp_login(conn, "/", 0, 131072, 0,
	    AMQP_SASL_METHOD_PLAIN, "guest", "guest")))
		goto fail;
	amqp_channel_open(conn, 1);
	if (!reply_ok(amqp_get_rpc_reply(conn)))
		goto fail;
	amqp_queue_declare(conn, 1, amqp_cstring_bytes(QUEUE), 0, 1, 0, 0,
	    amqp_empty_table);
	if (!reply_ok(amqp_get_rpc_reply(conn)))
		goto fail;
	amqp_basic_qos(conn, 1, 0, 500, 0);
	if (!reply_ok(amqp_get_rpc_reply(conn)))
		goto fail;
	/* Manual acks: what reached us before a broker restart is not
	 * lost, it comes back marked redelivered. */
	amqp_basic_consume(conn, 1, amqp_cstring_bytes(QUEUE),
	    amqp_empty_bytes, 0, 0, 0, amqp_empty_table);
	if (!reply_ok(amqp_get_rpc_reply(conn)))
		goto fail;
	return conn;
fail:
	amqp_destroy_connection(conn);
	return NULL;
}

static int64_t
envelope_id(const amqp_envelope_t *env)
{
	const amqp_basic_properties_t *p = &env->message.properties;
	char buf[32];
	size_t n;

	if (!(p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG))
		return -1;
	n = p->message_id.len < sizeof(buf) - 1 ? p->message_id.len :
	    sizeof(buf) - 1;
	memcpy(buf, p->message_id.bytes, n);
	buf[n] = '\0';
	return strtoll(buf, NULL, 10);
}

static void *
consumer_main(void *arg)
{
	struct consumer *c = arg;
	amqp_connection_state_t conn = NULL;

	while (!atomic_load(&c->stop)) {
		struct timeval tv = { 0, 200000 };
		amqp_envelope_t env;
		amqp_rpc_reply_t r;

		if (conn == NULL && (conn = consumer_connect(c)) == NULL) {
			nap_ms(200);
			continue;
		}
		amqp_maybe_release_buffers(conn);
		r = amqp_consume_message(conn, &env, &tv, 0);
		if (reply_ok(r)) {
			int st;

			consumer_record(c, envelope_id(&env),
			    env.redelivered != 0);
			st = amqp_basic_ack(conn, 1, env.delivery_tag, 0);
			amqp_destroy_envelope(&env);
			if (st == AMQP_STATUS_OK)
				continue;
		} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
		    r.library_error == AMQP_STATUS_TIMEOUT) {
			continue;
		}
		/* Closed, or a frame other than a delivery (the broker
		 * shutting down): start over on a new connection. */
		amqp_destroy_connection(conn);
		conn = NULL;
		c->reconnects++;
	}
	if (conn != NULL) {
		amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
		amqp_destroy_connection(conn);
	}
	return NULL;
}

static void
consumer_start(struct consumer *c, long long rows)
{
	size_t cap = 1024;

	memset(c, 0, sizeof(*c));
	while (cap < (size_t)rows * 4)
		cap *= 2;
	c->tab = xcalloc(cap, sizeof(*c->tab));
	c->mask = cap - 1;
	c->port = atoi(tl_env("OUTBOXD_AMQP_PORT"));
	pthread_mutex_init(&c->mu, NULL);
	ck_assert_int_eq(pthread_create(&c->thread, NULL, consumer_main, c),
	    0);
}

static size_t
consumer_distinct(struct consumer *c)
{
	size_t n;

	pthread_mutex_lock(&c->mu);
	n = c->distinct;
	pthread_mutex_unlock(&c->mu);
	return n;
}

static void
consumer_stop(struct consumer *c)
{
	atomic_store(&c->stop, 1);
	pthread_join(c->thread, NULL);
	pthread_mutex_destroy(&c->mu);
}

/* --- a scenario's bookkeeping and its verdict ---------------------------- */

struct scenario {
	const char *name;
	struct producer prod;
	struct consumer cons;
	int nfaults;
	int64_t recovery_ms[MAX_FAULTS];	/* fault → SUCCESS moves */
	int64_t down_ms[MAX_FAULTS];		/* how long it lasted */
	char extra[256];			/* more for the report */
};

static void
scenario_begin(struct scenario *s, const char *name, int stream_ms)
{
	struct tl_amqp *a = tl_amqp_open();

	memset(s, 0, sizeof(*s));
	s->name = name;
	/* A durable queue, empty: persistent messages survive a broker
	 * restart in it, so nothing confirmed may go missing. */
	tl_queue(a, QUEUE, "", "");
	tl_amqp_close(a);
	fprintf(stderr, "faults: scenario=%s seed=%" PRIu64 " rows=%lld "
	    "stream_ms=%d starting\n", name, seed, plan.rows, stream_ms);
	consumer_start(&s->cons, plan.rows);
	producer_start(&s->prod, plan.rows, stream_ms);
}

/* Fault k started at t0 (tl_ms) and was over at t_over; the SUCCESS
 * count stood at baseline then.  Records when it moved again. */
static void
record_recovery(struct scenario *s, int64_t t0, int64_t t_over,
    long long baseline)
{
	int64_t deadline = tl_ms() + 120000;
	long long v;

	ck_assert_int_lt(s->nfaults, MAX_FAULTS);
	/* Moving again, or nothing left to move (stream over, all sent). */
	while ((v = sent_count()) <= baseline && tl_ms() < deadline) {
		if (v >= plan.rows)
			break;
		nap_ms(20);
	}
	ck_assert_msg(v > baseline || v >= plan.rows, "%s: fault %d: no row "
	    "sent within 120 s (stuck at %lld)", s->name, s->nfaults, v);
	s->down_ms[s->nfaults] = t_over - t0;
	s->recovery_ms[s->nfaults] = tl_ms() - t0;
	s->nfaults++;
}

static void
assert_no_row_locked(void)
{
	static const char *const tables[] = { "t_transactional_message",
		"t_transactional_message_content" };

	for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
		PGresult *res;
		bool ok;
		char sql[256];

		tl_sql(db, "BEGIN");
		snprintf(sql, sizeof(sql), "SELECT count(*) FROM (SELECT 1 "
		    "FROM %s FOR UPDATE NOWAIT) s", tables[i]);
		res = PQexec(db, sql);
		ok = PQresultStatus(res) == PGRES_TUPLES_OK;
		if (!ok)
			fprintf(stderr, "faults: locked row in %s: %s",
			    tables[i], PQresultErrorMessage(res));
		PQclear(res);
		tl_sql(db, "ROLLBACK");
		ck_assert_msg(ok, "a row of %s is still locked", tables[i]);
	}
}

static void
format_list(char *buf, size_t size, const int64_t *v, int n)
{
	size_t len = 0;

	buf[0] = '\0';
	for (int i = 0; i < n && len + 24 < size; i++)
		len += (size_t)snprintf(buf + len, size - len, "%s%" PRId64,
		    i ? "," : "", v[i]);
}

/*
 * Waits for the stream to end and every row to be sent and received,
 * then checks and reports: nothing lost, duplicates within the batches
 * in flight at the faults, no row locked, every outboxd alive.
 */
static void
scenario_end(struct scenario *s, const pid_t *pids, int npids)
{
	long long rows, sent, lost = 0, dups = 0, dup_ids = 0, bound, phantom,
	    retried;
	int64_t deadline, max_rec = 0;
	char recov[2048], down[2048];
	PGresult *res;

	producer_join(&s->prod);
	if (PQstatus(db) != CONNECTION_OK)
		PQreset(db);
	ck_assert_msg(PQstatus(db) == CONNECTION_OK, "postgres: %s",
	    PQerrorMessage(db));
	rows = tl_sql_int(db, "SELECT count(*) FROM t_transactional_message");
	ck_assert_int_eq(rows, plan.rows);
	sent = wait_sent(rows, 180000);
	if (sent != rows) {
		char st[256];

		tl_sql_text(db, st, sizeof(st), "SELECT string_agg("
		    "message_status || ':' || n, ' ') FROM (SELECT "
		    "message_status, count(*) n FROM t_transactional_message "
		    "GROUP BY 1) s");
		ck_abort_msg("%s: %lld of %lld rows SUCCESS after 180 s "
		    "(status:count %s)", s->name, sent, rows, st);
	}
	assert_no_row_locked();
	/* Rows that failed at least once on the way (nack, return...). */
	retried = tl_sql_int(db, "SELECT count(*) FROM t_transactional_message"
	    " WHERE current_retry_times > 0");
	for (int i = 0; i < npids; i++)
		ck_assert_msg(alive(pids[i]), "%s: outboxd %d died (log %s)",
		    s->name, (int)pids[i], tl_outboxd_log(pids[i]));
	/* Received after the fact too: the consumer drains the queue,
	 * reconnecting if the broker restarted under it. */
	deadline = tl_ms() + 120000;
	while (consumer_distinct(&s->cons) < (size_t)rows &&
	    tl_ms() < deadline)
		nap_ms(50);
	/* Late duplicates are still in the queue: drain it until quiet. */
	while (tl_ms() < deadline) {
		int64_t last;

		pthread_mutex_lock(&s->cons.mu);
		last = s->cons.last_delivery_ms;
		pthread_mutex_unlock(&s->cons.mu);
		if (tl_ms() - last > 1500)
			break;
		nap_ms(100);
	}
	consumer_stop(&s->cons);
	res = PQexec(db, "SELECT id FROM t_transactional_message "
	    "WHERE message_status = 1 ORDER BY id");
	ck_assert_int_eq(PQresultStatus(res), PGRES_TUPLES_OK);
	for (int i = 0; i < PQntuples(res); i++) {
		int64_t id = strtoll(PQgetvalue(res, i, 0), NULL, 10);
		const struct seen *e = seen_slot(&s->cons, id);
		long long copies = e->id == 0 ? 0 : e->fresh > 0 ? e->fresh :
		    (e->again > 0);

		if (copies == 0) {
			if (lost < 5)
				fprintf(stderr, "faults: %s: id %" PRId64
				    " SUCCESS but never received\n",
				    s->name, id);
			lost++;
		} else if (copies > 1) {
			dups += copies - 1;
			dup_ids++;
		}
	}
	PQclear(res);
	/* Received ids that no row has: a commit the database forgot. */
	phantom = (long long)s->cons.distinct - sent;
	bound = (long long)s->nfaults * BATCH * batches_per_instance();
	for (int i = 0; i < s->nfaults; i++)
		if (s->recovery_ms[i] > max_rec)
			max_rec = s->recovery_ms[i];
	format_list(recov, sizeof(recov), s->recovery_ms, s->nfaults);
	format_list(down, sizeof(down), s->down_ms, s->nfaults);
	fprintf(stderr, "faults: scenario=%s seed=%" PRIu64 " rows=%lld "
	    "sent=%lld received=%zu lost=%lld phantom=%lld duplicated=%lld "
	    "dup_ids=%lld bound=%lld faults=%d recovery_ms=[%s] "
	    "max_recovery_ms=%" PRId64 " down_ms=[%s] retried_rows=%lld "
	    "deliveries=%zu consumer_reconnects=%d producer_retries=%d%s%s\n",
	    s->name, seed, rows, sent, s->cons.distinct, lost, phantom, dups,
	    dup_ids, bound, s->nfaults, recov, max_rec, down, retried,
	    s->cons.deliveries, s->cons.reconnects,
	    atomic_load(&s->prod.errors), s->extra[0] ? " " : "", s->extra);
	ck_assert_msg(lost == 0, "%s: %lld SUCCESS rows never received",
	    s->name, lost);
	ck_assert_msg(phantom == 0, "%s: %lld messages for rows that do not "
	    "exist", s->name, phantom);
	ck_assert_msg(s->cons.foreign == 0, "%s: %zu deliveries without an "
	    "outbox id", s->name, s->cons.foreign);
	ck_assert_msg(dups <= bound, "%s: %lld duplicates, more than %d "
	    "faults x %d batches x %d rows in flight", s->name, dups,
	    s->nfaults, batches_per_instance(), BATCH);
	free(s->cons.tab);
	for (int i = 0; i < npids; i++)
		ck_assert_int_eq(tl_outboxd_stop(pids[i], 30000), 0);
}

/* --- fixtures ----------------------------------------------------------- */

static void
setup(void)
{
	const char *s = getenv("FAULTS_SOAK");

	(void)tl_ms();	/* start its clock here, not in a thread */
	end_leftovers();
	/* A test that failed half-way may have left a server down. */
	tl_servers("start", "pg");
	tl_servers("start", "redis");
	if (!tl_port_open(atoi(tl_env("OUTBOXD_AMQP_PORT"))))
		tl_servers("start", "rabbitmq");
	db = tl_pg();
	tl_reset_db(db);
	/* The test servers run with synchronous_commit off: a PostgreSQL
	 * crash would forget the last commits, rows the relay had already
	 * sent among them.  These scenarios hold PostgreSQL to its word
	 * (new sessions; fsync stays off, which a process crash does not
	 * need).  teardown puts it back. */
	tl_sql(db, "DO $$ BEGIN EXECUTE format('ALTER DATABASE %%I SET "
	    "synchronous_commit = on', current_database()); END $$");
	leader_key_delete();
	plan.soak = s != NULL && strcmp(s, "1") == 0;
	plan.rows = plan.soak ? 100000 : 12000;
	plan.stream_s = plan.soak ? 120 : 8;
	plan.kills = plan.soak ? 60 : 10;
	plan.kill_gap_ms = 2000;
	plan.leader_kills = plan.soak ? 8 : 3;
	plan.restarts = plan.soak ? 3 : 1;
	plan.redis_outage_ms = plan.soak ? 10000 : 6000;
	plan.hang_ms = 8000;
	s = getenv("FAULTS_SEED");
	seed = s != NULL ? strtoull(s, NULL, 10) :
	    (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
	rng_state = seed;
	fprintf(stderr, "faults: seed=%" PRIu64 " (FAULTS_SEED=%" PRIu64
	    " replays it)%s\n", seed, seed, plan.soak ? " soak" : "");
}

static void
teardown(void)
{
	PQclear(PQexec(db, "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I "
	    "RESET synchronous_commit', current_database()); END $$"));
	PQfinish(db);
	end_leftovers();
}

/* --- the scenarios ------------------------------------------------------ */

/* Whether outboxd has a batch open: claimed and locked, not yet marked
 * (its session is idle in transaction while it awaits confirms). */
static bool
batch_in_flight(void)
{
	return try_int(db, "SELECT count(*) FROM pg_stat_activity WHERE "
	    "application_name = 'outboxd' AND state = 'idle in transaction'")
	    > 0;
}

/*
 * SIGKILL at random moments, restarted at once each time.  Every other
 * kill is aimed: within its random wait, it strikes as soon as a batch
 * is seen in flight, the moment that makes duplicates.
 */
START_TEST(test_sigkill_at_random_moments)
{
	struct scenario s;
	int aimed_hits = 0;
	pid_t pid;

	scenario_begin(&s, "sigkill", plan.stream_s * 1000 + plan.kills * 500);
	pid = start_outboxd(BASE_YAML);
	ck_assert_int_gt(wait_sent(1, 30000), 0);
	for (int k = 0; k < plan.kills; k++) {
		int64_t t0, until = tl_ms() + rng_below(plan.kill_gap_ms);
		long long baseline;

		/* The random moment: anywhere in claim, publish, confirm or
		 * mark, or while idle, or still starting up. */
		if (k % 2 == 0) {
			nap_ms(until - tl_ms());
		} else {
			while (tl_ms() < until && !batch_in_flight())
				;
			aimed_hits += tl_ms() < until;
		}
		t0 = tl_ms();
		tl_outboxd_kill(pid);
		baseline = sent_count();
		pid = start_outboxd(BASE_YAML);
		record_recovery(&s, t0, t0, baseline);
	}
	snprintf(s.extra, sizeof(s.extra), "kills_mid_batch=%d", aimed_hits);
	scenario_end(&s, &pid, 1);
}
END_TEST

/*
 * Starts a server, trying again until timeout_ms: after a SIGKILL the
 * old process may linger for a moment (a PostgreSQL postmaster not yet
 * reaped keeps its pid file valid, its backends their shared memory).
 */
static void
servers_start(const char *service, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	char cmd[1024];
	const char *src = getenv("OUTBOXD_SRCDIR");
	int rc;

	snprintf(cmd, sizeof(cmd), "'%s/tests/servers.sh' start '%s' %s "
	    ">/dev/null 2>&1", src ? src : ".", tl_env("OUTBOXD_SERVERS_DIR"),
	    service);
	while ((rc = system(cmd)) != 0 && tl_ms() < deadline)
		nap_ms(250);
	if (rc != 0)
		tl_servers("start", service);	/* fails with its words */
}

enum server_fault {
	FAULT_RESTART,		/* clean stop, then start */
	FAULT_CRASH,		/* SIGKILL, then start */
	FAULT_FREEZE,		/* SIGSTOP, then SIGCONT: a hung broker */
};

/* SIGSTOP or SIGCONT to the private RabbitMQ (its pid file). */
static void
rabbitmq_signal(int sig)
{
	pid_t pid = tl_rabbitmq_pid();

	ck_assert_msg(pid > 0 && kill(pid, sig) == 0, "signal %d to "
	    "rabbitmq (pid %d) failed", sig, (int)pid);
}

/*
 * A server stopped (cleanly, by SIGKILL, or frozen) and brought back
 * mid-stream, plan.restarts times; outboxd must find its way back.
 */
static void
server_fault(const char *service, const char *name, enum server_fault how)
{
	struct scenario s;
	/* A frozen broker is found out by the confirm timeout. */
	const char *yaml = how == FAULT_FREEZE ? BASE_YAML
	    "rabbitmq.confirm_timeout: 2s\nrabbitmq.connect_timeout: 2s\n" :
	    BASE_YAML;
	pid_t pid;

	scenario_begin(&s, name, plan.stream_s * 1000);
	pid = start_outboxd(yaml);
	for (int k = 0; k < plan.restarts; k++) {
		long long part = plan.rows * (k + 1) / (plan.restarts + 3);
		int64_t t0, t_up;
		long long baseline = -1;

		/* Mid-stream: part of the rows sent, more coming. */
		ck_assert_int_ge(wait_sent(part, 120000), part);
		t0 = tl_ms();
		if (how == FAULT_FREEZE) {
			rabbitmq_signal(SIGSTOP);
			baseline = sent_count();
			/* Longer than the confirm and connect timeouts. */
			nap_ms(6000);
			rabbitmq_signal(SIGCONT);
		} else {
			tl_servers(how == FAULT_CRASH ? "kill" : "stop",
			    service);
			if (strcmp(service, "pg") != 0)
				baseline = sent_count();
			servers_start(service, 60000);
		}
		t_up = tl_ms();
		if (baseline == -1) {
			/* outboxd's reconnect waits at least 100 ms: a count
			 * read at once is still the one before the stop. */
			PQreset(db);
			baseline = sent_count();
		}
		record_recovery(&s, t0, t_up, baseline);
		ck_assert_msg(alive(pid), "outboxd died across the fault");
	}
	scenario_end(&s, &pid, 1);
}

START_TEST(test_rabbitmq_restart_mid_stream)
{
	server_fault("rabbitmq", "rabbitmq-restart", FAULT_RESTART);
}
END_TEST

START_TEST(test_postgres_restart_mid_stream)
{
	server_fault("pg", "postgres-restart", FAULT_RESTART);
}
END_TEST

START_TEST(test_rabbitmq_crash_mid_stream)
{
	server_fault("rabbitmq", "rabbitmq-sigkill", FAULT_CRASH);
}
END_TEST

START_TEST(test_postgres_crash_mid_stream)
{
	server_fault("pg", "postgres-sigkill", FAULT_CRASH);
}
END_TEST

START_TEST(test_rabbitmq_frozen_mid_stream)
{
	server_fault("rabbitmq", "rabbitmq-frozen", FAULT_FREEZE);
}
END_TEST

/*
 * Redis stopped for a while: delivery must not stop (rows keep moving
 * during the outage), leadership falls back to PostgreSQL's advisory
 * lock, and Redis is used again once it is back.
 */
START_TEST(test_redis_outage_mid_stream)
{
	struct scenario s;
	long long baseline, during;
	int64_t t0, t_up, deadline;
	pid_t pid;

	scenario_begin(&s, "redis-outage", plan.stream_s * 1000 +
	    plan.redis_outage_ms);
	pid = start_outboxd(BASE_YAML);
	ck_assert_int_ge(wait_sent(plan.rows / 4, 120000), plan.rows / 4);
	t0 = tl_ms();
	tl_servers("stop", "redis");
	baseline = sent_count();
	/* The outage itself lasts redis_outage_ms; meanwhile rows must
	 * keep being sent (the first move is the recovery time). */
	record_recovery(&s, t0, t0, baseline);
	while (tl_ms() < t0 + plan.redis_outage_ms)
		nap_ms(100);
	during = sent_count() - baseline;
	ck_assert_msg(tl_log_contains(pid, "falls back to a postgres "
	    "advisory lock"), "no fallback logged (log %s)",
	    tl_outboxd_log(pid));
	tl_servers("start", "redis");
	t_up = tl_ms();
	s.down_ms[0] = t_up - t0;
	/* Redis reconnects back off up to reconnect.max (1 s in the test
	 * config): 60 s is ample. */
	deadline = tl_ms() + 60000;
	while (!tl_log_contains(pid, "redis is back") && tl_ms() < deadline)
		nap_ms(100);
	ck_assert_msg(tl_log_contains(pid, "redis is back"), "redis never "
	    "used again (log %s)", tl_outboxd_log(pid));
	snprintf(s.extra, sizeof(s.extra), "sent_during_outage=%lld "
	    "redis_back_after_ms=%" PRId64, during, tl_ms() - t_up);
	ck_assert_msg(during > 0, "no row sent while redis was down");
	scenario_end(&s, &pid, 1);
}
END_TEST

/*
 * Idle means idle while servers are away: an outboxd waiting for them
 * must sleep between its reconnect attempts, not spin.  Compensation is
 * due every 500 ms here, and the test configs cap reconnect delays at
 * 1 s, so that a retry or compensation time left in the past (the two
 * busy loops these scenarios caught) is reached within a second of the
 * outage, well inside the measuring window.
 */
#define OUTAGE_YAML BASE_YAML "relay.poll_interval: 500ms\n"
#define OUTAGE_ROWS 4000
#define OUTAGE_STREAM_MS 6000
#define CPU_WINDOW_MS 3000
/* Ten connection attempts a second cost next to nothing; a loop that
 * never sleeps takes a whole core, or what a busy machine leaves it. */
#define CPU_MAX_SHARE 0.10

static void
servers_down_idle(const char *name, bool broker_too)
{
	struct scenario s;
	int64_t t0, t_up;
	long long baseline;
	double cpu;
	char tok[128];
	bool still_leader;
	int had;
	pid_t pid;

	plan.rows = OUTAGE_ROWS;
	scenario_begin(&s, name, OUTAGE_STREAM_MS);
	pid = start_outboxd(OUTAGE_YAML);
	ck_assert_int_ge(wait_sent(plan.rows / 4, 60000), plan.rows / 4);
	/* The Redis leader compensates, and compensation is what touches
	 * PostgreSQL (and finds it gone) while the broker is down; with
	 * PostgreSQL down it is due and must wait without spinning. */
	ck_assert_msg(wait_log_lines(pid, "leadership acquired",
	    "backend=redis", 0, 30000), "%s: outboxd never became the redis "
	    "leader (log %s)", name, tl_outboxd_log(pid));
	t0 = tl_ms();
	if (broker_too) {
		/* RabbitMQ first, and known to be down before PostgreSQL
		 * goes: with PostgreSQL gone first the relay would not
		 * touch the broker connection and never see it close. */
		had = log_lines(pid, "rabbitmq unavailable", NULL);
		tl_servers("stop", "rabbitmq");
		ck_assert_msg(wait_log_lines(pid, "rabbitmq unavailable", NULL,
		    had, 30000), "%s: outboxd did not notice rabbitmq stop "
		    "(log %s)", name, tl_outboxd_log(pid));
	}
	had = log_lines(pid, "postgres unavailable", NULL);
	tl_servers("stop", "pg");
	/* A failed reconnect: from here on it only waits for servers. */
	ck_assert_msg(wait_log_lines(pid, "postgres unavailable", NULL, had,
	    30000), "%s: outboxd did not notice postgres stop (log %s)", name,
	    tl_outboxd_log(pid));
	cpu = tl_cpu_share(pid, CPU_WINDOW_MS);
	still_leader = token_owner(&pid, 1, leader_token(tok, sizeof(tok)))
	    == 0;
	fprintf(stderr, "faults: scenario=%s cpu_while_down=%.1f%% "
	    "window_ms=%d leader=%s\n", name, cpu * 100, CPU_WINDOW_MS,
	    still_leader ? "yes" : "no");
	/* Servers back before any verdict, so that a failure here leaves
	 * them running for the next test. */
	servers_start("pg", 60000);
	if (broker_too)
		servers_start("rabbitmq", 60000);
	t_up = tl_ms();
	/* outboxd's reconnect waits at least 100 ms: a count read at once
	 * is still the one before the stop. */
	PQreset(db);
	baseline = sent_count();
	ck_assert_msg(alive(pid), "%s: outboxd died while the servers were "
	    "down (log %s)", name, tl_outboxd_log(pid));
	ck_assert_msg(cpu < CPU_MAX_SHARE, "%s: outboxd used %.0f%% of a "
	    "core over %d ms with the servers down (at most %.0f%%: it "
	    "spins instead of sleeping until its retry time; log %s)", name,
	    cpu * 100, CPU_WINDOW_MS, CPU_MAX_SHARE * 100,
	    tl_outboxd_log(pid));
	ck_assert_msg(still_leader, "%s: outboxd was not the redis leader "
	    "during the outage, so its due compensation was not exercised "
	    "(key token %s)", name, tok);
	record_recovery(&s, t0, t_up, baseline);
	snprintf(s.extra, sizeof(s.extra), "cpu_while_down=%.1f%%",
	    cpu * 100);
	scenario_end(&s, &pid, 1);
}

/* With both servers down, the broker's retry time must move on too
 * (outboxd spun at 100 % CPU: it slept until a retry time in the past). */
START_TEST(test_postgres_and_rabbitmq_down_idle)
{
	servers_down_idle("postgres-rabbitmq-down", true);
}
END_TEST

/* The Redis leader with PostgreSQL down: its compensation is due but
 * cannot run, and must not ask for a wake-up at once, again and again
 * (the main loop spun). */
START_TEST(test_postgres_down_while_leader_idle)
{
	servers_down_idle("postgres-down-leader", false);
}
END_TEST

/*
 * An instance hung in the middle of a batch (SIGSTOP: what a VM pause,
 * a debugger or a swap storm does) while a second one runs.  The hung
 * one holds its batch's row locks: the other skips those rows (SKIP
 * LOCKED), so they wait for the hung instance to resume or die, and the
 * scenario reports how many waited (stranded_rows; recovery_ms is when
 * they were sent).  Once it resumes, nothing is lost.  PostgreSQL's
 * idle_in_transaction_session_timeout on outboxd's sessions would free
 * them while it hangs; see docs/RELIABILITY.md.
 */
START_TEST(test_hung_instance_mid_batch)
{
	struct scenario s;
	pid_t pids[2];
	long long max_id, stranded, baseline, sent_while_hung;
	int64_t t0, t_cont, t_done = 0;
	bool caught = false;
	char sql[256];

	scenario_begin(&s, "hung-instance", plan.stream_s * 1000 +
	    plan.hang_ms);
	pids[0] = start_outboxd(BASE_YAML);
	ck_assert_int_ge(wait_sent(plan.rows / 4, 120000), plan.rows / 4);
	/* Alone, any open outboxd transaction is this instance's batch. */
	for (int tries = 0; tries < 100 && !caught; tries++) {
		int64_t until = tl_ms() + 5000;

		while (tl_ms() < until && !batch_in_flight())
			;
		kill(pids[0], SIGSTOP);
		/* SIGSTOP lands asynchronously: a batch that commits in
		 * the meantime would be caught without being held. */
		ck_assert(tl_wait_stopped(pids[0], 10000));
		caught = batch_in_flight();
		if (!caught)
			kill(pids[0], SIGCONT);
	}
	ck_assert_msg(caught, "never caught a batch in flight");
	t0 = tl_ms();
	max_id = tl_sql_int(db, "SELECT max(id) FROM t_transactional_message");
	baseline = sent_count();
	pids[1] = start_outboxd(BASE_YAML);
	/* Rows older than the freeze still unsent: soon only the hung
	 * batch's, unless its locks are taken from it. */
	snprintf(sql, sizeof(sql), "SELECT count(*) FROM "
	    "t_transactional_message WHERE message_status <> 1 AND id <= %lld",
	    max_id);
	while (tl_ms() < t0 + plan.hang_ms) {
		if (t_done == 0 && try_int(db, sql) == 0)
			t_done = tl_ms();
		nap_ms(100);
	}
	stranded = tl_sql_int(db, "%s", sql);
	sent_while_hung = sent_count() - baseline;
	kill(pids[0], SIGCONT);
	t_cont = tl_ms();
	/* The hung batch's rows stay locked (outboxd's idle-in-transaction
	 * timeout is far longer than the hang), and the other instance
	 * serves the rest of the stream meanwhile. */
	ck_assert_msg(stranded > 0, "no row of the hung batch was held: the "
	    "scenario caught no batch");
	ck_assert_msg(sent_while_hung > 0, "the second instance sent nothing "
	    "while the first was hung");
	ck_assert_msg(tl_wait_sql_int(db, 0, 60000, "%s", sql) == 0,
	    "rows of the hung batch never sent");
	if (t_done == 0)
		t_done = tl_ms();
	ck_assert_int_lt(s.nfaults, MAX_FAULTS);
	s.down_ms[s.nfaults] = t_cont - t0;
	s.recovery_ms[s.nfaults++] = t_done - t0;
	snprintf(s.extra, sizeof(s.extra), "stranded_rows=%lld "
	    "hung_batch_sent_while_hung=%s sent_by_other=%lld", stranded,
	    t_done < t_cont ? "yes" : "no", sent_while_hung);
	scenario_end(&s, pids, 2);
}
END_TEST

/*
 * Three instances; the leader — the one whose token is in the Redis key,
 * matched to the "leader lock acquired" line of its log — is killed with
 * SIGKILL, and a replacement started.  Another instance must take over.
 * In parallel mode the others go on relaying meanwhile; in single-active
 * mode nobody relays until the dead leader's key expires.
 */
static void
kill_leaders(const char *name, const char *yaml)
{
	enum { N = 3 };
	struct scenario s;
	pid_t pids[N];
	char tok[128] = "", prev[128] = "";
	int64_t takeover[MAX_FAULTS];
	char list[200];
	int leader;

	scenario_begin(&s, name, plan.stream_s * 1000 +
	    plan.leader_kills * 3000);
	for (int i = 0; i < N; i++)
		pids[i] = start_outboxd(yaml);
	ck_assert_int_gt(wait_sent(1, 30000), 0);
	leader = wait_leader(pids, N, "", tok, sizeof(tok), 30000);
	ck_assert_msg(leader >= 0, "no leader among three instances");
	for (int k = 0; k < plan.leader_kills; k++) {
		int64_t t0;
		long long baseline;
		int next;

		nap_ms(rng_below(plan.kill_gap_ms));
		t0 = tl_ms();
		tl_outboxd_kill(pids[leader]);
		baseline = sent_count();
		/* Parallel: the others go on at once.  Single-active: rows
		 * move again when a new leader relays. */
		record_recovery(&s, t0, t0, baseline);
		snprintf(prev, sizeof(prev), "%s", tok);
		/* The dead leader's key expires after ttl (3 s); a
		 * survivor takes over at its next try. */
		next = wait_leader(pids, N, prev, tok, sizeof(tok), 30000);
		ck_assert_msg(next >= 0 && next != leader, "no new leader "
		    "after killing instance %d", leader);
		takeover[k] = tl_ms() - t0;
		pids[leader] = start_outboxd(yaml);
		leader = next;
	}
	format_list(list, sizeof(list), takeover, plan.leader_kills);
	snprintf(s.extra, sizeof(s.extra), "takeover_ms=[%s]", list);
	scenario_end(&s, pids, N);
}

START_TEST(test_leader_killed_among_three)
{
	kill_leaders("leader-kill", BASE_YAML);
}
END_TEST

START_TEST(test_single_active_leader_killed)
{
	kill_leaders("leader-kill-single-active", BASE_YAML
	    "relay.mode: single-active\n");
}
END_TEST

/* Whether name is one of the comma-separated words of list. */
static bool
listed(const char *list, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = list; p != NULL; p = strchr(p, ',')) {
		if (*p == ',')
			p++;
		if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == '\0'))
			return true;
	}
	return false;
}

int
main(void)
{
	const struct {
		const char *name;
		const TTest *test;
	} tests[] = {
		{ "sigkill", test_sigkill_at_random_moments },
		{ "rabbitmq", test_rabbitmq_restart_mid_stream },
		{ "postgres", test_postgres_restart_mid_stream },
		{ "rabbitmq-crash", test_rabbitmq_crash_mid_stream },
		{ "postgres-crash", test_postgres_crash_mid_stream },
		{ "rabbitmq-freeze", test_rabbitmq_frozen_mid_stream },
		{ "redis", test_redis_outage_mid_stream },
		{ "postgres-rabbitmq-down",
		    test_postgres_and_rabbitmq_down_idle },
		{ "postgres-down-leader",
		    test_postgres_down_while_leader_idle },
		{ "hung", test_hung_instance_mid_batch },
		{ "leader", test_leader_killed_among_three },
		{ "leader-single", test_single_active_leader_killed },
	};
	Suite *s = suite_create("faults");
	TCase *tc = tcase_create("faults");
	const char *soak = getenv("FAULTS_SOAK");
	/* FAULTS_ONLY=sigkill,redis runs just those scenarios. */
	const char *only = getenv("FAULTS_ONLY");
	SRunner *sr;
	int failed;

	/* A name misspelt, or none, would run nothing, and pass. */
	if (only != NULL && *only == '\0') {
		fprintf(stderr, "FAULTS_ONLY is empty: unset it to run every "
		    "scenario\n");
		return 2;
	}
	for (const char *p = only; p != NULL && *p != '\0';) {
		size_t len = strcspn(p, ",");
		bool known = false;

		for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
			known = known || (strlen(tests[i].name) == len &&
			    strncmp(tests[i].name, p, len) == 0);
		if (!known) {
			fprintf(stderr, "FAULTS_ONLY: no scenario \"%.*s\"\n",
			    (int)len, p);
			return 2;
		}
		p += len + (p[len] == ',');
	}
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, soak != NULL && strcmp(soak, "1") == 0 ?
	    3600 : 600);
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
		if (only == NULL || listed(only, tests[i].name))
			tcase_add_test(tc, tests[i].test);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
