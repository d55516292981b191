/*
 * Refused rows: a small unsorted table.  It is written only when the
 * database refuses a row's every mark, and read at each claim only
 * while it holds any: one atomic read otherwise.
 */
#include "refused.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "util.h"

struct refused_row {
	int64_t id;
	int64_t until_ms;	/* left out of claims until then */
	int64_t wait_ms;	/* the last wait, doubled at the next refusal */
};

struct refused {
	pthread_mutex_t mu;
	struct refused_row *v;
	size_t n, cap;
	atomic_size_t count;	/* n, for readers without the lock */
};

struct refused *
refused_new(size_t cap)
{
	struct refused *t = xcalloc(1, sizeof(*t));

	pthread_mutex_init(&t->mu, NULL);
	t->cap = cap > 0 ? cap : 1;
	t->v = xcalloc(t->cap, sizeof(*t->v));
	atomic_init(&t->count, 0);
	return t;
}

void
refused_free(struct refused *t)
{
	if (t == NULL)
		return;
	pthread_mutex_destroy(&t->mu);
	free(t->v);
	free(t);
}

size_t
refused_count(const struct refused *t)
{
	return atomic_load_explicit(&t->count, memory_order_relaxed);
}

/* id's place in t->v, or t->n.  Lock held. */
static size_t
find(const struct refused *t, int64_t id)
{
	size_t i = 0;

	while (i < t->n && t->v[i].id != id)
		i++;
	return i;
}

/* Lock held. */
static void
drop(struct refused *t, size_t i)
{
	t->v[i] = t->v[--t->n];
	atomic_store_explicit(&t->count, t->n, memory_order_relaxed);
}

int64_t
refused_hold(struct refused *t, int64_t id, int64_t init_ms,
    int64_t max_ms, int64_t now_ms, enum refused_entry *entry)
{
	struct refused_row *r;
	size_t i;
	int64_t wait;

	pthread_mutex_lock(&t->mu);
	i = find(t, id);
	*entry = i < t->n ? REFUSED_AGAIN : t->n == t->cap ?
	    REFUSED_EVICTED : REFUSED_NEW;
	if (*entry == REFUSED_EVICTED) {
		/* Full: the row due for its try first gives way. */
		i = 0;
		for (size_t k = 1; k < t->n; k++)
			if (t->v[k].until_ms < t->v[i].until_ms)
				i = k;
		t->v[i].wait_ms = 0;
	} else if (i == t->n) {
		t->v[t->n].wait_ms = 0;
		t->n++;
		atomic_store_explicit(&t->count, t->n, memory_order_relaxed);
	}
	r = &t->v[i];
	if (r->wait_ms <= 0)
		wait = init_ms;
	else if (r->wait_ms > max_ms / 2)
		wait = max_ms;
	else
		wait = r->wait_ms * 2;
	if (wait > max_ms)
		wait = max_ms;
	if (wait < 1)
		wait = 1;
	r->id = id;
	r->wait_ms = wait;
	r->until_ms = now_ms + wait;
	pthread_mutex_unlock(&t->mu);
	return wait;
}

void
refused_clear(struct refused *t, int64_t id)
{
	size_t i;

	if (refused_count(t) == 0)
		return;
	pthread_mutex_lock(&t->mu);
	i = find(t, id);
	if (i < t->n)
		drop(t, i);
	pthread_mutex_unlock(&t->mu);
}

/*
 * Writes to ids (at most cap) the rows still held at now_ms, or those
 * whose hold has ended by then; rows long past their try are forgotten
 * on the way.
 */
static size_t
collect(struct refused *t, int64_t now_ms, bool held, int64_t *ids,
    size_t cap)
{
	size_t out = 0;

	if (refused_count(t) == 0)
		return 0;
	pthread_mutex_lock(&t->mu);
	for (size_t i = 0; i < t->n;) {
		if (now_ms - t->v[i].until_ms > REFUSED_FORGET_MS) {
			drop(t, i);
			continue;
		}
		if ((now_ms < t->v[i].until_ms) == held && out < cap)
			ids[out++] = t->v[i].id;
		i++;
	}
	pthread_mutex_unlock(&t->mu);
	return out;
}

size_t
refused_held(struct refused *t, int64_t now_ms, int64_t *ids, size_t cap)
{
	return collect(t, now_ms, true, ids, cap);
}

size_t
refused_ended(struct refused *t, int64_t before_ms, int64_t *ids, size_t cap)
{
	return collect(t, before_ms, false, ids, cap);
}

int64_t
refused_wait_ms(struct refused *t, int64_t now_ms)
{
	int64_t first = INT64_MAX;

	if (refused_count(t) == 0)
		return 0;
	pthread_mutex_lock(&t->mu);
	for (size_t i = 0; i < t->n; i++)
		if (t->v[i].until_ms > now_ms && t->v[i].until_ms < first)
			first = t->v[i].until_ms;
	pthread_mutex_unlock(&t->mu);
	return first == INT64_MAX ? 0 : first - now_ms;
}
