/*
 * Backoff: pure functions that say how long to wait before attempt n+1,
 * for every strategy of the seeds, plus a small cursor for reconnect
 * loops.  All times are milliseconds; every input has a defined result.
 */
#ifndef OUTBOXD_BACKOFF_H
#define OUTBOXD_BACKOFF_H

#include <stdbool.h>
#include <stdint.h>

enum backoff_strategy {
	BACKOFF_EXPONENTIAL,	/* init × factor^n, capped (seed 001/002) */
	BACKOFF_FIXED,		/* init every time */
	BACKOFF_RANDOM,		/* uniform in [min, max) (seed 003) */
	BACKOFF_FIBONACCI,	/* init × fib(n+1): 1,1,2,3,5,… (seed 003) */
	BACKOFF_ETHERNET,	/* slot × r, r in [0, 2^min(n,10) − 1] (004) */
};

/*
 * Truncated binary exponential backoff as in Ethernet (seed 004): after
 * n = attempt + 1 collisions r is drawn from [0, 2^min(n, 10) − 1], and
 * attempt 16 gives up.
 */
#define BACKOFF_ETHERNET_CEILING 10
#define BACKOFF_ETHERNET_ATTEMPTS 16

enum backoff_jitter {
	JITTER_NONE,
	JITTER_PROPORTIONAL,	/* d × (1 ± f), f = jitter_factor (seed 003) */
	JITTER_FULL,		/* uniform in [0, d] */
	JITTER_EQUAL,		/* d/2 + uniform in [0, d/2] */
	JITTER_DECORRELATED,	/* min(cap, uniform in [init, 3 × prev]) */
};

/*
 * Jitter applies to the deterministic strategies (exponential, fixed,
 * fibonacci); random and ethernet are random already and ignore it.
 * Decorrelated replaces the schedule, so it goes with exponential only.
 * backoff_params_check() rejects the other combinations.
 */

struct backoff_params {
	enum backoff_strategy strategy;
	enum backoff_jitter jitter;
	int64_t init_ms;	/* first delay; slot for ethernet; min for
				 * random (where 0 is allowed) */
	double factor;		/* growth per attempt (exponential) */
	int64_t max_ms;		/* cap on every delay; max for random */
	double jitter_factor;	/* for JITTER_PROPORTIONAL, in [0, 1] */
	int max_attempts;	/* 0 = unlimited; ethernet gives up after 16 */
};

/* A seedable generator (xoshiro256** style); never rand(). */
struct backoff_rng {
	uint64_t s[4];
};

void backoff_rng_seed(struct backoff_rng *, uint64_t seed);
/* Seeds from getrandom(2); falls back to time and pid if that fails. */
void backoff_rng_seed_random(struct backoff_rng *);
uint64_t backoff_rng_next(struct backoff_rng *);
/* Uniform double in [0, 1). */
double backoff_rng_unit(struct backoff_rng *);

/* Fills p with the defaults: exponential, no jitter, 10 s, ×2, 1 h cap,
 * jitter_factor 0.2 (used only by proportional jitter; config's default
 * too), no attempt limit. */
void backoff_params_default(struct backoff_params *);

/*
 * Returns NULL when p is usable, or a static message saying what is
 * wrong ("factor must be a finite number of at least 1", …) for config
 * and row validation.  backoff_delay() does not need it: it clamps bad
 * values instead (negative → 0, factor < 1 or NaN → 1, see
 * docs/BACKOFF.md), but a config or row that fails it should be refused.
 */
const char *backoff_params_check(const struct backoff_params *);
/* The same, and keys[0] and keys[1] name the settings the problem is
 * about ("init", "max", "jitter", "strategy", …; keys[1] NULL when one
 * is), so that a config error can point at the one that was written. */
const char *backoff_params_check_keys(const struct backoff_params *,
    const char *keys[2]);

/*
 * Delay before the next attempt after `attempt` failures have been seen
 * (attempt 0 = the first retry waits init).  prev_ms is the previous
 * delay, used only by JITTER_DECORRELATED (pass 0 for the first).  rng may
 * be NULL: deterministic strategies then draw nothing, and the others
 * use a per-thread generator seeded from getrandom(2).  The result is in
 * [0, max_ms]; huge attempts and overflow clamp to max_ms, a negative
 * attempt counts as 0.  Returns -1 when the strategy gives up (attempt
 * >= max_attempts, or ethernet's 16).  Thread-safe: the only state is
 * *rng.
 */
int64_t backoff_delay(const struct backoff_params *, long attempt,
    int64_t prev_ms, struct backoff_rng *);

/* For reconnect loops: remembers the attempt count and previous delay. */
struct backoff_cursor {
	struct backoff_params params;
	struct backoff_rng rng;
	long attempt;
	int64_t prev_ms;
};

/* Copies the params and seeds the cursor's generator from getrandom(2). */
void backoff_cursor_init(struct backoff_cursor *,
    const struct backoff_params *);
/* Reseeds the cursor's generator, for reproducible tests. */
void backoff_cursor_seed(struct backoff_cursor *, uint64_t seed);
/* The delay to wait now; advances the cursor.  Never -1: a cursor that
 * ran past max_attempts keeps returning max_ms (reconnects never give up). */
int64_t backoff_cursor_next(struct backoff_cursor *);
void backoff_cursor_reset(struct backoff_cursor *);

/* Names used by config and the CLI: "exponential", "full", …  The parse
 * functions return 0, or -1 for an unknown name; the name functions
 * return "unknown" for a value outside the enum. */
int backoff_strategy_parse(const char *, enum backoff_strategy *)
    __attribute__((warn_unused_result));
int backoff_jitter_parse(const char *, enum backoff_jitter *)
    __attribute__((warn_unused_result));
const char *backoff_strategy_name(enum backoff_strategy);
const char *backoff_jitter_name(enum backoff_jitter);

#endif
