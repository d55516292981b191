/*
 * The relay end to end against real servers: rows become confirmed
 * messages, bad rows fail alone and die on schedule, and server restarts
 * lose nothing.
 */
#include <check.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "store.h"
#include "testlib.h"
#include "util.h"


static PGconn *db;

static void
setup(void)
{
	/* A test that failed half-way may have left the broker frozen or a
	 * server down (the restarts): the next one starts from servers
	 * that answer. */
	tl_rabbitmq_freeze(false);
	if (!tl_port_open(atoi(tl_env("OUTBOXD_AMQP_PORT"))))
		tl_servers("start", "rabbitmq");
	if (!tl_port_open(atoi(tl_env("OUTBOXD_PG_PORT"))))
		tl_servers("start", "pg");
	db = tl_pg();
	tl_reset_db(db);
}

static void
teardown(void)
{
	PQfinish(db);
}

/* Every id in first..first+n-1 arrived exactly once. */
static void
assert_each_once(const unsigned *counts, long long n)
{
	long long missing = 0, dup = 0;

	for (long long i = 0; i < n; i++) {
		missing += counts[i] == 0;
		dup += counts[i] > 1;
	}
	ck_assert_int_eq(missing, 0);
	ck_assert_int_eq(dup, 0);
}

/* Counts rows in a state, with an optional extra condition. */
#define COUNT_STATUS(st) \
	"SELECT count(*) FROM t_transactional_message WHERE message_status = " #st

START_TEST(test_function_and_plain_inserts_arrive)
{
	struct tl_amqp *a = tl_amqp_open();
	struct tl_msg m;
	long long id_fn, id_plain;
	pid_t pid;
	int seen = 0;

	tl_queue(a, "relay.basic", "", "");
	tl_consume(a, "relay.basic");
	id_fn = tl_sql_int(db, "SELECT outbox_enqueue('', 'relay.basic', "
	    "'{\"order\": 1}', business_module => 'orders', business_key => "
	    "'order-1', content_type => 'application/json', headers => "
	    "'{\"tenant\": \"acme\", \"gone\": null, \"CC\": null}')");
	/* Two plain INSERTs in one transaction, queue_name as the route. */
	tl_sql(db, "BEGIN; INSERT INTO t_transactional_message (queue_name, "
	    "business_module, business_key, content_type) VALUES "
	    "('relay.basic', 'billing', 'inv-9', 'text/plain'); "
	    "INSERT INTO t_transactional_message_content (message_id, content)"
	    " VALUES (currval(pg_get_serial_sequence('t_transactional_message',"
	    " 'id')), convert_to('plain body', 'UTF8')); COMMIT");
	id_plain = tl_sql_int(db, "SELECT max(id) FROM t_transactional_message");
	pid = tl_outboxd_start(NULL);
	while (seen < 2 && tl_next(a, 10000, &m)) {
		if (m.message_id == id_fn) {
			ck_assert_str_eq(m.body, "{\"order\": 1}");
			ck_assert_str_eq(m.content_type, "application/json");
			ck_assert_str_eq(m.business_module, "orders");
			ck_assert_str_eq(m.business_key, "order-1");
			/* A key whose value is JSON null is left out (jsonb
			 * keeps CC and gone first): sent as "", it was a
			 * header of its own, and a CC made the row dead. */
			ck_assert_str_eq(m.extra_header, "tenant=acme");
		} else {
			ck_assert_int_eq(m.message_id, id_plain);
			ck_assert_str_eq(m.body, "plain body");
			ck_assert_str_eq(m.content_type, "text/plain");
			ck_assert_str_eq(m.business_key, "inv-9");
		}
		ck_assert_int_eq(m.delivery_mode, 2);
		ck_assert_int_eq(m.attempt, 1);
		ck_assert_msg(m.timestamp > 1700000000ULL, "timestamp %llu",
		    (unsigned long long)m.timestamp);
		tl_msg_free(&m);
		seen++;
	}
	ck_assert_int_eq(seen, 2);
	ck_assert_int_eq(tl_wait_sql_int(db, 2, 5000, COUNT_STATUS(1)
	    " AND next_schedule_time IS NULL"), 2);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	tl_amqp_close(a);
}
END_TEST

/*
 * After a SIGTERM mid-stream: no row is left locked, what is SUCCESS
 * (returned) arrived on queue exactly once, and the rest were never
 * touched (no attempt counted, none failed).
 */
static long long
assert_stopped_clean(struct tl_amqp *a, const char *queue, long long first,
    long long n)
{
	unsigned *counts = xcalloc((size_t)n, sizeof(*counts));
	long long received = 0, dup = 0, sent = tl_sql_int(db,
	    COUNT_STATUS(1));

	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM pg_locks l "
	    "JOIN pg_class c ON c.oid = l.relation WHERE c.relname = "
	    "'t_transactional_message' AND l.pid <> pg_backend_pid()"), 0);
	tl_consume(a, queue);
	(void)tl_collect_to_end(a, queue, counts, first, n, 60000);
	for (long long i = 0; i < n; i++) {
		received += counts[i] > 0;
		dup += counts[i] > 1;
	}
	ck_assert_int_eq(received, sent);
	ck_assert_int_eq(dup, 0);
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE message_status <> 1 AND "
	    "(message_status <> 0 OR current_retry_times <> 0)"), 0);
	free(counts);
	return sent;
}

START_TEST(test_ten_thousand_rows_each_once)
{
	enum { N = 10000 };
	struct tl_amqp *a = tl_amqp_open();
	unsigned *counts = xcalloc(N, sizeof(*counts));
	long long first;
	int64_t t0;
	pid_t pid;

	tl_queue(a, "relay.bulk", "", "");
	tl_consume(a, "relay.bulk");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.bulk', 'msg ' || g) "
	    "FROM generate_series(1, %d) g", N);
	first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	t0 = tl_ms();
	pid = tl_outboxd_start("relay.batch_size: 500\n");
	tl_collect(a, counts, first, N, N, 15000, 120000);
	fprintf(stderr, "relay: %d rows delivered in %lld ms\n", N,
	    (long long)(tl_ms() - t0));
	ck_assert_int_eq(tl_wait_sql_int(db, N, 10000, COUNT_STATUS(1)), N);
	(void)tl_collect_to_end(a, "relay.bulk", counts, first, N, 30000);
	assert_each_once(counts, N);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	free(counts);
	tl_amqp_close(a);
}
END_TEST

/*
 * relay.workers: 4 relays in one process share a backlog.  Each has its
 * own session (four, while it runs), each takes batches (their log lines
 * say which worker), no row goes out twice, and SIGTERM lets every
 * worker finish its batch: nothing stays locked or half-marked.
 */
START_TEST(test_workers_share_the_backlog)
{
	enum { N = 20000, WORKERS = 4 };
	struct tl_amqp *a = tl_amqp_open();
	unsigned *counts = xcalloc(N, sizeof(*counts));
	long long first;
	char needle[64], log[512];
	pid_t pid;

	tl_queue(a, "relay.workers", "", "");
	tl_consume(a, "relay.workers");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.workers', 'msg ' || g) "
	    "FROM generate_series(1, %d) g", N);
	first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	pid = tl_outboxd_start("log.level: debug\nrelay.batch_size: 100\n"
	    "relay.workers: 4\n");
	ck_assert_int_eq(tl_wait_sql_int(db, WORKERS, 20000, "SELECT count(*) "
	    "FROM pg_stat_activity WHERE application_name = 'outboxd'"),
	    WORKERS);
	tl_collect(a, counts, first, N, N, 15000, 120000);
	ck_assert_int_eq(tl_wait_sql_int(db, N, 10000, COUNT_STATUS(1)), N);
	(void)tl_collect_to_end(a, "relay.workers", counts, first, N, 30000);
	assert_each_once(counts, N);
	/* The main thread's relay logs without a worker field. */
	for (int w = 1; w < WORKERS; w++) {
		snprintf(needle, sizeof(needle), "msg=\"batch done\" "
		    "worker=%d rows=", w);
		ck_assert_msg(tl_log_contains(pid, needle), "worker %d never "
		    "finished a batch (log %s)", w, tl_outboxd_log(pid));
	}
	/* The log is forgotten with the child: keep its path. */
	snprintf(log, sizeof(log), "%s", tl_outboxd_log(pid));
	ck_assert_int_eq(tl_outboxd_stop(pid, 20000), 0);
	/* A backend leaves the view a moment after its client is gone. */
	ck_assert_int_eq(tl_wait_sql_int(db, 0, 10000, "SELECT count(*) FROM "
	    "pg_stat_activity WHERE application_name = 'outboxd'"), 0);
	ck_assert_msg(tl_file_lines(log, "msg=\"outboxd stopped\" "
	    "published=20000 ", NULL) == 1, "the totals at exit leave the workers out "
	    "(log %s)", log);
	free(counts);
	tl_amqp_close(a);
}
END_TEST

/*
 * Workers do not LISTEN: a trickle of single rows is relayed by the main
 * relay alone (when every NOTIFY woke every worker, they took about two
 * rows in three), and a backlog calls them in at once.
 */
START_TEST(test_workers_join_on_a_backlog)
{
	enum { TRICKLE = 30, BACKLOG = 5000, WORKERS = 3 };
	struct tl_amqp *a = tl_amqp_open();
	struct tl_msg m;
	char log[512], needle[64];
	int by_workers;
	pid_t pid;

	tl_queue(a, "relay.kick", "", "");
	tl_consume(a, "relay.kick");
	pid = tl_outboxd_start("log.level: debug\nrelay.batch_size: 100\n"
	    "relay.workers: 3\nrelay.poll_interval: 30s\n");
	snprintf(log, sizeof(log), "%s", tl_outboxd_log(pid));
	ck_assert_int_eq(tl_wait_sql_int(db, WORKERS, 20000, "SELECT count(*) "
	    "FROM pg_stat_activity WHERE application_name = 'outboxd'"),
	    WORKERS);
	for (int i = 0; i < TRICKLE; i++) {
		tl_sql(db, "SELECT outbox_enqueue('', 'relay.kick', 'one')");
		ck_assert(tl_next(a, 10000, &m));
		tl_msg_free(&m);
	}
	/* A worker's own claim, once a second while idle, may still catch
	 * a row now and then. */
	by_workers = tl_file_lines(log, "msg=\"batch done\" worker=", NULL);
	ck_assert_msg(by_workers <= 3, "workers relayed %d of %d single rows "
	    "(log %s)", by_workers, TRICKLE, log);
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.kick', 'backlog ' || g) "
	    "FROM generate_series(1, %d) g", BACKLOG);
	ck_assert_int_eq(tl_wait_sql_int(db, TRICKLE + BACKLOG, 30000,
	    COUNT_STATUS(1)), TRICKLE + BACKLOG);
	ck_assert_int_eq(tl_outboxd_stop(pid, 20000), 0);
	for (int w = 1; w < WORKERS; w++) {
		snprintf(needle, sizeof(needle), "msg=\"batch done\" "
		    "worker=%d rows=", w);
		ck_assert_msg(tl_file_lines(log, needle, NULL) > 0, "worker %d "
		    "was not called in for the backlog (log %s)", w, log);
	}
	tl_amqp_close(a);
}
END_TEST

/*
 * SIGTERM while every worker has a batch in flight: each batch finishes
 * (confirms awaited, rows marked) before the process exits 0, so what is
 * SUCCESS is exactly what arrived, and no row is left locked.
 */
START_TEST(test_workers_stop_cleanly_mid_stream)
{
	enum { N = 100000 };
	struct tl_amqp *a = tl_amqp_open();
	long long first;
	pid_t pid;

	tl_queue(a, "relay.workers.stop", "", "");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.workers.stop', 'msg ' "
	    "|| g) FROM generate_series(1, %d) g", N);
	first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	pid = tl_outboxd_start("relay.batch_size: 200\nrelay.workers: 3\n");
	/* Mid-stream: some sent, most not. */
	ck_assert_int_ge(tl_wait_sql_int(db, 2000, 30000, COUNT_STATUS(1)
	    " AND id < (SELECT min(id) + 2000 FROM t_transactional_message)"),
	    2000);
	ck_assert_int_eq(tl_outboxd_stop(pid, 30000), 0);
	ck_assert_msg(assert_stopped_clean(a, "relay.workers.stop", first, N) <
	    N, "all %d rows went out before SIGTERM: the test proves nothing",
	    N);
	tl_amqp_close(a);
}
END_TEST

/* Bad rows of each kind between good ones; each fails alone. */
/* Outboxd's sessions holding the outbox's row-exclusive lock: each is
 * inside a batch's transaction. */
#define SESSIONS_IN_A_BATCH \
	"SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_class c ON " \
	"c.oid = l.relation JOIN pg_stat_activity s ON s.pid = l.pid WHERE " \
	"c.relname = 't_transactional_message' AND l.mode = " \
	"'RowExclusiveLock' AND s.application_name = 'outboxd'"

#define PIPELINED "relay.batch_size: 200\nrelay.workers: 1\n" \
	"relay.pipeline: true\n"

/* n rows for queue (declared), and a pipelined outboxd to relay them;
 * *first is the first row's id. */
static pid_t
start_pipelined(struct tl_amqp *a, const char *queue, int n,
    long long *first)
{
	tl_queue(a, queue, "", "");
	tl_sql(db, "SELECT outbox_enqueue('', '%s', 'msg ' || g) FROM "
	    "generate_series(1, %d) g", queue, n);
	*first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	return tl_outboxd_start(PIPELINED);
}

/*
 * relay.pipeline: one relay on two sessions.  Its batches overlap in
 * the database (one is claimed or marked while the other is at the
 * broker, so both sessions hold a batch at once), and SIGTERM
 * mid-stream still finishes both: what is SUCCESS is exactly what
 * arrived, once, and the rest was never touched.
 */
START_TEST(test_pipelined_relay_overlaps_and_stops_clean)
{
	enum { N = 100000 };
	struct tl_amqp *a = tl_amqp_open();
	long long first, sent;
	char log[512];
	pid_t pid;

	pid = start_pipelined(a, "relay.pipe", N, &first);
	snprintf(log, sizeof(log), "%s", tl_outboxd_log(pid));
	ck_assert_int_eq(tl_wait_sql_int(db, 2, 30000, SESSIONS_IN_A_BATCH),
	    2);
	ck_assert_int_eq(tl_outboxd_stop(pid, 30000), 0);
	ck_assert_msg(tl_file_lines(log, "msg=\"postgres connected\" "
	    "sessions=2", NULL) == 1, "log %s", log);
	sent = assert_stopped_clean(a, "relay.pipe", first, N);
	ck_assert_msg(sent > 0 && sent < N, "%lld of %d rows sent before "
	    "SIGTERM: the test proves nothing", sent, N);
	tl_amqp_close(a);
}
END_TEST

/* A pipelined relay's two batches held with the broker frozen: the one
 * sent, whose confirms it awaits, and the next one claimed.  Each
 * session inside a batch is idle in its transaction then; the count of
 * SUCCESS rows read twice alike says the batch before was marked. */
static long long
frozen_with_two_batches(void)
{
	long long sent = -1, again;

	for (int64_t deadline = tl_ms() + 10000;; sleep_ms(100, NULL)) {
		ck_assert_msg(tl_ms() < deadline, "no two batches held");
		if (tl_sql_int(db, SESSIONS_IN_A_BATCH " AND s.state = "
		    "'idle in transaction'") != 2) {
			sent = -1;
			continue;
		}
		again = tl_sql_int(db, COUNT_STATUS(1));
		if (again == sent)
			return sent;
		sent = again;
	}
}

/*
 * SIGTERM while a pipelined relay awaits a batch's confirms, its next
 * batch claimed: that batch goes back unsent, and only the awaited one
 * is marked.  The stop was checked only before a claim, so the relay
 * sent the claimed batch too and awaited its confirms as well: a second
 * wait on the way to the stop, which a slow broker could stretch past
 * relay.shutdown_timeout, a confirmed batch then left unmarked.
 */
START_TEST(test_pipelined_stop_sends_no_claimed_batch)
{
	enum { N = 10000, BATCH = 200 };
	struct tl_amqp *a = tl_amqp_open();
	long long first, before, after;
	pid_t pid;

	pid = start_pipelined(a, "relay.pipe.stop", N, &first);
	ck_assert_int_ge(tl_wait_sql_int(db, 1000, 30000, "SELECT CASE WHEN "
	    "count(*) >= 1000 THEN 1000 ELSE 0 END FROM "
	    "t_transactional_message WHERE message_status = 1"), 1000);
	tl_rabbitmq_freeze(true);
	before = frozen_with_two_batches();
	kill(pid, SIGTERM);
	ck_assert(tl_signal_taken(pid, SIGTERM, 5000));
	tl_rabbitmq_freeze(false);
	ck_assert_int_eq(tl_outboxd_wait(pid, 30000), 0);
	after = tl_sql_int(db, COUNT_STATUS(1));
	fprintf(stderr, "relay: pipelined stop marked %lld rows after "
	    "SIGTERM\n", after - before);
	ck_assert_int_eq(after - before, BATCH);
	ck_assert_int_eq(assert_stopped_clean(a, "relay.pipe.stop", first, N),
	    after);
	tl_amqp_close(a);
}
END_TEST

/*
 * A lock queued behind a pipelined relay's open batch (a migration's)
 * would wait for that batch, the batch for the relay's next claim, and
 * the claim for the lock: nothing would move until a lock_timeout (60 s
 * here).  The claim made while a batch is open gives way quickly, so
 * the lock comes within a batch's time, and the relay goes on after it.
 */
START_TEST(test_pipelined_claim_gives_way_to_a_lock)
{
	enum { N = 100000 };
	struct tl_amqp *a = tl_amqp_open();
	PGconn *locker;
	int64_t t0;
	pid_t pid;

	tl_queue(a, "relay.pipe.lock", "", "");
	tl_consume(a, "relay.pipe.lock");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.pipe.lock', 'msg ' || "
	    "g) FROM generate_series(1, %d) g", N);
	pid = tl_outboxd_start(PIPELINED "postgres.lock_timeout: 60s\n");
	ck_assert_int_eq(tl_wait_sql_int(db, 2, 30000, SESSIONS_IN_A_BATCH),
	    2);
	locker = tl_pg();
	t0 = tl_ms();
	/* tl_sql fails the test if the lock is not granted in 10 s. */
	tl_sql(locker, "BEGIN; SET LOCAL lock_timeout = '10s'; LOCK TABLE "
	    "t_transactional_message IN ACCESS EXCLUSIVE MODE");
	fprintf(stderr, "relay: the lock behind a pipelined relay came in "
	    "%lld ms\n", (long long)(tl_ms() - t0));
	ck_assert_int_lt(tl_sql_int(locker, COUNT_STATUS(1)), N);
	tl_sql(locker, "COMMIT");
	PQfinish(locker);
	ck_assert_int_eq(tl_wait_sql_int(db, N, 120000, COUNT_STATUS(1)), N);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	tl_amqp_close(a);
}
END_TEST

START_TEST(test_bad_rows_fail_alone_and_die)
{
	struct tl_amqp *a = tl_amqp_open();
	unsigned counts[64] = { 0 };
	char err[512];
	pid_t pid;
	long long good, first, once = 0;

	tl_queue(a, "relay.good", "", "");
	tl_exchange(a, "relay.direct", "direct");
	tl_consume(a, "relay.good");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.good', 'good ' || g) "
	    "FROM generate_series(1, 20) g");
	/* Unroutable: the default exchange has no such queue. */
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.nowhere', 'x', "
	    "max_retry_times => 3, init_backoff => '100ms', business_key => "
	    "'unroutable')");
	tl_sql(db, "SELECT outbox_enqueue('relay.missing', 'k', 'x', "
	    "max_retry_times => 3, init_backoff => '100ms', business_key => "
	    "'missing')");
	tl_sql(db, "SELECT outbox_enqueue('relay.direct', 'k', 'x', "
	    "exchange_type => 'topic', max_retry_times => 3, init_backoff => "
	    "'100ms', business_key => 'mismatch')");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.good', 'good ' || g) "
	    "FROM generate_series(21, 40) g");
	first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	ck_assert_int_lt(tl_sql_int(db, "SELECT max(id) FROM "
	    "t_transactional_message") - first, 64);
	pid = tl_outboxd_start(NULL);
	good = tl_collect(a, counts, first, 64, 40, 5000, 30000);
	ck_assert_int_eq(good, 40);
	for (int i = 0; i < 64; i++)
		once += counts[i] == 1;
	ck_assert_int_eq(once, 40);
	/* Each bad row fails on its first attempt with the broker's words
	 * and a future due time, then dies after three attempts. */
	ck_assert_int_eq(tl_wait_sql_int(db, 3, 20000,
	    COUNT_STATUS(3) " AND current_retry_times = 3"), 3);
	tl_sql_text(db, err, sizeof(err), "SELECT last_error FROM "
	    "t_transactional_message WHERE business_key = 'unroutable'");
	ck_assert_msg(strstr(err, "NO_ROUTE") != NULL, "last_error: %s", err);
	tl_sql_text(db, err, sizeof(err), "SELECT last_error FROM "
	    "t_transactional_message WHERE business_key = 'missing'");
	ck_assert_msg(strstr(err, "NOT_FOUND") != NULL, "last_error: %s", err);
	tl_sql_text(db, err, sizeof(err), "SELECT last_error FROM "
	    "t_transactional_message WHERE business_key = 'mismatch'");
	ck_assert_msg(strstr(err, "PRECONDITION_FAILED") != NULL,
	    "last_error: %s", err);
	ck_assert_int_eq(tl_sql_int(db, COUNT_STATUS(1)), 40);
	ck_assert_int_eq(tl_sql_int(db, COUNT_STATUS(3)
	    " AND next_schedule_time IS NULL"), 3);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	/* Nothing more came: no good row twice, no bad row at all. */
	ck_assert_uint_eq(tl_collect_to_end(a, "relay.good", counts, first, 64,
	    30000), 0);
	tl_amqp_close(a);
}
END_TEST

/* A failing row's first failure sets FAIL with a future due time. */
START_TEST(test_failure_is_rescheduled_in_future)
{
	pid_t pid;

	tl_sql(db, "SELECT outbox_enqueue('relay.missing2', 'k', 'x', "
	    "init_backoff => '1 hour')");
	pid = tl_outboxd_start(NULL);
	ck_assert_int_eq(tl_wait_sql_int(db, 1, 10000, COUNT_STATUS(2)
	    " AND current_retry_times = 1 AND last_error LIKE '%%NOT_FOUND%%'"
	    " AND next_schedule_time > now() + interval '50 minutes'"), 1);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
}
END_TEST

/*
 * init_backoff × factor^n per row, capped by backoff.max.  Each state
 * lasts its delay only: the count and the delay are read in one query,
 * and a state a stalled test missed is skipped, not misread.
 */
START_TEST(test_schedule_follows_formula_and_cap)
{
	const long long want[] = { 400, 800, 1600, 2000, 2000 };
	int seen = 0, checked = 0;
	bool capped = false;
	pid_t pid;

	tl_sql(db, "SELECT outbox_enqueue('relay.nope', 'k', 'x', "
	    "max_retry_times => 6, init_backoff => '400ms', "
	    "backoff_factor => 2)");
	pid = tl_outboxd_start("backoff.max: 2s\n");
	while (seen < 5) {
		long long pair, delay;

		ck_assert_int_eq(tl_wait_sql_int(db, 1, 20000, "SELECT "
		    "(current_retry_times > %d)::int FROM "
		    "t_transactional_message", seen), 1);
		/* Both come from one UPDATE's time: the exact delay. */
		pair = tl_sql_int(db, "SELECT current_retry_times * 1000000 + "
		    "coalesce((extract(epoch FROM next_schedule_time - "
		    "edit_time) * 1000)::int8, 0) FROM t_transactional_message");
		seen = (int)(pair / 1000000);
		delay = pair % 1000000;
		if (seen <= 5) {
			ck_assert_msg(delay == want[seen - 1], "failure %d: "
			    "delay %lld ms, want %lld", seen, delay,
			    want[seen - 1]);
			checked++;
			capped = capped || seen >= 4;
		}
	}
	ck_assert_int_ge(checked, 3);
	ck_assert_msg(capped, "no capped delay seen");
	ck_assert_int_eq(tl_wait_sql_int(db, 1, 10000, COUNT_STATUS(3)
	    " AND current_retry_times = 6"), 1);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
}
END_TEST

/* Rows sent, a server restarted mid-stream: every row SUCCESS and every
 * SUCCESS row received at least once.  The rows come due over 10 s, so
 * that some are still unsent when the restart begins (a backlog drained
 * before the server went down would prove nothing). */
static void
restart_mid_stream(const char *service)
{
	enum { N = 5000 };
	struct tl_amqp *a = tl_amqp_open();
	unsigned *counts = xcalloc(N, sizeof(*counts));
	long long first, missing = 0, dups = 0, sent, before;
	pid_t pid;

	tl_queue(a, "relay.restart", "", "");
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.restart', 'r ' || g) "
	    "FROM generate_series(1, %d) g", N);
	first = tl_sql_int(db, "SELECT min(id) FROM t_transactional_message");
	tl_sql(db, "UPDATE t_transactional_message SET next_schedule_time = "
	    "now() + (id - %lld) * interval '2 ms'", first);
	pid = tl_outboxd_start("relay.batch_size: 100\n");
	/* Restart once the relay is part-way through. */
	ck_assert_int_eq(tl_wait_sql_int(db, -2, 30000, "SELECT CASE WHEN "
	    "count(*) >= 500 THEN -2 ELSE count(*) END FROM "
	    "t_transactional_message WHERE message_status = 1"), -2);
	before = tl_sql_int(db, COUNT_STATUS(1));
	ck_assert_msg(before < N, "every row was sent before the %s restart: "
	    "the test proves nothing", service);
	tl_servers("restart", service);
	/* Our own session did not survive a PostgreSQL restart either. */
	if (PQstatus(db) != CONNECTION_OK || strcmp(service, "pg") == 0)
		PQreset(db);
	ck_assert_int_eq(tl_wait_sql_int(db, N, 120000, COUNT_STATUS(1)), N);
	tl_amqp_close(a);
	/* The consumer connects after the restart: a RabbitMQ restart must
	 * not have lost persistent messages either. */
	a = tl_amqp_open();
	tl_consume(a, "relay.restart");
	(void)tl_collect_to_end(a, "relay.restart", counts, first, N, 60000);
	for (long long i = 0; i < N; i++) {
		if (counts[i] == 0)
			missing++;
		else if (counts[i] > 1)
			dups++;
	}
	sent = tl_sql_int(db, COUNT_STATUS(1));
	fprintf(stderr, "restart %s: %lld sent, %lld missing, %lld "
	    "duplicates\n", service, sent, missing, dups);
	ck_assert_int_eq(missing, 0);
	/* Only what was in flight at the restart goes out twice: a batch
	 * of 100 for each of the relay and its two workers, awaited or
	 * marking, and as many again at most. */
	ck_assert_int_le(dups, 600);
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	free(counts);
	tl_amqp_close(a);
}

START_TEST(test_rabbitmq_restart_loses_nothing)
{
	restart_mid_stream("rabbitmq");
}
END_TEST

START_TEST(test_postgres_restart_loses_nothing)
{
	restart_mid_stream("pg");
}
END_TEST

/* NOTIFY wakes the relay long before the poll interval. */
START_TEST(test_notify_wakes_idle_relay)
{
	struct tl_amqp *a = tl_amqp_open();
	struct tl_msg m;
	int64_t t0, took;
	pid_t pid;

	tl_queue(a, "relay.wake", "", "");
	tl_consume(a, "relay.wake");
	pid = tl_outboxd_start("relay.poll_interval: 30s\n");
	/* Wait for the relay to be up and idle: one row through first. */
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.wake', 'warm-up')");
	ck_assert(tl_next(a, 10000, &m));
	tl_msg_free(&m);
	t0 = tl_ms();
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.wake', 'wake')");
	ck_assert(tl_next(a, 10000, &m));
	took = tl_ms() - t0;
	ck_assert_str_eq(m.body, "wake");
	tl_msg_free(&m);
	fprintf(stderr, "relay: idle wake-up took %lld ms\n", (long long)took);
	/* NOTIFY, not the 30 s poll, even under a sanitizer. */
	ck_assert_int_lt(took, 1000 * tl_slowdown());
	ck_assert_int_eq(tl_outboxd_stop(pid, 10000), 0);
	tl_amqp_close(a);
}
END_TEST

/* --- the store's own session --------------------------------------------- */

/* A relay's store on the private PostgreSQL, over TCP, connected. */
static struct store *
store_open(int64_t lock_timeout_ms)
{
	struct store_conf conf = {
		.conninfo = (char *)tl_env("OUTBOXD_PG_CONNINFO"),
		.connect_timeout_ms = 5000,
		.application_name = "check_relay",
		.idle_in_transaction_timeout_ms = 30000,
		.index_plans = true,
		.lock_timeout_ms = lock_timeout_ms,
	};
	struct store *s = store_new(&conf);

	ck_assert_msg(store_connect(s) == 0, "connect: %s", store_error(s));
	return s;
}

/*
 * Keepalive probes go out only while nothing sent is unacknowledged: a
 * PostgreSQL host gone with a query on the wire is noticed by the
 * kernel's retransmission limit alone, some 15 minutes, unless
 * TCP_USER_TIMEOUT is set on the socket.
 */
START_TEST(test_pg_socket_bounds_unacknowledged_data)
{
	struct store *s = store_open(0);
	int fd = store_socket(s);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(tl_sockopt(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
	ck_assert_int_eq(tl_sockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), 30000);
	store_free(s);
}
END_TEST

/* The session's setting name, as text. */
static const char *
setting(struct store *s, const char *name, char *buf, size_t size)
{
	ck_assert_msg(store_setting(s, name, buf, size) == 0, "%s: %s", name,
	    store_error(s));
	return buf;
}

/*
 * The server's end probes too: with PostgreSQL's defaults a backend cut
 * off by a partition kept its session, and the leader's advisory lock
 * with it, for 2 h 10 min.
 */
START_TEST(test_pg_backend_probes_its_client)
{
	struct store *s = store_open(0);
	char v[64];

	ck_assert_str_eq(setting(s, "tcp_keepalives_idle", v, sizeof(v)),
	    "10");
	ck_assert_str_eq(setting(s, "tcp_keepalives_interval", v, sizeof(v)),
	    "5");
	ck_assert_str_eq(setting(s, "tcp_keepalives_count", v, sizeof(v)),
	    "3");
	ck_assert_str_eq(setting(s, "tcp_user_timeout", v, sizeof(v)),
	    "30000");
	store_free(s);
}
END_TEST

/*
 * A statement_timeout of the role or database (here the connection's
 * options) applies to migrate's session too, and cancelled its CREATE
 * INDEX CONCURRENTLY, which waits for the transactions writing the
 * table to end: migrate lifts it while it runs and restores it after.
 */
START_TEST(test_migrate_outlasts_statement_timeout)
{
	char conninfo[512], v[64], err[1024];
	struct store_conf conf = { .conninfo = conninfo,
		.connect_timeout_ms = 5000 };
	PGconn *writer = tl_pg();
	struct store *s;
	int64_t t0, took;
	PGresult *res;
	int rc;

	snprintf(conninfo, sizeof(conninfo), "%s options='-c "
	    "statement_timeout=500'", tl_env("OUTBOXD_PG_CONNINFO"));
	tl_sql(db, "DROP INDEX t_transactional_message_sent_idx");
	tl_sql(db, "DELETE FROM outboxd_migrations WHERE name = "
	    "'007_outbox_sent_index.sql'");
	/* A producer's transaction, open for 2 s: the build waits for it. */
	ck_assert(PQsendQuery(writer, "BEGIN; LOCK TABLE "
	    "t_transactional_message IN ROW EXCLUSIVE MODE; "
	    "SELECT pg_sleep(2); COMMIT") == 1);
	ck_assert_int_eq(tl_wait_sql_int(db, 1, 10000, "SELECT count(*) FROM "
	    "pg_locks l JOIN pg_class c ON c.oid = l.relation WHERE "
	    "c.relname = 't_transactional_message' AND l.mode = "
	    "'RowExclusiveLock' AND l.pid <> pg_backend_pid()"), 1);
	s = store_new(&conf);
	ck_assert_msg(store_connect(s) == 0, "connect: %s", store_error(s));
	t0 = tl_ms();
	rc = store_migrate(s);
	took = tl_ms() - t0;
	snprintf(err, sizeof(err), "%s", store_error(s));
	while ((res = PQgetResult(writer)) != NULL)
		PQclear(res);
	PQfinish(writer);
	if (rc != 0) {
		/* Put the index back before failing. */
		conf.conninfo = (char *)tl_env("OUTBOXD_PG_CONNINFO");
		store_free(s);
		s = store_new(&conf);
		ck_assert(store_connect(s) == 0 && store_migrate(s) == 0);
		ck_abort_msg("migrate failed after %lld ms: %s",
		    (long long)took, err);
	}
	ck_assert_msg(took >= 1000, "migrate took %lld ms", (long long)took);
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM pg_index WHERE "
	    "indexrelid = 't_transactional_message_sent_idx'::regclass AND "
	    "indisvalid"), 1);
	ck_assert_str_eq(setting(s, "statement_timeout", v, sizeof(v)),
	    "500ms");
	store_free(s);
}
END_TEST

/* Rows out of retries in the outbox that the sweep has made DEAD. */
#define SWEPT "SELECT count(*) FROM t_transactional_message WHERE " \
	"message_status = 3 AND last_error LIKE 'retries exhausted%%'"

/*
 * The leader's sweep of rows out of retries runs on the main relay's
 * session: a row locked elsewhere (an open psql transaction) held it for
 * lock_timeout at every poll, or for good with no lock_timeout.  It is
 * skipped, and swept once free.
 */
START_TEST(test_sweep_skips_a_locked_row)
{
	PGconn *holder = tl_pg();
	struct store *s = store_open(3000);
	int64_t t0, took, n = -1;
	int rc;

	tl_sql(db, "SELECT outbox_enqueue('', 'relay.spent', 'x', "
	    "max_retry_times => 0, business_key => 'spent-' || g) FROM "
	    "generate_series(1, 3) g");
	tl_sql(holder, "BEGIN");
	tl_sql(holder, "SELECT 1 FROM t_transactional_message WHERE "
	    "business_key = 'spent-2' FOR UPDATE");
	t0 = tl_ms();
	rc = store_sweep_exhausted(s, 1000, 0, NULL, &n);
	took = tl_ms() - t0;
	ck_assert_msg(rc == 0, "sweep after %lld ms: %s", (long long)took,
	    store_error(s));
	ck_assert_msg(took < 1000, "sweep took %lld ms", (long long)took);
	ck_assert_int_eq(n, 2);
	ck_assert_int_eq(tl_sql_int(db, SWEPT " AND business_key <> "
	    "'spent-2'"), 2);
	tl_sql(holder, "COMMIT");
	ck_assert_msg(store_sweep_exhausted(s, 1000, 0, NULL, &n) == 0, "sweep: %s",
	    store_error(s));
	ck_assert_int_eq(n, 1);
	ck_assert_int_eq(tl_sql_int(db, SWEPT), 3);
	PQfinish(holder);
	store_free(s);
}
END_TEST

/*
 * A claim with a short lock wait (a pipelined relay's, made while its
 * other session holds a batch) leaves the batch's marks the configured
 * wait.  SET LOCAL lasted the whole transaction: marks that waited
 * 100 ms for a lock (a trigger's, say) failed, and the batch, published
 * and confirmed, went out again.
 */
START_TEST(test_short_claim_wait_leaves_the_marks_theirs)
{
	/* 0: outboxd sets none; the session's own, from its start (here
	 * the conninfo's options), applies. */
	const int64_t configured[] = { 3000, 0 };
	const char *const want[] = { "3s", "7s" };
	struct store_claim_opts opts = { .limit = 10,
		.include_retries = true, .lock_timeout_ms = 100 };
	struct store_batch batch;
	char value[32];

	tl_sql(db, "SELECT outbox_enqueue('', 'relay.shortwait', 'x')");
	setenv("PGOPTIONS", "-c lock_timeout=7s", 1);
	for (int i = 0; i < 2; i++) {
		struct store *s = store_open(configured[i]);

		ck_assert_msg(store_claim(s, &opts, &batch) == 0, "claim: %s",
		    store_error(s));
		ck_assert_uint_eq(batch.n, 1);
		ck_assert_int_eq(store_setting(s, "lock_timeout", value,
		    sizeof(value)), 0);
		ck_assert_str_eq(value, want[i]);
		store_abort(s, &batch);
		store_free(s);
	}
	unsetenv("PGOPTIONS");
}
END_TEST

/* n rows for relay.locked, the one at index refused (-1: none) with
 * business_key 'refused'. */
static void
enqueue_keyed(int n, int refused)
{
	tl_sql(db, "SELECT outbox_enqueue('', 'relay.locked', 'x', "
	    "business_key => CASE WHEN g = %d THEN 'refused' END) "
	    "FROM generate_series(1, %d) g", refused + 1, n);
}

/* Claims n due rows on s, all of them. */
static void
claim_all(struct store *s, struct store_batch *batch, struct store_mark *marks,
    size_t n)
{
	struct store_claim_opts opts = { .limit = (int)n,
		.include_retries = true };

	ck_assert_msg(store_claim(s, &opts, batch) == 0, "claim: %s",
	    store_error(s));
	ck_assert_uint_eq(batch->n, n);
	for (size_t i = 0; i < n; i++)
		marks[i] = (struct store_mark){ .id = batch->rows[i].id,
			.kind = MARK_SUCCESS };
}

/* MultiXact ids taken so far: their counter's distance from the oldest
 * the database still holds. */
#define MULTIXACTS "SELECT mxid_age(datminmxid) FROM pg_database WHERE " \
	"datname = current_database()"

/*
 * The database refuses one row's mark while another session waits for
 * the batch's rows (here a plain FOR UPDATE, so that the wait is sure;
 * another relay's claim, SKIP LOCKED, takes them the same way once
 * free).  The second try began with a ROLLBACK: the waiting session got
 * the rows, published and confirmed, and the second try left them to it
 * (MARK_RELEASE), for another relay to publish again.  Once the database
 * has refused a mark, the marks go under a savepoint for a while, and
 * the refused row is found with the rows still locked: both ways a
 * trigger can refuse, at the mark and at a deferred check before the
 * COMMIT.  Until then, no savepoint: a batch takes no MultiXact.
 */
START_TEST(test_refused_mark_keeps_the_rows_locked)
{
	enum { N = 20, REFUSED = 4 };
	static const char *const kind[] = { "", "CONSTRAINT " },
	    *const when[] = { "", "DEFERRABLE INITIALLY DEFERRED " };
	struct store_mark marks[N];
	struct store_batch batch;
	struct store *s = store_open(0);
	PGconn *waiter = tl_pg();
	long long multixacts;
	PGresult *res;

	tl_sql(db, "CREATE OR REPLACE FUNCTION relay_refuse_mark() RETURNS "
	    "trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION "
	    "'relay: mark refused'; END $$");
	/* Nothing refused yet: marks without a savepoint. */
	enqueue_keyed(N, -1);
	multixacts = tl_sql_int(db, MULTIXACTS);
	claim_all(s, &batch, marks, N);
	ck_assert_int_eq(store_finish(s, &batch, marks, N), 0);
	ck_assert_int_eq(tl_sql_int(db, MULTIXACTS), multixacts);
	for (int round = 0; round < 3; round++) {
		int k = round == 2;

		tl_sql(db, "DROP TRIGGER IF EXISTS relay_refuse_mark ON "
		    "t_transactional_message");
		tl_sql(db, "CREATE %sTRIGGER relay_refuse_mark AFTER UPDATE ON "
		    "t_transactional_message %sFOR EACH ROW WHEN "
		    "(NEW.business_key = 'refused' AND NEW.message_status = 1) "
		    "EXECUTE FUNCTION relay_refuse_mark()", kind[k], when[k]);
		enqueue_keyed(N, REFUSED);
		claim_all(s, &batch, marks, N);
		/* The first refusal, unwatched, makes the marks guarded. */
		if (round > 0) {
			tl_sql(waiter, "BEGIN");
			ck_assert_int_eq(PQsendQuery(waiter, "SELECT id FROM "
			    "t_transactional_message WHERE message_status = 0 "
			    "FOR UPDATE"), 1);
			ck_assert_int_eq(tl_wait_sql_int(db, 1, 10000, "SELECT "
			    "count(*) FROM pg_stat_activity WHERE pid = %d AND "
			    "wait_event_type = 'Lock'", PQbackendPID(waiter)), 1);
		}
		ck_assert_int_eq(store_finish(s, &batch, marks, N), 1);
		for (size_t i = 0; i < N; i++)
			ck_assert_msg(marks[i].kind == (i == REFUSED ? MARK_DEAD :
			    MARK_SUCCESS), "round %d: mark %zu is %d", round, i,
			    (int)marks[i].kind);
		if (round > 0) {
			/* The waiter finds the rows sent, none to take. */
			res = PQgetResult(waiter);
			ck_assert_int_eq(PQresultStatus(res), PGRES_TUPLES_OK);
			ck_assert_int_eq(PQntuples(res), 0);
			PQclear(res);
			while ((res = PQgetResult(waiter)) != NULL)
				PQclear(res);
			tl_sql(waiter, "COMMIT");
		}
		ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
		    "t_transactional_message WHERE message_status = 1"),
		    N + (round + 1) * (N - 1));
	}
	tl_sql(db, "DROP TRIGGER relay_refuse_mark ON t_transactional_message");
	PQfinish(waiter);
	store_free(s);
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("relay");
	TCase *tc = tcase_create("relay");
	SRunner *sr;
	int failed;

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_function_and_plain_inserts_arrive);
	tcase_add_test(tc, test_ten_thousand_rows_each_once);
	tcase_add_test(tc, test_workers_share_the_backlog);
	tcase_add_test(tc, test_workers_join_on_a_backlog);
	tcase_add_test(tc, test_workers_stop_cleanly_mid_stream);
	tcase_add_test(tc, test_pipelined_relay_overlaps_and_stops_clean);
	tcase_add_test(tc, test_pipelined_claim_gives_way_to_a_lock);
	tcase_add_test(tc, test_pipelined_stop_sends_no_claimed_batch);
	tcase_add_test(tc, test_bad_rows_fail_alone_and_die);
	tcase_add_test(tc, test_failure_is_rescheduled_in_future);
	tcase_add_test(tc, test_schedule_follows_formula_and_cap);
	tcase_add_test(tc, test_notify_wakes_idle_relay);
	suite_add_tcase(s, tc);
	/* Server restarts: 25 s of waiting on servers, where a thread
	 * sanitizer has little to see (make tsan leaves them out). */
	tc = tcase_create("restart");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 300);
	tcase_set_tags(tc, "restart");
	tcase_add_test(tc, test_rabbitmq_restart_loses_nothing);
	tcase_add_test(tc, test_postgres_restart_loses_nothing);
	suite_add_tcase(s, tc);
	/* The store on its own, no outboxd: CK_RUN_CASE=store. */
	tc = tcase_create("store");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_pg_socket_bounds_unacknowledged_data);
	tcase_add_test(tc, test_pg_backend_probes_its_client);
	tcase_add_test(tc, test_migrate_outlasts_statement_timeout);
	tcase_add_test(tc, test_sweep_skips_a_locked_row);
	tcase_add_test(tc, test_short_claim_wait_leaves_the_marks_theirs);
	tcase_add_test(tc, test_refused_mark_keeps_the_rows_locked);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	/* Whatever failed, leave the broker running for the next suite. */
	tl_rabbitmq_freeze(false);
	return failed == 0 ? 0 : 1;
}
