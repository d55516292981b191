/* Durations and logfmt quoting: the small pure helpers. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "migrations.h"
#include "util.h"

/*
 * Logs one line of each level, and one from a signal handler, with
 * stderr sent to a file; JOURNAL_STREAM names that file (as systemd
 * names the journal's stream), or another one, or is unset.  Returns
 * the file's text (free it).
 */
static char *
log_lines_with_stream(int which)
{
	const char *dir = getenv("TMPDIR");
	char path[512], stream[64], *text;
	int fd, saved = dup(STDERR_FILENO);
	struct stat st;
	FILE *f;
	long len;

	snprintf(path, sizeof(path), "%s/check_util_log.XXXXXX",
	    dir != NULL && *dir != '\0' ? dir : "/tmp");
	fd = mkstemp(path);
	ck_assert(fd >= 0 && saved >= 0);
	ck_assert_int_eq(fstat(fd, &st), 0);
	snprintf(stream, sizeof(stream), "%llu:%llu",
	    (unsigned long long)st.st_dev,
	    (unsigned long long)st.st_ino + (which == 1 ? 1 : 0));
	if (which == 2)
		unsetenv("JOURNAL_STREAM");
	else
		setenv("JOURNAL_STREAM", stream, 1);
	ck_assert_int_eq(dup2(fd, STDERR_FILENO), STDERR_FILENO);
	ck_assert_int_eq(log_detect_journal(), which == 0);
	log_set_level(LOG_DEBUG);
	log_debug("a debug line", NULL);
	log_info("an info line", "k=v");
	log_warn("a warning", NULL);
	log_error("an error", NULL);
	log_from_signal_handler(LOG_ERROR, "msg=\"from a handler\"");
	ck_assert_int_eq(dup2(saved, STDERR_FILENO), STDERR_FILENO);
	close(saved);
	close(fd);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	fseek(f, 0, SEEK_END);
	len = ftell(f);
	rewind(f);
	text = calloc(1, (size_t)len + 1);
	ck_assert_ptr_nonnull(text);
	ck_assert_int_eq(fread(text, 1, (size_t)len, f), (size_t)len);
	fclose(f);
	unlink(path);
	return text;
}

/* Under systemd, each line starts with its syslog priority, which
 * journald strips and keeps: `journalctl -p warning` finds warnings. */
START_TEST(test_log_journal_priorities)
{
	char *text = log_lines_with_stream(0);
	const char *want[] = { "<7>ts=", "msg=\"a debug line\"\n",
		"<6>ts=", "msg=\"an info line\" k=v\n",
		"<4>ts=", "msg=\"a warning\"\n",
		"<3>ts=", "msg=\"an error\"\n",
		"<3>ts=", "msg=\"from a handler\"\n" };
	const char *p = text;

	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i += 2) {
		ck_assert_msg(strncmp(p, want[i], strlen(want[i])) == 0,
		    "line %zu: %s", i / 2, p);
		p = strstr(p, want[i + 1]);
		ck_assert_msg(p != NULL, "no %s in %s", want[i + 1], text);
		p += strlen(want[i + 1]);
	}
	ck_assert_str_eq(p, "");
	free(text);

	/* Another stream, or none: plain logfmt lines. */
	for (int which = 1; which <= 2; which++) {
		text = log_lines_with_stream(which);
		ck_assert_msg(strncmp(text, "ts=", 3) == 0 &&
		    strstr(text, "\n<") == NULL, "%s", text);
		free(text);
	}
}
END_TEST

START_TEST(test_duration_parse_table)
{
	static const struct {
		const char *in;
		int rc;
		int64_t ms;
	} cases[] = {
		{ "250ms", 0, 250 }, { "10s", 0, 10000 }, { "5m", 0, 300000 },
		{ "1h", 0, 3600000 }, { "2d", 0, 172800000 }, { "0", 0, 0 },
		{ "1500", 0, 1500 }, { "", -1, 0 }, { "-1s", -1, 0 },
		{ "10x", -1, 0 }, { "s", -1, 0 }, { " 1s", -1, 0 },
		{ "1.5s", -1, 0 }, { "99999999999999999999", -1, 0 },
		{ "9999999999999999d", -1, 0 },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int64_t ms = 0;
		int rc = duration_parse(cases[i].in, &ms);

		ck_assert_msg(rc == cases[i].rc, "'%s': rc %d", cases[i].in,
		    rc);
		if (rc == 0)
			ck_assert_msg(ms == cases[i].ms, "'%s': %lld",
			    cases[i].in, (long long)ms);
	}
	ck_assert_int_eq(duration_parse(NULL, &(int64_t){ 0 }), -1);
}
END_TEST

START_TEST(test_int64_parse)
{
	int64_t v = 0;

	ck_assert(int64_parse("42", 2, &v) && v == 42);
	ck_assert(int64_parse("-7", 2, &v) && v == -7);
	ck_assert(int64_parse("9223372036854775807", 19, &v) &&
	    v == INT64_MAX);
	ck_assert(int64_parse("123x", 3, &v) && v == 123); /* len counts */
	ck_assert(!int64_parse("", 0, &v));
	ck_assert(!int64_parse("12a", 3, &v));
	ck_assert(!int64_parse("9223372036854775808", 19, &v));
	ck_assert(!int64_parse("123456789012345678901234", 24, &v));
}
END_TEST

START_TEST(test_duration_format_roundtrip)
{
	static const int64_t values[] = { 0, 1, 999, 1000, 1500, 60000,
		3600000, 86400000, 90061000 };
	char buf[32];

	for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
		int64_t back;

		duration_format(buf, sizeof(buf), values[i]);
		ck_assert_int_eq(duration_parse(buf, &back), 0);
		ck_assert_int_eq(back, values[i]);
	}
	ck_assert_str_eq(duration_format(buf, sizeof(buf), 3600000), "1h");
	ck_assert_str_eq(duration_format(buf, sizeof(buf), 1500), "1500ms");
}
END_TEST

START_TEST(test_log_quote)
{
	char buf[64];

	ck_assert_str_eq(log_quote(buf, sizeof(buf), "plain"), "plain");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "two words"),
	    "\"two words\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "a\"b\\c"),
	    "\"a\\\"b\\\\c\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "k=v"), "\"k=v\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "line\nbreak"),
	    "\"line\\nbreak\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), ""), "\"\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), NULL), "\"\"");
	/* Truncation keeps the closing quote and the terminator. */
	log_quote(buf, 8, "a long value with spaces");
	ck_assert_uint_lt(strlen(buf), 8);
	ck_assert_uint_gt(strlen(buf), 2);
	ck_assert_int_eq(buf[0], '"');
	ck_assert_int_eq(buf[strlen(buf) - 1], '"');
}
END_TEST

/* Cut between characters, never inside one: half a UTF-8 sequence made
 * the whole line invalid (journalctl showed a blob). */
START_TEST(test_log_quote_keeps_utf8_whole)
{
	char buf[64];

	/* "ошибка": 2 bytes a letter; 7 bytes of room take 3 letters. */
	ck_assert_str_eq(log_quote(buf, 8, "\xd0\xbe\xd1\x88\xd0\xb8\xd0"
	    "\xb1\xd0\xba\xd0\xb0"), "\xd0\xbe\xd1\x88\xd0\xb8");
	/* Quoted: 5 bytes of room between the quotes. */
	ck_assert_str_eq(log_quote(buf, 8, "a \xd0\xbe\xd1\x88\xd0\xb8"),
	    "\"a \xd0\xbe\"");
	/* A 4-byte sequence that does not fit is left out whole. */
	ck_assert_str_eq(log_quote(buf, 4, "x\xf0\x9f\x98\x80"), "x");
	ck_assert_str_eq(log_quote(buf, 6, "x\xf0\x9f\x98\x80"),
	    "x\xf0\x9f\x98\x80");
	/* Bytes that are not UTF-8, or a sequence cut short, become '?'. */
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "a\xff" "b\xd0"),
	    "a?b?");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "\xe2\x82"), "??");
	/* C1 controls (NEL, CSI) are spaces, as C0 ones are; the value
	 * is quoted for them.  U+00A0 and up stay. */
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "a\xc2\x85" "b\xc2\x9b"
	    "1m"), "\"a b 1m\"");
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "\xc2\xa0\xc3\xa9"),
	    "\xc2\xa0\xc3\xa9");
	/* A lone 0xc2 at the end is not UTF-8. */
	ck_assert_str_eq(log_quote(buf, sizeof(buf), "x\xc2"), "x?");
}
END_TEST

/* The signal handler's timestamp, without gmtime, against gmtime: every
 * day from 1970 to 2200 (leap years, centuries, 2000), and the time of
 * day's fields. */
START_TEST(test_utc_stamp_matches_gmtime)
{
	char mine[32], want[40];
	struct tm tm;

	for (int64_t day = 0; day < 84000; day++) {
		time_t t = (time_t)(day * 86400 + (day * 3607) % 86400);

		gmtime_r(&t, &tm);
		strftime(want, sizeof(want), "%Y-%m-%dT%H:%M:%S", &tm);
		strcat(want, ".042Z");
		ck_assert_uint_eq(log_utc_stamp(mine, (int64_t)t, 42),
		    strlen(want));
		ck_assert_str_eq(mine, want);
	}
}
END_TEST

START_TEST(test_str_replace_controls)
{
	char s[] = "a\tb\nc\x7f d\x01";
	char c1[] = "e\xc2\x9b" "31m f\xc2\x85g \xc2\xa0h";

	ck_assert_str_eq(str_replace_controls(s, '?'), "a?b?c? d?");
	/* C1 controls too (CSI, NEL); a no-break space is text. */
	ck_assert_str_eq(str_replace_controls(c1, '?'),
	    "e??31m f??g \xc2\xa0h");
}
END_TEST

/* Well-formed UTF-8 and the ways text is not: what PostgreSQL refuses. */
START_TEST(test_utf8_seq_len)
{
	static const struct {
		const char *s;
		size_t n, want;
	} cases[] = {
		{ "a", 1, 1 },
		{ "\xc3\xa9", 2, 2 },			/* é */
		{ "\xe8\xb7\xaf", 3, 3 },		/* 路 */
		{ "\xf0\x9f\x98\x80", 4, 4 },	/* U+1F600 */
		{ "\xf4\x8f\xbf\xbf", 4, 4 },	/* U+10FFFF */
		{ "\xc3", 1, 0 },			/* cut short */
		{ "\xe8\xb7", 2, 0 },
		{ "\xa9", 1, 0 },			/* stray continuation */
		{ "\xc0\xaf", 2, 0 },			/* overlong "/" */
		{ "\xe0\x80\xaf", 3, 0 },
		{ "\xf0\x80\x80\xaf", 4, 0 },
		{ "\xed\xa0\x80", 3, 0 },		/* surrogate */
		{ "\xf4\x90\x80\x80", 4, 0 },	/* past U+10FFFF */
		{ "\xf5\x80\x80\x80", 4, 0 },
		{ "\xff", 1, 0 },
		{ "\xc3\x28", 2, 0 },			/* bad continuation */
		{ "\xe8\xb7\x28", 3, 0 },
		{ "", 0, 0 },
	};

	for (size_t i = 0; i < ARRAY_LEN(cases); i++)
		ck_assert_msg(utf8_seq_len((const unsigned char *)cases[i].s,
		    cases[i].n) == cases[i].want, "case %zu", i);
}
END_TEST

START_TEST(test_log_level_parse)
{
	enum log_level l;

	ck_assert_int_eq(log_level_parse("debug", &l), 0);
	ck_assert_int_eq(l, LOG_DEBUG);
	ck_assert_int_eq(log_level_parse("warning", &l), 0);
	ck_assert_int_eq(l, LOG_WARN);
	ck_assert_int_eq(log_level_parse("loud", &l), -1);
}
END_TEST

/*
 * A fault that repeats at every try: the first ten lines pass, then one
 * a second, and the line that passes says how many were held back.
 */
START_TEST(test_log_limit_burst_then_one_a_second)
{
	struct log_limit limit = { 0 };
	const int64_t t0 = 5000000;
	unsigned long skipped = 99, passed = 0;
	char field[40];

	/* A thousand tries in the first second (a 1 ms reconnect). */
	for (int64_t t = t0; t < t0 + 1000; t++)
		if (log_limit_pass(&limit, t, &skipped)) {
			ck_assert_uint_eq(skipped, 0);
			passed++;
		}
	ck_assert_uint_eq(passed, LOG_LIMIT_BURST);
	/* The next one a second after the first, with the count of the
	 * 990 held back. */
	ck_assert(log_limit_pass(&limit, t0 + LOG_LIMIT_EVERY_MS, &skipped));
	ck_assert_uint_eq(skipped, 1000 - LOG_LIMIT_BURST);
	limit = (struct log_limit){ 0 };
	for (int i = 0; i < LOG_LIMIT_BURST + 5; i++)
		(void)log_limit_pass(&limit, t0, &skipped);
	ck_assert(!log_limit_pass(&limit, t0 + LOG_LIMIT_EVERY_MS - 1,
	    &skipped));
	ck_assert(log_limit_pass(&limit, t0 + LOG_LIMIT_EVERY_MS, &skipped));
	ck_assert_uint_eq(skipped, 6);
	ck_assert_str_eq(log_skipped_field(field, sizeof(field), skipped),
	    " lines_skipped=6");
	/* Then one a second, each line counting the tries between. */
	ck_assert(!log_limit_pass(&limit, t0 + LOG_LIMIT_EVERY_MS + 500,
	    &skipped));
	ck_assert(log_limit_pass(&limit, t0 + LOG_LIMIT_EVERY_MS * 2,
	    &skipped));
	ck_assert_uint_eq(skipped, 1);
	/* Quiet for a while refills the burst... */
	passed = 0;
	for (int i = 0; i < 100; i++)
		passed += log_limit_pass(&limit, t0 + 60000, &skipped);
	ck_assert_uint_eq(passed, LOG_LIMIT_BURST);
	/* ...and so does the end of the fault, without a stale count. */
	log_limit_reset(&limit);
	ck_assert(log_limit_pass(&limit, t0 + 60001, &skipped));
	ck_assert_uint_eq(skipped, 0);
	ck_assert_str_eq(log_skipped_field(field, sizeof(field), skipped), "");
}
END_TEST

/*
 * A line written while the reader is slow, and a signal comes: the
 * daemon's SIGTERM and SIGHUP handlers have no SA_RESTART, so the
 * blocked write(2) returned EINTR, and the line was lost.  stderr is a
 * full stream socket here (as the journal's is when journald lags);
 * SIGALRM comes at 100 ms, and the reader starts at 300 ms.
 */
struct drain {
	int fd;
	char tail[256];
};

static void *
drain_later(void *arg)
{
	struct drain *d = arg;
	char buf[4096];
	size_t keep = 0;
	ssize_t n;

	usleep(300 * 1000);
	/* Until EOF: the test closes its end once the line is written,
	 * or was given up. */
	while ((n = read(d->fd, buf, sizeof(buf))) > 0) {
		for (ssize_t i = 0; i < n; i++) {
			if (keep == sizeof(d->tail) - 1) {
				memmove(d->tail, d->tail + 1, keep - 1);
				keep--;
			}
			d->tail[keep++] = buf[i];
		}
	}
	d->tail[keep] = '\0';
	return NULL;
}

static void
on_alarm(int sig)
{
	(void)sig;
}

START_TEST(test_log_line_survives_a_signal)
{
	struct sigaction sa = { .sa_handler = on_alarm };
	struct itimerval at = { .it_value = { .tv_usec = 100 * 1000 } };
	struct drain d = { 0 };
	sigset_t alrm, old;
	int sv[2], saved, size = 4096, flags;
	pthread_t reader;
	char fill[1024];

	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
	(void)setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
	flags = fcntl(sv[0], F_GETFL);
	ck_assert_int_eq(fcntl(sv[0], F_SETFL, flags | O_NONBLOCK), 0);
	memset(fill, 'x', sizeof(fill));
	while (write(sv[0], fill, sizeof(fill)) > 0)
		;
	ck_assert_int_eq(errno, EAGAIN);
	ck_assert_int_eq(fcntl(sv[0], F_SETFL, flags), 0);
	d.fd = sv[1];
	/* The signal is for this thread, not the reader's. */
	sigemptyset(&alrm);
	sigaddset(&alrm, SIGALRM);
	pthread_sigmask(SIG_BLOCK, &alrm, &old);
	ck_assert_int_eq(pthread_create(&reader, NULL, drain_later, &d), 0);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	sigemptyset(&sa.sa_mask);
	ck_assert_int_eq(sigaction(SIGALRM, &sa, NULL), 0);	/* no SA_RESTART */

	fflush(stderr);
	saved = dup(STDERR_FILENO);
	dup2(sv[0], STDERR_FILENO);
	log_set_level(LOG_INFO);
	ck_assert_int_eq(setitimer(ITIMER_REAL, &at, NULL), 0);
	log_info("the line a signal cut", "k=v");
	dup2(saved, STDERR_FILENO);
	close(saved);
	close(sv[0]);
	ck_assert_int_eq(pthread_join(reader, NULL), 0);
	close(sv[1]);
	ck_assert_msg(strstr(d.tail, "msg=\"the line a signal cut\" k=v\n") !=
	    NULL, "the line was lost; the stream ended with: %s", d.tail);
}
END_TEST

/*
 * Each migration compiled in is its sql/ file, byte for byte: the
 * Makefile's generator once left a backslash single under mawk (Debian's
 * awk), so a migration with E'\n' or a regex would have applied other
 * SQL through `outboxd migrate` than through psql.
 */
START_TEST(test_migrations_are_their_files)
{
	const char *src = getenv("OUTBOXD_SRCDIR");
	int n = 0;

	for (const struct migration *m = migrations; m->name != NULL; m++) {
		char path[512], *text;
		FILE *f;
		long len;

		snprintf(path, sizeof(path), "%s/sql/%s", src != NULL ? src :
		    ".", m->name);
		f = fopen(path, "rb");
		ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
		ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
		len = ftell(f);
		ck_assert_int_ge(len, 0);
		rewind(f);
		text = calloc(1, (size_t)len + 1);
		ck_assert_ptr_nonnull(text);
		ck_assert_int_eq(fread(text, 1, (size_t)len, f), (size_t)len);
		fclose(f);
		ck_assert_msg(strcmp(m->sql, text) == 0, "%s differs from "
		    "its file", m->name);
		ck_assert_int_eq(m->online_index != NULL,
		    strstr(text, "-- outboxd: online index ") != NULL);
		free(text);
		n++;
	}
	ck_assert_int_ge(n, 8);
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("util");
	TCase *tc = tcase_create("util");
	SRunner *sr;
	int failed;

	tcase_add_test(tc, test_duration_parse_table);
	tcase_add_test(tc, test_duration_format_roundtrip);
	tcase_add_test(tc, test_int64_parse);
	tcase_add_test(tc, test_log_quote);
	tcase_add_test(tc, test_log_limit_burst_then_one_a_second);
	tcase_add_test(tc, test_log_quote_keeps_utf8_whole);
	tcase_add_test(tc, test_utc_stamp_matches_gmtime);
	tcase_add_test(tc, test_log_level_parse);
	tcase_add_test(tc, test_log_journal_priorities);
	tcase_add_test(tc, test_str_replace_controls);
	tcase_add_test(tc, test_utf8_seq_len);
	tcase_add_test(tc, test_log_line_survives_a_signal);
	tcase_add_test(tc, test_migrations_are_their_files);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
