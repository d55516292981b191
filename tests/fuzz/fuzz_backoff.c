/*
 * Fuzzes backoff_delay() with every parameter taken from the input: a
 * row's init_backoff and backoff_factor come from producers, so NaN,
 * infinities, negatives, huge attempts and unknown strategies must all
 * give a delay in [0, max_ms] (or -1 for "give up"), never UB.
 */
#include <inttypes.h>
#include <string.h>

#include "backoff.h"
#include "fuzz.h"

/* Takes the next n bytes of the input (zeros once it runs out). */
static void
take(const uint8_t **data, size_t *size, void *out, size_t n)
{
	size_t k = *size < n ? *size : n;

	memset(out, 0, n);
	memcpy(out, *data, k);
	*data += k;
	*size -= k;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct backoff_params p;
	struct backoff_rng rng;
	struct backoff_cursor cur;
	uint8_t strategy, jitter;
	int64_t prev, max, d;
	uint64_t seed;
	long attempt;

	take(&data, &size, &strategy, 1);
	take(&data, &size, &jitter, 1);
	/* Mostly valid enums, sometimes one past them. */
	p.strategy = (enum backoff_strategy)(strategy % 7);
	p.jitter = (enum backoff_jitter)(jitter % 7);
	take(&data, &size, &p.init_ms, sizeof(p.init_ms));
	take(&data, &size, &p.factor, sizeof(p.factor));
	take(&data, &size, &p.max_ms, sizeof(p.max_ms));
	take(&data, &size, &p.jitter_factor, sizeof(p.jitter_factor));
	take(&data, &size, &p.max_attempts, sizeof(p.max_attempts));
	take(&data, &size, &attempt, sizeof(attempt));
	take(&data, &size, &prev, sizeof(prev));
	take(&data, &size, &seed, sizeof(seed));
	max = p.max_ms > 0 ? p.max_ms : 0;

	(void)backoff_params_check(&p);
	(void)backoff_strategy_name(p.strategy);
	(void)backoff_jitter_name(p.jitter);
	backoff_rng_seed(&rng, seed);
	d = backoff_delay(&p, attempt, prev, &rng);
	FUZZ_CHECK(d == -1 || (d >= 0 && d <= max),
	    "delay %" PRId64 " outside [0, %" PRId64 "]", d, max);
	if (d == -1)
		FUZZ_CHECK((p.max_attempts > 0 && attempt >= p.max_attempts) ||
		    (p.strategy == BACKOFF_ETHERNET &&
		    attempt >= BACKOFF_ETHERNET_ATTEMPTS),
		    "gave up at attempt %ld", attempt);

	/* A reconnect cursor never gives up and stays under the cap. */
	backoff_cursor_init(&cur, &p);
	backoff_cursor_seed(&cur, seed);
	for (int i = 0; i < 40; i++) {
		d = backoff_cursor_next(&cur);
		FUZZ_CHECK(d >= 0 && d <= max, "cursor step %d: %" PRId64, i,
		    d);
	}
	return 0;
}
