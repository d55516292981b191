/*
 * Unit tests for daemon/backoff.c: exact schedules, jitter statistics
 * with fixed seeds, Ethernet's bounds, edge cases and the cursor.
 */
#include <check.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backoff.h"

#define SEED 20240601ULL
#define DRAWS 100000
#define MAX_STEPS 16
#define HOUR_MS 3600000

/*
 * Check's ck_assert records a mark point on success, a write(2) in fork
 * mode: loops over 100,000 draws check with this instead.
 */
#define REQUIRE(expr, ...) \
	do { \
		if (!(expr)) \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

/* Shorthand for a params literal, in struct order. */
#define P(strategy, jitter, init, factor, max, jf, attempts) \
	{ (strategy), (jitter), (init), (factor), (max), (jf), (attempts) }
#define EXP BACKOFF_EXPONENTIAL
#define FIX BACKOFF_FIXED
#define RND BACKOFF_RANDOM
#define FIB BACKOFF_FIBONACCI
#define ETH BACKOFF_ETHERNET

/* ---- exact schedules of the deterministic strategies ---- */

static const struct schedule_case {
	const char *name;
	struct backoff_params p;
	int n;
	int64_t want[MAX_STEPS];
} schedule_cases[] = {
	{ "seed 002: 100ms x2 capped at 30s",
	    P(EXP, JITTER_NONE, 100, 2, 30000, 0, 0), 12,
	    { 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000,
	    30000, 30000 } },
	{ "seed 003: 10ms x2",
	    P(EXP, JITTER_NONE, 10, 2, HOUR_MS, 0, 0), 8,
	    { 10, 20, 40, 80, 160, 320, 640, 1280 } },
	{ "seed 001: 10s x2^n capped at 1h",
	    P(EXP, JITTER_NONE, 10000, 2, HOUR_MS, 0, 0), 11,
	    { 10000, 20000, 40000, 80000, 160000, 320000, 640000, 1280000,
	    2560000, 3600000, 3600000 } },
	{ "fibonacci 10ms (seed 003)",
	    P(FIB, JITTER_NONE, 10, 2, HOUR_MS, 0, 0), 10,
	    { 10, 10, 20, 30, 50, 80, 130, 210, 340, 550 } },
	{ "fibonacci capped at 5s",
	    P(FIB, JITTER_NONE, 1000, 2, 5000, 0, 0), 7,
	    { 1000, 1000, 2000, 3000, 5000, 5000, 5000 } },
	{ "fixed 250ms",
	    P(FIX, JITTER_NONE, 250, 2, HOUR_MS, 0, 0), 5,
	    { 250, 250, 250, 250, 250 } },
	{ "fixed above the cap",
	    P(FIX, JITTER_NONE, 5000, 2, 1000, 0, 0), 3,
	    { 1000, 1000, 1000 } },
	{ "factor 1 is constant",
	    P(EXP, JITTER_NONE, 500, 1, HOUR_MS, 0, 0), 5,
	    { 500, 500, 500, 500, 500 } },
	{ "factor 1.5 truncates to whole ms",
	    P(EXP, JITTER_NONE, 1000, 1.5, HOUR_MS, 0, 0), 6,
	    { 1000, 1500, 2250, 3375, 5062, 7593 } },
	{ "factor 1000",
	    P(EXP, JITTER_NONE, 1, 1000, HOUR_MS, 0, 0), 5,
	    { 1, 1000, 1000000, 3600000, 3600000 } },
	{ "max_attempts 3 gives up",
	    P(EXP, JITTER_NONE, 100, 2, HOUR_MS, 0, 3), 5,
	    { 100, 200, 400, -1, -1 } },
	{ "init above the cap",
	    P(EXP, JITTER_NONE, 7200000, 2, HOUR_MS, 0, 0), 3,
	    { 3600000, 3600000, 3600000 } },
};

START_TEST(test_schedule)
{
	const struct schedule_case *c = &schedule_cases[_i];
	struct backoff_rng rng, before;

	backoff_rng_seed(&rng, SEED);
	before = rng;
	for (int n = 0; n < c->n; n++) {
		int64_t got = backoff_delay(&c->p, n, 0, NULL);
		int64_t again = backoff_delay(&c->p, n, 0, &rng);

		ck_assert_msg(got == c->want[n],
		    "%s: attempt %d: got %lld, want %lld", c->name, n,
		    (long long)got, (long long)c->want[n]);
		ck_assert_int_eq(again, got);
	}
	/* Deterministic strategies must not draw from the generator. */
	ck_assert_msg(memcmp(&rng, &before, sizeof(rng)) == 0,
	    "%s: the generator was used", c->name);
}
END_TEST

/* ---- statistics of every jitter mode (and the random strategy) ---- */

static const struct stat_case {
	const char *name;
	struct backoff_params p;
	long attempt;
	int64_t prev;
	int64_t lo, hi;		/* every draw in [lo, hi] */
	double mean;		/* theory */
	int ends;		/* lo and hi themselves must be drawn */
} stat_cases[] = {
	{ "none", P(EXP, JITTER_NONE, 1000, 2, HOUR_MS, 0, 0), 2, 0,
	    4000, 4000, 4000, 1 },
	{ "proportional 0.5", P(EXP, JITTER_PROPORTIONAL, 1000, 2, HOUR_MS,
	    0.5, 0), 2, 0, 2000, 6000, 4000, 0 },
	{ "proportional 1", P(EXP, JITTER_PROPORTIONAL, 1000, 2, HOUR_MS,
	    1, 0), 2, 0, 0, 8000, 4000, 0 },
	/* x uniform in [2000, 6000] clamped at 5000: mean 15.5e6 / 4000. */
	{ "proportional clamped at the cap", P(EXP, JITTER_PROPORTIONAL,
	    1000, 2, 5000, 0.5, 0), 2, 0, 2000, 5000, 3875, 0 },
	{ "full", P(EXP, JITTER_FULL, 1000, 2, HOUR_MS, 0, 0), 2, 0,
	    0, 4000, 2000, 1 },
	{ "equal", P(EXP, JITTER_EQUAL, 1000, 2, HOUR_MS, 0, 0), 2, 0,
	    2000, 4000, 3000, 1 },
	{ "equal on fixed 1001ms", P(FIX, JITTER_EQUAL, 1001, 2, HOUR_MS,
	    0, 0), 0, 0, 500, 1001, 750.5, 1 },
	{ "full on fibonacci", P(FIB, JITTER_FULL, 100, 2, HOUR_MS, 0, 0),
	    5, 0, 0, 800, 400, 1 },
	{ "decorrelated, prev 1s", P(EXP, JITTER_DECORRELATED, 100, 2,
	    HOUR_MS, 0, 0), 7, 1000, 100, 3000, 1550, 1 },
	{ "decorrelated, first (prev 0 = init)", P(EXP, JITTER_DECORRELATED,
	    100, 2, HOUR_MS, 0, 0), 0, 0, 100, 300, 200, 1 },
	/* min(2000, U{100..3000}): (1996050 + 1000 × 2000) / 2901. */
	{ "decorrelated clamped at the cap", P(EXP, JITTER_DECORRELATED, 100,
	    2, 2000, 0, 0), 3, 1000, 100, 2000, 1377.47, 1 },
	{ "random [100, 1100)", P(RND, JITTER_NONE, 100, 2, 1100, 0, 0), 4,
	    0, 100, 1099, 599.5, 1 },
	{ "random [0, 1000)", P(RND, JITTER_NONE, 0, 2, 1000, 0, 0), 0, 0,
	    0, 999, 499.5, 1 },
};

START_TEST(test_jitter_stats)
{
	const struct stat_case *c = &stat_cases[_i];
	struct backoff_rng rng;
	int64_t seen_lo = INT64_MAX, seen_hi = INT64_MIN;
	double sum = 0, slack;

	backoff_rng_seed(&rng, SEED + (uint64_t)_i);
	for (int i = 0; i < DRAWS; i++) {
		int64_t d = backoff_delay(&c->p, c->attempt, c->prev, &rng);

		REQUIRE(d >= c->lo && d <= c->hi,
		    "%s: %lld outside [%lld, %lld]", c->name, (long long)d,
		    (long long)c->lo, (long long)c->hi);
		seen_lo = d < seen_lo ? d : seen_lo;
		seen_hi = d > seen_hi ? d : seen_hi;
		sum += (double)d;
	}
	ck_assert_msg(fabs(sum / DRAWS - c->mean) <= 0.02 * c->mean,
	    "%s: mean %.2f, theory %.2f", c->name, sum / DRAWS, c->mean);
	/* The draws must cover the range, not sit in one corner of it;
	 * discrete ranges must reach both ends (no off-by-one). */
	slack = c->ends ? 0 : 0.01 * (double)(c->hi - c->lo);
	ck_assert_msg((double)(seen_lo - c->lo) <= slack &&
	    (double)(c->hi - seen_hi) <= slack,
	    "%s: draws span only [%lld, %lld]", c->name,
	    (long long)seen_lo, (long long)seen_hi);
}
END_TEST

/* Full jitter over d = 9 must hit each of 0..9 about equally often. */
START_TEST(test_jitter_uniform)
{
	struct backoff_params p = P(FIX, JITTER_FULL, 9, 2, HOUR_MS, 0, 0);
	struct backoff_rng rng;
	int count[10] = { 0 };

	backoff_rng_seed(&rng, SEED);
	for (int i = 0; i < DRAWS; i++) {
		int64_t d = backoff_delay(&p, 0, 0, &rng);

		REQUIRE(d >= 0 && d <= 9, "%lld outside [0, 9]", (long long)d);
		count[d]++;
	}
	for (int v = 0; v < 10; v++)
		ck_assert_msg(abs(count[v] - DRAWS / 10) < DRAWS / 100,
		    "value %d drawn %d times of %d", v, count[v], DRAWS);
}
END_TEST

/*
 * Over n = 3 × 2^61 values, a plain x % n would return [0, 2^61) with
 * probability 3/8 instead of 1/3: this catches a biased reduction.
 */
START_TEST(test_uniform_large_range)
{
	int64_t n = 3 * (INT64_C(1) << 61);
	struct backoff_params p = P(RND, JITTER_NONE, 0, 2, n, 0, 0);
	struct backoff_rng rng;
	int low = 0;

	backoff_rng_seed(&rng, SEED);
	for (int i = 0; i < DRAWS; i++) {
		int64_t d = backoff_delay(&p, 0, 0, &rng);

		REQUIRE(d >= 0 && d < n, "%lld outside [0, n)", (long long)d);
		low += d < (INT64_C(1) << 61);
	}
	ck_assert_double_eq_tol((double)low / DRAWS, 1.0 / 3, 0.01);
}
END_TEST

/* ---- Ethernet: bounds per attempt, give-up at 16 ---- */

START_TEST(test_ethernet_attempt)
{
	struct backoff_params p = P(ETH, JITTER_NONE, 10, 2, HOUR_MS, 0, 0);
	long attempt = _i;
	int k = attempt + 1 < 10 ? (int)attempt + 1 : 10;
	int64_t bound = 10 * ((INT64_C(1) << k) - 1);
	int64_t seen_hi = 0, seen_lo = INT64_MAX;
	struct backoff_rng rng;
	double sum = 0, mean = (double)bound / 2;

	backoff_rng_seed(&rng, SEED + (uint64_t)attempt);
	for (int i = 0; i < DRAWS; i++) {
		int64_t d = backoff_delay(&p, attempt, 0, &rng);

		REQUIRE(d >= 0 && d <= bound && d % 10 == 0,
		    "attempt %ld: %lld not a slot multiple in [0, %lld]",
		    attempt, (long long)d, (long long)bound);
		seen_lo = d < seen_lo ? d : seen_lo;
		seen_hi = d > seen_hi ? d : seen_hi;
		sum += (double)d;
	}
	ck_assert_int_eq(seen_lo, 0);
	ck_assert_int_eq(seen_hi, bound);
	ck_assert_msg(fabs(sum / DRAWS - mean) <= 0.02 * mean,
	    "attempt %ld: mean %.2f, theory %.2f", attempt, sum / DRAWS, mean);
}
END_TEST

START_TEST(test_ethernet_gives_up)
{
	struct backoff_params p = P(ETH, JITTER_NONE, 10, 2, HOUR_MS, 0, 0);
	struct backoff_rng rng;
	static const long gone[] = { 16, 17, 100, 1000000, LONG_MAX };

	backoff_rng_seed(&rng, SEED);
	ck_assert_int_ge(backoff_delay(&p, 15, 0, &rng), 0);
	for (size_t i = 0; i < sizeof(gone) / sizeof(gone[0]); i++)
		ck_assert_int_eq(backoff_delay(&p, gone[i], 0, &rng), -1);
	/* A smaller max_attempts wins; a larger one cannot extend 16. */
	p.max_attempts = 3;
	ck_assert_int_eq(backoff_delay(&p, 3, 0, &rng), -1);
	p.max_attempts = 20;
	ck_assert_int_eq(backoff_delay(&p, 16, 0, &rng), -1);
}
END_TEST

/* ---- edge cases with one exact answer ---- */

static const struct edge_case {
	const char *name;
	struct backoff_params p;
	long attempt;
	int64_t want;
} edge_cases[] = {
	{ "attempt 1,000,000", P(EXP, JITTER_NONE, 100, 2, 30000, 0, 0),
	    1000000, 30000 },
	{ "attempt LONG_MAX", P(EXP, JITTER_NONE, 100, 2, 30000, 0, 0),
	    LONG_MAX, 30000 },
	{ "negative attempt counts as 0", P(EXP, JITTER_NONE, 100, 2, 30000,
	    0, 0), -5, 100 },
	{ "factor 1000, attempt 0", P(EXP, JITTER_NONE, 10, 1000, HOUR_MS, 0,
	    0), 0, 10 },
	{ "factor 1000, attempt 1", P(EXP, JITTER_NONE, 10, 1000, HOUR_MS, 0,
	    0), 1, 10000 },
	{ "factor 1000, attempt 2", P(EXP, JITTER_NONE, 10, 1000, HOUR_MS, 0,
	    0), 2, HOUR_MS },
	{ "factor 1000, attempt 1,000,000", P(EXP, JITTER_NONE, 10, 1000,
	    HOUR_MS, 0, 0), 1000000, HOUR_MS },
	{ "factor 1000 up to INT64_MAX", P(EXP, JITTER_NONE, 10, 1000,
	    INT64_MAX, 0, 0), 1000000, INT64_MAX },
	{ "factor 0.5 holds at init", P(EXP, JITTER_NONE, 100, 0.5, 30000, 0,
	    0), 3, 100 },
	{ "factor 0 holds at init", P(EXP, JITTER_NONE, 100, 0, 30000, 0, 0),
	    3, 100 },
	{ "negative factor holds at init", P(EXP, JITTER_NONE, 100, -2,
	    30000, 0, 0), 3, 100 },
	{ "NaN factor holds at init", P(EXP, JITTER_NONE, 100, NAN, 30000, 0,
	    0), 3, 100 },
	{ "infinite factor, attempt 0", P(EXP, JITTER_NONE, 100, INFINITY,
	    30000, 0, 0), 0, 100 },
	{ "infinite factor, attempt 1", P(EXP, JITTER_NONE, 100, INFINITY,
	    30000, 0, 0), 1, 30000 },
	{ "init 0", P(EXP, JITTER_NONE, 0, 2, 30000, 0, 0), 10, 0 },
	{ "init 0, 2^2000 is inf", P(EXP, JITTER_NONE, 0, 2, 30000, 0, 0),
	    2000, 0 },
	{ "negative init", P(EXP, JITTER_NONE, -100, 2, 30000, 0, 0), 3, 0 },
	{ "max 0", P(EXP, JITTER_NONE, 100, 2, 0, 0, 0), 3, 0 },
	{ "negative max", P(EXP, JITTER_NONE, 100, 2, -5, 0, 0), 3, 0 },
	{ "INT64_MAX x 2", P(EXP, JITTER_NONE, INT64_MAX, 2, INT64_MAX, 0, 0),
	    1, INT64_MAX },
	{ "just past INT64_MAX", P(EXP, JITTER_NONE, INT64_MAX / 2 + 1, 2,
	    INT64_MAX, 0, 0), 1, INT64_MAX },
	{ "3^40 > INT64_MAX", P(EXP, JITTER_NONE, 3, 3, INT64_MAX, 0, 0), 39,
	    INT64_MAX },
	{ "2^62 exactly", P(EXP, JITTER_NONE, 1, 2, INT64_MAX, 0, 0), 62,
	    INT64_C(1) << 62 },
	{ "fibonacci attempt 1,000,000", P(FIB, JITTER_NONE, 10, 2, HOUR_MS,
	    0, 0), 1000000, HOUR_MS },
	{ "fibonacci fib(92) fits", P(FIB, JITTER_NONE, 1, 2, INT64_MAX, 0,
	    0), 91, INT64_C(7540113804746346429) },
	{ "fibonacci fib(93) overflows", P(FIB, JITTER_NONE, 1, 2, INT64_MAX,
	    0, 0), 92, INT64_MAX },
	{ "fibonacci LONG_MAX", P(FIB, JITTER_NONE, 1, 2, INT64_MAX, 0, 0),
	    LONG_MAX, INT64_MAX },
	{ "fibonacci huge init", P(FIB, JITTER_NONE, INT64_MAX, 2, INT64_MAX,
	    0, 0), 5, INT64_MAX },
	{ "fixed, negative init", P(FIX, JITTER_NONE, -1, 2, 1000, 0, 0), 2,
	    0 },
	{ "random, empty range", P(RND, JITTER_NONE, 500, 2, 500, 0, 0), 0,
	    500 },
	{ "random, max 0", P(RND, JITTER_NONE, 0, 2, 0, 0, 0), 0, 0 },
	{ "ethernet, slot 0", P(ETH, JITTER_NONE, 0, 2, 1000, 0, 0), 5, 0 },
	{ "max_attempts 5, attempt 4", P(EXP, JITTER_NONE, 100, 2, HOUR_MS, 0,
	    5), 4, 1600 },
	{ "max_attempts 5, attempt 5", P(EXP, JITTER_NONE, 100, 2, HOUR_MS, 0,
	    5), 5, -1 },
	{ "max_attempts 5, attempt 1,000,000", P(EXP, JITTER_NONE, 100, 2,
	    HOUR_MS, 0, 5), 1000000, -1 },
	{ "negative max_attempts is unlimited", P(EXP, JITTER_NONE, 100, 2,
	    HOUR_MS, 0, -1), 3, 800 },
	{ "unknown strategy acts as exponential",
	    P((enum backoff_strategy)99, JITTER_NONE, 100, 2, HOUR_MS, 0, 0),
	    3, 800 },
	{ "unknown jitter acts as none",
	    P(EXP, (enum backoff_jitter)99, 100, 2, HOUR_MS, 0, 0), 3, 800 },
	{ "proportional, NaN jitter factor", P(EXP, JITTER_PROPORTIONAL, 100,
	    2, HOUR_MS, NAN, 0), 3, 800 },
	{ "proportional, jitter factor 0", P(EXP, JITTER_PROPORTIONAL, 100,
	    2, HOUR_MS, 0, 0), 3, 800 },
};

START_TEST(test_edge)
{
	const struct edge_case *c = &edge_cases[_i];
	struct backoff_rng rng;
	int64_t got;

	backoff_rng_seed(&rng, SEED);
	got = backoff_delay(&c->p, c->attempt, 0, &rng);
	ck_assert_msg(got == c->want, "%s: got %lld, want %lld", c->name,
	    (long long)got, (long long)c->want);
}
END_TEST

/* ---- random edge cases: only bounds are known ---- */

static const struct bound_case {
	const char *name;
	struct backoff_params p;
	long attempt;
	int64_t prev;
	int64_t lo, hi;
} bound_cases[] = {
	{ "decorrelated, 3 x INT64_MAX", P(EXP, JITTER_DECORRELATED, 100, 2,
	    INT64_MAX, 0, 0), 3, INT64_MAX, 100, INT64_MAX },
	{ "decorrelated, 3 x INT64_MAX capped", P(EXP, JITTER_DECORRELATED,
	    100, 2, HOUR_MS, 0, 0), 3, INT64_MAX, 100, HOUR_MS },
	{ "decorrelated, negative prev", P(EXP, JITTER_DECORRELATED, 100, 2,
	    HOUR_MS, 0, 0), 3, -5, 100, 300 },
	{ "decorrelated, init above cap", P(EXP, JITTER_DECORRELATED, 5000,
	    2, 1000, 0, 0), 3, 0, 1000, 1000 },
	{ "full at INT64_MAX", P(EXP, JITTER_FULL, 100, 2, INT64_MAX, 0, 0),
	    1000000, 0, 0, INT64_MAX },
	{ "equal at INT64_MAX", P(EXP, JITTER_EQUAL, 100, 2, INT64_MAX, 0, 0),
	    1000000, 0, INT64_MAX / 2, INT64_MAX },
	{ "proportional 1 at INT64_MAX", P(EXP, JITTER_PROPORTIONAL, 100, 2,
	    INT64_MAX, 1, 0), 1000000, 0, 0, INT64_MAX },
	{ "proportional factor 5 acts as 1", P(EXP, JITTER_PROPORTIONAL, 100,
	    2, HOUR_MS, 5, 0), 3, 0, 0, 1600 },
	{ "random up to INT64_MAX", P(RND, JITTER_NONE, 0, 2, INT64_MAX, 0,
	    0), 0, 0, 0, INT64_MAX - 1 },
	{ "ethernet, huge slot", P(ETH, JITTER_NONE, INT64_MAX / 2, 2,
	    INT64_MAX, 0, 0), 15, 0, 0, INT64_MAX },
	{ "ethernet, capped", P(ETH, JITTER_NONE, 10, 2, 100, 0, 0), 9, 0,
	    0, 100 },
	{ "ethernet ignores jitter", P(ETH, JITTER_FULL, 10, 2, HOUR_MS, 0,
	    0), 0, 0, 0, 10 },
};

START_TEST(test_bounds)
{
	const struct bound_case *c = &bound_cases[_i];
	struct backoff_rng rng;

	backoff_rng_seed(&rng, SEED);
	for (int i = 0; i < 2000; i++) {
		/* Every second draw uses the per-thread default generator. */
		int64_t d = backoff_delay(&c->p, c->attempt, c->prev,
		    i % 2 ? &rng : NULL);

		REQUIRE(d >= c->lo && d <= c->hi,
		    "%s: %lld outside [%lld, %lld]", c->name, (long long)d,
		    (long long)c->lo, (long long)c->hi);
	}
}
END_TEST

/* ---- validation messages for config and rows ---- */

static const struct check_case {
	const char *name;
	struct backoff_params p;
	const char *want;	/* NULL = valid, else a substring */
} check_cases[] = {
	{ "defaults", P(EXP, JITTER_NONE, 10000, 2, HOUR_MS, 0.5, 0), NULL },
	{ "factor 1", P(EXP, JITTER_NONE, 100, 1, HOUR_MS, 0.5, 0), NULL },
	{ "factor 1000", P(EXP, JITTER_NONE, 100, 1000, HOUR_MS, 0.5, 0),
	    NULL },
	{ "factor 0.5", P(EXP, JITTER_NONE, 100, 0.5, HOUR_MS, 0.5, 0),
	    "factor" },
	{ "factor 0", P(EXP, JITTER_NONE, 100, 0, HOUR_MS, 0.5, 0), "factor" },
	{ "factor -1", P(EXP, JITTER_NONE, 100, -1, HOUR_MS, 0.5, 0),
	    "factor" },
	{ "factor NaN", P(EXP, JITTER_NONE, 100, NAN, HOUR_MS, 0.5, 0),
	    "factor" },
	{ "factor inf", P(EXP, JITTER_NONE, 100, INFINITY, HOUR_MS, 0.5, 0),
	    "factor" },
	{ "init 0", P(EXP, JITTER_NONE, 0, 2, HOUR_MS, 0.5, 0),
	    "initial delay" },
	{ "init -1", P(EXP, JITTER_NONE, -1, 2, HOUR_MS, 0.5, 0),
	    "initial delay" },
	{ "random from 0", P(RND, JITTER_NONE, 0, 2, HOUR_MS, 0.5, 0), NULL },
	{ "random, negative min", P(RND, JITTER_NONE, -1, 2, HOUR_MS, 0.5, 0),
	    "initial delay" },
	{ "random, min = max", P(RND, JITTER_NONE, 1000, 2, 1000, 0.5, 0),
	    "random" },
	{ "max 0", P(EXP, JITTER_NONE, 100, 2, 0, 0.5, 0), "maximum delay" },
	{ "max -1", P(EXP, JITTER_NONE, 100, 2, -1, 0.5, 0), "maximum delay" },
	{ "init above max is clamped", P(EXP, JITTER_NONE, 7200000, 2,
	    HOUR_MS, 0.5, 0), NULL },
	{ "jitter factor 0", P(EXP, JITTER_PROPORTIONAL, 100, 2, HOUR_MS, 0,
	    0), NULL },
	{ "jitter factor 1", P(EXP, JITTER_PROPORTIONAL, 100, 2, HOUR_MS, 1,
	    0), NULL },
	{ "jitter factor 1.5", P(EXP, JITTER_PROPORTIONAL, 100, 2, HOUR_MS,
	    1.5, 0), "jitter factor" },
	{ "jitter factor -0.1", P(EXP, JITTER_PROPORTIONAL, 100, 2, HOUR_MS,
	    -0.1, 0), "jitter factor" },
	{ "jitter factor NaN", P(EXP, JITTER_NONE, 100, 2, HOUR_MS, NAN, 0),
	    "jitter factor" },
	{ "max_attempts -1", P(EXP, JITTER_NONE, 100, 2, HOUR_MS, 0.5, -1),
	    "attempts" },
	{ "max_attempts 16", P(EXP, JITTER_NONE, 100, 2, HOUR_MS, 0.5, 16),
	    NULL },
	{ "ethernet", P(ETH, JITTER_NONE, 10, 2, HOUR_MS, 0.5, 0), NULL },
	{ "ethernet with jitter", P(ETH, JITTER_FULL, 10, 2, HOUR_MS, 0.5, 0),
	    "jitter applies" },
	{ "random with jitter", P(RND, JITTER_PROPORTIONAL, 10, 2, HOUR_MS,
	    0.5, 0), "jitter applies" },
	{ "fixed with full", P(FIX, JITTER_FULL, 10, 2, HOUR_MS, 0.5, 0),
	    NULL },
	{ "fibonacci with equal", P(FIB, JITTER_EQUAL, 10, 2, HOUR_MS, 0.5,
	    0), NULL },
	{ "fixed with decorrelated", P(FIX, JITTER_DECORRELATED, 10, 2,
	    HOUR_MS, 0.5, 0), "decorrelated" },
	{ "exponential with decorrelated", P(EXP, JITTER_DECORRELATED, 10, 2,
	    HOUR_MS, 0.5, 0), NULL },
	{ "unknown strategy", P((enum backoff_strategy)99, JITTER_NONE, 10, 2,
	    HOUR_MS, 0.5, 0), "strategy" },
	{ "unknown jitter", P(EXP, (enum backoff_jitter)99, 10, 2, HOUR_MS,
	    0.5, 0), "jitter mode" },
};

START_TEST(test_check)
{
	const struct check_case *c = &check_cases[_i];
	const char *msg = backoff_params_check(&c->p);

	if (c->want == NULL)
		ck_assert_msg(msg == NULL, "%s: rejected: %s", c->name, msg);
	else
		ck_assert_msg(msg != NULL && strstr(msg, c->want) != NULL,
		    "%s: got \"%s\", want \"%s\"", c->name,
		    msg ? msg : "(accepted)", c->want);
}
END_TEST

START_TEST(test_defaults)
{
	struct backoff_params p;

	memset(&p, 0xff, sizeof(p));
	backoff_params_default(&p);
	ck_assert_ptr_null(backoff_params_check(&p));
	ck_assert_int_eq(p.strategy, BACKOFF_EXPONENTIAL);
	ck_assert_int_eq(p.jitter, JITTER_NONE);
	ck_assert_int_eq(p.init_ms, 10000);
	ck_assert_double_eq(p.factor, 2.0);
	ck_assert_int_eq(p.max_ms, HOUR_MS);
	ck_assert_int_eq(p.max_attempts, 0);
	ck_assert_double_eq(p.jitter_factor, 0.2);
	ck_assert_int_eq(backoff_delay(&p, 0, 0, NULL), 10000);
	ck_assert_int_eq(backoff_delay(&p, 4, 0, NULL), 160000);
}
END_TEST

/* ---- names ---- */

START_TEST(test_names)
{
	static const char *const bad[] = { "", "Exponential", "exp", "full ",
	    "jitter", NULL };
	enum backoff_strategy s = BACKOFF_FIXED;
	enum backoff_jitter j = JITTER_FULL;

	for (int i = BACKOFF_EXPONENTIAL; i <= BACKOFF_ETHERNET; i++) {
		const char *name = backoff_strategy_name(i);

		ck_assert_str_ne(name, "unknown");
		ck_assert_int_eq(backoff_strategy_parse(name, &s), 0);
		ck_assert_int_eq(s, i);
	}
	for (int i = JITTER_NONE; i <= JITTER_DECORRELATED; i++) {
		const char *name = backoff_jitter_name(i);

		ck_assert_str_ne(name, "unknown");
		ck_assert_int_eq(backoff_jitter_parse(name, &j), 0);
		ck_assert_int_eq(j, i);
	}
	ck_assert_str_eq(backoff_strategy_name(BACKOFF_ETHERNET), "ethernet");
	ck_assert_str_eq(backoff_jitter_name(JITTER_EQUAL), "equal");
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_int_eq(backoff_strategy_parse(bad[i], &s), -1);
		ck_assert_int_eq(backoff_jitter_parse(bad[i], &j), -1);
	}
	/* A failed parse leaves the output alone. */
	ck_assert_int_eq(s, BACKOFF_ETHERNET);
	ck_assert_int_eq(j, JITTER_DECORRELATED);
	ck_assert_str_eq(backoff_strategy_name((enum backoff_strategy)99),
	    "unknown");
	ck_assert_str_eq(backoff_jitter_name((enum backoff_jitter)-1),
	    "unknown");
}
END_TEST

/* ---- the generator ---- */

START_TEST(test_rng_repeatable)
{
	struct backoff_rng a, b, c;
	int differ = 0;

	backoff_rng_seed(&a, 42);
	backoff_rng_seed(&b, 42);
	backoff_rng_seed(&c, 43);
	for (int i = 0; i < 1000; i++) {
		uint64_t x = backoff_rng_next(&a);

		REQUIRE(x == backoff_rng_next(&b), "draw %d differs", i);
		differ += x != backoff_rng_next(&c);
	}
	ck_assert_int_ge(differ, 999);
	/* Seed 0 must not give the all-zero state xoshiro cannot leave. */
	backoff_rng_seed(&a, 0);
	ck_assert(a.s[0] | a.s[1] | a.s[2] | a.s[3]);
}
END_TEST

START_TEST(test_rng_quality)
{
	struct backoff_rng rng;
	int bits[64] = { 0 };
	double sum = 0;

	backoff_rng_seed(&rng, SEED);
	for (int i = 0; i < DRAWS; i++) {
		double u = backoff_rng_unit(&rng);
		uint64_t x = backoff_rng_next(&rng);

		REQUIRE(u >= 0.0 && u < 1.0, "unit draw %g", u);
		sum += u;
		for (int b = 0; b < 64; b++)
			bits[b] += (int)((x >> b) & 1);
	}
	ck_assert_double_eq_tol(sum / DRAWS, 0.5, 0.005);
	for (int b = 0; b < 64; b++)
		ck_assert_msg(abs(bits[b] - DRAWS / 2) < DRAWS / 100,
		    "bit %d set %d times of %d", b, bits[b], DRAWS);
}
END_TEST

START_TEST(test_rng_seed_random)
{
	struct backoff_rng a, b;

	backoff_rng_seed_random(&a);
	backoff_rng_seed_random(&b);
	ck_assert(a.s[0] | a.s[1] | a.s[2] | a.s[3]);
	ck_assert(memcmp(&a, &b, sizeof(a)) != 0);
}
END_TEST

/* ---- thread safety: no hidden state shared between callers ---- */

#define THREADS 4
#define THREAD_DRAWS 20000

struct thread_arg {
	int64_t sum;
	int out_of_bounds;
};

static void *
thread_main(void *v)
{
	struct thread_arg *arg = v;
	struct backoff_params p = P(EXP, JITTER_FULL, 100, 2, HOUR_MS, 0, 0);
	struct backoff_rng rng;

	backoff_rng_seed(&rng, SEED);
	for (int i = 0; i < THREAD_DRAWS; i++) {
		int64_t d = backoff_delay(&p, i % 20, 0, &rng);
		int64_t e = backoff_delay(&p, 3, 0, NULL);

		arg->sum += d;
		arg->out_of_bounds += d < 0 || d > HOUR_MS || e < 0 ||
		    e > 800;
	}
	return NULL;
}

START_TEST(test_threads)
{
	pthread_t t[THREADS];
	struct thread_arg args[THREADS + 1];

	memset(args, 0, sizeof(args));
	thread_main(&args[THREADS]);
	for (int i = 0; i < THREADS; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, thread_main,
		    &args[i]), 0);
	for (int i = 0; i < THREADS; i++)
		ck_assert_int_eq(pthread_join(t[i], NULL), 0);
	/* Same seed, same draws, whichever thread ran them. */
	for (int i = 0; i <= THREADS; i++) {
		ck_assert_int_eq(args[i].sum, args[THREADS].sum);
		ck_assert_int_eq(args[i].out_of_bounds, 0);
	}
}
END_TEST

/* ---- the cursor for reconnect loops ---- */

START_TEST(test_cursor_schedule)
{
	struct backoff_params p = P(EXP, JITTER_NONE, 100, 2, 1000, 0, 0);
	static const int64_t want[] = { 100, 200, 400, 800, 1000, 1000 };
	struct backoff_cursor c;

	backoff_cursor_init(&c, &p);
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		ck_assert_int_eq(backoff_cursor_next(&c), want[i]);
	ck_assert_int_eq(c.attempt, 6);
	ck_assert_int_eq(c.prev_ms, 1000);
	backoff_cursor_reset(&c);
	ck_assert_int_eq(c.attempt, 0);
	ck_assert_int_eq(backoff_cursor_next(&c), 100);
	ck_assert_int_eq(backoff_cursor_next(&c), 200);
}
END_TEST

START_TEST(test_cursor_never_gives_up)
{
	struct backoff_params p = P(EXP, JITTER_NONE, 100, 2, 1000, 0, 2);
	struct backoff_params e = P(ETH, JITTER_NONE, 10, 2, 5000, 0, 0);
	struct backoff_cursor c;

	backoff_cursor_init(&c, &p);
	ck_assert_int_eq(backoff_cursor_next(&c), 100);
	ck_assert_int_eq(backoff_cursor_next(&c), 200);
	ck_assert_int_eq(backoff_cursor_next(&c), 1000);
	ck_assert_int_eq(backoff_cursor_next(&c), 1000);

	backoff_cursor_init(&c, &e);
	backoff_cursor_seed(&c, SEED);
	for (int i = 0; i < 16; i++) {
		int64_t d = backoff_cursor_next(&c);

		ck_assert(d >= 0 && d <= 5000 && d % 10 == 0);
	}
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(backoff_cursor_next(&c), 5000);

	/* The counter saturates instead of overflowing. */
	backoff_cursor_init(&c, &p);
	c.attempt = LONG_MAX;
	ck_assert_int_eq(backoff_cursor_next(&c), 1000);
	ck_assert_int_eq(c.attempt, LONG_MAX);
}
END_TEST

START_TEST(test_cursor_decorrelated)
{
	struct backoff_params p = P(EXP, JITTER_DECORRELATED, 100, 2, 30000,
	    0, 0);
	struct backoff_cursor a, b;
	int64_t prev = 100, reached = 0;

	backoff_cursor_init(&a, &p);
	backoff_cursor_init(&b, &p);
	backoff_cursor_seed(&a, SEED);
	backoff_cursor_seed(&b, SEED);
	for (int i = 0; i < 1000; i++) {
		int64_t d = backoff_cursor_next(&a);
		int64_t hi = 3 * prev < 30000 ? 3 * prev : 30000;

		REQUIRE(d >= 100 && d <= hi,
		    "step %d: %lld outside [100, %lld]", i, (long long)d,
		    (long long)hi);
		REQUIRE(d == backoff_cursor_next(&b), "step %d: cursors differ",
		    i);
		REQUIRE(a.prev_ms == d, "step %d: prev_ms not kept", i);
		reached = d > reached ? d : reached;
		prev = d;
	}
	ck_assert_int_eq(reached, 30000);
	/* After a reset the previous delay is forgotten again. */
	backoff_cursor_reset(&a);
	ck_assert_int_eq(a.prev_ms, 0);
	for (int i = 0; i < 100; i++) {
		int64_t d;

		backoff_cursor_reset(&a);
		d = backoff_cursor_next(&a);
		REQUIRE(d >= 100 && d <= 300, "%lld outside [100, 300]",
		    (long long)d);
	}
}
END_TEST

static Suite *
backoff_suite(void)
{
	Suite *s = suite_create("backoff");
	TCase *tc;

	tc = tcase_create("schedules");
	tcase_add_loop_test(tc, test_schedule, 0,
	    sizeof(schedule_cases) / sizeof(schedule_cases[0]));
	tcase_add_loop_test(tc, test_edge, 0,
	    sizeof(edge_cases) / sizeof(edge_cases[0]));
	tcase_add_test(tc, test_defaults);
	suite_add_tcase(s, tc);

	tc = tcase_create("random");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_jitter_stats, 0,
	    sizeof(stat_cases) / sizeof(stat_cases[0]));
	tcase_add_test(tc, test_jitter_uniform);
	tcase_add_test(tc, test_uniform_large_range);
	tcase_add_loop_test(tc, test_ethernet_attempt, 0,
	    BACKOFF_ETHERNET_ATTEMPTS);
	tcase_add_test(tc, test_ethernet_gives_up);
	tcase_add_loop_test(tc, test_bounds, 0,
	    sizeof(bound_cases) / sizeof(bound_cases[0]));
	tcase_add_test(tc, test_rng_repeatable);
	tcase_add_test(tc, test_rng_quality);
	tcase_add_test(tc, test_rng_seed_random);
	tcase_add_test(tc, test_threads);
	suite_add_tcase(s, tc);

	tc = tcase_create("config");
	tcase_add_loop_test(tc, test_check, 0,
	    sizeof(check_cases) / sizeof(check_cases[0]));
	tcase_add_test(tc, test_names);
	suite_add_tcase(s, tc);

	tc = tcase_create("cursor");
	tcase_add_test(tc, test_cursor_schedule);
	tcase_add_test(tc, test_cursor_never_gives_up);
	tcase_add_test(tc, test_cursor_decorrelated);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(backoff_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
