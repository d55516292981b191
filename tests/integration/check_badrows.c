/*
 * Bad rows among good ones: each is recorded (message_status and
 * last_error), permanent errors die at once, transient ones follow the
 * backoff, and none crashes outboxd or holds up the good rows around it.
 */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "cutter.h"
#include "testlib.h"
#include "util.h"

#define GOOD "badrows.good"
#define GOOD_PER_SIDE 10
/* Short lock timings: a leader retries FAIL rows, so be one quickly. */
#define BASE_YAML "redis.ttl: 3s\n"

static PGconn *db;
static struct tl_amqp *amqp;	/* consumes GOOD */
static char uniq[32];		/* per test: fresh exchange names */

static void refuse_marks(const char *when);
static void allow_marks(void);

/* Every delivery from GOOD in this test, by message id. */
static long long *got;
static size_t ngot, capgot;

static void
leader_key_delete(void)
{
	struct timeval tv = { 2, 0 };
	redisContext *r = redisConnectWithTimeout("127.0.0.1",
	    atoi(tl_env("OUTBOXD_REDIS_PORT")), tv);

	/* A leader killed by an earlier suite leaves its key for a ttl;
	 * no outboxd runs now, so nobody holds it. */
	if (r != NULL && r->err == 0)
		freeReplyObject(redisCommand(r, "DEL outboxd:leader"));
	if (r != NULL)
		redisFree(r);
}

static void
setup(void)
{
	db = tl_pg();
	tl_reset_db(db);
	/* Left by a test that failed before it dropped them. */
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_slow_mark ON "
	    "t_transactional_message");
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_read_only_mark ON "
	    "t_transactional_message");
	leader_key_delete();
	amqp = tl_amqp_open();
	tl_queue(amqp, GOOD, "", "");
	tl_consume(amqp, GOOD);
	ngot = 0;
	snprintf(uniq, sizeof(uniq), "%d.%lld", (int)getpid(),
	    (long long)time(NULL));
}

static void
teardown(void)
{
	tl_amqp_close(amqp);
	PQfinish(db);
	free(got);
	got = NULL;
	ngot = capgot = 0;
}

/* --- rows and what became of them ---------------------------------------- */

/* n good rows to GOOD (business_module 'good'). */
static void
good_rows(int n)
{
	tl_sql(db, "SELECT outbox_enqueue('', '" GOOD "', 'good ' || g, "
	    "business_module => 'good') FROM generate_series(1, %d) g", n);
}

static void
record(long long id)
{
	if (ngot == capgot) {
		capgot = capgot ? capgot * 2 : 64;
		got = xrealloc(got, capgot * sizeof(*got));
	}
	got[ngot++] = id;
}

static size_t
times_received(long long id)
{
	size_t n = 0;

	for (size_t i = 0; i < ngot; i++)
		n += got[i] == id;
	return n;
}

/* Takes everything GOOD holds up to now, late copies included
 * (tl_mark_end). */
static void
drain(void)
{
	int64_t deadline = tl_ms() + 60000;
	char marker[64];
	struct tl_msg m;

	tl_mark_end(amqp, GOOD, marker, sizeof(marker));
	while (tl_next_before(amqp, marker, deadline, &m)) {
		record(m.message_id);
		tl_msg_free(&m);
	}
}

/*
 * Every good row is SUCCESS and was received, however many there are;
 * returns how many extra copies came (a channel closed by the broker
 * resends what it had not confirmed: at-least-once), at most two per
 * good row.
 */
static long long
assert_good_delivered(void)
{
	long long n = tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_module = 'good'");
	long long dups = 0, *ids;
	PGresult *res;

	ck_assert_int_eq(tl_wait_sql_int(db, n, 30000, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_module = 'good' AND "
	    "message_status = 1"), n);
	res = PQexec(db, "SELECT id FROM t_transactional_message WHERE "
	    "business_module = 'good'");
	ck_assert_int_eq(PQresultStatus(res), PGRES_TUPLES_OK);
	ids = xcalloc((size_t)n + 1, sizeof(*ids));
	for (int i = 0; i < PQntuples(res); i++)
		ids[i] = strtoll(PQgetvalue(res, i, 0), NULL, 10);
	PQclear(res);
	drain();
	for (long long i = 0; i < n; i++) {
		size_t k = times_received(ids[i]);

		ck_assert_msg(k >= 1, "good row %lld never received", ids[i]);
		dups += (long long)k - 1;
	}
	free(ids);
	/* A channel the broker closed sends again what it had not
	 * confirmed: a copy now and then (10 of 30 rows at most so far).
	 * Two copies more than rows is a batch sent over and over. */
	ck_assert_msg(dups <= 2 * n, "%lld duplicates of %lld good rows", dups,
	    n);
	return dups;
}

/* The bad row's state: status and current_retry_times. */
static void
row_state(const char *key, int *status, int *retries)
{
	*status = (int)tl_sql_int(db, "SELECT message_status FROM "
	    "t_transactional_message WHERE business_key = '%s'", key);
	*retries = (int)tl_sql_int(db, "SELECT current_retry_times FROM "
	    "t_transactional_message WHERE business_key = '%s'", key);
}

/* Waits for the row with business_key key to reach status with the
 * given retry count (either -1: any); returns whether it did. */
static bool
wait_row(const char *key, int status, int retries, int timeout_ms)
{
	return tl_wait_sql_int(db, 1, timeout_ms, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key = '%s' AND "
	    "(%d < 0 OR message_status = %d) AND (%d < 0 OR "
	    "current_retry_times = %d)", key, status, status, retries,
	    retries) == 1;
}

static char *
last_error(const char *key, char *buf, size_t size)
{
	return tl_sql_text(db, buf, size, "SELECT coalesce(last_error, '') "
	    "FROM t_transactional_message WHERE business_key = '%s'", key);
}

/* The row's status, retry count and last_error as expected. */
static void
assert_row(const char *key, int status, int retries, const char *error)
{
	char err[1024];
	int st, n;

	if (!wait_row(key, status, retries, 30000)) {
		row_state(key, &st, &n);
		ck_abort_msg("row %s: status %d retries %d (want %d, %d); "
		    "last_error: %s", key, st, n, status, retries,
		    last_error(key, err, sizeof(err)));
	}
	last_error(key, err, sizeof(err));
	ck_assert_msg(error == NULL || strstr(err, error) != NULL,
	    "row %s: last_error '%s' lacks '%s'", key, err, error);
	row_state(key, &st, &n);
	fprintf(stderr, "badrows: %s: status=%d retries=%d last_error=\"%s\"\n",
	    key, st, n, err);
}

/* Milliseconds from the last mark to the next due time. */
static long long
scheduled_delay_ms(const char *key)
{
	return tl_sql_int(db, "SELECT (extract(epoch FROM next_schedule_time "
	    "- edit_time) * 1000)::int8 FROM t_transactional_message WHERE "
	    "business_key = '%s'", key);
}

static bool
alive(pid_t pid)
{
	return waitpid(pid, NULL, WNOHANG) == 0;
}

/*
 * The end of every case: outboxd still runs, and delivers good rows
 * written now as it did before; then it stops cleanly.
 */
static void
assert_still_serving(pid_t pid)
{
	long long dups;

	ck_assert_msg(alive(pid), "outboxd died (log %s)",
	    tl_outboxd_log(pid));
	good_rows(GOOD_PER_SIDE);
	dups = assert_good_delivered();
	ck_assert_msg(alive(pid), "outboxd died (log %s)",
	    tl_outboxd_log(pid));
	fprintf(stderr, "badrows: good rows delivered, %lld duplicates\n",
	    dups);
	ck_assert_int_eq(tl_outboxd_stop(pid, 30000), 0);
}

/* Good rows, the bad row(s) from sql, good rows; outboxd started. */
static pid_t
start_with(const char *yaml, const char *sql)
{
	good_rows(GOOD_PER_SIDE);
	tl_sql(db, "%s", sql);
	good_rows(GOOD_PER_SIDE);
	return tl_outboxd_start(yaml);
}

/* --- the cases ----------------------------------------------------------- */

/*
 * No content row: a plain INSERT of the message alone.  Transient (a
 * producer writing the two rows in separate transactions may commit the
 * content later): FAIL, retried on the backoff, DEAD once out of tries.
 */
START_TEST(test_no_content_row)
{
	pid_t pid = start_with(BASE_YAML, "INSERT INTO t_transactional_message "
	    "(queue_name, business_key, max_retry_times, init_backoff) VALUES "
	    "('" GOOD "', 'no-content', 3, '1 second')");

	assert_row("no-content", 2, 1, "no content row");
	ck_assert_int_eq(scheduled_delay_ms("no-content"), 1000);
	assert_good_delivered();
	/* Retried at 1 s, then 2 s later; the third failure is the last. */
	assert_row("no-content", 2, 2, "no content row");
	assert_row("no-content", 3, 3, "no content row");
	assert_still_serving(pid);
}
END_TEST

/*
 * A batch of which nothing could be published has no confirm time: it
 * is a batch, not a broker figure.  Each one used to file about 0 s
 * under outboxd_confirm_duration_seconds, so a backlog of bad rows
 * dragged the broker's quantiles towards 0.
 */
START_TEST(test_unpublished_batch_times_no_confirm)
{
	char yaml[128], body[65536];
	int port = tl_free_port();
	pid_t pid;

	snprintf(yaml, sizeof(yaml), BASE_YAML "http.listen: "
	    "\"127.0.0.1:%d\"\n", port);
	tl_sql(db, "INSERT INTO t_transactional_message (queue_name, "
	    "business_key, max_retry_times, init_backoff) VALUES ('" GOOD
	    "', 'unpublished', 1, '1 second')");
	pid = tl_outboxd_start(yaml);
	assert_row("unpublished", 3, 1, "no content row");
	ck_assert_int_eq(tl_http_get(port, "/metrics", body, sizeof(body)),
	    200);
	ck_assert(tl_metric(body, "outboxd_batch_duration_seconds_count") >=
	    1);
	ck_assert(tl_metric(body, "outboxd_confirm_duration_seconds_count") ==
	    0);
	assert_still_serving(pid);
}
END_TEST

/*
 * No route at all: the default exchange with neither routing_key nor
 * queue_name.  No queue is named "", so this can never be delivered:
 * permanent, DEAD at once.
 */
START_TEST(test_empty_routing)
{
	pid_t pid = start_with(BASE_YAML,
	    "SELECT outbox_enqueue('', NULL, 'nowhere', business_key => "
	    "'route-null');"
	    "SELECT outbox_enqueue('', '', 'nowhere', business_key => "
	    "'route-empty')");

	assert_row("route-null", 3, 1, "no route");
	assert_row("route-empty", 3, 1, "no route");
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE message_status = 3 AND "
	    "next_schedule_time IS NULL"), 2);
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * 5 MiB against the broker's max_message_size of 4 MiB (tests/servers.sh)
 * with rabbitmq.max_payload at its 16 MiB default: outboxd sends it, the
 * broker closes the channel, the row is rejected with the broker's
 * words, and the good rows in the same batch go through.
 */
START_TEST(test_payload_over_broker_limit)
{
	int st, n;
	pid_t pid = start_with(BASE_YAML,
	    "SELECT outbox_enqueue('', '" GOOD "', "
	    "convert_to(repeat('x', 5 * 1024 * 1024), 'UTF8'), "
	    "business_key => 'broker-max', max_retry_times => 2, "
	    "init_backoff => '200ms')");

	ck_assert_msg(tl_wait_sql_int(db, 1, 30000, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key = 'broker-max' AND "
	    "current_retry_times >= 1") == 1, "5 MiB row never tried");
	row_state("broker-max", &st, &n);
	{
		char err[512];

		fprintf(stderr, "badrows: broker-max: first failure: "
		    "status=%d retries=%d last_error=\"%s\"\n", st, n,
		    last_error("broker-max", err, sizeof(err)));
	}
	/* Too big for the broker is permanent: DEAD after one attempt. */
	assert_row("broker-max", 3, 1, "4194304");
	ck_assert(tl_log_contains(pid, "publish channel closed by the "
	    "broker"));
	assert_good_delivered();
	ck_assert_int_eq(times_received(tl_sql_int(db, "SELECT id FROM "
	    "t_transactional_message WHERE business_key = 'broker-max'")), 0);
	assert_still_serving(pid);
}
END_TEST

/* Above rabbitmq.max_payload: permanent, DEAD at once, never sent. */
START_TEST(test_payload_over_max_payload)
{
	pid_t pid = start_with(BASE_YAML "rabbitmq.max_payload: 1MiB\n",
	    "SELECT outbox_enqueue('', '" GOOD "', "
	    "convert_to(repeat('y', 2 * 1024 * 1024), 'UTF8'), "
	    "business_key => 'max-payload')");

	assert_row("max-payload", 3, 1, "exceeds rabbitmq.max_payload");
	assert_good_delivered();
	/* Refused before sending: the broker never closed a channel. */
	ck_assert(!tl_log_contains(pid, "publish channel closed"));
	assert_still_serving(pid);
}
END_TEST

/* Whether pid runs with AddressSanitizer or under valgrind (make
 * valgrind-integration), whose shadow memory, quarantine or free lists
 * make its resident size say nothing about outboxd's. */
static bool
under_a_checker(pid_t pid)
{
	char path[64], line[512];
	bool checked = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	while (!checked && fgets(line, sizeof(line), f) != NULL)
		checked = strstr(line, "libasan") != NULL ||
		    strstr(line, "vgpreload") != NULL;
	fclose(f);
	return checked;
}

/*
 * Far above rabbitmq.max_payload (64 MiB against 1 MiB): the claim reads
 * the content's length, not the content, and the row is DEAD unsent.
 * Before, the 64 MiB were downloaded to be refused (a row of 1 GB did
 * that too, and the process could be killed for its memory, then meet
 * the same row first after its restart).
 */
START_TEST(test_huge_payload_left_in_the_database)
{
	long kib;
	pid_t pid = start_with(BASE_YAML "rabbitmq.max_payload: 1MiB\n",
	    "SELECT outbox_enqueue('', '" GOOD "', "
	    "convert_to(repeat('z', 64 * 1024 * 1024), 'UTF8'), "
	    "business_key => 'huge')");

	assert_row("huge", 3, 1, "payload of 67108864 bytes exceeds "
	    "rabbitmq.max_payload (1048576)");
	assert_good_delivered();
	kib = tl_proc_kib(pid, "VmHWM");
	fprintf(stderr, "badrows: huge: peak RSS %ld KiB\n", kib);
	if (!under_a_checker(pid))
		ck_assert_int_lt(kib, 40 * 1024);
	assert_still_serving(pid);
}
END_TEST

/*
 * 48 rows of 1 MiB, each within max_payload, with relay.batch_size 500:
 * a batch ends where its contents pass 8 MiB, so no batch holds them
 * all, memory stays bounded, and each is delivered once.  Before, one
 * batch took all 48 MiB (500 rows of 16 MiB would have been 8 GiB).
 */
START_TEST(test_batch_ends_at_its_bytes)
{
	long kib;
	int most;
	pid_t pid = start_with(BASE_YAML "relay.batch_size: 500\n",
	    "SELECT outbox_enqueue('', '" GOOD "', convert_to(repeat('w', "
	    "1024 * 1024), 'UTF8'), business_key => 'mib-' || g) "
	    "FROM generate_series(1, 48) g");

	ck_assert_int_eq(tl_wait_sql_int(db, 48, 60000, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key LIKE 'mib-%%' AND "
	    "message_status = 1"), 48);
	assert_good_delivered();
	{
		long long ids[48], first = tl_sql_int(db, "SELECT min(id) "
		    "FROM t_transactional_message WHERE business_key LIKE "
		    "'mib-%%'");

		for (int i = 0; i < 48; i++)
			ids[i] = first + i;
		for (int i = 0; i < 48; i++)
			ck_assert_int_eq(times_received(ids[i]), 1);
	}
	/* A batch is claimed and marked in one transaction: its rows
	 * share xmin (edit_time could coincide across sessions). */
	most = (int)tl_sql_int(db, "SELECT max(n) FROM (SELECT count(*) AS n "
	    "FROM t_transactional_message WHERE business_key LIKE 'mib-%%' "
	    "GROUP BY xmin::text) b");
	kib = tl_proc_kib(pid, "VmHWM");
	fprintf(stderr, "badrows: 48 x 1 MiB: at most %d in a batch, peak "
	    "RSS %ld KiB\n", most, kib);
	ck_assert_int_le(most, 9);
	/* Pipelined, two workers hold four batches: 31 MiB measured. */
	if (!under_a_checker(pid))
		ck_assert_int_lt(kib, 48 * 1024);
	assert_still_serving(pid);
}
END_TEST

/*
 * An exchange that does not exist (NOT_FOUND): transient.  FAIL with
 * the row's backoff; once the exchange is declared, a retry delivers.
 */
START_TEST(test_unknown_exchange)
{
	char sql[512], ex[128], q[128];
	struct tl_msg m;
	long long id;
	pid_t pid;

	snprintf(ex, sizeof(ex), "badrows.late.%s", uniq);
	snprintf(q, sizeof(q), "badrows.late.%s", uniq);
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue('%s', 'k', 'late', "
	    "business_key => 'missing-exchange', max_retry_times => 10, "
	    "init_backoff => '2s', backoff_factor => 1)", ex);
	pid = start_with(BASE_YAML, sql);
	assert_row("missing-exchange", 2, 1, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("missing-exchange"), 2000);
	assert_good_delivered();
	/* Someone declares it: the next retry goes through. */
	{
		struct tl_amqp *a = tl_amqp_open();

		tl_exchange(a, ex, "direct");
		tl_queue(a, q, ex, "k");
		tl_consume(a, q);
		ck_assert_int_eq(tl_wait_sql_int(db, 1, 30000,
		    "SELECT count(*) FROM t_transactional_message WHERE "
		    "business_key = 'missing-exchange' AND "
		    "message_status = 1"), 1);
		id = tl_sql_int(db, "SELECT id FROM t_transactional_message "
		    "WHERE business_key = 'missing-exchange'");
		ck_assert(tl_next(a, 10000, &m));
		ck_assert_int_eq(m.message_id, id);
		ck_assert_int_ge(m.attempt, 2);
		fprintf(stderr, "badrows: missing-exchange delivered on "
		    "attempt %d once declared\n", m.attempt);
		tl_msg_free(&m);
		tl_exchange_delete(a, ex);
		tl_amqp_close(a);
	}
	assert_still_serving(pid);
}
END_TEST

/* The exchange exists with another type (PRECONDITION_FAILED): FAIL
 * with the broker's words, rescheduled. */
START_TEST(test_wrong_exchange_type)
{
	struct tl_amqp *a = tl_amqp_open();
	char sql[512], ex[128];
	pid_t pid;

	snprintf(ex, sizeof(ex), "badrows.direct.%s", uniq);
	tl_exchange(a, ex, "direct");
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue('%s', 'k', 'x', "
	    "exchange_type => 'topic', business_key => 'wrong-type', "
	    "init_backoff => '1 hour')", ex);
	pid = start_with(BASE_YAML, sql);
	assert_row("wrong-type", 2, 1, "PRECONDITION_FAILED");
	ck_assert_int_eq(scheduled_delay_ms("wrong-type"), 3600000);
	assert_good_delivered();
	assert_still_serving(pid);
	tl_exchange_delete(a, ex);
	tl_amqp_close(a);
}
END_TEST

/*
 * Unusable per-row backoff (negative init_backoff, backoff_factor 0):
 * the row is still retried, on the global defaults (10 s first delay),
 * and last_error says its own values were ignored.
 */
START_TEST(test_unusable_row_backoff)
{
	char sql[1024];
	pid_t pid;

	snprintf(sql, sizeof(sql),
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    "business_key => 'negative-backoff', init_backoff => '-5 seconds');"
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    "business_key => 'zero-factor', init_backoff => '200ms', "
	    "backoff_factor => 0)", uniq, uniq);
	pid = start_with(BASE_YAML, sql);
	assert_row("negative-backoff", 2, 1, "row backoff ignored");
	assert_row("zero-factor", 2, 1, "row backoff ignored");
	ck_assert_int_eq(scheduled_delay_ms("negative-backoff"), 10000);
	ck_assert_int_eq(scheduled_delay_ms("zero-factor"), 10000);
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/* max_retry_times 0: never due, never sent; the leader's compensation
 * marks it DEAD ("retries exhausted"). */
START_TEST(test_max_retry_times_zero)
{
	pid_t pid = start_with(BASE_YAML, "SELECT outbox_enqueue('', '" GOOD
	    "', 'never', business_key => 'no-retries', max_retry_times => 0)");
	long long id = tl_sql_int(db, "SELECT id FROM t_transactional_message"
	    " WHERE business_key = 'no-retries'");

	assert_row("no-retries", 3, 0, "retries exhausted");
	assert_good_delivered();
	ck_assert_int_eq(times_received(id), 0);
	assert_still_serving(pid);
}
END_TEST

/* NULL next_schedule_time means due now: delivered. */
START_TEST(test_null_next_schedule_time)
{
	pid_t pid = start_with(BASE_YAML, "WITH m AS (INSERT INTO "
	    "t_transactional_message (queue_name, business_key, "
	    "next_schedule_time) VALUES ('" GOOD "', 'null-schedule', NULL) "
	    "RETURNING id) INSERT INTO t_transactional_message_content "
	    "(message_id, content) SELECT id, 'due now' FROM m");
	long long id = tl_sql_int(db, "SELECT id FROM t_transactional_message"
	    " WHERE business_key = 'null-schedule'");

	assert_row("null-schedule", 1, 0, NULL);
	assert_good_delivered();
	ck_assert_int_eq(times_received(id), 1);
	assert_still_serving(pid);
}
END_TEST

/*
 * headers must be a JSON object: an array or a scalar is a malformed
 * row, permanent, DEAD at once.  Text that is not JSON at all never
 * gets that far: a jsonb column refuses it at INSERT.
 */
START_TEST(test_headers_not_an_object)
{
	PGresult *res;
	pid_t pid;

	res = PQexec(db, "INSERT INTO t_transactional_message (queue_name, "
	    "headers) VALUES ('" GOOD "', '{not json')");
	ck_assert_int_eq(PQresultStatus(res), PGRES_FATAL_ERROR);
	/* invalid_text_representation */
	ck_assert_str_eq(PQresultErrorField(res, PG_DIAG_SQLSTATE), "22P02");
	fprintf(stderr, "badrows: invalid JSON refused at INSERT: %s",
	    PQresultErrorMessage(res));
	PQclear(res);
	pid = start_with(BASE_YAML,
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'headers-array', headers => '[1,2]');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'headers-string', headers => '\"tenant\"');"
	    /* A JSON null is what drivers write for no headers. */
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'headers-null', headers => 'null')");
	assert_row("headers-array", 3, 1, "headers must be a JSON object");
	assert_row("headers-string", 3, 1, "headers must be a JSON object");
	assert_row("headers-null", 1, 0, NULL);
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * CC and BCC are RabbitMQ's sender-selected routing: the broker wants a
 * list of routing keys there and closes the channel on the string
 * outboxd would send, taking the batch's unconfirmed rows with it (sent
 * again: duplicates) at every retry.  Refused unsent, DEAD at once; the
 * same names in another case are plain headers.
 */
START_TEST(test_routing_headers_refused)
{
	pid_t pid = start_with(BASE_YAML,
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'header-cc', headers => '{\"tenant\": \"a\", \"CC\": \"b\"}');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'header-bcc', headers => '{\"BCC\": \"b\"}');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'header-cc-lower', headers => '{\"cc\": \"b\", "
	    "\"Bcc\": \"c\"}')");
	long long dups;

	assert_row("header-cc", 3, 1, "headers: \"CC\" is RabbitMQ's "
	    "sender-selected routing");
	assert_row("header-bcc", 3, 1, "headers: \"BCC\"");
	assert_row("header-cc-lower", 1, 0, NULL);
	dups = assert_good_delivered();
	ck_assert_msg(dups == 0, "%lld good rows sent twice", dups);
	assert_still_serving(pid);
}
END_TEST

/* Content that is not UTF-8 (with a NUL too): delivered byte for byte. */
START_TEST(test_non_utf8_content)
{
	static const unsigned char want[] = { 0xff, 0xfe, 0x00, 0xc3, 0x28 };
	pid_t pid = start_with(BASE_YAML, "SELECT outbox_enqueue('', '" GOOD
	    "', '\\xfffe00c328'::bytea, business_key => 'binary', "
	    "content_type => 'application/octet-stream')");
	long long id = tl_sql_int(db, "SELECT id FROM t_transactional_message"
	    " WHERE business_key = 'binary'");
	struct tl_msg m;
	bool seen = false;

	assert_row("binary", 1, 0, NULL);
	/* Read it ourselves to see the bytes. */
	while (!seen && tl_next(amqp, 10000, &m)) {
		if (m.message_id == id) {
			ck_assert_uint_eq(m.body_len, sizeof(want));
			ck_assert(memcmp(m.body, want, sizeof(want)) == 0);
			ck_assert_str_eq(m.content_type,
			    "application/octet-stream");
			seen = true;
		}
		record(m.message_id);
		tl_msg_free(&m);
	}
	ck_assert_msg(seen, "binary row never received");
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * A database in WIN1252 stores bytes that encoding leaves unassigned
 * (0x81, 0x8d, 0x8f, 0x90, 0x9d) and that have no UTF-8 form, which is
 * what outboxd reads in.  Such a byte in a name or a header failed every
 * claim that reached the row ("character with byte sequence 0x81 in
 * encoding "WIN1252" has no equivalent in encoding "UTF8""), and with
 * the row first in line nothing was sent at all.  Now such rows are
 * DEAD with those words, and every other row goes.  The suite's helpers
 * work on a database of that encoding for this case.
 */
/* The outbox in a new database in WIN1252, migrated; db points there
 * (win1252_close puts it back).  Its config, with extra YAML, goes to
 * yaml[] and the file cfg[]. */
static void
win1252_open(const char *extra, char *yaml, size_t ysize, char *cfg,
    size_t csize)
{
	char conninfo[512], out[4096], err[4096];

	tl_sql(db, "DROP DATABASE IF EXISTS badrows_win1252 WITH (FORCE)");
	tl_sql(db, "CREATE DATABASE badrows_win1252 TEMPLATE template0 "
	    "ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C'");
	snprintf(conninfo, sizeof(conninfo), "%s dbname=badrows_win1252",
	    tl_env("OUTBOXD_PG_CONNINFO"));
	snprintf(yaml, ysize, BASE_YAML "postgres.conninfo: \"%s\"\n%s",
	    conninfo, extra);
	tl_config_write(cfg, csize, yaml);
	ck_assert_msg(tl_outboxd_cli(out, sizeof(out), err, sizeof(err), cfg,
	    "migrate", NULL) == 0, "migrate: %s", err);
	db = PQconnectdb(conninfo);
	ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s",
	    PQerrorMessage(db));
	ck_assert_str_eq(PQparameterStatus(db, "server_encoding"), "WIN1252");
}

/* Polls pid's log for needle until timeout_ms passes. */
static bool
wait_log_line(pid_t pid, const char *needle, int timeout_ms)
{
	for (int64_t deadline = tl_ms() + timeout_ms; tl_ms() < deadline;
	    sleep_ms(50, NULL))
		if (tl_log_contains(pid, needle))
			return true;
	return tl_log_contains(pid, needle);
}

static void
win1252_close(PGconn *outbox_db)
{
	PQfinish(db);
	db = outbox_db;
	tl_sql(db, "DROP DATABASE badrows_win1252 WITH (FORCE)");
}

START_TEST(test_row_with_no_utf8_form)
{
	char yaml[1024], cfg[512], out[4096], err[4096];
	PGconn *outbox_db = db;
	pid_t pid;

	win1252_open("", yaml, sizeof(yaml), cfg, sizeof(cfg));

	/* First in line, so that before every claim failed on them.  The
	 * first one's DEAD mark is refused, which failed every claim. */
	refuse_marks("NEW.message_status = 3");
	tl_sql(db, "SELECT outbox_enqueue('', E'badrows.\\x90', 'x', "
	    "business_key => 'refused-unreadable')");
	tl_sql(db, "SELECT outbox_enqueue('', E'badrows.\\x81', 'x', "
	    "business_key => 'win-routing-key')");
	tl_sql(db, "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'win-header', headers => E'{\"tenant\": \"a\\x8d\"}')");
	pid = start_with(yaml, "SELECT outbox_enqueue('', '" GOOD "', 'x', "
	    "business_key => 'win-latin', headers => "
	    "E'{\"caf\\xe9\": \"\\x80\"}')");
	assert_row("win-routing-key", 3, 1, "no UTF-8 form");
	assert_row("win-routing-key", 3, 1, "0x81 in encoding");
	assert_row("win-header", 3, 1, "0x8d in encoding");
	/* Bytes WIN1252 assigns (e acute, the euro sign) go as UTF-8. */
	assert_row("win-latin", 1, 0, NULL);
	assert_good_delivered();
	ck_assert(tl_log_contains(pid, "msg=\"message dead\""));
	/* Held out of the claims, due, until its DEAD mark goes through. */
	assert_row("refused-unreadable", 0, 0, NULL);
	ck_assert_int_ge(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"marking failed\"", "error=\"the database refused to "
	    "mark it dead (a name or header has no UTF-8 form): badrows: "
	    "mark refused (P0001)\""), 1);
	allow_marks();
	assert_row("refused-unreadable", 3, 1, "0x90 in encoding");
	/* The operator's list shows them, the bytes as escapes. */
	ck_assert_msg(tl_outboxd_cli(out, sizeof(out), err, sizeof(err), cfg,
	    "dead", NULL) == 0, "dead: %s", err);
	ck_assert_msg(strstr(out, "badrows.\\201") != NULL, "dead: %s", out);
	ck_assert_msg(strstr(out, "win-header") != NULL, "dead: %s", out);
	assert_still_serving(pid);
	win1252_close(outbox_db);
}
END_TEST

/*
 * Many such rows at once: more made DEAD than the store reports one by
 * one (STORE_UNREADABLE_KEPT, 8: the rest in one line), and more whose
 * DEAD mark is refused than the relay holds back (STORE_SKIP_MAX, 64:
 * each claim meets them again, so it paces itself instead of spinning).
 * Each is counted, none is sent, and once the marks go through every
 * one is DEAD and the good rows go.
 */
START_TEST(test_many_rows_with_no_utf8_form)
{
	enum { DEAD = 20, HELD = 70 };
	char yaml[1024], cfg[512], metrics[8192];
	PGconn *outbox_db = db;
	double cpu;
	pid_t pid;
	int port = tl_free_port();
	char extra[256];

	/* One relay: two could share the rows, each finding 8 or fewer. */
	snprintf(extra, sizeof(extra), "relay.workers: 1\n"
	    "reconnect.init: 100ms\nreconnect.max: 1s\n"
	    "http.listen: \"127.0.0.1:%d\"\n", port);
	win1252_open(extra, yaml, sizeof(yaml), cfg, sizeof(cfg));
	refuse_marks("NEW.message_status = 3");
	tl_sql(db, "SELECT outbox_enqueue('', E'badrows.\\x81', 'x', "
	    "business_key => 'win-' || g) FROM generate_series(1, %d) g", DEAD);
	tl_sql(db, "SELECT outbox_enqueue('', E'badrows.\\x90', 'x', "
	    "business_key => 'refused-' || g) FROM generate_series(1, %d) g",
	    HELD);
	pid = start_with(yaml, "SELECT 1");
	ck_assert_int_eq(tl_wait_sql_int(db, DEAD, 30000, "SELECT count(*) "
	    "FROM t_transactional_message WHERE business_key LIKE 'win-%%' "
	    "AND message_status = 3 AND last_error LIKE '%%0x81 in encoding%%'"),
	    DEAD);
	ck_assert_msg(wait_log_line(pid, "msg=\"more messages dead, "
	    "unreadable\" rows=12", 10000), "log %s", tl_outboxd_log(pid));
	ck_assert_int_eq(tl_http_get(port, "/metrics", metrics,
	    sizeof(metrics)), 200);
	ck_assert_double_ge(tl_metric(metrics, "outboxd_messages_dead_total"),
	    DEAD);
	/* Held back, and paced: not a claim after claim. */
	ck_assert(tl_log_contains(pid, "msg=\"marking failed\""));
	cpu = tl_cpu_share(pid, 2000);
	fprintf(stderr, "badrows: %d rows held, outboxd at %.1f%% of a core\n",
	    HELD, cpu * 100);
	ck_assert_msg(cpu < 0.3, "outboxd spins: %.0f%% of a core", cpu * 100);
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key LIKE 'refused-%%' AND "
	    "message_status = 0 AND current_retry_times = 0"), HELD);
	allow_marks();
	ck_assert_int_eq(tl_wait_sql_int(db, HELD, 30000, "SELECT count(*) "
	    "FROM t_transactional_message WHERE business_key LIKE "
	    "'refused-%%' AND message_status = 3"), HELD);
	assert_good_delivered();
	ck_assert_uint_eq(ngot, 2 * GOOD_PER_SIDE);
	assert_still_serving(pid);
	win1252_close(outbox_db);
}
END_TEST

/*
 * The broker's words about a row, cut at a byte count in the middle of a
 * character (RabbitMQ cuts its close text, outboxd its return text):
 * stored with the bad bytes as "?".  PostgreSQL refused them once, and
 * with them every mark of the batch, each time the row came round again.
 */
START_TEST(test_broker_text_cut_mid_character)
{
	char err[1024];
	pid_t pid;

	pid = start_with(BASE_YAML,
	    "SELECT outbox_enqueue(repeat(chr(233), 120), 'k', 'x', "
	    " business_key => 'accented-exchange', init_backoff => '1 hour');"
	    "SELECT outbox_enqueue('', repeat(chr(36335), 80), 'x', "
	    " business_key => 'cjk-route', init_backoff => '1 hour')");
	assert_row("accented-exchange", 2, 1, "NOT_FOUND");
	assert_row("cjk-route", 2, 1, "NO_ROUTE");
	/* The text kept its whole characters. */
	last_error("cjk-route", err, sizeof(err));
	ck_assert_msg(strstr(err, "\xe8\xb7\xaf\xe8\xb7\xaf") != NULL,
	    "last_error: %s", err);
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * An exchange type RabbitMQ does not know ('Topic', a plugin's type not
 * installed): the broker closes the whole connection (503), not just the
 * channel.  The row takes the blame, FAIL with the broker's words and its
 * backoff; it used to be left untouched, and every batch reconnected and
 * met it again, hundreds of times a second.
 */
START_TEST(test_unknown_exchange_type)
{
	char sql[512];
	pid_t pid;

	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue('badrows.cap.%s', "
	    "'k', 'x', exchange_type => 'Topic', business_key => "
	    "'unknown-type', init_backoff => '1 hour')", uniq);
	pid = start_with(BASE_YAML, sql);
	assert_row("unknown-type", 2, 1, "unknown exchange type 'Topic'");
	ck_assert_int_eq(scheduled_delay_ms("unknown-type"), 3600000);
	assert_good_delivered();
	/* One connection lost for it, not a loop of them; and the row's
	 * doing, not the broker's: no reconnect pacing (the good rows
	 * would wait it out). */
	ck_assert_int_le(tl_file_lines(tl_outboxd_log(pid),
	    "broker connection lost", NULL), 2);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "connection short-lived", NULL), 0);
	assert_still_serving(pid);
}
END_TEST

/*
 * A message that breaks every connection that carries it: the cutter in
 * front of RabbitMQ resets each connection whose client sends the
 * message's body (in the field: a body too large for the confirm
 * timeout, content a middlebox resets).  A lost connection counts no
 * attempt, so such a row was sent again at every reconnect, without
 * end, and the good rows of its batch with it, never confirmed.  Now the
 * rows that lose a connection are sent apart from their batch, then
 * alone; the third loss in a row, alone, counts an attempt, and with
 * max_retry_times 2 the next one makes the row DEAD: four connections
 * cut in all, and every good row delivered.
 */
START_TEST(test_message_that_breaks_connections)
{
	struct tl_cutter *cutter = tl_cutter_start(
	    atoi(tl_env("OUTBOXD_AMQP_PORT")), "CUT-THIS-CONNECTION");
	char yaml[256];
	pid_t pid;

	snprintf(yaml, sizeof(yaml), BASE_YAML "rabbitmq.nodes: "
	    "[\"127.0.0.1:%d\"]\n", tl_cutter_port(cutter));
	pid = start_with(yaml, "SELECT outbox_enqueue('', '" GOOD "', "
	    "'CUT-THIS-CONNECTION', business_key => 'cutter', "
	    "max_retry_times => 2, init_backoff => '100ms')");
	assert_row("cutter", 3, 2, "alone in flight");
	fprintf(stderr, "badrows: cutter: %lld duplicates among the good "
	    "rows, %d connections cut\n", assert_good_delivered(),
	    tl_cutter_cuts(cutter));
	ck_assert_int_eq(tl_cutter_cuts(cutter), 4);
	ck_assert(tl_log_contains(pid, "sending suspects apart"));
	assert_still_serving(pid);
	tl_cutter_stop(cutter);
}
END_TEST

/*
 * A pipelined relay sends a batch with a row for an exchange deleted
 * since it was checked (outboxd remembers exchanges that exist), then
 * marks the batch before, which a trigger makes slower than
 * rabbitmq.confirm_timeout.  When it comes back to the batch, the
 * broker has closed the channel at that row, and the rows after it are
 * sent again.  They were given what was left of the batch's deadline,
 * nothing: the connection was dropped ("confirms missing") and they
 * were left unconfirmed.  Each round now has its own time.
 */
START_TEST(test_pipelined_batch_resent_after_a_slow_mark)
{
	struct tl_amqp *a = tl_amqp_open();
	char sql[1024], ex[128];
	pid_t pid;

	snprintf(ex, sizeof(ex), "badrows.gone.%s", uniq);
	tl_exchange(a, ex, "direct");
	tl_sql(db, "CREATE OR REPLACE FUNCTION badrows_slow_mark()"
	    " RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
	    " PERFORM pg_sleep(2.5); RETURN NEW; END $$");
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_slow_mark ON "
	    "t_transactional_message");
	tl_sql(db, "CREATE TRIGGER badrows_slow_mark BEFORE UPDATE ON"
	    " t_transactional_message FOR EACH ROW WHEN"
	    " (NEW.business_key = 'slow-mark' AND NEW.message_status = 1)"
	    " EXECUTE FUNCTION badrows_slow_mark()");
	pid = tl_outboxd_start(BASE_YAML "relay.workers: 1\n"
	    "relay.pipeline: true\nrelay.batch_size: 5\n"
	    "rabbitmq.confirm_timeout: 1s\n");
	/* Checked once (unroutable, but it exists), then deleted. */
	tl_sql(db, "SELECT outbox_enqueue('%s', 'k', 'x', business_key => "
	    "'warm', init_backoff => '1 hour')", ex);
	assert_row("warm", 2, 1, "NO_ROUTE");
	tl_exchange_delete(a, ex);
	tl_amqp_close(a);
	/* Batches of 5: the slow row in the first, the deleted exchange
	 * in the middle of the second. */
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue("
	    "CASE WHEN g = 8 THEN '%s' ELSE '' END,"
	    " CASE WHEN g = 8 THEN 'k' ELSE '" GOOD "' END, 'x' || g,"
	    " business_module => CASE WHEN g = 8 THEN NULL ELSE 'good' END,"
	    " business_key => CASE g WHEN 3 THEN 'slow-mark'"
	    "  WHEN 8 THEN 'gone' END,"
	    " init_backoff => '1 hour') FROM generate_series(1, 20) g", ex);
	tl_sql(db, "%s", sql);
	assert_row("gone", 2, 1, "NOT_FOUND");
	/* The rows before it that the close left unconfirmed come twice
	 * (at-least-once), as in test_unknown_exchange. */
	fprintf(stderr, "badrows: gone: %lld duplicates among the good "
	    "rows\n", assert_good_delivered());
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"broker connection lost\"", NULL), 0);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"publish channel closed by the broker\"", NULL), 1);
	tl_sql(db, "DROP TRIGGER badrows_slow_mark ON "
	    "t_transactional_message");
	tl_sql(db, "DROP FUNCTION badrows_slow_mark()");
	assert_still_serving(pid);
}
END_TEST

/* A trigger that refuses to update the rows whose business_key starts
 * with 'refused' when `when` holds of NEW; when is NULL, only the
 * trigger's function, for a test's own trigger. */
static void
refuse_marks(const char *when)
{
	/* One left by a failed test would refuse this one's rows. */
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_refuse_mark ON "
	    "t_transactional_message");
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_refuse_at_commit ON "
	    "t_transactional_message");
	tl_sql(db, "CREATE OR REPLACE FUNCTION badrows_refuse_mark()"
	    " RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
	    " RAISE EXCEPTION 'badrows: mark refused'; END $$");
	if (when == NULL)
		return;
	tl_sql(db, "CREATE TRIGGER badrows_refuse_mark BEFORE UPDATE ON"
	    " t_transactional_message FOR EACH ROW WHEN"
	    " (NEW.business_key LIKE 'refused%%' AND %s)"
	    " EXECUTE FUNCTION badrows_refuse_mark()", when);
}

static void
allow_marks(void)
{
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_refuse_mark ON "
	    "t_transactional_message");
	tl_sql(db, "DROP TRIGGER IF EXISTS badrows_refuse_at_commit ON "
	    "t_transactional_message");
	tl_sql(db, "DROP FUNCTION badrows_refuse_mark()");
}

#define REFUSED_SENT "the database refused to mark it sent (it was " \
	"published and confirmed): badrows: mark refused (P0001)"

/*
 * The database refuses to mark a row sent (a trigger's exception; a
 * constraint would do the same), in a batch with 20 good rows.  The
 * batch's one UPDATE failed, the whole batch rolled back, and every row
 * was published again at each paced retry, none ever marked.  Now the
 * marks are written again row by row: the good rows are SUCCESS, each
 * received once, and the refused row is DEAD, with why.  Six rows are
 * refused: the texts of the first four were freed when the fifth came,
 * and their `message dead` lines read freed memory (ASan: use after
 * free).
 */
START_TEST(test_mark_refused_for_one_row)
{
	char key[32];
	pid_t pid;

	refuse_marks("NEW.message_status = 1");
	/* One relay: the 26 rows in one batch, one UPDATE. */
	pid = start_with(BASE_YAML "relay.workers: 1\n", "SELECT "
	    "outbox_enqueue('', '" GOOD "', 'x', business_key => 'refused' || "
	    "CASE WHEN g = 1 THEN '' ELSE '-' || g END) "
	    "FROM generate_series(1, 6) g");
	assert_row("refused", 3, 1, REFUSED_SENT);
	for (int i = 2; i <= 6; i++) {
		snprintf(key, sizeof(key), "refused-%d", i);
		assert_row(key, 3, 1, REFUSED_SENT);
	}
	ck_assert_int_eq(assert_good_delivered(), 0);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"message dead\"", "error=\"" REFUSED_SENT "\""), 6);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"marking failed\"", NULL), 0);
	allow_marks();
	assert_still_serving(pid);
}
END_TEST

/*
 * One refused row amid 2,000 good ones, in one batch: the second try
 * finds it by halving the batch.  Row by row, it wrote each mark under a
 * savepoint of its own: 2,001 UPDATEs here, three round trips a row,
 * and with batches of 10,000 and a database 2 ms away about 60 s, past
 * the stall limit and WatchdogSec=, after which the restart met the
 * same batch.  A statement trigger counts the UPDATEs, refused ones too
 * (a sequence is not rolled back); the leader's few sweeps count too.
 */
START_TEST(test_refused_row_found_by_halving)
{
	long long updates;
	pid_t pid;

	refuse_marks("NEW.message_status = 1");
	tl_sql(db, "DROP SEQUENCE IF EXISTS badrows_updates");
	tl_sql(db, "CREATE SEQUENCE badrows_updates");
	tl_sql(db, "CREATE OR REPLACE FUNCTION badrows_count_update()"
	    " RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
	    " PERFORM nextval('badrows_updates'); RETURN NULL; END $$");
	tl_sql(db, "CREATE TRIGGER badrows_count_update BEFORE UPDATE ON"
	    " t_transactional_message FOR EACH STATEMENT"
	    " EXECUTE FUNCTION badrows_count_update()");
	good_rows(1000);
	tl_sql(db, "SELECT outbox_enqueue('', '" GOOD "', 'x', "
	    "business_key => 'refused')");
	good_rows(1000);
	pid = tl_outboxd_start(BASE_YAML "relay.workers: 1\n"
	    "relay.batch_size: 2001\n");
	assert_row("refused", 3, 1, REFUSED_SENT);
	ck_assert_int_eq(assert_good_delivered(), 0);
	updates = tl_sql_int(db, "SELECT CASE WHEN is_called THEN last_value"
	    " ELSE 0 END FROM badrows_updates");
	fprintf(stderr, "badrows: one refused row in 2,001: %lld UPDATEs\n",
	    updates);
	ck_assert_int_lt(updates, 200);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"message dead\"", "error=\"" REFUSED_SENT "\""), 1);
	tl_sql(db, "DROP TRIGGER badrows_count_update ON "
	    "t_transactional_message");
	tl_sql(db, "DROP FUNCTION badrows_count_update()");
	tl_sql(db, "DROP SEQUENCE badrows_updates");
	allow_marks();
	assert_still_serving(pid);
}
END_TEST

/* retry_in_ms of the first n "marking failed" lines of a row, in
 * out[n]; returns how many were found (none while outboxd has not made
 * its log yet). */
static int
marking_failed_waits(const char *log, long long *out, int n)
{
	FILE *f = fopen(log, "r");
	char line[8192];
	const char *p;
	int k = 0;

	if (f == NULL)
		return 0;
	while (k < n && fgets(line, sizeof(line), f) != NULL) {
		if (strstr(line, "msg=\"marking failed\" id=") == NULL ||
		    (p = strstr(line, "retry_in_ms=")) == NULL)
			continue;
		out[k++] = strtoll(p + strlen("retry_in_ms="), NULL, 10);
	}
	fclose(f);
	return k;
}

/*
 * Five rows whose every mark is refused fill a batch: each waits the
 * first wait, 100 ms.  Before, one relay-wide pacing was stepped once
 * per row (100, 200, 400 ms, ...), so that nine such rows made the
 * first wait 15 s.  The rows come round at their own pacing: their
 * fourth copy takes at least the first three waits (100, 200, 400 ms),
 * pipelined too.
 */
START_TEST(test_refused_marks_paced_once_per_batch)
{
	long long waits[5], first;
	int64_t t0, took;
	struct tl_msg m;
	const char *log;
	pid_t pid;

	refuse_marks("true");
	pid = start_with(BASE_YAML "relay.workers: 1\nrelay.batch_size: 5\n",
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'refused-' || g) FROM generate_series(1, 5) g");
	log = tl_outboxd_log(pid);
	first = tl_sql_int(db, "SELECT id FROM t_transactional_message "
	    "WHERE business_key = 'refused-1'");
	for (int64_t until = tl_ms() + 20000; tl_ms() < until &&
	    marking_failed_waits(log, waits, 5) < 5;)
		usleep(20000);
	t0 = tl_ms();
	ck_assert_int_eq(marking_failed_waits(log, waits, 5), 5);
	for (int i = 1; i < 5; i++)
		ck_assert_msg(waits[i] == waits[0], "one batch, waits %lld "
		    "and %lld", waits[0], waits[i]);
	while (times_received(first) < 4 && tl_ms() - t0 < 20000) {
		if (tl_next(amqp, 200, &m)) {
			record(m.message_id);
			tl_msg_free(&m);
		}
	}
	took = tl_ms() - t0;
	ck_assert_uint_ge(times_received(first), 4);
	fprintf(stderr, "badrows: refused-1 sent 4 times in %" PRId64
	    " ms after its first batch\n", took);
	ck_assert_int_ge(took, 250);
	allow_marks();
	assert_row("refused-1", 1, 0, NULL);
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * The same refusal from a deferred constraint trigger, which checks at
 * COMMIT.  The COMMIT rolled the batch's marks back, and the batch was
 * published again at every paced retry, none marked.  Now the marks are
 * written again row by row with the checks immediate, so the refused
 * row is found and made DEAD, and the good rows are SUCCESS, received
 * once.
 */
START_TEST(test_mark_refused_at_commit)
{
	pid_t pid;

	refuse_marks(NULL);
	tl_sql(db, "CREATE CONSTRAINT TRIGGER badrows_refuse_at_commit"
	    " AFTER UPDATE ON t_transactional_message"
	    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN"
	    " (NEW.business_key = 'refused-at-commit' AND"
	    " NEW.message_status = 1)"
	    " EXECUTE FUNCTION badrows_refuse_mark()");
	pid = start_with(BASE_YAML "relay.workers: 1\n", "SELECT "
	    "outbox_enqueue('', '" GOOD "', 'x', "
	    "business_key => 'refused-at-commit')");
	assert_row("refused-at-commit", 3, 1, REFUSED_SENT);
	ck_assert_int_eq(assert_good_delivered(), 0);
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid),
	    "msg=\"marking failed\"", NULL), 0);
	allow_marks();
	assert_still_serving(pid);
}
END_TEST

/*
 * The same, with every update of the row refused, DEAD too: the row
 * stays due, untouched, and is sent again with the reconnect pacing (a
 * line each time), while the good rows of its batch are SUCCESS and
 * received once.  Once the trigger goes, the row is SUCCESS.
 */
START_TEST(test_every_mark_refused_for_one_row)
{
	pid_t pid;

	refuse_marks("true");
	pid = start_with(BASE_YAML "relay.workers: 1\n", "SELECT "
	    "outbox_enqueue('', '" GOOD "', 'x', business_key => 'refused')");
	ck_assert_int_eq(assert_good_delivered(), 0);
	/* Its batch's marks are written: it is still as it was. */
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key = 'refused' AND "
	    "message_status = 0 AND current_retry_times = 0"), 1);
	for (int64_t until = tl_ms() + 20000; tl_ms() < until &&
	    tl_file_lines(tl_outboxd_log(pid), "badrows: mark refused",
	    "msg=\"marking failed\"") < 3;)
		usleep(50000);
	ck_assert_int_ge(tl_file_lines(tl_outboxd_log(pid),
	    "badrows: mark refused", "msg=\"marking failed\""), 3);
	allow_marks();
	assert_row("refused", 1, 0, NULL);
	assert_still_serving(pid);
}
END_TEST

/*
 * A mark fails as on a server gone read-only (SQLSTATE 25006, raised once
 * by a trigger, on the session that LISTENs).  With relay.pipeline
 * (OUTBOXD_TEST_YAML), the next batch is at the broker then, and it has
 * a row over the broker's max_message_size: the sessions are ended, but
 * only once the run is over.  Ended at once, the batch at the broker
 * pointed into its session's freed result, and the channel close for
 * the big row had the batch's messages read from freed memory and sent
 * again (a report under the sanitizers).  Every good row is sent, and
 * the big one is dead, as always.
 */
START_TEST(test_mark_on_a_read_only_session)
{
	pid_t pid;

	tl_sql(db, "DROP SEQUENCE IF EXISTS badrows_ro_once");
	tl_sql(db, "CREATE SEQUENCE badrows_ro_once");
	tl_sql(db, "CREATE OR REPLACE FUNCTION badrows_read_only_mark()"
	    " RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
	    " IF EXISTS (SELECT 1 FROM pg_listening_channels())"
	    "  AND nextval('badrows_ro_once') = 1 THEN"
	    "  RAISE EXCEPTION 'badrows: read-only' USING ERRCODE = '25006';"
	    " END IF; RETURN NEW; END $$");
	tl_sql(db, "CREATE TRIGGER badrows_read_only_mark BEFORE UPDATE ON"
	    " t_transactional_message FOR EACH ROW WHEN"
	    " (NEW.message_status = 1 AND NEW.business_module = 'good')"
	    " EXECUTE FUNCTION badrows_read_only_mark()");
	/* 10 good rows, then the big one and 10 more: batches of 10. */
	pid = start_with(BASE_YAML "relay.workers: 1\nrelay.batch_size: 10\n",
	    "SELECT outbox_enqueue('', '" GOOD "', "
	    "convert_to(repeat('x', 5 * 1024 * 1024), 'UTF8'), "
	    "business_key => 'read-only-big')");
	assert_row("read-only-big", 3, 1, "4194304");
	ck_assert_int_eq(tl_file_lines(tl_outboxd_log(pid), "postgres session "
	    "read-only", "badrows: read-only"), 1);
	tl_sql(db, "DROP TRIGGER badrows_read_only_mark ON "
	    "t_transactional_message");
	tl_sql(db, "DROP FUNCTION badrows_read_only_mark()");
	tl_sql(db, "DROP SEQUENCE badrows_ro_once");
	assert_still_serving(pid);
}
END_TEST

/*
 * A row whose every mark is refused, ahead of a backlog of 2,000 rows,
 * batches of 10.  The relay paced itself for it, and each batch held
 * that row again (the oldest due), so the backlog went one batch per
 * pacing wait (here at most reconnect.max, 1 s): minutes.  The row alone
 * is now left out of the claims until its next try, and the backlog
 * goes as fast as ever.
 */
START_TEST(test_refused_row_holds_back_no_backlog)
{
	pid_t pid;

	refuse_marks("true");
	pid = start_with(BASE_YAML "relay.workers: 1\nrelay.batch_size: 10\n",
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'refused'); SELECT outbox_enqueue('', '" GOOD "', 'good ' || g, "
	    "business_module => 'good') FROM generate_series(1, 2000) g");
	ck_assert_int_eq(assert_good_delivered(), 0);
	ck_assert_int_eq(tl_sql_int(db, "SELECT count(*) FROM "
	    "t_transactional_message WHERE business_key = 'refused' AND "
	    "message_status = 0"), 1);
	allow_marks();
	assert_row("refused", 1, 0, NULL);
	assert_still_serving(pid);
}
END_TEST

/*
 * A trigger that refuses every update of 200 rows, in batches of 10: no
 * mark of a batch goes through, and each batch meets new refusals.
 * Holding rows back does not help there (the next batch is refused the
 * same), so the relay paces itself, as it always did.  Without that it
 * claimed and published batch after batch at once, the same rows over
 * and over as the table of held rows (64) gave them back.
 */
START_TEST(test_every_row_refused_is_paced)
{
	int64_t until;
	struct tl_msg m;
	int copies = 0;
	pid_t pid;

	refuse_marks("true");
	pid = start_with(BASE_YAML "relay.workers: 1\nrelay.batch_size: 10\n",
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', business_key => "
	    "'refused-' || g) FROM generate_series(1, 200) g");
	/* Three seconds of it, from the first refused copy on. */
	for (until = tl_ms() + 20000; tl_ms() < until;) {
		if (!tl_next(amqp, 200, &m))
			continue;
		record(m.message_id);
		if (strncmp(m.business_key, "refused-", 8) == 0 &&
		    copies++ == 0)
			until = tl_ms() + 3000;
		tl_msg_free(&m);
	}
	fprintf(stderr, "badrows: %d refused copies in 3 s\n", copies);
	ck_assert_int_gt(copies, 0);
	/* Batches of new refusals are paced (50-100 ms, doubling to 1 s);
	 * rows refused before come back at their own waits.  Unpaced, a
	 * batch every few milliseconds: thousands. */
	ck_assert_int_le(copies, 1000);
	allow_marks();
	assert_still_serving(pid);
}
END_TEST

/*
 * A failed row's retry is counted from its mark, not from its claim: the
 * batch's marks can come long after the claim (confirms take up to
 * rabbitmq.confirm_timeout).  Here a trigger holds the batch's
 * mark_success for 2 s, and mark_failed follows it in the same
 * transaction: its edit_time must be 2 s after the sent row's, with the
 * delay counted from there.  now() (the claim's time) gave both rows the
 * same time.
 */
START_TEST(test_retry_counted_from_the_mark)
{
	char sql[1024];
	pid_t pid;

	tl_sql(db, "CREATE OR REPLACE FUNCTION badrows_slow_mark()"
	    " RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
	    " PERFORM pg_sleep(2); RETURN NEW; END $$");
	tl_sql(db, "CREATE TRIGGER badrows_slow_mark BEFORE UPDATE ON"
	    " t_transactional_message FOR EACH ROW WHEN"
	    " (NEW.message_status = 1 AND NEW.business_key = 'slow-mark')"
	    " EXECUTE FUNCTION badrows_slow_mark()");
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue('', '" GOOD "', "
	    "'x', business_key => 'slow-mark');"
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    " business_key => 'missing-exchange', init_backoff => '1 hour')",
	    uniq);
	/* One relay: two would split the rows between their claims, and
	 * the two marks would not share a transaction. */
	pid = start_with(BASE_YAML "relay.workers: 1\n", sql);
	assert_row("missing-exchange", 2, 1, "NOT_FOUND");
	ck_assert_int_ge(tl_sql_int(db, "SELECT (extract(epoch FROM "
	    "(SELECT edit_time FROM t_transactional_message WHERE "
	    "business_key = 'missing-exchange') - (SELECT edit_time FROM "
	    "t_transactional_message WHERE business_key = 'slow-mark')) * "
	    "1000)::int8"), 2000);
	ck_assert_int_eq(scheduled_delay_ms("missing-exchange"), 3600000);
	tl_sql(db, "DROP TRIGGER badrows_slow_mark ON t_transactional_message");
	tl_sql(db, "DROP FUNCTION badrows_slow_mark()");
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * Everything at once, in the same batches as 100 good rows: the bad rows
 * do not disturb one another either.  max_payload 6 MiB puts the 5 MiB
 * row over the broker's limit and the 7 MiB one over ours.
 */
START_TEST(test_all_bad_rows_at_once)
{
	struct tl_amqp *a = tl_amqp_open();
	char sql[4096], ex[128], yaml[256];
	static char body[65536];
	int port = tl_free_port();
	int64_t deadline;
	double oversized, bad_row;
	pid_t pid;

	snprintf(ex, sizeof(ex), "badrows.direct.%s", uniq);
	tl_exchange(a, ex, "direct");
	good_rows(50);
	snprintf(sql, sizeof(sql),
	    "INSERT INTO t_transactional_message (queue_name, business_key) "
	    " VALUES ('" GOOD "', 'no-content');"
	    "SELECT outbox_enqueue('', NULL, 'x', business_key => 'route');"
	    "SELECT outbox_enqueue('', '" GOOD "', convert_to(repeat('x', "
	    " 5 * 1024 * 1024), 'UTF8'), business_key => 'broker-max');"
	    "SELECT outbox_enqueue('', '" GOOD "', convert_to(repeat('x', "
	    " 7 * 1024 * 1024), 'UTF8'), business_key => 'max-payload');"
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    " business_key => 'missing-exchange');"
	    "SELECT outbox_enqueue('%s', 'k', 'x', exchange_type => 'topic', "
	    " business_key => 'wrong-type');"
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    " business_key => 'negative-backoff', init_backoff => '-1s');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', max_retry_times => 0,"
	    " business_key => 'no-retries');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', headers => '[1,2]',"
	    " business_key => 'headers-array');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', headers =>"
	    " jsonb_build_object(repeat('h', 300), 'v'),"
	    " business_key => 'long-header');"
	    "SELECT outbox_enqueue('', '" GOOD "', '\\xff'::bytea,"
	    " business_key => 'binary')", uniq, ex, uniq);
	tl_sql(db, "%s", sql);
	good_rows(50);
	snprintf(yaml, sizeof(yaml), BASE_YAML "relay.batch_size: 40\n"
	    "rabbitmq.max_payload: 6MiB\nhttp.listen: \"127.0.0.1:%d\"\n",
	    port);
	pid = tl_outboxd_start(yaml);
	assert_row("no-content", 2, 1, "no content row");
	assert_row("route", 3, 1, "no route");
	/* Over the broker's limit: a channel close, then DEAD at once —
	 * the row can never fit, so the error is permanent. */
	assert_row("broker-max", 3, 1, "4194304");
	assert_row("max-payload", 3, 1, "exceeds rabbitmq.max_payload");
	assert_row("missing-exchange", 2, 1, "NOT_FOUND");
	assert_row("wrong-type", 2, 1, "PRECONDITION_FAILED");
	assert_row("negative-backoff", 2, 1, "row backoff ignored");
	assert_row("no-retries", 3, 0, "retries exhausted");
	assert_row("headers-array", 3, 1, "headers must be a JSON object");
	assert_row("long-header", 3, 1, "longer than 255 bytes");
	assert_row("binary", 1, 0, NULL);
	/* Too large: broker-max and max-payload.  Not publishable as they
	 * are: route, headers-array and long-header (a name no frame can
	 * carry, counted as oversized before).  Counted just after the
	 * marks commit. */
	deadline = tl_ms() + 10000;
	do {
		ck_assert_int_eq(tl_http_get(port, "/metrics", body,
		    sizeof(body)), 200);
		oversized = tl_metric(body, "outboxd_messages_failed_total"
		    "{reason=\"oversized\"}");
		bad_row = tl_metric(body, "outboxd_messages_failed_total"
		    "{reason=\"bad_row\"}");
	} while ((oversized != 2 || bad_row != 3) && tl_ms() < deadline &&
	    usleep(50 * 1000) == 0);
	ck_assert_double_eq(oversized, 2);
	ck_assert_double_eq(bad_row, 3);
	fprintf(stderr, "badrows: all at once: %lld duplicates among the "
	    "good rows\n", assert_good_delivered());
	assert_still_serving(pid);
	tl_exchange_delete(a, ex);
	tl_amqp_close(a);
}
END_TEST

/* --- odd values in good rows -------------------------------------------- */

/* outboxd status with BASE_YAML: its exit status, its output in out. */
static int
status(char *out, size_t size)
{
	char cfg[512], err[1024];
	int rc;

	tl_config_write(cfg, sizeof(cfg), BASE_YAML);
	rc = tl_outboxd_cli(out, size, err, sizeof(err), cfg, "status", NULL);
	if (rc != 0)
		fprintf(stderr, "badrows: outboxd status: %s", err);
	return rc;
}

/*
 * 'infinity' and '-infinity' are valid timestamps.  As create_time they
 * failed every claim ("cannot convert infinity to bigint"), the row
 * being the oldest due one, and '-infinity' with no schedule failed the
 * counts ("cannot subtract infinite timestamps").  They are plain rows,
 * delivered once; the counts go on.
 */
START_TEST(test_infinite_create_time)
{
	char out[1024];
	long long dups;
	pid_t pid;

	good_rows(GOOD_PER_SIDE);
	tl_sql(db, "WITH m AS (INSERT INTO t_transactional_message "
	    "(queue_name, business_module, business_key, create_time, "
	    "next_schedule_time) VALUES "
	    "('" GOOD "', 'good', 'created-infinity', 'infinity', now()), "
	    "('" GOOD "', 'good', 'created-minus-infinity', '-infinity', NULL)"
	    " RETURNING id) INSERT INTO t_transactional_message_content "
	    "(message_id, content) SELECT id, 'x' FROM m");
	good_rows(GOOD_PER_SIDE);
	ck_assert_int_eq(status(out, sizeof(out)), 0);
	ck_assert_msg(strstr(out, "due now:          22\n") != NULL, "%s",
	    out);
	pid = tl_outboxd_start(BASE_YAML);
	assert_row("created-infinity", 1, 0, NULL);
	assert_row("created-minus-infinity", 1, 0, NULL);
	dups = assert_good_delivered();
	ck_assert_msg(dups == 0, "%lld rows sent twice", dups);
	ck_assert_int_eq(status(out, sizeof(out)), 0);
	assert_still_serving(pid);
}
END_TEST

/* The NOT NULLs test_null_numbers drops and the types
 * test_narrow_id_and_factor changes, back (with the rows gone): also
 * the "values" case's unchecked teardown, for a failed test. */
static void
restore_columns(void)
{
	PGconn *c = tl_pg();

	tl_reset_db(c);
	tl_sql(c, "ALTER TABLE t_transactional_message"
	    " ALTER id TYPE bigint,"
	    " ALTER current_retry_times TYPE smallint,"
	    " ALTER max_retry_times TYPE smallint,"
	    " ALTER backoff_factor TYPE double precision,"
	    " ALTER init_backoff SET NOT NULL,"
	    " ALTER backoff_factor SET NOT NULL,"
	    " ALTER create_time SET NOT NULL");
	PQfinish(c);
}

/*
 * A table whose NOT NULLs were dropped (the schema check looks at
 * columns and types only): a NULL init_backoff, backoff_factor or
 * create_time is the column's default (10 s, 2, now).  They were read
 * as 8 bytes of whatever followed libpq's empty string.
 */
START_TEST(test_null_numbers)
{
	char sql[1024], err[1024];
	long long id;
	pid_t pid;

	tl_sql(db, "ALTER TABLE t_transactional_message"
	    " ALTER init_backoff DROP NOT NULL,"
	    " ALTER backoff_factor DROP NOT NULL,"
	    " ALTER create_time DROP NOT NULL");
	snprintf(sql, sizeof(sql),
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    " business_key => 'null-init');"
	    "SELECT outbox_enqueue('badrows.none.%s', 'k', 'x', "
	    " business_key => 'null-factor', init_backoff => '1s');"
	    "SELECT outbox_enqueue('', '" GOOD "', 'x', "
	    " business_key => 'null-created');"
	    "UPDATE t_transactional_message SET init_backoff = NULL"
	    " WHERE business_key = 'null-init';"
	    "UPDATE t_transactional_message SET backoff_factor = NULL"
	    " WHERE business_key IN ('null-init', 'null-factor');"
	    "UPDATE t_transactional_message SET create_time = NULL"
	    " WHERE business_key = 'null-created'", uniq, uniq);
	pid = start_with(BASE_YAML, sql);
	id = tl_sql_int(db, "SELECT id FROM t_transactional_message"
	    " WHERE business_key = 'null-created'");
	assert_row("null-init", 2, 1, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("null-init"), 10000);
	/* The row's own 1 s, grown by the default factor of 2. */
	assert_row("null-factor", 2, 2, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("null-factor"), 2000);
	ck_assert_msg(strstr(last_error("null-init", err, sizeof(err)),
	    "ignored") == NULL, "null-init: %s", err);
	ck_assert_msg(strstr(last_error("null-factor", err, sizeof(err)),
	    "ignored") == NULL, "null-factor: %s", err);
	assert_row("null-created", 1, 0, NULL);
	assert_good_delivered();
	ck_assert_int_eq(times_received(id), 1);
	assert_still_serving(pid);
	restore_columns();
}
END_TEST

/*
 * Wider columns in an older table: bigint retry counts, with values that
 * do not fit int4 ("retry for ever").  Their casts in the claim failed
 * ("integer out of range"), and with them every claim: nothing was sent
 * at all.  They are clamped now; the row fails on its own (an unknown
 * exchange) and is retried on its backoff.
 */
START_TEST(test_wide_retry_counts)
{
	char sql[512];
	pid_t pid;

	tl_sql(db, "ALTER TABLE t_transactional_message"
	    " ALTER current_retry_times TYPE bigint,"
	    " ALTER max_retry_times TYPE bigint");
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue("
	    "'badrows.none.%s', 'k', 'x', business_key => 'wide', "
	    "init_backoff => '1s'); UPDATE t_transactional_message SET "
	    "max_retry_times = 3000000000 WHERE business_key = 'wide'", uniq);
	pid = start_with(BASE_YAML, sql);
	assert_row("wide", 2, 1, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("wide"), 1000);
	assert_good_delivered();
	assert_still_serving(pid);
	restore_columns();
}
END_TEST

/*
 * A negative current_retry_times (set by hand, or by another tool): the
 * claim reads it as 0, but the mark counted on from the negative value,
 * so the row had that many attempts more than max_retry_times (32,773
 * for -32768).  The mark counts from 0 too: the first failure is 1.
 */
START_TEST(test_negative_retry_count)
{
	char sql[512];
	pid_t pid;

	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue("
	    "'badrows.none.%s', 'k', 'x', business_key => 'negative', "
	    "init_backoff => '1 hour'); UPDATE t_transactional_message SET "
	    "current_retry_times = -5 WHERE business_key = 'negative'", uniq);
	pid = start_with(BASE_YAML, sql);
	assert_row("negative", 2, 1, "NOT_FOUND");
	assert_good_delivered();
	assert_still_serving(pid);
}
END_TEST

/*
 * A table from before outboxd, kept by migration 001's IF NOT EXISTS,
 * with an integer id and a real backoff_factor (the schema check does
 * not look at their types).  Both were read as 8 bytes: every row was
 * published under a wrong message_id and never marked, so it was sent
 * again at every cycle, and the factor was nonsense, so the global
 * backoff was used instead of the row's.
 */
START_TEST(test_narrow_id_and_factor)
{
	char sql[512];
	long long dups;
	pid_t pid;

	tl_sql(db, "ALTER TABLE t_transactional_message"
	    " ALTER id TYPE integer, ALTER backoff_factor TYPE real");
	snprintf(sql, sizeof(sql), "SELECT outbox_enqueue("
	    "'badrows.none.%s', 'k', 'x', business_key => 'factor-3', "
	    "init_backoff => '1s', backoff_factor => 3)", uniq);
	pid = start_with(BASE_YAML, sql);
	assert_row("factor-3", 2, 1, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("factor-3"), 1000);
	assert_row("factor-3", 2, 2, "NOT_FOUND");
	ck_assert_int_eq(scheduled_delay_ms("factor-3"), 3000);
	dups = assert_good_delivered();
	ck_assert_msg(dups == 0, "%lld rows sent twice", dups);
	assert_still_serving(pid);
	restore_columns();
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("badrows");
	TCase *tc = tcase_create("badrows");
	SRunner *sr;
	int failed;

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_no_content_row);
	tcase_add_test(tc, test_unpublished_batch_times_no_confirm);
	tcase_add_test(tc, test_empty_routing);
	tcase_add_test(tc, test_payload_over_broker_limit);
	tcase_add_test(tc, test_payload_over_max_payload);
	tcase_add_test(tc, test_huge_payload_left_in_the_database);
	tcase_add_test(tc, test_batch_ends_at_its_bytes);
	tcase_add_test(tc, test_unknown_exchange);
	tcase_add_test(tc, test_wrong_exchange_type);
	tcase_add_test(tc, test_unusable_row_backoff);
	tcase_add_test(tc, test_max_retry_times_zero);
	tcase_add_test(tc, test_null_next_schedule_time);
	tcase_add_test(tc, test_headers_not_an_object);
	tcase_add_test(tc, test_routing_headers_refused);
	tcase_add_test(tc, test_non_utf8_content);
	tcase_add_test(tc, test_row_with_no_utf8_form);
	tcase_add_test(tc, test_many_rows_with_no_utf8_form);
	tcase_add_test(tc, test_broker_text_cut_mid_character);
	tcase_add_test(tc, test_unknown_exchange_type);
	tcase_add_test(tc, test_message_that_breaks_connections);
	tcase_add_test(tc, test_mark_refused_for_one_row);
	tcase_add_test(tc, test_refused_row_found_by_halving);
	tcase_add_test(tc, test_mark_refused_at_commit);
	tcase_add_test(tc, test_refused_marks_paced_once_per_batch);
	tcase_add_test(tc, test_pipelined_batch_resent_after_a_slow_mark);
	tcase_add_test(tc, test_every_mark_refused_for_one_row);
	tcase_add_test(tc, test_refused_row_holds_back_no_backlog);
	tcase_add_test(tc, test_mark_on_a_read_only_session);
	tcase_add_test(tc, test_every_row_refused_is_paced);
	tcase_add_test(tc, test_retry_counted_from_the_mark);
	tcase_add_test(tc, test_all_bad_rows_at_once);
	suite_add_tcase(s, tc);
	/* Good rows with values that once stopped outboxd:
	 * CK_RUN_CASE=values. */
	tc = tcase_create("values");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 300);
	tcase_add_unchecked_fixture(tc, NULL, restore_columns);
	tcase_add_test(tc, test_infinite_create_time);
	tcase_add_test(tc, test_null_numbers);
	tcase_add_test(tc, test_narrow_id_and_factor);
	tcase_add_test(tc, test_wide_retry_counts);
	tcase_add_test(tc, test_negative_retry_count);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
