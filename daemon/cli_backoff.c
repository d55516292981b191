/*
 * `outboxd backoff`: prints when each attempt of a row would run under a
 * backoff configuration and when the row would be dead, using the same
 * backoff_delay() the relay uses, so what it shows is what happens.
 */
#include "cli_backoff.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backoff.h"
#include "config.h"
#include "util.h"

#define EXIT_USAGE 2
/* max_retry_times is a smallint column. */
#define MAX_ATTEMPTS 32767

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: outboxd backoff [options]\n"
	    "\n"
	    "Prints when each attempt of a row runs and when the row is "
	    "dead.\n"
	    "\n"
	    "  --strategy NAME      exponential (default), fixed, random,\n"
	    "                       fibonacci, ethernet\n"
	    "  --jitter NAME        none (default), proportional, full, "
	    "equal,\n"
	    "                       decorrelated\n"
	    "  --jitter-factor F    for proportional: d x (1 +- F), F in "
	    "[0, 1]\n"
	    "                       (default 0.2, as in config)\n"
	    "  --init DURATION      first delay (init_backoff); the slot for\n"
	    "                       ethernet, the minimum for random "
	    "(default 10s)\n"
	    "  --factor F           growth per attempt (backoff_factor), "
	    ">= 1\n"
	    "                       (default 2)\n"
	    "  --max DURATION       cap on every delay; the maximum for "
	    "random\n"
	    "                       (default 1h)\n"
	    "  --attempts N         max_retry_times: the row is dead after N\n"
	    "                       failed attempts, 1..%d (default 5)\n"
	    "  --seed N             seed for the random strategies "
	    "(default: random)\n"
	    "  -h, --help           this text\n"
	    "\n"
	    "Durations: 250ms, 10s, 5m, 1h, 2d, or a number of ms.\n"
	    "Example: outboxd backoff --init 10s --factor 2 --max 1h "
	    "--attempts 8\n", MAX_ATTEMPTS);
}

static int
bad_usage(const char *what, const char *value)
{
	fprintf(stderr, "outboxd backoff: %s: '%s'\n", what, value);
	fprintf(stderr, "Try 'outboxd backoff --help'.\n");
	return EXIT_USAGE;
}

static int
parse_double(const char *s, double *out)
{
	char *end;

	errno = 0;
	*out = strtod(s, &end);
	if (end == s || *end != '\0' || errno != 0)
		return -1;
	return 0;
}

static int
parse_u64(const char *s, uint64_t *out)
{
	char *end;

	/* strtoull would accept "-1" as 2^64 - 1. */
	if (*s < '0' || *s > '9')
		return -1;
	errno = 0;
	*out = strtoull(s, &end, 10);
	if (*end != '\0' || errno != 0)
		return -1;
	return 0;
}

/*
 * A span for people: "250ms", "1.5s", "21m10s", "1d2h".  duration_format
 * prints exact config values ("1270s"); a cumulative time reads better
 * split into units.
 */
static char *
format_span(char *buf, size_t size, int64_t ms)
{
	static const struct {
		const char *unit;
		int64_t ms;
	} units[] = {
		{ "d", 86400000 }, { "h", 3600000 }, { "m", 60000 },
	};
	size_t len = 0;
	int64_t s, frac;

	if (ms < 1000) {
		snprintf(buf, size, "%" PRId64 "ms", ms);
		return buf;
	}
	buf[0] = '\0';
	for (size_t i = 0; i < ARRAY_LEN(units); i++) {
		if (ms < units[i].ms)
			continue;
		len += (size_t)snprintf(buf + len, size - len, "%" PRId64 "%s",
		    ms / units[i].ms, units[i].unit);
		ms %= units[i].ms;
		if (len >= size)
			return buf;
	}
	s = ms / 1000;
	frac = ms % 1000;
	if (frac != 0) {
		/* Trailing zeros of the fraction say nothing. */
		int digits = 3;

		while (frac % 10 == 0) {
			frac /= 10;
			digits--;
		}
		snprintf(buf + len, size - len, "%" PRId64 ".%0*" PRId64 "s",
		    s, digits, frac);
	} else if (s != 0) {
		snprintf(buf + len, size - len, "%" PRId64 "s", s);
	}
	return buf;
}

static bool
is_random(const struct backoff_params *p)
{
	return p->jitter != JITTER_NONE || p->strategy == BACKOFF_RANDOM ||
	    p->strategy == BACKOFF_ETHERNET;
}

static void
print_schedule(const struct backoff_params *p, int attempts, uint64_t seed)
{
	struct backoff_rng rng;
	char b1[64], b2[64], b3[64];
	int64_t at = 0, d = 0;
	int n;

	backoff_rng_seed(&rng, seed);
	printf("strategy=%s jitter=%s", backoff_strategy_name(p->strategy),
	    backoff_jitter_name(p->jitter));
	if (p->jitter == JITTER_PROPORTIONAL)
		printf(" jitter_factor=%g", p->jitter_factor);
	printf(" init=%s factor=%g max=%s attempts=%d",
	    duration_format(b1, sizeof(b1), p->init_ms), p->factor,
	    duration_format(b2, sizeof(b2), p->max_ms), attempts);
	if (is_random(p))
		printf(" seed=%" PRIu64, seed);
	printf("\n\n%7s  %12s  %14s\n", "attempt", "delay", "at");
	printf("%7d  %12s  %14s  (first try)\n", 1, "-", "0ms");

	/*
	 * Attempt k + 1 waits backoff_delay(k) after attempt k fails, as the
	 * relay does: attempt 0 of the API is the first retry.  A row keeps
	 * no previous delay, so the relay passes 0 (decorrelated then draws
	 * from [init, 3 x init] every time); passing the last one printed
	 * a schedule growing 1.5x a step that no row lives through.
	 */
	for (n = 1; n < attempts; n++) {
		d = backoff_delay(p, n - 1, 0, &rng);
		if (d < 0)
			break;
		at = d > INT64_MAX - at ? INT64_MAX : at + d;
		printf("%7d  %12s  %14s\n", n + 1,
		    format_span(b1, sizeof(b1), d),
		    format_span(b2, sizeof(b2), at));
	}
	format_span(b3, sizeof(b3), at);
	if (at >= 1000)		/* exact ms too, for scripts and checks */
		snprintf(b3 + strlen(b3), sizeof(b3) - strlen(b3),
		    " (%" PRId64 "ms)", at);
	if (d < 0)
		printf("dead: the %s strategy gives up after attempt %d "
		    "fails, %s after the first try\n",
		    backoff_strategy_name(p->strategy), n, b3);
	else
		printf("dead: after attempt %d fails, %s after the first try "
		    "(max_retry_times=%d)\n", attempts, b3, attempts);
}

int
cli_backoff(int argc, char **argv)
{
	enum { O_STRATEGY = 256, O_JITTER, O_JITTER_FACTOR, O_INIT, O_FACTOR,
	    O_MAX, O_ATTEMPTS, O_SEED };
	static const struct option opts[] = {
		{ "strategy", required_argument, NULL, O_STRATEGY },
		{ "jitter", required_argument, NULL, O_JITTER },
		{ "jitter-factor", required_argument, NULL, O_JITTER_FACTOR },
		{ "init", required_argument, NULL, O_INIT },
		{ "factor", required_argument, NULL, O_FACTOR },
		{ "max", required_argument, NULL, O_MAX },
		{ "attempts", required_argument, NULL, O_ATTEMPTS },
		{ "seed", required_argument, NULL, O_SEED },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	struct backoff_params p;
	struct backoff_rng seeder;
	uint64_t seed, u;
	bool seeded = false;
	int attempts = 5, opt;
	const char *msg;

	backoff_params_default(&p);
	/* 0 makes glibc reinitialise getopt after main's own parsing;
	 * errors are ours to word, since argv[0] is only "backoff". */
	optind = 0;
	opterr = 0;
	while ((opt = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
		switch (opt) {
		case O_STRATEGY:
			if (backoff_strategy_parse(optarg, &p.strategy) == -1)
				return bad_usage("unknown strategy", optarg);
			break;
		case O_JITTER:
			if (backoff_jitter_parse(optarg, &p.jitter) == -1)
				return bad_usage("unknown jitter", optarg);
			break;
		case O_JITTER_FACTOR:
			if (parse_double(optarg, &p.jitter_factor) == -1)
				return bad_usage("bad --jitter-factor", optarg);
			break;
		case O_INIT:
			if (duration_parse(optarg, &p.init_ms) == -1)
				return bad_usage("bad --init duration", optarg);
			break;
		case O_FACTOR:
			if (parse_double(optarg, &p.factor) == -1)
				return bad_usage("bad --factor", optarg);
			break;
		case O_MAX:
			if (duration_parse(optarg, &p.max_ms) == -1)
				return bad_usage("bad --max duration", optarg);
			/* As backoff.max: a schedule no config can have
			 * showed as if it could. */
			if (p.max_ms > CONFIG_BACKOFF_MAX_MS)
				return bad_usage("--max is backoff.max, at "
				    "most 30d", optarg);
			break;
		case O_ATTEMPTS:
			if (parse_u64(optarg, &u) == -1 || u < 1 ||
			    u > MAX_ATTEMPTS)
				return bad_usage("--attempts must be 1..32767",
				    optarg);
			attempts = (int)u;
			break;
		case O_SEED:
			if (parse_u64(optarg, &seed) == -1)
				return bad_usage("bad --seed", optarg);
			seeded = true;
			break;
		case 'h':
			usage(stdout);
			return 0;
		case ':':
			return bad_usage("option needs a value",
			    argv[optind - 1]);
		default:
			if (optopt != 0) {
				char flag[3] = { '-', (char)optopt, '\0' };

				return bad_usage("unknown option", flag);
			}
			return bad_usage("unknown option", argv[optind - 1]);
		}
	}
	if (optind < argc)
		return bad_usage("unexpected argument", argv[optind]);
	if ((msg = backoff_params_check(&p)) != NULL) {
		fprintf(stderr, "outboxd backoff: %s\n", msg);
		return EXIT_USAGE;
	}
	if (!seeded) {
		/* Printed in the header, so a run can be repeated. */
		backoff_rng_seed_random(&seeder);
		seed = backoff_rng_next(&seeder);
	}
	print_schedule(&p, attempts, seed);
	return 0;
}
