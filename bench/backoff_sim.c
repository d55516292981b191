/*
 * backoff_sim: N clients that collide on one shared resource retry with
 * each backoff strategy; prints the calls and the simulated time until
 * all have succeeded, to show why jitter matters (see docs/BACKOFF.md).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backoff.h"
#include "util.h"

/*
 * The model, after the experiment in Marc Brooker's "Exponential Backoff
 * And Jitter" (AWS Architecture Blog, 2015), written from its description:
 *
 * - Every client wants to make one successful write to the same item,
 *   and all start at t = 0 (the worst case: a shared failure just ended).
 * - A call takes `call` ms.  Writes use optimistic concurrency: a call
 *   reads the item's version when it starts and commits when it ends.
 *   The earliest call still pending opens a window of `call` ms; every
 *   call that starts inside that window read the same version, so only
 *   the first one commits and the others get a version conflict.
 * - A client that lost learns it when its call ends, then waits
 *   backoff_delay(attempt) and calls again.  Ethernet gives up after 16
 *   retries; the other strategies retry until they succeed.
 *
 * Time is simulated in whole milliseconds (the unit of backoff_delay),
 * so a run is instant and exactly repeatable with --seed.
 */

/* A run that makes this many calls is stopped and reported as such. */
#define CALL_LIMIT 100000000LL

struct sim_opts {
	int clients;
	int runs;
	int64_t call_ms;
	int64_t init_ms;
	double factor;
	int64_t max_ms;
	double jitter_factor;
	uint64_t seed;
};

struct client {
	long attempt;		/* failures so far = the next delay's index */
	int64_t prev_ms;	/* previous delay, for decorrelated jitter */
};

struct event {
	int64_t t;		/* when the client's next call starts */
	int id;
};

/* A binary min-heap of calls by start time, then client id, so that
 * ties resolve the same way on every run. */
struct heap {
	struct event *e;
	int n;
};

struct result {
	long long calls;
	int64_t done_ms;	/* when the last client finished */
	int gave_up;
	bool stopped;		/* hit CALL_LIMIT */
};

static bool
event_less(const struct event *a, const struct event *b)
{
	return a->t < b->t || (a->t == b->t && a->id < b->id);
}

static void
heap_push(struct heap *h, struct event ev)
{
	int i = h->n++;

	while (i > 0 && event_less(&ev, &h->e[(i - 1) / 2])) {
		h->e[i] = h->e[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h->e[i] = ev;
}

static struct event
heap_pop(struct heap *h)
{
	struct event top = h->e[0], last = h->e[--h->n];
	int i = 0;

	for (;;) {
		int c = 2 * i + 1;

		if (c >= h->n)
			break;
		if (c + 1 < h->n && event_less(&h->e[c + 1], &h->e[c]))
			c++;
		if (!event_less(&h->e[c], &last))
			break;
		h->e[i] = h->e[c];
		i = c;
	}
	if (h->n > 0)
		h->e[i] = last;
	return top;
}

static void
simulate(const struct sim_opts *o, const struct backoff_params *p,
    uint64_t seed, struct result *r)
{
	struct client *cl = xcalloc((size_t)o->clients, sizeof(*cl));
	struct heap h = { xcalloc((size_t)o->clients, sizeof(struct event)),
	    0 };
	struct backoff_rng rng;

	memset(r, 0, sizeof(*r));
	backoff_rng_seed(&rng, seed);
	for (int i = 0; i < o->clients; i++)
		heap_push(&h, (struct event){ 0, i });

	while (h.n > 0) {
		/* The earliest pending call wins its window. */
		struct event win = heap_pop(&h);
		int64_t window_end = win.t + o->call_ms;

		r->calls++;
		if (window_end > r->done_ms)
			r->done_ms = window_end;

		/* Everyone else who started in the window conflicts. */
		while (h.n > 0 && h.e[0].t < window_end) {
			struct event lose = heap_pop(&h);
			struct client *c = &cl[lose.id];
			int64_t end = lose.t + o->call_ms;
			int64_t d = backoff_delay(p, c->attempt, c->prev_ms,
			    &rng);

			r->calls++;
			if (d < 0) {
				r->gave_up++;
				if (end > r->done_ms)
					r->done_ms = end;
				continue;
			}
			c->attempt++;
			c->prev_ms = d;
			heap_push(&h, (struct event){ end + d, lose.id });
		}
		if (r->calls >= CALL_LIMIT) {
			r->stopped = true;
			break;
		}
	}
	free(h.e);
	free(cl);
}

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: backoff_sim [options]\n"
	    "\n"
	    "N clients write the same item at t = 0 with optimistic "
	    "concurrency:\n"
	    "of the calls that start within one call time of the earliest "
	    "pending\n"
	    "call, only that earliest one succeeds; the others back off and "
	    "retry.\n"
	    "Prints, per strategy, the calls made and the simulated time "
	    "until all\n"
	    "clients have succeeded (means over the runs).\n"
	    "\n"
	    "  --clients N          clients (default 100)\n"
	    "  --call DURATION      time a call takes = the conflict window "
	    "(10ms)\n"
	    "  --init DURATION      first delay; ethernet slot; random "
	    "minimum (10ms)\n"
	    "  --factor F           exponential growth (2)\n"
	    "  --max DURATION       cap on a delay; random maximum (10s)\n"
	    "  --jitter-factor F    for proportional jitter (0.2)\n"
	    "  --runs N             runs per strategy, seeds seed..seed+N-1 "
	    "(10)\n"
	    "  --seed N             first seed (1)\n"
	    "  -h, --help           this text\n");
}

static int
bad(const char *what, const char *value)
{
	fprintf(stderr, "backoff_sim: bad %s: '%s' (see --help)\n", what,
	    value);
	return 2;
}

static int
parse_int(const char *s, long long lo, long long hi, long long *out)
{
	char *end;

	errno = 0;
	*out = strtoll(s, &end, 10);
	if (end == s || *end != '\0' || errno != 0 || *out < lo || *out > hi)
		return -1;
	return 0;
}

static int
parse_double(const char *s, double *out)
{
	char *end;

	errno = 0;
	*out = strtod(s, &end);
	return end == s || *end != '\0' || errno != 0 ? -1 : 0;
}

static int
parse_opts(int argc, char **argv, struct sim_opts *o)
{
	enum { O_CLIENTS = 256, O_CALL, O_INIT, O_FACTOR, O_MAX, O_JF,
	    O_RUNS, O_SEED };
	static const struct option opts[] = {
		{ "clients", required_argument, NULL, O_CLIENTS },
		{ "call", required_argument, NULL, O_CALL },
		{ "init", required_argument, NULL, O_INIT },
		{ "factor", required_argument, NULL, O_FACTOR },
		{ "max", required_argument, NULL, O_MAX },
		{ "jitter-factor", required_argument, NULL, O_JF },
		{ "runs", required_argument, NULL, O_RUNS },
		{ "seed", required_argument, NULL, O_SEED },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long long v;
	int opt;

	while ((opt = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (opt) {
		case O_CLIENTS:
			if (parse_int(optarg, 1, 1000000, &v) == -1)
				return bad("--clients (1..1000000)", optarg);
			o->clients = (int)v;
			break;
		case O_CALL:
			if (duration_parse(optarg, &o->call_ms) == -1 ||
			    o->call_ms < 1)
				return bad("--call (at least 1ms)", optarg);
			break;
		case O_INIT:
			if (duration_parse(optarg, &o->init_ms) == -1)
				return bad("--init", optarg);
			break;
		case O_FACTOR:
			if (parse_double(optarg, &o->factor) == -1)
				return bad("--factor", optarg);
			break;
		case O_MAX:
			if (duration_parse(optarg, &o->max_ms) == -1)
				return bad("--max", optarg);
			break;
		case O_JF:
			if (parse_double(optarg, &o->jitter_factor) == -1)
				return bad("--jitter-factor", optarg);
			break;
		case O_RUNS:
			if (parse_int(optarg, 1, 10000, &v) == -1)
				return bad("--runs (1..10000)", optarg);
			o->runs = (int)v;
			break;
		case O_SEED:
			if (parse_int(optarg, 0, LLONG_MAX, &v) == -1)
				return bad("--seed", optarg);
			o->seed = (uint64_t)v;
			break;
		case 'h':
			usage(stdout);
			return 1;
		default:
			fprintf(stderr, "see backoff_sim --help\n");
			return 2;
		}
	}
	if (optind < argc)
		return bad("argument", argv[optind]);
	return 0;
}

int
main(int argc, char **argv)
{
	static const struct {
		const char *name;
		enum backoff_strategy strategy;
		enum backoff_jitter jitter;
	} rows[] = {
		{ "exponential, no jitter", BACKOFF_EXPONENTIAL, JITTER_NONE },
		{ "exponential, full jitter", BACKOFF_EXPONENTIAL,
		    JITTER_FULL },
		{ "exponential, equal jitter", BACKOFF_EXPONENTIAL,
		    JITTER_EQUAL },
		{ "exponential, decorrelated", BACKOFF_EXPONENTIAL,
		    JITTER_DECORRELATED },
		{ "exponential, proportional", BACKOFF_EXPONENTIAL,
		    JITTER_PROPORTIONAL },
		{ "fixed", BACKOFF_FIXED, JITTER_NONE },
		{ "random", BACKOFF_RANDOM, JITTER_NONE },
		{ "fibonacci", BACKOFF_FIBONACCI, JITTER_NONE },
		{ "ethernet", BACKOFF_ETHERNET, JITTER_NONE },
	};
	struct sim_opts o = {
		.clients = 100, .runs = 10, .call_ms = 10, .init_ms = 10,
		.factor = 2.0, .max_ms = 10000, .jitter_factor = 0.2,
		.seed = 1,
	};
	struct backoff_params params[ARRAY_LEN(rows)];
	char b1[32], b2[32], b3[32];
	const char *msg;
	int rc;

	if ((rc = parse_opts(argc, argv, &o)) != 0)
		return rc == 1 ? 0 : rc;
	/* Every row is checked before any output, as config would be. */
	for (size_t i = 0; i < ARRAY_LEN(rows); i++) {
		struct backoff_params *p = &params[i];

		backoff_params_default(p);
		p->strategy = rows[i].strategy;
		p->jitter = rows[i].jitter;
		p->init_ms = o.init_ms;
		p->factor = o.factor;
		p->max_ms = o.max_ms;
		p->jitter_factor = o.jitter_factor;
		if ((msg = backoff_params_check(p)) != NULL) {
			fprintf(stderr, "backoff_sim: %s: %s\n", rows[i].name,
			    msg);
			return 2;
		}
	}

	printf("backoff_sim: %d clients, call %s, init %s, factor %g, "
	    "max %s, jitter factor %g, %d runs from seed %" PRIu64 "\n\n",
	    o.clients, duration_format(b1, sizeof(b1), o.call_ms),
	    duration_format(b2, sizeof(b2), o.init_ms), o.factor,
	    duration_format(b3, sizeof(b3), o.max_ms), o.jitter_factor,
	    o.runs, o.seed);
	printf("%-28s %12s %12s %14s %8s\n", "strategy", "calls",
	    "calls/client", "all done (s)", "gave up");

	for (size_t i = 0; i < ARRAY_LEN(rows); i++) {
		double calls = 0, done = 0, gave_up = 0;
		bool stopped = false;

		for (int run = 0; run < o.runs; run++) {
			struct result r;

			simulate(&o, &params[i], o.seed + (uint64_t)run, &r);
			calls += (double)r.calls;
			done += (double)r.done_ms;
			gave_up += r.gave_up;
			stopped |= r.stopped;
		}
		printf("%-28s %12.0f %12.1f %14.3f %8.1f%s\n", rows[i].name,
		    calls / o.runs, calls / o.runs / o.clients,
		    done / o.runs / 1000.0, gave_up / o.runs,
		    stopped ? "  (stopped: call limit)" : "");
	}
	return 0;
}
