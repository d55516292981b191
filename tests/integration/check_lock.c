/*
 * The Redis leader lock against real servers: the shared Redis that
 * tests/servers.sh started, and private ones (unix socket, passwords, a
 * hung server) that this suite starts and stops itself.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "lock.h"
#include "log.h"
#include "testlib.h"
#include "util.h"

/* Short timings keep the suite fast; the module scales them all. */
#define TTL_MS 900
#define CONNECT_TIMEOUT_MS 500
/* What a tick or a wake-up may take beyond its budget on a busy box. */
#define SLACK_MS 300
/* Reconnects back off up to 10 s (±20 %). */
#define RECONNECT_WAIT_MS 15000

#define RIGHT_PASSWORD "Right-Pass-7c1f"
#define WRONG_PASSWORD "Wrong-Pass-93ab"
#define ACL_USER "outboxd-lock"

static char key[128];		/* a fresh key per test */

/* --- helpers ------------------------------------------------------------ */

static void
nap_ms(int64_t ms)
{
	struct timespec ts = { (time_t)(ms / 1000),
	    (long)(ms % 1000) * 1000000 };

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

static int
redis_port(void)
{
	return atoi(tl_env("OUTBOXD_REDIS_PORT"));
}

static redisContext *
admin_check(redisContext *c, const char *where)
{
	ck_assert_msg(c != NULL && c->err == 0, "admin connection to %s: %s",
	    where, c != NULL ? c->errstr : "out of memory");
	return c;
}

/* A plain hiredis connection, independent of the module under test. */
static redisContext *
admin_tcp(void)
{
	return admin_check(redisConnect("127.0.0.1", redis_port()),
	    "shared redis");
}

static redisReply *
admin_vcmd(redisContext *c, const char *fmt, va_list ap)
{
	redisReply *r = redisvCommand(c, fmt, ap);

	ck_assert_msg(r != NULL, "redis: %s (%s)", c->errstr, fmt);
	ck_assert_msg(r->type != REDIS_REPLY_ERROR, "redis: %s (%s)", r->str,
	    fmt);
	return r;
}

static void admin_ok(redisContext *, const char *, ...)
    __attribute__((format(printf, 2, 3)));
static long long admin_int(redisContext *, const char *, ...)
    __attribute__((format(printf, 2, 3)));
static char *admin_str(redisContext *, char *, size_t, const char *, ...)
    __attribute__((format(printf, 4, 5)));

static void
admin_ok(redisContext *c, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	freeReplyObject(admin_vcmd(c, fmt, ap));
	va_end(ap);
}

static long long
admin_int(redisContext *c, const char *fmt, ...)
{
	redisReply *r;
	long long v;
	va_list ap;

	va_start(ap, fmt);
	r = admin_vcmd(c, fmt, ap);
	va_end(ap);
	ck_assert_int_eq(r->type, REDIS_REPLY_INTEGER);
	v = r->integer;
	freeReplyObject(r);
	return v;
}

/* A string or status reply into buf; "" for nil. */
static char *
admin_str(redisContext *c, char *buf, size_t size, const char *fmt, ...)
{
	redisReply *r;
	va_list ap;

	va_start(ap, fmt);
	r = admin_vcmd(c, fmt, ap);
	va_end(ap);
	ck_assert(r->type == REDIS_REPLY_STRING ||
	    r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_NIL);
	snprintf(buf, size, "%s", r->type == REDIS_REPLY_NIL ? "" : r->str);
	freeReplyObject(r);
	return buf;
}

/* Calls of one command since the server started, from INFO. */
static long long
command_calls(redisContext *c, const char *name)
{
	char info[16384], field[64];
	const char *p;

	admin_str(c, info, sizeof(info), "INFO commandstats");
	snprintf(field, sizeof(field), "cmdstat_%s:calls=", name);
	p = strstr(info, field);
	return p != NULL ? atoll(p + strlen(field)) : 0;
}

static void
conf_init(struct lock_conf *c, char *host, int port)
{
	memset(c, 0, sizeof(*c));
	c->enabled = true;
	c->host = host;
	c->port = port;
	c->key = key;
	c->ttl_ms = TTL_MS;
	c->connect_timeout_ms = CONNECT_TIMEOUT_MS;
}

static struct lock *
lock_shared(void)
{
	struct lock_conf c;

	conf_init(&c, "127.0.0.1", redis_port());
	return lock_new(&c);
}

/* Sleeps until the lock has work, but never long, so polls stay fine. */
static void
nap_for(const struct lock *l)
{
	int64_t ms = lock_next_tick_ms(l);

	nap_ms(ms < 1 ? 1 : ms > 10 ? 10 : ms);
}

/* Polls lock_tick until it returns want; false if timeout_ms passed. */
static bool
tick_until(struct lock *l, enum lock_state want, int64_t timeout_ms)
{
	int64_t end = now_mono_ms() + timeout_ms;

	for (;;) {
		if (lock_tick(l) == want)
			return true;
		if (now_mono_ms() >= end)
			return false;
		nap_for(l);
	}
}

static bool
is_token(const char *s)
{
	return strlen(s) == 32 && strspn(s, "0123456789abcdef") == 32;
}

static void
report(const char *what, int64_t ms)
{
	printf("timing: %s: %" PRId64 " ms\n", what, ms);
	fflush(stdout);
}

static void
setup(void)
{
	snprintf(key, sizeof(key), "outboxd:test:lock:%d:%" PRId64,
	    (int)getpid(), now_mono_us());
}

static void
teardown(void)
{
	redisContext *c = redisConnect("127.0.0.1", redis_port());

	/* Best effort: a failed test may have left its key behind. */
	if (c != NULL && c->err == 0)
		freeReplyObject(redisCommand(c, "DEL %s", key));
	redisFree(c);
}

/* --- the shared Redis ---------------------------------------------------- */

START_TEST(test_exactly_one_of_four_holds)
{
	redisContext *c = admin_tcp();
	struct lock *l[4];
	int holder = -1, n;
	int64_t end;
	char val[64];

	for (size_t i = 0; i < ARRAY_LEN(l); i++)
		l[i] = lock_shared();
	/* Over two ttls, every round has exactly one holder, always the
	 * same, and the key carries its token. */
	end = now_mono_ms() + 2 * TTL_MS;
	while (now_mono_ms() < end) {
		n = 0;
		for (size_t i = 0; i < ARRAY_LEN(l); i++) {
			enum lock_state st = lock_tick(l[i]);

			ck_assert(st == LOCK_HELD || st == LOCK_NOT_HELD);
			if (st != LOCK_HELD) {
				ck_assert(!lock_held(l[i]));
				ck_assert_str_eq(lock_token(l[i]), "");
				continue;
			}
			ck_assert(lock_held(l[i]));
			if (holder < 0)
				holder = (int)i;
			ck_assert_int_eq(holder, (int)i);
			n++;
		}
		ck_assert_int_eq(n, 1);
		ck_assert(is_token(lock_token(l[holder])));
		ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
		    lock_token(l[holder]));
		nap_ms(5);
	}
	for (size_t i = 0; i < ARRAY_LEN(l); i++) {
		ck_assert_int_eq(lock_lost_count(l[i]), 0);
		ck_assert_str_eq(lock_error(l[i]), "");
		lock_free(l[i]);
	}
	redisFree(c);
}
END_TEST

START_TEST(test_holder_renews_across_ttls)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared(), *b = lock_shared();
	char token[40], val[64];
	long long pttl, prev = TTL_MS;
	int64_t t0, end, next, rise_at = 0, sum = 0;
	int rises = 0;

	t0 = now_mono_ms();
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	/* Read at once, before anything else takes time: just acquired,
	 * the next work is the renewal, ttl/3 away. */
	next = lock_next_tick_ms(a);
	pttl = admin_int(c, "PTTL %s", key);
	report("acquire (connect + SET)", now_mono_ms() - t0);
	ck_assert_msg(next > TTL_MS / 3 - SLACK_MS / 3 && next <= TTL_MS / 3,
	    "next tick in %" PRId64 " ms", next);
	ck_assert_msg(pttl > TTL_MS - SLACK_MS / 3 && pttl <= TTL_MS,
	    "pttl %lld", pttl);
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	snprintf(token, sizeof(token), "%s", lock_token(a));

	/* Four ttls: without renewals the key would be long gone. */
	end = now_mono_ms() + 4 * TTL_MS;
	while (now_mono_ms() < end) {
		ck_assert_int_eq(lock_tick(a), LOCK_HELD);
		ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
		pttl = admin_int(c, "PTTL %s", key);
		ck_assert_msg(pttl > 0, "key expired (pttl %lld)", pttl);
		if (pttl > prev + 100) {
			if (rise_at != 0)
				sum += now_mono_ms() - rise_at;
			rise_at = now_mono_ms();
			rises++;
		}
		prev = pttl;
		ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
		    token);
		nap_ms(5);
	}
	/* Renewing every ttl/3 gives about 12 in four ttls. */
	ck_assert_msg(rises >= 9, "only %d renewals seen", rises);
	report("renewal interval (mean, ttl 900)", sum / (rises - 1));
	ck_assert_str_eq(lock_token(a), token);
	ck_assert_int_eq(lock_lost_count(a), 0);
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

START_TEST(test_release_lets_other_acquire)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared(), *b = lock_shared();
	char val[64];
	int64_t t0;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	lock_release(a);
	ck_assert(!lock_held(a));
	ck_assert_str_eq(lock_token(a), "");
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	ck_assert_int_eq(lock_lost_count(a), 0);
	/* b looks again within ttl/3. */
	t0 = now_mono_ms();
	ck_assert(tick_until(b, LOCK_HELD, TTL_MS));
	report("takeover after release", now_mono_ms() - t0);
	ck_assert_int_le(now_mono_ms() - t0, TTL_MS / 3 + SLACK_MS);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(b));
	/* Released twice is harmless and deletes nothing of b's. */
	lock_release(a);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(b));
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

START_TEST(test_deleted_key_is_noticed_then_reacquired)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared();
	char old[40], val[64];
	enum lock_state st = LOCK_HELD;
	int64_t t0, end;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	snprintf(old, sizeof(old), "%s", lock_token(a));
	admin_ok(c, "DEL %s", key);
	t0 = now_mono_ms();
	end = t0 + TTL_MS;
	while (lock_lost_count(a) == 0 && now_mono_ms() < end) {
		st = lock_tick(a);
		nap_for(a);
	}
	ck_assert_int_eq(lock_lost_count(a), 1);
	/* The tick that finds out says so, before competing again. */
	ck_assert_int_eq(st, LOCK_NOT_HELD);
	ck_assert(!lock_held(a));
	report("loss noticed after DEL", now_mono_ms() - t0);
	ck_assert_int_le(now_mono_ms() - t0, TTL_MS / 3 + SLACK_MS);
	ck_assert_int_eq(lock_next_tick_ms(a), 0);
	ck_assert(tick_until(a, LOCK_HELD, TTL_MS));
	ck_assert(is_token(lock_token(a)));
	ck_assert_str_ne(lock_token(a), old);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(a));
	ck_assert_int_eq(lock_lost_count(a), 1);
	lock_free(a);
	redisFree(c);
}
END_TEST

START_TEST(test_overwritten_key_is_lost_and_kept)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared();
	char val[64];
	int64_t end;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	admin_ok(c, "SET %s intruder PX 60000", key);
	end = now_mono_ms() + TTL_MS;
	while (lock_lost_count(a) == 0 && now_mono_ms() < end) {
		(void)lock_tick(a);
		nap_for(a);
	}
	ck_assert_int_eq(lock_lost_count(a), 1);
	ck_assert(!lock_held(a));
	/* The intruder's key stays: a cannot take it, nor delete it. */
	ck_assert(!tick_until(a, LOCK_HELD, TTL_MS));
	lock_release(a);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    "intruder");
	ck_assert_int_eq(lock_lost_count(a), 1);
	lock_free(a);
	redisFree(c);
}
END_TEST

START_TEST(test_release_compares_token)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared();
	char val[64];

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	/* Overwritten before a's renewal came due: only the release can
	 * find out, and it must not delete the other key. */
	admin_ok(c, "SET %s intruder PX 60000", key);
	ck_assert(lock_held(a));
	lock_release(a);
	ck_assert(!lock_held(a));
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    "intruder");
	ck_assert_int_eq(lock_lost_count(a), 1);
	lock_free(a);
	redisFree(c);
}
END_TEST

START_TEST(test_stalled_holder_loses_it)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared(), *b = lock_shared();
	char val[64];
	int64_t before, acquired, took;

	before = now_mono_ms();
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	acquired = now_mono_ms();
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	/* a stalls: nobody ticks it. b gets the key once it expires. */
	ck_assert(tick_until(b, LOCK_HELD, 3 * TTL_MS));
	took = now_mono_ms() - acquired;
	report("takeover from a stalled holder (ttl 900)", took);
	/* The key was set after `before`: it cannot have expired sooner
	 * than a ttl from then (a few ms for the two clocks). */
	ck_assert_int_ge(acquired + took - before, TTL_MS - 5);
	ck_assert_int_le(took, TTL_MS + TTL_MS / 3 + SLACK_MS);
	/* a no longer claims it, even before its next tick... */
	ck_assert(!lock_held(a));
	/* ...which reports the loss and leaves b's key alone. */
	ck_assert_int_eq(lock_tick(a), LOCK_NOT_HELD);
	ck_assert_int_eq(lock_lost_count(a), 1);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(b));
	ck_assert(lock_held(b));
	ck_assert_int_eq(lock_tick(a), LOCK_NOT_HELD);
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

/*
 * A stall longer than our view of the key (2/3 ttl) but shorter than
 * the key itself: nobody can have taken it, so the holder renews it and
 * keeps leading.  Before, the stall alone deleted the key and took it
 * back with a new token, and leadership flapped.
 */
START_TEST(test_short_stall_renews_late)
{
	enum { LONG_TTL_MS = 3000 };
	redisContext *c = admin_tcp();
	struct lock_conf conf;
	struct lock *a;
	char token[64], val[64];
	int64_t acquired;

	conf_init(&conf, "127.0.0.1", redis_port());
	conf.ttl_ms = LONG_TTL_MS;
	a = lock_new(&conf);
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	acquired = now_mono_ms();
	snprintf(token, sizeof(token), "%s", lock_token(a));
	/* Past the validity (2000 ms), well before the key's end. */
	nap_ms(LONG_TTL_MS * 2 / 3 + 250);
	ck_assert(!lock_held(a));
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_lt(now_mono_ms() - acquired, LONG_TTL_MS);
	ck_assert(lock_held(a));
	ck_assert_int_eq(lock_lost_count(a), 0);
	ck_assert_str_eq(lock_token(a), token);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key), token);
	/* Renewed for a whole ttl from now. */
	ck_assert_int_gt(admin_int(c, "PTTL %s", key), LONG_TTL_MS - 500);
	lock_free(a);
	redisFree(c);
}
END_TEST

START_TEST(test_cheap_when_nothing_due)
{
	redisContext *c = admin_tcp();
	struct lock *a = lock_shared();
	long long sets, evals;
	int64_t t0, next, us;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	sets = command_calls(c, "set");
	evals = command_calls(c, "eval");
	next = lock_next_tick_ms(a);
	t0 = now_mono_ms();
	us = now_mono_us();
	for (int i = 0; i < 10000; i++)
		ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	us = now_mono_us() - us;
	/* The loop must have ended before the renewal came due. */
	ck_assert_int_lt(now_mono_ms() - t0, next);
	ck_assert_int_eq(command_calls(c, "set"), sets);
	ck_assert_int_eq(command_calls(c, "eval"), evals);
	printf("timing: 10000 idle lock_tick calls: %" PRId64 " us\n", us);
	lock_free(a);
	redisFree(c);
}
END_TEST

START_TEST(test_database_is_selected)
{
	redisContext *c = admin_tcp();
	struct lock_conf conf;
	struct lock *a;
	char val[64];

	conf_init(&conf, "127.0.0.1", redis_port());
	conf.database = 3;
	a = lock_new(&conf);
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	admin_ok(c, "SELECT 3");
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(a));
	lock_release(a);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	lock_free(a);
	redisFree(c);
}
END_TEST

static void
ignore_signal(int sig)
{
	(void)sig;
}

static void *
signal_later(void *target)
{
	nap_ms(300);
	(void)pthread_kill(*(pthread_t *)target, SIGHUP);
	return NULL;
}

/*
 * A reload's SIGHUP while the connect waits for the TCP handshake.  A
 * listener whose accept queue is full drops the SYN, so the handshake
 * waits.  hiredis 0.14 took the EINTR for a
 * failed connect: "poll(2): Interrupted system call" at 300 ms.  Now the
 * connect runs its course (its timeout here, 1.5 s) and the signal is
 * handled after it.  (A stop signal still cuts it short.)
 */
START_TEST(test_signal_does_not_cut_the_connect)
{
	struct sockaddr_in addr = { .sin_family = AF_INET,
		.sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(addr);
	struct sigaction quiet = { .sa_handler = ignore_signal }, old;
	int listener = socket(AF_INET, SOCK_STREAM, 0), fillers[2];
	pthread_t self = pthread_self(), signaller;
	struct lock_conf conf;
	struct lock *l;
	int64_t started, took;

	ck_assert_int_ge(listener, 0);
	ck_assert_int_eq(bind(listener, (struct sockaddr *)&addr,
	    sizeof(addr)), 0);
	ck_assert_int_eq(listen(listener, 0), 0);
	ck_assert_int_eq(getsockname(listener, (struct sockaddr *)&addr,
	    &len), 0);
	/* The first fills the queue, the second's SYN is dropped too. */
	for (int i = 0; i < 2; i++) {
		fillers[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
		ck_assert_int_ge(fillers[i], 0);
		(void)connect(fillers[i], (struct sockaddr *)&addr,
		    sizeof(addr));
	}
	nap_ms(50);
	conf_init(&conf, "127.0.0.1", ntohs(addr.sin_port));
	conf.connect_timeout_ms = 1500;
	l = lock_new(&conf);
	/* No SA_RESTART, as in the daemon: poll() returns EINTR. */
	ck_assert_int_eq(sigaction(SIGHUP, &quiet, &old), 0);
	ck_assert_int_eq(pthread_create(&signaller, NULL, signal_later,
	    &self), 0);
	started = now_mono_ms();
	ck_assert_int_eq(lock_tick(l), LOCK_UNAVAILABLE);
	took = now_mono_ms() - started;
	ck_assert_int_eq(pthread_join(signaller, NULL), 0);
	fprintf(stderr, "lock: connect with a signal in it gave up after "
	    "%lld ms: %s\n", (long long)took, lock_error(l));
	ck_assert_msg(strstr(lock_error(l), "Interrupted") == NULL, "%s",
	    lock_error(l));
	ck_assert_int_ge(took, 1400);
	ck_assert_int_eq(sigaction(SIGHUP, &old, NULL), 0);
	lock_free(l);
	for (int i = 0; i < 2; i++)
		close(fillers[i]);
	close(listener);
}
END_TEST

START_TEST(test_disabled_is_always_held)
{
	redisContext *c = admin_tcp();
	struct lock_conf conf;
	struct lock *l;

	conf_init(&conf, "127.0.0.1", redis_port());
	conf.enabled = false;
	l = lock_new(&conf);
	for (int i = 0; i < 5; i++) {
		ck_assert_int_eq(lock_tick(l), LOCK_HELD);
		ck_assert(lock_held(l));
		ck_assert_int_eq(lock_next_tick_ms(l), INT64_MAX);
	}
	lock_release(l);
	ck_assert_int_eq(lock_tick(l), LOCK_HELD);
	ck_assert_str_eq(lock_error(l), "");
	ck_assert_int_eq(lock_lost_count(l), 0);
	/* It never went to Redis. */
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	lock_free(l);
	lock_free(NULL);
	lock_release(NULL);
	redisFree(c);
}
END_TEST

/* --- the shared Redis stops and comes back ------------------------------ */

static void
restart_shared_redis(void)
{
	char line[1024];
	const char *src = getenv("OUTBOXD_SRCDIR");
	const char *dir = getenv("OUTBOXD_SERVERS_DIR");

	/* Whatever the test did, leave the shared Redis running. */
	if (dir == NULL)
		return;
	snprintf(line, sizeof(line), "'%s/tests/servers.sh' start '%s' redis "
	    ">/dev/null 2>&1", src != NULL ? src : ".", dir);
	if (system(line) != 0)
		fprintf(stderr, "check_lock: could not restart redis\n");
}

/* Ticks a and b until both report st; fails if any tick took longer
 * than its budget.  Returns the longest tick. */
static int64_t
tick_both_until(struct lock *a, struct lock *b, enum lock_state st,
    int64_t timeout_ms, bool either)
{
	int64_t end = now_mono_ms() + timeout_ms, longest = 0, t, d;
	enum lock_state sa, sb;

	for (;;) {
		t = now_mono_ms();
		sa = lock_tick(a);
		d = now_mono_ms() - t;
		longest = d > longest ? d : longest;
		t = now_mono_ms();
		sb = lock_tick(b);
		d = now_mono_ms() - t;
		longest = d > longest ? d : longest;
		ck_assert_msg(longest <= CONNECT_TIMEOUT_MS + SLACK_MS,
		    "lock_tick blocked %" PRId64 " ms", longest);
		if (either ? (sa == st || sb == st) : (sa == st && sb == st))
			return longest;
		ck_assert_msg(now_mono_ms() < end, "no state %d in %" PRId64
		    " ms: a %d (%s), b %d (%s)", st, timeout_ms, sa,
		    lock_error(a), sb, lock_error(b));
		nap_ms(5);
	}
}

START_TEST(test_redis_down_and_back)
{
	struct lock *a = lock_shared(), *b = lock_shared();
	redisContext *c;
	int64_t t0, longest;
	char val[64];

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	ck_assert(lock_redis_up(a) && lock_redis_up(b));
	tl_servers("stop", "redis");
	t0 = now_mono_ms();
	/* a's renewal fails at ttl/3, a third of the ttl before its
	 * validity runs out: the connection reads as down from then on,
	 * while a still holds (the daemon's connection_up gauge; before,
	 * it said up until the validity ran out). */
	while (lock_redis_up(a)) {
		ck_assert_int_eq(lock_tick(a), LOCK_HELD);
		ck_assert_msg(now_mono_ms() < t0 + TTL_MS, "a never found "
		    "redis down");
		nap_ms(5);
	}
	ck_assert(lock_held(a));
	/* b finds out at its next look (ttl/3), a at the latest when its
	 * validity (2/3 ttl) runs out. */
	longest = tick_both_until(a, b, LOCK_UNAVAILABLE, 2 * TTL_MS, false);
	report("both unavailable after redis stop", now_mono_ms() - t0);
	report("longest lock_tick while redis down", longest);
	ck_assert_int_le(now_mono_ms() - t0, TTL_MS + SLACK_MS);
	ck_assert(!lock_held(a));
	ck_assert_int_eq(lock_lost_count(a), 1);
	ck_assert_int_eq(lock_lost_count(b), 0);
	ck_assert_msg(strstr(lock_error(a), "127.0.0.1") != NULL, "error: %s",
	    lock_error(a));
	ck_assert_msg(strstr(lock_error(b), "127.0.0.1") != NULL, "error: %s",
	    lock_error(b));
	/* Paced reconnects: nothing to do right away. */
	ck_assert_int_gt(lock_next_tick_ms(a), 0);

	tl_servers("start", "redis");
	t0 = now_mono_ms();
	(void)tick_both_until(a, b, LOCK_HELD, RECONNECT_WAIT_MS, true);
	report("reacquired after redis start", now_mono_ms() - t0);
	ck_assert(lock_held(a) != lock_held(b));
	ck_assert_str_eq(lock_error(lock_held(a) ? a : b), "");
	ck_assert(lock_redis_up(lock_held(a) ? a : b));
	c = admin_tcp();
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(lock_held(a) ? a : b));
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

/* --- a private Redis on a unix socket ----------------------------------- */

static struct {
	char dir[96];
	char sock[108];		/* a unix socket's longest path */
	char logfile[128];
	pid_t pid;
	/* As it started: Redis lowers the default to what the file
	 * descriptor limit allows. */
	char maxclients[24];
} priv;

static redisContext *
priv_admin(void)
{
	redisContext *c = admin_check(redisConnectUnix(priv.sock),
	    "private redis");
	redisReply *r = redisCommand(c, "PING");

	/* A test that failed half-way may have left a password set or
	 * the default user restricted: undo both. */
	if (r != NULL && r->type == REDIS_REPLY_ERROR) {
		admin_ok(c, "AUTH %s", RIGHT_PASSWORD);
		admin_ok(c, "CONFIG SET requirepass %s", "");
	}
	if (r != NULL)
		freeReplyObject(r);
	admin_ok(c, "ACL SETUSER default resetkeys ~*");
	/* The tests that lower it, or make it a replica, set it back
	 * themselves. */
	admin_ok(c, "CONFIG SET maxclients %s", priv.maxclients);
	admin_ok(c, "REPLICAOF NO ONE");
	return c;
}

/*
 * In the servers' directory, and in the foreground as a child bound to
 * this process: a suite killed by its timeout leaves no Redis running,
 * nor a directory that `servers.sh stop` does not know.
 */
static void
priv_start(void)
{
	int64_t end;

	ck_assert_int_lt(snprintf(priv.dir, sizeof(priv.dir),
	    "%s/lock-redis.XXXXXX", tl_env("OUTBOXD_SERVERS_DIR")),
	    (int)sizeof(priv.dir) - 12);
	ck_assert_msg(mkdtemp(priv.dir) != NULL, "mkdtemp: %s",
	    strerror(errno));
	snprintf(priv.sock, sizeof(priv.sock), "%s/redis.sock", priv.dir);
	snprintf(priv.logfile, sizeof(priv.logfile), "%s/redis.log",
	    priv.dir);
	priv.pid = tl_fork_bound();
	if (priv.pid == 0) {
		execlp("redis-server", "redis-server", "--port", "0",
		    "--unixsocket", priv.sock, "--unixsocketperm", "700",
		    "--daemonize", "no", "--logfile", priv.logfile,
		    "--dir", priv.dir, "--save", "", "--appendonly", "no",
		    (char *)NULL);
		_exit(127);
	}
	/* Ready when it answers PING. */
	end = now_mono_ms() + 10000;
	for (;;) {
		redisContext *c = redisConnectUnix(priv.sock);
		redisReply *r = NULL;
		bool up;

		if (c != NULL && c->err == 0)
			r = redisCommand(c, "PING");
		up = r != NULL && r->type == REDIS_REPLY_STATUS;
		if (r != NULL)
			freeReplyObject(r);
		redisFree(c);
		if (up)
			break;
		ck_assert_msg(now_mono_ms() < end && waitpid(priv.pid, NULL,
		    WNOHANG) == 0, "private redis not ready; see %s",
		    priv.logfile);
		nap_ms(20);
	}
	{
		redisContext *c = admin_check(redisConnectUnix(priv.sock),
		    "private redis");
		redisReply *r = redisCommand(c, "CONFIG GET maxclients");

		ck_assert_msg(r != NULL && r->type == REDIS_REPLY_ARRAY &&
		    r->elements == 2, "CONFIG GET maxclients: %s", c->errstr);
		snprintf(priv.maxclients, sizeof(priv.maxclients), "%s",
		    r->element[1]->str);
		freeReplyObject(r);
		redisFree(c);
	}
}

static void
priv_stop(void)
{
	int64_t end = now_mono_ms() + 10000;
	pid_t gone = 0;

	if (priv.pid > 0) {
		/* It may have been left stopped by a failed test. */
		kill(priv.pid, SIGCONT);
		kill(priv.pid, SIGTERM);
		while ((gone = waitpid(priv.pid, NULL, WNOHANG)) == 0 &&
		    now_mono_ms() < end)
			nap_ms(20);
		if (gone == 0) {
			kill(priv.pid, SIGKILL);
			(void)waitpid(priv.pid, NULL, 0);
		}
		priv.pid = 0;
	}
	unlink(priv.sock);
	unlink(priv.logfile);
	rmdir(priv.dir);
}

static struct lock *
lock_private(char *username, char *password)
{
	static char host[160];
	struct lock_conf c;

	snprintf(host, sizeof(host), "unix:%s", priv.sock);
	conf_init(&c, host, 0);
	c.username = username;
	c.password = password;
	return lock_new(&c);
}

START_TEST(test_unix_socket)
{
	redisContext *c = priv_admin();
	struct lock *a = lock_private(NULL, NULL);
	struct lock *b = lock_private(NULL, NULL);
	char val[64];

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(a));
	lock_release(a);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

/* An ACL user: AUTH user pass. */
START_TEST(test_acl_user)
{
	redisContext *c = priv_admin();
	struct lock *good, *bad, *anon;
	char val[64];
	const char *err;

	admin_ok(c, "ACL SETUSER %s reset on >%s ~* +@all", ACL_USER,
	    RIGHT_PASSWORD);
	admin_ok(c, "AUTH %s %s", ACL_USER, RIGHT_PASSWORD);
	/* The default user may not touch the lock key: anonymous access
	 * fails, so AUTH is what makes the good lock work. */
	admin_ok(c, "ACL SETUSER default resetkeys ~other:*");
	good = lock_private(ACL_USER, RIGHT_PASSWORD);
	bad = lock_private(ACL_USER, WRONG_PASSWORD);
	anon = lock_private(NULL, NULL);
	ck_assert_int_eq(lock_tick(good), LOCK_HELD);
	ck_assert_int_eq(lock_tick(bad), LOCK_UNAVAILABLE);
	err = lock_error(bad);
	ck_assert_msg(strstr(err, "AUTH") != NULL, "error: %s", err);
	ck_assert_msg(strstr(err, WRONG_PASSWORD) == NULL, "error: %s", err);
	ck_assert_msg(strstr(err, RIGHT_PASSWORD) == NULL, "error: %s", err);
	ck_assert_int_gt(lock_next_tick_ms(bad), 0);
	ck_assert_int_eq(lock_tick(anon), LOCK_UNAVAILABLE);
	ck_assert_msg(strstr(lock_error(anon), "NOPERM") != NULL, "error: %s",
	    lock_error(anon));
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key),
	    lock_token(good));
	lock_release(good);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	/* Back as the default user before deleting ours: Redis drops the
	 * connections of a deleted user. */
	redisFree(c);
	c = priv_admin();
	admin_ok(c, "ACL DELUSER %s", ACL_USER);
	lock_free(good);
	lock_free(bad);
	lock_free(anon);
	redisFree(c);
}
END_TEST

/* requirepass: AUTH pass. */
START_TEST(test_requirepass)
{
	redisContext *c = priv_admin();
	struct lock *good, *bad, *anon;
	const char *err;

	admin_ok(c, "CONFIG SET requirepass %s", RIGHT_PASSWORD);
	good = lock_private(NULL, RIGHT_PASSWORD);
	bad = lock_private(NULL, WRONG_PASSWORD);
	anon = lock_private(NULL, NULL);
	ck_assert_int_eq(lock_tick(good), LOCK_HELD);
	ck_assert_int_eq(lock_tick(bad), LOCK_UNAVAILABLE);
	err = lock_error(bad);
	ck_assert_msg(strstr(err, "AUTH") != NULL, "error: %s", err);
	ck_assert_msg(strstr(err, WRONG_PASSWORD) == NULL, "error: %s", err);
	ck_assert_msg(strstr(err, RIGHT_PASSWORD) == NULL, "error: %s", err);
	ck_assert_int_eq(lock_tick(anon), LOCK_UNAVAILABLE);
	ck_assert_msg(strstr(lock_error(anon), "NOAUTH") != NULL, "error: %s",
	    lock_error(anon));
	/* Refused at once, on the next try too: no connection counted (it
	 * was, and logged "redis connected", at every try). */
	ck_assert_msg(strncmp(lock_error(anon), "PING ", 5) == 0, "error: %s",
	    lock_error(anon));
	ck_assert(lock_held(good));
	lock_release(good);
	/* This connection authenticated before the password was set. */
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	/* The next try of the anonymous lock (after its backoff, which
	 * would outlast the good one's validity) is refused the same way. */
	for (int64_t end = now_mono_ms() + RECONNECT_WAIT_MS;
	    lock_next_tick_ms(anon) > 0; nap_for(anon))
		ck_assert_msg(now_mono_ms() < end, "no second try");
	ck_assert_int_eq(lock_tick(anon), LOCK_UNAVAILABLE);
	ck_assert_uint_eq(lock_reconnects(anon), 0);
	admin_ok(c, "CONFIG SET requirepass %s", "");
	lock_free(good);
	lock_free(bad);
	lock_free(anon);
	redisFree(c);
}
END_TEST

/*
 * A password of asterisks, and an error that holds one (the socket's
 * path here, through a link named with one): the error's masking found
 * each copy again in its own mask, and the tick never ended.
 */
START_TEST(test_password_of_asterisks)
{
	static char stars[] = "*";
	redisContext *c = priv_admin();
	char link[128], host[160];
	struct lock_conf conf;
	struct lock *bad;
	int64_t t0;

	admin_ok(c, "CONFIG SET requirepass %s", RIGHT_PASSWORD);
	snprintf(link, sizeof(link), "%s.*", priv.dir);
	(void)unlink(link);
	ck_assert_int_eq(symlink(priv.dir, link), 0);
	snprintf(host, sizeof(host), "unix:%s/redis.sock", link);
	conf_init(&conf, host, 0);
	conf.password = stars;
	bad = lock_new(&conf);
	t0 = now_mono_ms();
	ck_assert_int_eq(lock_tick(bad), LOCK_UNAVAILABLE);
	ck_assert_int_lt(now_mono_ms() - t0, CONNECT_TIMEOUT_MS + SLACK_MS);
	ck_assert_msg(strstr(lock_error(bad), "WRONGPASS") != NULL &&
	    strstr(lock_error(bad), ".*/redis.sock") != NULL, "error: %s",
	    lock_error(bad));
	lock_free(bad);
	(void)unlink(link);
	admin_ok(c, "CONFIG SET requirepass %s", "");
	redisFree(c);
}
END_TEST

/* A Redis that accepts connections but never answers (SIGSTOP). */
START_TEST(test_hung_redis_never_blocks)
{
	struct lock *a = lock_private(NULL, NULL);
	int64_t t0, t, d, longest = 0;
	enum lock_state st;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(kill(priv.pid, SIGSTOP), 0);
	t0 = now_mono_ms();
	do {
		t = now_mono_ms();
		st = lock_tick(a);
		d = now_mono_ms() - t;
		longest = d > longest ? d : longest;
		ck_assert_msg(d <= CONNECT_TIMEOUT_MS + SLACK_MS,
		    "lock_tick blocked %" PRId64 " ms", d);
		ck_assert_msg(now_mono_ms() - t0 < 5 * TTL_MS,
		    "still %d: %s", st, lock_error(a));
		nap_for(a);
	} while (st != LOCK_UNAVAILABLE);
	report("unavailable after redis hung", now_mono_ms() - t0);
	report("longest lock_tick while redis hung", longest);
	ck_assert_int_eq(lock_lost_count(a), 1);
	ck_assert(!lock_held(a));
	ck_assert_msg(strstr(lock_error(a), "timed out") != NULL, "error: %s",
	    lock_error(a));
	ck_assert_int_eq(kill(priv.pid, SIGCONT), 0);
	ck_assert(tick_until(a, LOCK_HELD, RECONNECT_WAIT_MS));
	lock_free(a);
}
END_TEST

enum { LONG_TTL_MS = 3000 };

/* A lock on the private Redis with a 3 s ttl, reconnecting every
 * 100 ms, held. */
static struct lock *
long_ttl_lock_held(void)
{
	static char host[160];
	struct backoff_params quick;
	struct lock_conf conf;
	struct lock *a;

	snprintf(host, sizeof(host), "unix:%s", priv.sock);
	conf_init(&conf, host, 0);
	conf.ttl_ms = LONG_TTL_MS;
	a = lock_new(&conf);
	backoff_params_default(&quick);
	quick.init_ms = 100;
	quick.max_ms = 100;
	lock_set_reconnect(a, &quick);
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	return a;
}

/*
 * That lock, lost while Redis hangs (SIGSTOP) past its validity but not
 * past the key's ttl; Redis answers again when this returns.  Its token
 * goes to token.
 */
static struct lock *
lose_while_redis_hangs(char *token, size_t size)
{
	struct lock *a = long_ttl_lock_held();
	int64_t t0;

	snprintf(token, size, "%s", lock_token(a));
	ck_assert_int_eq(kill(priv.pid, SIGSTOP), 0);
	t0 = now_mono_ms();
	while (lock_tick(a) != LOCK_UNAVAILABLE || lock_lost_count(a) == 0) {
		ck_assert_msg(now_mono_ms() - t0 < LONG_TTL_MS, "not lost: %s",
		    lock_error(a));
		nap_for(a);
	}
	report("lost while redis hung (ttl 3000)", now_mono_ms() - t0);
	ck_assert_int_eq(kill(priv.pid, SIGCONT), 0);
	return a;
}

/*
 * Redis hangs past the holder's validity but not past the key's ttl:
 * the holder reports the loss, and when Redis answers again it finds
 * its own key and renews it.  Before, SET NX failed on that key and no
 * instance led until it expired.
 */
START_TEST(test_key_outliving_an_outage_is_reclaimed)
{
	redisContext *c;
	char token[64], val[64];
	struct lock *a = lose_while_redis_hangs(token, sizeof(token));
	int64_t resumed = now_mono_ms();

	ck_assert(tick_until(a, LOCK_HELD, LONG_TTL_MS));
	report("reclaimed after redis resumed", now_mono_ms() - resumed);
	ck_assert_str_eq(lock_token(a), token);
	ck_assert_int_eq(lock_lost_count(a), 1);
	c = priv_admin();
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key), token);
	redisFree(c);
	lock_free(a);
}
END_TEST

/*
 * The first SET gets no answer in time (Redis stopped), and Redis runs
 * it once it goes on: the key is ours.  It was taken for another
 * instance's, and nobody led until it expired (3 s here); it is now
 * reclaimed at the next try, under the token the SET carried.
 */
START_TEST(test_set_answered_too_late_is_reclaimed)
{
	redisContext *c;
	char val[64] = "";
	struct lock *a = long_ttl_lock_held();
	int64_t resumed, end;

	/* Connected, and the key free again: the next tick is the SET. */
	lock_release(a);
	ck_assert_int_eq(kill(priv.pid, SIGSTOP), 0);
	ck_assert_int_eq(lock_tick(a), LOCK_UNAVAILABLE);
	ck_assert_int_eq(kill(priv.pid, SIGCONT), 0);
	resumed = now_mono_ms();
	/* The SET landed after all. */
	c = priv_admin();
	end = resumed + 5000;
	while (admin_str(c, val, sizeof(val), "GET %s", key)[0] == '\0' &&
	    now_mono_ms() < end)
		nap_ms(10);
	ck_assert_msg(val[0] != '\0', "the late SET never landed");
	ck_assert(tick_until(a, LOCK_HELD, LONG_TTL_MS / 2));
	report("a late SET reclaimed", now_mono_ms() - resumed);
	ck_assert_str_eq(lock_token(a), val);
	redisFree(c);
	lock_free(a);
}
END_TEST

/*
 * The same loss, and the instance stops before it has reclaimed the
 * key: the release deletes the key, which is still ours.  Before, only
 * a lock held was released, and the next leader waited for the rest of
 * the key's ttl.
 */
START_TEST(test_release_after_an_outage_deletes_the_key)
{
	redisContext *c;
	char token[64], val[64];
	struct lock *a = lose_while_redis_hangs(token, sizeof(token));

	c = priv_admin();
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key), token);
	ck_assert(!lock_held(a));
	lock_release(a);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	redisFree(c);
	lock_free(a);
}
END_TEST

/* Closes every client's connection, and takes no new one until
 * maxclients is set back (priv_admin does). */
static void
cut_off_clients(redisContext *c)
{
	admin_ok(c, "CONFIG SET maxclients 1");
	ck_assert_int_ge(admin_int(c, "CLIENT KILL TYPE normal SKIPME yes"),
	    1);
}

/*
 * Redis's `timeout`, a restart or a proxy closes idle connections, and
 * only the next command finds out.  That command is now sent again on a
 * new connection, in the same tick.  Before, every standby said "redis
 * unavailable" at its next look (and fell back to the advisory lock),
 * and the holder lost its connection, and a renewal, each time.
 */
START_TEST(test_idle_connection_closed_is_made_again)
{
	redisContext *c = priv_admin();
	struct lock *a = lock_private(NULL, NULL);
	struct lock *b = lock_private(NULL, NULL);
	enum lock_state st;
	int64_t end;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_int_eq(lock_tick(b), LOCK_NOT_HELD);
	ck_assert_int_ge(admin_int(c, "CLIENT KILL TYPE normal SKIPME yes"),
	    2);
	/* A ttl: each renews or looks again at least twice. */
	for (end = now_mono_ms() + TTL_MS; now_mono_ms() < end; nap_ms(5)) {
		st = lock_tick(b);
		ck_assert_msg(st == LOCK_NOT_HELD, "b: %d: %s", st,
		    lock_error(b));
		st = lock_tick(a);
		ck_assert_msg(st == LOCK_HELD && lock_redis_up(a), "a: %d: %s",
		    st, lock_error(a));
	}
	ck_assert_int_eq(lock_reconnects(a), 1);
	ck_assert_int_eq(lock_reconnects(b), 1);
	ck_assert_int_eq(lock_lost_count(a), 0);
	lock_free(a);
	lock_free(b);
	redisFree(c);
}
END_TEST

/*
 * A release that cannot reach Redis (its connection closed, and no new
 * one taken: maxclients) leaves the key, under our token, for up to a
 * ttl.  The token is kept, and the next acquire reclaims the key.
 * Before, it was forgotten, and the key kept every instance out, this
 * one too, until it expired.
 */
START_TEST(test_failed_release_keeps_the_token)
{
	redisContext *c = priv_admin();
	struct lock *a = lock_private(NULL, NULL);
	char token[64], val[64];

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	snprintf(token, sizeof(token), "%s", lock_token(a));
	cut_off_clients(c);
	lock_release(a);
	ck_assert(!lock_held(a));
	ck_assert_str_eq(admin_str(c, val, sizeof(val), "GET %s", key), token);
	admin_ok(c, "CONFIG SET maxclients %s", priv.maxclients);
	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	ck_assert_str_eq(lock_token(a), token);
	lock_release(a);
	ck_assert_int_eq(admin_int(c, "EXISTS %s", key), 0);
	lock_free(a);
	redisFree(c);
}
END_TEST

/*
 * A renewal fails at once (no connection taken), and the connect of the
 * next try hangs (Redis stopped) past the lock's validity: that tick
 * reports the loss.  Before, it returned LOCK_HELD while lock_held()
 * said false, and the leader led one tick more.
 */
START_TEST(test_connect_past_the_validity_is_a_loss)
{
	redisContext *c = priv_admin();
	struct lock *a = lock_private(NULL, NULL);
	enum lock_state st;
	int64_t end = now_mono_ms() + 5 * TTL_MS;

	ck_assert_int_eq(lock_tick(a), LOCK_HELD);
	cut_off_clients(c);
	/* The renewal, at ttl/3, fails fast. */
	while (lock_redis_up(a)) {
		ck_assert_msg(now_mono_ms() < end, "renewal never failed");
		ck_assert_int_eq(lock_tick(a), LOCK_HELD);
		nap_for(a);
	}
	admin_ok(c, "CONFIG SET maxclients %s", priv.maxclients);
	redisFree(c);
	ck_assert_int_eq(kill(priv.pid, SIGSTOP), 0);
	while (lock_next_tick_ms(a) > 0)
		nap_for(a);
	st = lock_tick(a);
	ck_assert_int_eq(kill(priv.pid, SIGCONT), 0);
	ck_assert_msg(st != LOCK_HELD || lock_held(a), "LOCK_HELD, yet not "
	    "held: %s", lock_error(a));
	ck_assert_int_eq(lock_lost_count(a), 1);
	lock_free(a);
}
END_TEST

/*
 * A Redis that answers and refuses the command: a replica (READONLY),
 * as after a failover that redis.address did not follow.  The
 * connection works and is kept.  Before, each try dropped it and made a
 * new one, which logged "redis connected" and counted a reconnect, to
 * meet the same refusal.
 */
START_TEST(test_refused_command_keeps_the_connection)
{
	redisContext *c = priv_admin();
	struct lock *a = lock_private(NULL, NULL);
	struct backoff_params quick;
	int64_t end;

	backoff_params_default(&quick);
	quick.init_ms = 50;
	quick.max_ms = 50;
	lock_set_reconnect(a, &quick);
	admin_ok(c, "REPLICAOF 127.0.0.1 1");
	for (end = now_mono_ms() + 1000; now_mono_ms() < end; nap_for(a)) {
		enum lock_state st = lock_tick(a);

		ck_assert_msg(st == LOCK_UNAVAILABLE && strstr(lock_error(a),
		    "READONLY") != NULL, "%d: %s", st, lock_error(a));
	}
	ck_assert_int_eq(lock_reconnects(a), 0);
	ck_assert(lock_redis_up(a));
	admin_ok(c, "REPLICAOF NO ONE");
	ck_assert(tick_until(a, LOCK_HELD, 5000));
	ck_assert_int_eq(lock_reconnects(a), 0);
	lock_release(a);
	lock_free(a);
	redisFree(c);
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("lock");
	TCase *shared = tcase_create("shared");
	TCase *down = tcase_create("redis down");
	TCase *priv_tc = tcase_create("private redis");
	SRunner *sr;
	const char *port = getenv("OUTBOXD_REDIS_PORT");
	int failed;

	if (port == NULL || *port == '\0') {
		fprintf(stderr, "check_lock: OUTBOXD_REDIS_PORT is not set: "
		    "run it through tests/run-integration.sh (make "
		    "integration), or start a Redis with tests/servers.sh "
		    "and source its env.sh\n");
		return 1;
	}
	/* As in main.c: a write to a closed socket must fail, not kill. */
	signal(SIGPIPE, SIG_IGN);
	log_set_level(LOG_WARN);

	tcase_add_checked_fixture(shared, setup, teardown);
	tcase_set_timeout(shared, 60);
	tcase_add_test(shared, test_exactly_one_of_four_holds);
	tcase_add_test(shared, test_holder_renews_across_ttls);
	tcase_add_test(shared, test_release_lets_other_acquire);
	tcase_add_test(shared, test_deleted_key_is_noticed_then_reacquired);
	tcase_add_test(shared, test_overwritten_key_is_lost_and_kept);
	tcase_add_test(shared, test_release_compares_token);
	tcase_add_test(shared, test_stalled_holder_loses_it);
	tcase_add_test(shared, test_short_stall_renews_late);
	tcase_add_test(shared, test_cheap_when_nothing_due);
	tcase_add_test(shared, test_database_is_selected);
	tcase_add_test(shared, test_disabled_is_always_held);
	tcase_add_test(shared, test_signal_does_not_cut_the_connect);
	suite_add_tcase(s, shared);

	tcase_add_checked_fixture(down, setup, teardown);
	tcase_add_unchecked_fixture(down, NULL, restart_shared_redis);
	tcase_set_timeout(down, 120);
	tcase_add_test(down, test_redis_down_and_back);
	suite_add_tcase(s, down);

	tcase_add_checked_fixture(priv_tc, setup, NULL);
	tcase_add_unchecked_fixture(priv_tc, priv_start, priv_stop);
	tcase_set_timeout(priv_tc, 60);
	tcase_add_test(priv_tc, test_unix_socket);
	tcase_add_test(priv_tc, test_acl_user);
	tcase_add_test(priv_tc, test_requirepass);
	tcase_add_test(priv_tc, test_password_of_asterisks);
	tcase_add_test(priv_tc, test_hung_redis_never_blocks);
	tcase_add_test(priv_tc, test_key_outliving_an_outage_is_reclaimed);
	tcase_add_test(priv_tc, test_set_answered_too_late_is_reclaimed);
	tcase_add_test(priv_tc, test_release_after_an_outage_deletes_the_key);
	tcase_add_test(priv_tc, test_idle_connection_closed_is_made_again);
	tcase_add_test(priv_tc, test_failed_release_keeps_the_token);
	tcase_add_test(priv_tc, test_connect_past_the_validity_is_a_loss);
	tcase_add_test(priv_tc, test_refused_command_keeps_the_connection);
	suite_add_tcase(s, priv_tc);

	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
