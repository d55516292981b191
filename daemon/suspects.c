/*
 * Suspects: a small table of row ids kept sorted, so that a batch looks
 * each row up by bisection.  It is written only when a connection is
 * lost with rows in flight, and read only while it holds any.
 */
#include "suspects.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

struct suspect {
	int64_t id;
	int64_t lost_ms;	/* monotonic time of its last loss */
	enum suspect_level level;
};

struct suspects {
	pthread_mutex_t mu;
	struct suspect *v;	/* sorted by id */
	size_t n, cap;
	atomic_size_t count;	/* n, for readers without the lock */
};

struct suspects *
suspects_new(size_t cap)
{
	struct suspects *s = xcalloc(1, sizeof(*s));

	pthread_mutex_init(&s->mu, NULL);
	s->cap = cap > 0 ? cap : 1;
	s->v = xcalloc(s->cap, sizeof(*s->v));
	atomic_init(&s->count, 0);
	return s;
}

void
suspects_free(struct suspects *s)
{
	if (s == NULL)
		return;
	pthread_mutex_destroy(&s->mu);
	free(s->v);
	free(s);
}

int
suspects_any(const struct suspects *s)
{
	return atomic_load_explicit(&s->count, memory_order_relaxed) > 0;
}

size_t
suspects_count(const struct suspects *s)
{
	return atomic_load_explicit(&s->count, memory_order_relaxed);
}

/* Where id is, or would go, in s->v; *found says which.  Lock held. */
static size_t
find(const struct suspects *s, int64_t id, int *found)
{
	size_t lo = 0, hi = s->n;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (s->v[mid].id < id)
			lo = mid + 1;
		else
			hi = mid;
	}
	*found = lo < s->n && s->v[lo].id == id;
	return lo;
}

/* Lock held. */
static void
remove_at(struct suspects *s, size_t i)
{
	memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof(*s->v));
	s->n--;
	atomic_store_explicit(&s->count, s->n, memory_order_relaxed);
}

static int
forgotten(const struct suspect *x, int64_t now_ms)
{
	return now_ms - x->lost_ms > SUSPECT_FORGET_MS;
}

/* Makes room for one more: forgets every expired row, and if none was,
 * the one lost longest ago.  Lock held; s->n == s->cap. */
static void
make_room(struct suspects *s, int64_t now_ms)
{
	size_t kept = 0, oldest = 0;

	for (size_t i = 0; i < s->n; i++)
		if (!forgotten(&s->v[i], now_ms))
			s->v[kept++] = s->v[i];
	s->n = kept;
	if (s->n == s->cap) {
		for (size_t i = 1; i < s->n; i++)
			if (s->v[i].lost_ms < s->v[oldest].lost_ms)
				oldest = i;
		remove_at(s, oldest);
	}
	atomic_store_explicit(&s->count, s->n, memory_order_relaxed);
}

enum suspect_level
suspects_level(struct suspects *s, int64_t id, int64_t now_ms)
{
	enum suspect_level level = SUSPECT_NONE;
	size_t i;
	int found;

	if (!suspects_any(s))
		return SUSPECT_NONE;
	pthread_mutex_lock(&s->mu);
	i = find(s, id, &found);
	if (found && forgotten(&s->v[i], now_ms))
		remove_at(s, i);
	else if (found)
		level = s->v[i].level;
	pthread_mutex_unlock(&s->mu);
	return level;
}

enum suspect_level
suspects_lost(struct suspects *s, int64_t id, int64_t now_ms)
{
	enum suspect_level before = SUSPECT_NONE;
	size_t i;
	int found;

	pthread_mutex_lock(&s->mu);
	i = find(s, id, &found);
	if (found && !forgotten(&s->v[i], now_ms))
		before = s->v[i].level;
	if (!found) {
		if (s->n == s->cap) {
			make_room(s, now_ms);
			i = find(s, id, &found);
		}
		memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof(*s->v));
		s->n++;
		atomic_store_explicit(&s->count, s->n, memory_order_relaxed);
	}
	s->v[i].id = id;
	s->v[i].lost_ms = now_ms;
	s->v[i].level = before == SUSPECT_NONE ? SUSPECT_GROUP : SUSPECT_ALONE;
	pthread_mutex_unlock(&s->mu);
	return before;
}

void
suspects_clear(struct suspects *s, int64_t id)
{
	size_t i;
	int found;

	if (!suspects_any(s))
		return;
	pthread_mutex_lock(&s->mu);
	i = find(s, id, &found);
	if (found)
		remove_at(s, i);
	pthread_mutex_unlock(&s->mu);
}
