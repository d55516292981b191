/*
 * `outboxd backoff` (daemon/cli_backoff.c): the schedules it prints, the
 * ones docs/BACKOFF.md shows among them, its seeds, and its answers to
 * bad options.  It runs in this process, its output caught in files.
 */
#include <check.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_backoff.h"

#define MAX_ARGS 16

struct run {
	int rc;
	char out[16384];
	char err[2048];
};

static void
read_back(FILE *f, char *buf, size_t size)
{
	size_t n;

	rewind(f);
	n = fread(buf, 1, size - 1, f);
	buf[n] = '\0';
	fclose(f);
}

/* cli_backoff("backoff", args..., NULL), with stdout and stderr caught. */
static void
run_backoff(struct run *r, ...)
{
	char *argv[MAX_ARGS + 2];
	int argc = 0, saved_out, saved_err;
	FILE *out = tmpfile(), *err = tmpfile();
	va_list ap;

	ck_assert_msg(out != NULL && err != NULL, "tmpfile failed");
	argv[argc++] = "backoff";
	va_start(ap, r);
	while (argc <= MAX_ARGS && (argv[argc] = va_arg(ap, char *)) != NULL)
		argc++;
	va_end(ap);
	ck_assert_msg(argc <= MAX_ARGS, "too many arguments");
	argv[argc] = NULL;

	fflush(stdout);
	fflush(stderr);
	saved_out = dup(STDOUT_FILENO);
	saved_err = dup(STDERR_FILENO);
	ck_assert_msg(saved_out != -1 && saved_err != -1, "dup failed");
	dup2(fileno(out), STDOUT_FILENO);
	dup2(fileno(err), STDERR_FILENO);
	r->rc = cli_backoff(argc, argv);
	fflush(stdout);
	fflush(stderr);
	dup2(saved_out, STDOUT_FILENO);
	dup2(saved_err, STDERR_FILENO);
	close(saved_out);
	close(saved_err);
	read_back(out, r->out, sizeof(r->out));
	read_back(err, r->err, sizeof(r->err));
}

/* Fails the test, showing the whole output, unless it holds text. */
#define assert_has(out, text) \
	ck_assert_msg(strstr((out), (text)) != NULL, "wanted \"%s\" in:\n%s", \
	    (text), (out))

static bool
starts_with(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* The example of docs/BACKOFF.md, whole. */
START_TEST(test_documented_schedule)
{
	static const char want[] =
	    "strategy=exponential jitter=none init=10s factor=2 max=1h "
	    "attempts=8\n"
	    "\n"
	    "attempt         delay              at\n"
	    "      1             -             0ms  (first try)\n"
	    "      2           10s             10s\n"
	    "      3           20s             30s\n"
	    "      4           40s           1m10s\n"
	    "      5         1m20s           2m30s\n"
	    "      6         2m40s           5m10s\n"
	    "      7         5m20s          10m30s\n"
	    "      8        10m40s          21m10s\n"
	    "dead: after attempt 8 fails, 21m10s (1270000ms) after the "
	    "first try (max_retry_times=8)\n";
	struct run r;

	run_backoff(&r, "--strategy", "exponential", "--init", "10s",
	    "--factor", "2", "--max", "1h", "--attempts", "8", NULL);
	ck_assert_int_eq(r.rc, 0);
	ck_assert_str_eq(r.out, want);
	ck_assert_str_eq(r.err, "");
}
END_TEST

/* Past the cap the delays stop growing (docs/BACKOFF.md). */
START_TEST(test_cap)
{
	struct run r;

	run_backoff(&r, "--init", "10s", "--factor", "2", "--max", "1h",
	    "--attempts", "12", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "     10        42m40s        1h25m10s\n"
	    "     11            1h        2h25m10s\n"
	    "     12            1h        3h25m10s\n"
	    "dead: after attempt 12 fails, 3h25m10s (12310000ms) after the "
	    "first try (max_retry_times=12)\n");
}
END_TEST

/* The defaults are the daemon's and the seed's: 10 s, x 2, 5 attempts. */
START_TEST(test_defaults)
{
	struct run r;

	run_backoff(&r, NULL);
	ck_assert_int_eq(r.rc, 0);
	ck_assert_msg(starts_with(r.out, "strategy=exponential jitter=none "
	    "init=10s factor=2 max=1h attempts=5\n"), "%s", r.out);
	assert_has(r.out, "dead: after attempt 5 fails, 2m30s "
	    "(150000ms) after the first try (max_retry_times=5)\n");
}
END_TEST

START_TEST(test_other_strategies)
{
	struct run r;

	run_backoff(&r, "--strategy", "fibonacci", "--init", "1s",
	    "--attempts", "6", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "      2            1s              1s\n"
	    "      3            1s              2s\n"
	    "      4            2s              4s\n"
	    "      5            3s              7s\n"
	    "      6            5s             12s\n");

	/* Under a second, the total has no exact-ms repeat. */
	run_backoff(&r, "--strategy", "fixed", "--init", "250ms",
	    "--attempts", "3", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "      3         250ms           500ms\n"
	    "dead: after attempt 3 fails, 500ms after the first try "
	    "(max_retry_times=3)\n");

	/* One attempt: no retry at all. */
	run_backoff(&r, "--attempts", "1", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "(first try)\ndead: after attempt 1 "
	    "fails, 0ms after the first try");
}
END_TEST

/* Ethernet gives up after 16 retries, whatever --attempts allows. */
START_TEST(test_ethernet_gives_up)
{
	struct run r;

	run_backoff(&r, "--strategy", "ethernet", "--init", "1ms",
	    "--attempts", "30", "--seed", "1", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "\n     17 ");
	ck_assert_msg(strstr(r.out, "\n     18 ") == NULL, "%s", r.out);
	assert_has(r.out, "dead: the ethernet strategy gives up "
	    "after attempt 17 fails, ");

	run_backoff(&r, "--strategy", "ethernet", "--attempts", "5", "--seed",
	    "1", NULL);
	ck_assert_int_eq(r.rc, 0);
	assert_has(r.out, "dead: after attempt 5 fails, ");
}
END_TEST

/* A seed repeats a random schedule; docs/BACKOFF.md shows seed 42's. */
START_TEST(test_seed_repeats)
{
	struct run a, b;

	run_backoff(&a, "--jitter", "full", "--init", "10s", "--max", "1h",
	    "--attempts", "6", "--seed", "42", NULL);
	run_backoff(&b, "--jitter", "full", "--init", "10s", "--max", "1h",
	    "--attempts", "6", "--seed", "42", NULL);
	ck_assert_int_eq(a.rc, 0);
	ck_assert_str_eq(a.out, b.out);
	assert_has(a.out, " seed=42\n");
	assert_has(a.out, "      2        9.287s          9.287s\n"
	    "      3         282ms          9.569s\n"
	    "      4       33.518s         43.087s\n"
	    "      5       12.056s         55.143s\n"
	    "      6      1m50.14s       2m45.283s\n"
	    "dead: after attempt 6 fails, 2m45.283s (165283ms) after the "
	    "first try (max_retry_times=6)\n");
}
END_TEST

/* Without --seed, the seed it drew is printed, and repeats the run. */
START_TEST(test_printed_seed_repeats)
{
	struct run a, b;
	const char *at;
	char seed[32];

	run_backoff(&a, "--strategy", "random", "--init", "0", "--max", "1h",
	    "--attempts", "8", NULL);
	ck_assert_int_eq(a.rc, 0);
	at = strstr(a.out, " seed=");
	ck_assert_msg(at != NULL, "no seed in: %s", a.out);
	ck_assert_int_eq(sscanf(at, " seed=%31[0-9]\n", seed), 1);
	run_backoff(&b, "--strategy", "random", "--init", "0", "--max", "1h",
	    "--attempts", "8", "--seed", seed, NULL);
	ck_assert_int_eq(b.rc, 0);
	ck_assert_str_eq(a.out, b.out);

	/* Proportional jitter shows its factor too. */
	run_backoff(&a, "--jitter", "proportional", "--jitter-factor", "0.5",
	    "--seed", "7", NULL);
	ck_assert_int_eq(a.rc, 0);
	ck_assert_msg(starts_with(a.out, "strategy=exponential "
	    "jitter=proportional jitter_factor=0.5 init=10s factor=2 max=1h "
	    "attempts=5 seed=7\n"), "%s", a.out);

	/* A schedule without randomness has no seed to print. */
	run_backoff(&a, "--strategy", "fixed", NULL);
	ck_assert_msg(strstr(a.out, "seed=") == NULL, "%s", a.out);
}
END_TEST

/*
 * Decorrelated jitter for a row: the relay passes no previous delay (a
 * row keeps none), so each delay is drawn from [init, 3 x init].  The
 * command once fed each delay back, and printed 57m3s for what rows
 * live through in 4 to 12 minutes.
 */
START_TEST(test_decorrelated_as_rows_live_it)
{
	struct run r;
	const char *at;
	long long total_ms;

	run_backoff(&r, "--jitter", "decorrelated", "--init", "10s", "--max",
	    "1h", "--attempts", "25", "--seed", "1", NULL);
	ck_assert_int_eq(r.rc, 0);
	at = strstr(r.out, "dead: after attempt 25 fails, ");
	ck_assert_msg(at != NULL, "%s", r.out);
	at = strchr(at, '(');
	ck_assert_msg(at != NULL && sscanf(at, "(%lldms)", &total_ms) == 1,
	    "%s", r.out);
	ck_assert_int_ge(total_ms, 24 * 10000LL);
	ck_assert_int_le(total_ms, 24 * 30000LL);
}
END_TEST

START_TEST(test_help)
{
	struct run r;

	run_backoff(&r, "--help", NULL);
	ck_assert_int_eq(r.rc, 0);
	ck_assert_msg(starts_with(r.out, "usage: outboxd backoff [options]\n"),
	    "%s", r.out);
	assert_has(r.out, "1..32767");
	ck_assert_str_eq(r.err, "");
}
END_TEST

/* Each bad command line: exit 2, nothing on stdout, and a message that
 * names what is wrong. */
static const struct {
	const char *args[4];
	const char *says;
} bad_cases[] = {
	{ { "--strategy", "nope" }, "unknown strategy: 'nope'" },
	{ { "--jitter", "some" }, "unknown jitter: 'some'" },
	{ { "--jitter-factor", "x" }, "bad --jitter-factor: 'x'" },
	{ { "--jitter", "proportional", "--jitter-factor", "2" },
	  "jitter factor must be between 0 and 1" },
	{ { "--init", "10x" }, "bad --init duration: '10x'" },
	{ { "--init", "-1s" }, "bad --init duration: '-1s'" },
	{ { "--max", "soon" }, "bad --max duration: 'soon'" },
	{ { "--max", "31d" }, "--max is backoff.max, at most 30d: '31d'" },
	{ { "--factor", "two" }, "bad --factor: 'two'" },
	{ { "--factor", "0.5" }, "factor must be a finite number of at "
	  "least 1" },
	{ { "--factor", "inf" }, "factor must be a finite number" },
	{ { "--attempts", "0" }, "--attempts must be 1..32767: '0'" },
	{ { "--attempts", "32768" }, "--attempts must be 1..32767: '32768'" },
	{ { "--attempts", "-1" }, "--attempts must be 1..32767: '-1'" },
	{ { "--attempts", "5x" }, "--attempts must be 1..32767: '5x'" },
	{ { "--seed", "-1" }, "bad --seed: '-1'" },
	{ { "--seed", "99999999999999999999999" }, "bad --seed" },
	{ { "--init" }, "option needs a value: '--init'" },
	{ { "--nope" }, "unknown option: '--nope'" },
	{ { "-x" }, "unknown option: '-x'" },
	{ { "extra" }, "unexpected argument: 'extra'" },
};

START_TEST(test_bad_usage)
{
	const char *const *a = bad_cases[_i].args;
	struct run r;

	/* The unused slots are NULL, which ends the list. */
	run_backoff(&r, a[0], a[1], a[2], a[3], NULL);
	ck_assert_msg(r.rc == 2, "%s: exit %d", a[0], r.rc);
	ck_assert_msg(strstr(r.err, bad_cases[_i].says) != NULL,
	    "%s: wanted \"%s\" in: %s", a[0], bad_cases[_i].says, r.err);
	ck_assert_msg(starts_with(r.err, "outboxd backoff: "), "%s", r.err);
	ck_assert_str_eq(r.out, "");
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("cli_backoff");
	TCase *tc = tcase_create("cli_backoff");
	SRunner *sr;
	int failed;

	tcase_add_test(tc, test_documented_schedule);
	tcase_add_test(tc, test_cap);
	tcase_add_test(tc, test_defaults);
	tcase_add_test(tc, test_other_strategies);
	tcase_add_test(tc, test_ethernet_gives_up);
	tcase_add_test(tc, test_seed_repeats);
	tcase_add_test(tc, test_printed_seed_repeats);
	tcase_add_test(tc, test_decorrelated_as_rows_live_it);
	tcase_add_test(tc, test_help);
	tcase_add_loop_test(tc, test_bad_usage, 0,
	    sizeof(bad_cases) / sizeof(bad_cases[0]));
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
