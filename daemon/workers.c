/*
 * Workers: relays on threads of their own.  Each owns its store, broker
 * and relay, and shares nothing with the others but the metrics registry
 * and the log, which are thread-safe.  The main thread talks to them
 * through atomics (stop, role) and one mutex-guarded config.
 */
#include "workers.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "log.h"

/* A step never blocks longer than this (confirm waits aside), so that a
 * role or config change is picked up soon. */
#define STEP_MS 1000

struct worker {
	struct workers *pool;
	int index;		/* 1.., the main thread's relay being 0 */
	pthread_t thread;
	bool started;
	struct store *store;
	struct store *store2;		/* relay.pipeline's second session */
	struct broker *broker;
	struct relay *relay;
	atomic_int_least64_t heartbeat_ms;	/* end of the last step */
	atomic_uint state;	/* enum worker_state bits, last step's */
	int kick_fd;		/* eventfd: the main relay found a backlog */
};

struct workers {
	struct worker *w;
	int n;
	int wake_fd;		/* eventfd, readable once stop is asked */
	atomic_bool stop;
	atomic_bool retries;
	atomic_bool active;
	pthread_mutex_t conf_lock;
	struct relay_conf conf;	/* guarded by conf_lock */
	atomic_uint conf_gen;	/* bumped by workers_set_conf */
	bool joined;		/* workers_join ran */
};

static unsigned
worker_state(const struct relay *r)
{
	unsigned state = 0;

	if (relay_store_up(r) && relay_broker_up(r))
		state |= WORKER_CONNECTED;
	if (relay_failing_ms(r) > 0)
		state |= WORKER_FAILING;
	if (relay_blocked_ms(r) > 0)
		state |= WORKER_BLOCKED;
	return state;
}

static void *
worker_main(void *arg)
{
	struct worker *w = arg;
	struct workers *p = w->pool;
	unsigned gen = 0;
	char field[32];

	snprintf(field, sizeof(field), "worker=%d", w->index);
	log_set_thread_field(field);
	while (!atomic_load(&p->stop)) {
		unsigned want = atomic_load(&p->conf_gen);

		if (want != gen) {
			struct relay_conf conf;

			(void)pthread_mutex_lock(&p->conf_lock);
			conf = p->conf;
			(void)pthread_mutex_unlock(&p->conf_lock);
			relay_set_conf(w->relay, &conf);
			gen = want;
		}
		relay_set_retries(w->relay, atomic_load(&p->retries));
		if (atomic_load(&p->active))
			relay_step(w->relay, STEP_MS);
		else
			relay_standby(w->relay, STEP_MS);
		atomic_store(&w->state, worker_state(w->relay));
		atomic_store(&w->heartbeat_ms, now_mono_ms());
	}
	return NULL;
}

static void
worker_free(struct worker *w)
{
	relay_free(w->relay);
	broker_free(w->broker);
	store_free(w->store2);
	store_free(w->store);
	if (w->kick_fd != -1)
		close(w->kick_fd);
}

struct workers *
workers_start(int n, bool active, const struct relay_conf *rconf,
    const struct store_conf *sconf, const struct broker_conf *bconf,
    struct suspects *suspects, struct refused *refused, char *err,
    size_t errlen)
{
	struct workers *p = xcalloc(1, sizeof(*p));
	sigset_t all, old;
	int rc = 0;

	p->w = xcalloc(n > 0 ? (size_t)n : 1, sizeof(*p->w));
	p->conf = *rconf;
	atomic_init(&p->stop, false);
	/* Until the main thread has decided the role: new rows only (what
	 * a non-leader relays), or nothing (single-active: a standby's
	 * workers must never claim). */
	atomic_init(&p->retries, false);
	atomic_init(&p->active, active);
	atomic_init(&p->conf_gen, 0);
	(void)pthread_mutex_init(&p->conf_lock, NULL);
	p->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (p->wake_fd == -1) {
		strfmt(err, errlen, "eventfd: %s", strerror(errno));
		workers_stop(p, NULL);
		return NULL;
	}
	/* Threads inherit the mask: with every signal blocked in them, the
	 * main thread alone takes SIGTERM and SIGHUP, and its poll() is the
	 * one they cut short. */
	sigfillset(&all);
	(void)pthread_sigmask(SIG_BLOCK, &all, &old);
	for (int i = 0; i < n; i++) {
		struct worker *w = &p->w[i];

		w->pool = p;
		w->index = i + 1;
		p->n = i + 1;	/* from here on workers_stop() frees it */
		w->kick_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
		if (w->kick_fd == -1) {
			rc = errno;
			break;
		}
		w->store = store_new(sconf);
		w->store2 = rconf->pipeline ? store_new(sconf) : NULL;
		w->broker = broker_new(bconf);
		w->relay = relay_new(rconf, w->store, w->store2, w->broker,
		    suspects, refused);
		relay_set_wake_fd(w->relay, p->wake_fd);
		relay_set_kick_fd(w->relay, w->kick_fd);
		atomic_init(&w->heartbeat_ms, now_mono_ms());
		atomic_init(&w->state, 0u);
		rc = pthread_create(&w->thread, NULL, worker_main, w);
		if (rc != 0)
			break;
		w->started = true;
	}
	(void)pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		strfmt(err, errlen, "cannot start relay worker %d: %s", p->n,
		    strerror(rc));
		workers_stop(p, NULL);
		return NULL;
	}
	return p;
}

/* workers_ask_to_stop() runs in a signal handler. */
_Static_assert(ATOMIC_BOOL_LOCK_FREE == 2, "the stop flag must be lock-free");

void
workers_ask_to_stop(struct workers *p)
{
	uint64_t one = 1;

	if (p == NULL)
		return;
	atomic_store(&p->stop, true);
	/* Never read: it stays readable and ends every later wait too. */
	if (p->wake_fd != -1)
		(void)!write(p->wake_fd, &one, sizeof(one));
}

void
workers_join(struct workers *p, struct relay_stats *sum)
{
	if (p == NULL || p->joined)
		return;
	workers_ask_to_stop(p);
	p->joined = true;
	for (int i = 0; i < p->n; i++) {
		struct worker *w = &p->w[i];

		if (w->started)
			(void)pthread_join(w->thread, NULL);
		if (sum != NULL) {
			const struct relay_stats *st = relay_stats(w->relay);

			sum->batches += st->batches;
			sum->published += st->published;
			sum->retried += st->retried;
			sum->dead += st->dead;
			sum->released += st->released;
			sum->store_errors += st->store_errors;
			sum->broker_errors += st->broker_errors;
		}
	}
}

void
workers_stop(struct workers *p, struct relay_stats *sum)
{
	if (p == NULL)
		return;
	workers_join(p, sum);
	for (int i = 0; i < p->n; i++)
		worker_free(&p->w[i]);
	if (p->wake_fd != -1)
		close(p->wake_fd);
	(void)pthread_mutex_destroy(&p->conf_lock);
	free(p->w);
	free(p);
}

void
workers_set_role(struct workers *p, bool retries, bool active)
{
	atomic_store(&p->retries, retries);
	atomic_store(&p->active, active);
}

void
workers_set_conf(struct workers *p, const struct relay_conf *conf)
{
	(void)pthread_mutex_lock(&p->conf_lock);
	p->conf = *conf;
	(void)pthread_mutex_unlock(&p->conf_lock);
	atomic_fetch_add(&p->conf_gen, 1);
}

void
workers_kick(struct workers *p)
{
	uint64_t one = 1;

	for (int i = 0; i < p->n; i++)
		(void)!write(p->w[i].kick_fd, &one, sizeof(one));
}

int
workers_count(const struct workers *p, enum worker_state state)
{
	int n = 0;

	for (int i = 0; i < p->n; i++)
		n += (atomic_load(&p->w[i].state) & state) ? 1 : 0;
	return n;
}

int64_t
workers_stalled_ms(const struct workers *p)
{
	int64_t now = now_mono_ms(), worst = 0;

	for (int i = 0; i < p->n; i++) {
		int64_t age = now - atomic_load(&p->w[i].heartbeat_ms);

		if (age > worst)
			worst = age;
	}
	return worst;
}
