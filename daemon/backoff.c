/*
 * Backoff delays for every strategy of seeds 001–004, computed with no
 * hidden state so the relay and any thread can call them freely.  Every
 * input has a defined result; nothing here can overflow.
 */
#include "backoff.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

static const char *const strategy_names[] = {
	[BACKOFF_EXPONENTIAL] = "exponential",
	[BACKOFF_FIXED] = "fixed",
	[BACKOFF_RANDOM] = "random",
	[BACKOFF_FIBONACCI] = "fibonacci",
	[BACKOFF_ETHERNET] = "ethernet",
};

static const char *const jitter_names[] = {
	[JITTER_NONE] = "none",
	[JITTER_PROPORTIONAL] = "proportional",
	[JITTER_FULL] = "full",
	[JITTER_EQUAL] = "equal",
	[JITTER_DECORRELATED] = "decorrelated",
};

#define N_STRATEGIES (sizeof(strategy_names) / sizeof(strategy_names[0]))
#define N_JITTERS (sizeof(jitter_names) / sizeof(jitter_names[0]))

/* splitmix64: spreads one seed word over the xoshiro state, as its
 * authors recommend, so that nearby seeds give unrelated streams. */
static uint64_t
splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static uint64_t
rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

void
backoff_rng_seed(struct backoff_rng *rng, uint64_t seed)
{
	for (size_t i = 0; i < 4; i++)
		rng->s[i] = splitmix64(&seed);
}

void
backoff_rng_seed_random(struct backoff_rng *rng)
{
	struct timespec rt, mt;
	uint64_t x;

	/* GRND_NONBLOCK: jitter needs no cryptographic seed, and a daemon
	 * started early at boot must not hang waiting for entropy. */
	if (getrandom(rng->s, sizeof(rng->s), GRND_NONBLOCK) ==
	    (ssize_t)sizeof(rng->s) &&
	    (rng->s[0] | rng->s[1] | rng->s[2] | rng->s[3]) != 0)
		return;
	clock_gettime(CLOCK_REALTIME, &rt);
	clock_gettime(CLOCK_MONOTONIC, &mt);
	x = (uint64_t)rt.tv_sec * 1000000000ULL + (uint64_t)rt.tv_nsec;
	x ^= ((uint64_t)mt.tv_nsec << 20) ^ ((uint64_t)getpid() << 40);
	x ^= (uint64_t)(uintptr_t)rng;
	backoff_rng_seed(rng, x);
}

/* xoshiro256** (Blackman and Vigna): fast, 256 bits of state, and good
 * enough statistically for jitter and simulations. */
uint64_t
backoff_rng_next(struct backoff_rng *rng)
{
	uint64_t *s = rng->s;
	uint64_t result = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;

	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

double
backoff_rng_unit(struct backoff_rng *rng)
{
	/* The top 53 bits fill a double's mantissa exactly. */
	return (double)(backoff_rng_next(rng) >> 11) * 0x1.0p-53;
}

/* Uniform integer in [0, n - 1] without modulo bias; 0 when n is 0. */
static uint64_t
rng_below(struct backoff_rng *rng, uint64_t n)
{
	uint64_t threshold, x;

	if (n == 0)
		return 0;
	/* Values below 2^64 mod n would make the low residues likelier. */
	threshold = -n % n;
	do
		x = backoff_rng_next(rng);
	while (x < threshold);
	return x % n;
}

/* Uniform integer in [lo, hi]; needs 0 <= lo <= hi. */
static int64_t
rng_between(struct backoff_rng *rng, int64_t lo, int64_t hi)
{
	/* hi - lo + 1 <= 2^63 fits in uint64_t. */
	return lo + (int64_t)rng_below(rng, (uint64_t)(hi - lo) + 1);
}

/* A NULL rng means "use a good default": one generator per thread,
 * seeded from getrandom(2) on first use, so callers share no state. */
static struct backoff_rng *
rng_or_default(struct backoff_rng *rng)
{
	static _Thread_local struct backoff_rng tl_rng;
	static _Thread_local int tl_seeded;

	if (rng != NULL)
		return rng;
	if (!tl_seeded) {
		backoff_rng_seed_random(&tl_rng);
		tl_seeded = 1;
	}
	return &tl_rng;
}

void
backoff_params_default(struct backoff_params *p)
{
	memset(p, 0, sizeof(*p));
	p->strategy = BACKOFF_EXPONENTIAL;
	p->jitter = JITTER_NONE;
	p->init_ms = 10000;
	p->factor = 2.0;
	p->max_ms = 3600000;
	p->jitter_factor = 0.2;
	p->max_attempts = 0;
}

/* Sets the names of the settings a problem is about (the second may be
 * NULL) and returns the message. */
static const char *
culprits(const char **keys, const char *first, const char *second,
    const char *msg)
{
	keys[0] = first;
	keys[1] = second;
	return msg;
}

const char *
backoff_params_check_keys(const struct backoff_params *p,
    const char *keys[2])
{
	const char **k = keys;

	if ((unsigned)p->strategy >= N_STRATEGIES)
		return culprits(k, "strategy", NULL,
		    "unknown backoff strategy");
	if ((unsigned)p->jitter >= N_JITTERS)
		return culprits(k, "jitter", NULL, "unknown jitter mode");
	if (p->init_ms < 0)
		return culprits(k, "init", NULL,
		    "initial delay must not be negative");
	if (p->init_ms == 0 && p->strategy != BACKOFF_RANDOM)
		return culprits(k, "init", "strategy",
		    "initial delay must be at least 1ms "
		    "(0 would retry in a busy loop)");
	if (p->max_ms <= 0)
		return culprits(k, "max", NULL,
		    "maximum delay must be at least 1ms");
	if (p->strategy == BACKOFF_RANDOM && p->init_ms >= p->max_ms)
		return culprits(k, "init", "max", "random needs the minimum "
		    "(initial delay) below the maximum");
	/* !(x >= 1) also catches NaN. */
	if (!(p->factor >= 1.0) || isinf(p->factor))
		return culprits(k, "factor", NULL,
		    "factor must be a finite number of at least 1");
	if (!(p->jitter_factor >= 0.0 && p->jitter_factor <= 1.0))
		return culprits(k, "jitter_factor", NULL,
		    "jitter factor must be between 0 and 1");
	if (p->max_attempts < 0)
		return culprits(k, "max_attempts", NULL, "maximum attempts "
		    "must not be negative (0 = unlimited)");
	if (p->jitter != JITTER_NONE && (p->strategy == BACKOFF_RANDOM ||
	    p->strategy == BACKOFF_ETHERNET))
		return culprits(k, "jitter", "strategy", "jitter applies only "
		    "to the exponential, fixed and fibonacci strategies "
		    "(random and ethernet are random already)");
	if (p->jitter == JITTER_DECORRELATED &&
	    p->strategy != BACKOFF_EXPONENTIAL)
		return culprits(k, "jitter", "strategy", "decorrelated jitter "
		    "replaces the schedule: use it with the exponential "
		    "strategy");
	return culprits(k, NULL, NULL, NULL);
}

const char *
backoff_params_check(const struct backoff_params *p)
{
	const char *keys[2];

	return backoff_params_check_keys(p, keys);
}

/* init × factor^attempt, clamped to max; init and max are >= 0. */
static int64_t
exponential(int64_t init, double factor, long attempt, int64_t max)
{
	double d;

	if (init >= max)
		return max;
	/* Early, so that 0 × inf cannot turn into NaN below. */
	if (init == 0)
		return 0;
	/* factor < 1 would shrink delays towards 0: hold them at init. */
	if (!(factor > 1.0) || attempt == 0)
		return init;
	/* pow() saturates to +inf, never traps; inf and anything at or
	 * past max (even past INT64_MAX) clamp before the conversion. */
	d = (double)init * pow(factor, (double)attempt);
	if (!(d < (double)max))
		return max;
	/* d < max <= INT64_MAX: the conversion is defined; rounding of
	 * (double)max cannot take the result past max, but be sure. */
	return (int64_t)d < max ? (int64_t)d : max;
}

/* init × fib(attempt + 1), fib = 1, 1, 2, 3, 5, …, clamped to max. */
static int64_t
fibonacci(int64_t init, long attempt, int64_t max)
{
	uint64_t a = 1, b = 1, limit, t;

	if (init == 0)
		return 0;
	/* a × init <= max exactly when a <= max / init. */
	limit = (uint64_t)(max / init);
	for (long i = 0; i < attempt; i++) {
		/* fib(attempt + 1) >= b: past the limit already.  This
		 * also bounds the loop to ~92 turns for any attempt, and
		 * keeps a + b below 2^64. */
		if (b > limit)
			return max;
		t = a + b;
		a = b;
		b = t;
	}
	if (a > limit)
		return max;
	return (int64_t)a * init;
}

/* slot × r, r uniform in [0, 2^min(attempt + 1, 10) − 1]. */
static int64_t
ethernet(int64_t slot, long attempt, int64_t max, struct backoff_rng *rng)
{
	long k = attempt + 1 < BACKOFF_ETHERNET_CEILING ? attempt + 1 :
	    BACKOFF_ETHERNET_CEILING;
	uint64_t r;

	if (slot == 0)
		return 0;
	r = rng_below(rng_or_default(rng), (uint64_t)1 << k);
	if (r > (uint64_t)(max / slot))
		return max;
	return (int64_t)r * slot;
}

/* d × (1 + f × u), u uniform in [-1, 1]; 0 <= d <= max. */
static int64_t
proportional(int64_t d, double f, int64_t max, struct backoff_rng *rng)
{
	double u, x;

	if (!(f > 0.0))
		return d;
	if (f > 1.0)
		f = 1.0;
	u = 2.0 * backoff_rng_unit(rng_or_default(rng)) - 1.0;
	x = (double)d * (1.0 + f * u);
	if (!(x > 0.0))
		return 0;
	if (!(x < (double)max))
		return max;
	return (int64_t)x < max ? (int64_t)x : max;
}

/* min(cap, uniform in [init, 3 × prev]), prev <= 0 meaning init. */
static int64_t
decorrelated(int64_t init, int64_t prev, int64_t max,
    struct backoff_rng *rng)
{
	int64_t hi, d;

	if (prev <= 0)
		prev = init;
	hi = prev > INT64_MAX / 3 ? INT64_MAX : 3 * prev;
	if (hi < init)
		hi = init;
	d = rng_between(rng_or_default(rng), init, hi);
	return d < max ? d : max;
}

int64_t
backoff_delay(const struct backoff_params *p, long attempt, int64_t prev_ms,
    struct backoff_rng *rng)
{
	int64_t init = p->init_ms > 0 ? p->init_ms : 0;
	int64_t max = p->max_ms > 0 ? p->max_ms : 0;
	int64_t d;

	if (attempt < 0)
		attempt = 0;
	if (p->max_attempts > 0 && attempt >= p->max_attempts)
		return -1;

	switch (p->strategy) {
	case BACKOFF_RANDOM:
		/* [init, max): an empty range degenerates to max. */
		if (init >= max)
			return max;
		return rng_between(rng_or_default(rng), init, max - 1);
	case BACKOFF_ETHERNET:
		if (attempt >= BACKOFF_ETHERNET_ATTEMPTS)
			return -1;
		return ethernet(init, attempt, max, rng);
	case BACKOFF_FIXED:
		d = init < max ? init : max;
		break;
	case BACKOFF_FIBONACCI:
		d = fibonacci(init, attempt, max);
		break;
	case BACKOFF_EXPONENTIAL:
	default:
		/* An unknown strategy (never valid config) gets the
		 * seed's default rather than undefined behaviour. */
		if (p->jitter == JITTER_DECORRELATED)
			return decorrelated(init, prev_ms, max, rng);
		d = exponential(init, p->factor, attempt, max);
		break;
	}

	/* d is in [0, max] here; every jitter keeps it there. */
	switch (p->jitter) {
	case JITTER_PROPORTIONAL:
		return proportional(d, p->jitter_factor, max, rng);
	case JITTER_FULL:
		return rng_between(rng_or_default(rng), 0, d);
	case JITTER_EQUAL:
		return rng_between(rng_or_default(rng), d / 2, d);
	case JITTER_DECORRELATED:	/* with fixed or fibonacci */
		return decorrelated(init, prev_ms, max, rng);
	case JITTER_NONE:
	default:
		return d;
	}
}

void
backoff_cursor_init(struct backoff_cursor *c, const struct backoff_params *p)
{
	c->params = *p;
	backoff_rng_seed_random(&c->rng);
	c->attempt = 0;
	c->prev_ms = 0;
}

void
backoff_cursor_seed(struct backoff_cursor *c, uint64_t seed)
{
	backoff_rng_seed(&c->rng, seed);
}

int64_t
backoff_cursor_next(struct backoff_cursor *c)
{
	int64_t d = backoff_delay(&c->params, c->attempt, c->prev_ms,
	    &c->rng);

	/* Reconnects never give up: past the limit, wait the cap. */
	if (d < 0)
		d = c->params.max_ms > 0 ? c->params.max_ms : 0;
	c->prev_ms = d;
	if (c->attempt < LONG_MAX)
		c->attempt++;
	return d;
}

void
backoff_cursor_reset(struct backoff_cursor *c)
{
	c->attempt = 0;
	c->prev_ms = 0;
}

int
backoff_strategy_parse(const char *s, enum backoff_strategy *out)
{
	for (size_t i = 0; s != NULL && i < N_STRATEGIES; i++) {
		if (strcmp(s, strategy_names[i]) == 0) {
			*out = (enum backoff_strategy)i;
			return 0;
		}
	}
	return -1;
}

int
backoff_jitter_parse(const char *s, enum backoff_jitter *out)
{
	for (size_t i = 0; s != NULL && i < N_JITTERS; i++) {
		if (strcmp(s, jitter_names[i]) == 0) {
			*out = (enum backoff_jitter)i;
			return 0;
		}
	}
	return -1;
}

const char *
backoff_strategy_name(enum backoff_strategy s)
{
	if ((unsigned)s >= N_STRATEGIES)
		return "unknown";
	return strategy_names[s];
}

const char *
backoff_jitter_name(enum backoff_jitter j)
{
	if ((unsigned)j >= N_JITTERS)
		return "unknown";
	return jitter_names[j];
}
