/*
 * Leader election and compensation.  Redis decides who leads; when it is
 * unreachable (or not configured), a PostgreSQL advisory lock does, so
 * compensation never stops silently.  The Redis leader holds the
 * advisory lock too, on its store session, and leads only while it
 * does: an instance that cannot reach Redis (a wrong password, a
 * partition) would otherwise take the advisory lock and lead beside the
 * Redis leader for as long as that lasted, and a Redis leader stuck in
 * a long step would lead on beside whoever took its expired key.
 * Nothing here is needed for correctness: every query is safe to run
 * twice, and row claims are guarded by FOR UPDATE SKIP LOCKED whoever
 * leads.
 */
#include "leader.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "log.h"
#include "metrics.h"

/* Bounded work per tick keeps the relay's batches flowing meanwhile. */
#define PURGE_CHUNK 1000
#define PURGE_CHUNKS_PER_TICK 10
#define SWEEP_CHUNK 1000
#define SWEEP_CHUNKS_PER_TICK 10
/* Retention is counted in days: a pass a minute keeps the table within
 * a minute of it.  A pass that finds nothing reads a few index pages
 * (sql/007); before that index it read every sent row. */
#define PURGE_INTERVAL_MS 60000
/* Compensation runs between the main relay's batches, on its session:
 * at most 1/COMPENSATION_SHARE of that session's time. */
#define COMPENSATION_SHARE 20
/* While a backlog is swept or purged, passes follow each other more
 * closely, but hold that session at most 1/BACKLOG_SHARE of the time. */
#define BACKLOG_SHARE 5
#define BACKLOG_MIN_WAIT_MS 100
/* Rows a sweep or purge found refused are left out of the passes this
 * long, then tried again (and logged again if still refused). */
#define SKIP_FORGET_MS (10 * 60 * 1000)
/* The least time the sweep and the purge each get (see phase_ms),
 * whatever postgres.lock_timeout. */
#define COMPENSATION_PHASE_MIN_MS 5000

/* Rows a pass leaves out (store_skip), since the first of them was. */
struct skip_list {
	struct store_skip rows;
	int64_t since_ms;
};

struct leader {
	struct lock *lock;	/* NULL when Redis is disabled */
	struct store *store;
	struct relay_conf conf;
	bool is_leader;
	enum leader_backend backend;	/* of the leadership held */
	enum leader_backend election;	/* what this instance elects with */
	bool redis_was_up;
	bool fenced;		/* Redis key held, advisory lock not */
	int64_t ttl_ms;		/* of the Redis key */
	int64_t store_down_since;	/* 0 while the store session is up */
	bool store_was_up;	/* since the start */
	/* The key's holder whose advisory-lock tries fail on a live
	 * session: since when, and until when it keeps out of the
	 * election once it gave the key up (give_up_the_key). */
	int64_t advisory_failing_since;
	int64_t aside_until_ms;
	struct log_limit aside_log;
	int64_t next_compensation_ms;
	int64_t next_purge_ms;
	/* A compensation or advisory-lock try that keeps failing is
	 * retried every poll interval (10 ms at the least). */
	struct log_limit compensation_log, advisory_log;
	struct log_limit purge_log;	/* tried once a purge interval */
	struct log_limit sweep_log;
	/* Rows the database refuses to sweep or purge. */
	struct skip_list sweep_skip, purge_skip;
	/* Rows per sweep or purge statement: halved while one cannot end
	 * within its time (chunk_timed_out), grown back after. */
	int sweep_chunk, purge_chunk;
	struct leader_gauges gauges;
};

struct leader *
leader_new(const struct lock_conf *lock_conf, const struct relay_conf *conf,
    struct store *store)
{
	struct leader *l = xcalloc(1, sizeof(*l));

	l->store = store;
	l->conf = *conf;
	l->sweep_chunk = SWEEP_CHUNK;
	l->purge_chunk = PURGE_CHUNK;
	if (lock_conf->enabled) {
		l->lock = lock_new(lock_conf);
		l->ttl_ms = lock_conf->ttl_ms;
		lock_set_reconnect(l->lock, &conf->reconnect);
	}
	l->redis_was_up = true;
	return l;
}

void
leader_free(struct leader *l)
{
	if (l == NULL)
		return;
	lock_free(l->lock);
	free(l);
}

void
leader_set_conf(struct leader *l, const struct relay_conf *conf)
{
	l->conf = *conf;
	if (l->lock != NULL)
		lock_set_reconnect(l->lock, &conf->reconnect);
}

const char *
leader_backend_name(enum leader_backend b)
{
	switch (b) {
	case LEADER_BACKEND_REDIS:
		return "redis";
	case LEADER_BACKEND_POSTGRES:
		return "postgres";
	case LEADER_BACKEND_NONE:
		break;
	}
	return "none";
}

static void
set_leader(struct leader *l, bool is_leader, enum leader_backend backend)
{
	if (is_leader != l->is_leader || (is_leader && backend != l->backend))
		log_info(is_leader ? "leadership acquired" :
		    "leadership released", "backend=%s",
		    leader_backend_name(is_leader ? backend : l->backend));
	if (is_leader && !l->is_leader) {
		l->next_compensation_ms = 0;	/* compensate at once */
		l->next_purge_ms = 0;
	}
	l->is_leader = is_leader;
	l->backend = is_leader ? backend : LEADER_BACKEND_NONE;
}

/* Takes the advisory lock if it can: 1 held, 0 another instance holds
 * it, -1 no store session (and so no leader work) or the try failed
 * (logged). */
static int
hold_advisory_lock(struct leader *l)
{
	bool held = false;

	if (!store_connected(l->store))
		return -1;
	if (store_try_leader_lock(l->store, &held) == -1) {
		log_event_limited(&l->advisory_log, LOG_WARN,
		    "advisory lock failed", "error=%s",
		    log_quote((char[600]){ 0 }, 600, store_error(l->store)));
		return -1;
	}
	log_limit_reset(&l->advisory_log);
	return held ? 1 : 0;
}

/* Lets the advisory lock go, for the Redis key's holder to take; a
 * session that would not is closed (store.c), and the relay reconnects. */
static void
let_advisory_lock_go(struct leader *l)
{
	if (store_release_leader_lock(l->store) == -1)
		log_warn("advisory lock not released: postgres session "
		    "closed to let it go", "error=%s",
		    log_quote((char[600]){ 0 }, 600, store_error(l->store)));
}

/* Leadership through PostgreSQL's advisory lock, on the store session.
 * The relay keeps the session up, also in single-active standby. */
static void
seek_postgres_leadership(struct leader *l)
{
	l->fenced = false;
	l->election = store_connected(l->store) ? LEADER_BACKEND_POSTGRES :
	    LEADER_BACKEND_NONE;
	set_leader(l, hold_advisory_lock(l) == 1, LEADER_BACKEND_POSTGRES);
}

/* Whether the holder of the Redis key also holds the advisory lock,
 * which it needs to lead (see the top of this file). */
static bool
advisory_lock_too(struct leader *l)
{
	int rc = hold_advisory_lock(l);
	bool held = rc == 1;

	if (rc == -1) {
		/* A try the server refused, not a session gone (which
		 * stand_aside_without_store sees to). */
		if (store_connected(l->store) && l->advisory_failing_since == 0)
			l->advisory_failing_since = now_mono_ms();
		return false;
	}
	l->advisory_failing_since = 0;
	if (!held && !l->fenced)
		log_warn("leader lock held, but another instance holds the "
		    "postgres advisory lock: not leading until it lets go",
		    "hint=\"an instance that cannot reach redis leads through "
		    "postgres; pg_locks shows its pid\"");
	else if (held && l->fenced)
		log_info("postgres advisory lock acquired", NULL);
	l->fenced = !held;
	return held;
}

/*
 * Without its store session an instance cannot lead (it leads through
 * the advisory lock), yet it would renew the Redis key and keep every
 * other instance from leading for as long as its PostgreSQL stayed out
 * of reach (its own partition, a password change, "too many clients").
 * So it gives the key up after a third of a ttl without the session (a
 * quick reconnect keeps it), and does not compete until the session is
 * back.  At the start the same third of a ttl lets it compete before the
 * relay's first connect: the key is taken on the first tick, not after
 * a first batch (whose rows the workers may already have sent).  True
 * when the election is left alone this tick.
 */
static bool
stand_aside_without_store(struct leader *l)
{
	int64_t now = now_mono_ms();
	char qerr[600];

	if (store_connected(l->store)) {
		l->store_down_since = 0;
		l->store_was_up = true;
		return false;
	}
	if (l->store_down_since == 0)
		l->store_down_since = now;
	if ((lock_held(l->lock) || !l->store_was_up) &&
	    now - l->store_down_since < l->ttl_ms / 3)
		return false;	/* the session may come back, or come */
	if (lock_held(l->lock)) {
		log_warn("leader lock given up: no postgres session",
		    "down_ms=%" PRId64 " error=%s", now - l->store_down_since,
		    log_quote(qerr, sizeof(qerr), store_error(l->store)));
		lock_release(l->lock);
	}
	l->fenced = false;
	l->election = LEADER_BACKEND_NONE;
	set_leader(l, false, LEADER_BACKEND_REDIS);
	return true;
}

/*
 * The key's holder whose advisory-lock tries fail on a live session
 * (EXECUTE on pg_try_advisory_lock revoked by a hardening script, "out
 * of shared memory") cannot lead, yet it renewed the key and so kept
 * every other instance from leading for as long as its tries failed: no
 * retries, no sweep, and in single-active mode no delivery.  Like a
 * holder without its session, it gives the key up after a third of a
 * ttl of failed tries, and keeps out of the election for a ttl, for an
 * instance whose try works to take the key.  (If every instance's try
 * fails, the key goes round and nobody leads; each says why.)
 */
static void
give_up_the_key(struct leader *l)
{
	int64_t now = now_mono_ms();

	if (l->advisory_failing_since == 0 ||
	    now - l->advisory_failing_since < l->ttl_ms / 3)
		return;
	log_event_limited(&l->aside_log, LOG_WARN, "leader lock given up: "
	    "the postgres advisory lock cannot be taken", "failing_ms=%"
	    PRId64 " aside_ms=%" PRId64 " error=%s hint=\"an instance that "
	    "can take it leads meanwhile; outboxd's role needs EXECUTE on "
	    "pg_try_advisory_lock(bigint)\"", now - l->advisory_failing_since,
	    l->ttl_ms, log_quote((char[600]){ 0 }, 600,
	    store_error(l->store)));
	lock_release(l->lock);
	l->advisory_failing_since = 0;
	l->aside_until_ms = now + l->ttl_ms;
	l->fenced = false;
}

/* Whether the instance keeps out of the election (give_up_the_key). */
static bool
standing_aside(const struct leader *l, int64_t now)
{
	return now < l->aside_until_ms;
}

static void
update_leadership(struct leader *l)
{
	enum lock_state st;
	int64_t failing_since;

	if (l->lock == NULL) {
		seek_postgres_leadership(l);
		return;
	}
	/* Failed tries count while they follow one another, key held. */
	failing_since = l->advisory_failing_since;
	l->advisory_failing_since = 0;
	if (stand_aside_without_store(l))
		return;
	if (standing_aside(l, now_mono_ms())) {
		set_leader(l, false, LEADER_BACKEND_REDIS);
		return;
	}
	st = lock_tick(l->lock);
	if (st == LOCK_UNAVAILABLE) {
		if (l->redis_was_up)
			log_warn("redis unavailable: leader election falls "
			    "back to a postgres advisory lock", "error=%s",
			    log_quote((char[600]){ 0 }, 600,
			    lock_error(l->lock)));
		l->redis_was_up = false;
		seek_postgres_leadership(l);
		return;
	}
	if (!l->redis_was_up)
		log_info("redis is back: leader election uses it again",
		    NULL);
	l->redis_was_up = true;
	l->election = LEADER_BACKEND_REDIS;
	if (st != LOCK_HELD) {
		/* Redis answers and another holds the key: the advisory
		 * lock goes, for the key's holder to take. */
		let_advisory_lock_go(l);
		l->fenced = false;
		set_leader(l, false, LEADER_BACKEND_REDIS);
		return;
	}
	l->advisory_failing_since = failing_since;
	if (advisory_lock_too(l)) {
		log_limit_reset(&l->aside_log);
		set_leader(l, true, LEADER_BACKEND_REDIS);
		return;
	}
	give_up_the_key(l);
	set_leader(l, false, LEADER_BACKEND_REDIS);
}

int64_t
leader_compensation_interval_ms(int64_t poll_interval_ms, int64_t took_ms)
{
	int64_t stretched = took_ms * COMPENSATION_SHARE;

	return stretched > poll_interval_ms ? stretched : poll_interval_ms;
}

int64_t
leader_backlog_interval_ms(int64_t took_ms)
{
	int64_t wait = took_ms * (BACKLOG_SHARE - 1);

	return wait > BACKLOG_MIN_WAIT_MS ? wait : BACKLOG_MIN_WAIT_MS;
}

/* Before a pass: forgets the rows it leaves out SKIP_FORGET_MS after the
 * first of them, so that a row whose trigger or reference is gone is
 * swept or purged after all.  An empty list's clock starts now. */
static void
skip_list_expire(struct skip_list *list)
{
	int64_t now = now_mono_ms();

	if (list->rows.n > 0 && now - list->since_ms >= SKIP_FORGET_MS)
		list->rows.n = 0;
	if (list->rows.n == 0)
		list->since_ms = now;
}

/* What a pass's chunks found refused, said once for the pass: the rows
 * are left out from now on. */
struct pass_refusals {
	size_t rows;
	int64_t first;
	char why[sizeof(((struct store_skip *)0)->why)];
};

static void
pass_refusals_add(struct pass_refusals *p, const struct store_skip *skip)
{
	if (skip->refused == 0)
		return;
	if (p->rows == 0) {
		p->first = skip->first;
		snprintf(p->why, sizeof(p->why), "%s", skip->why);
	}
	p->rows += skip->refused;
}

static void
pass_refusals_log(const char *msg, const struct pass_refusals *p,
    const struct skip_list *list)
{
	if (p->rows == 0)
		return;
	log_warn(msg, "rows=%zu first_id=%" PRId64 " left_out=%zu "
	    "retry_in_ms=%" PRId64 " error=%s", p->rows, p->first,
	    list->rows.n, list->since_ms + SKIP_FORGET_MS - now_mono_ms(),
	    log_quote((char[600]){ 0 }, 600, p->why));
}

/*
 * The sweep and the purge each get postgres.lock_timeout and a second
 * more, 5 s at the least (config_longest_step_ms counts them), through
 * statement_timeout: a statement slow for its work rather than for a
 * lock (an application table that references the rows without an index
 * on its column scans that table for every row deleted) held the main
 * loop until the watchdog killed the daemon, and the next leader met
 * the same chunk.  The second more: a lock wait ends as a lock timeout
 * first, and is not taken for slow work.  The phase's end as a
 * deadline: 0 without a lock_timeout (no limit, as for the claims).
 * The count stays unlimited: it only reads, and its cost (80 ms a
 * million unsent rows) spaces the passes out (compensation_interval).
 */
static int64_t
phase_ms(const struct leader *l)
{
	int64_t lt = store_lock_timeout_ms(l->store);

	return lt <= 0 ? 0 : lt + 1000 > COMPENSATION_PHASE_MIN_MS ?
	    lt + 1000 : COMPENSATION_PHASE_MIN_MS;
}

static int64_t
phase_deadline(const struct leader *l)
{
	return phase_ms(l) > 0 ? now_mono_ms() + phase_ms(l) : 0;
}

/* Before each chunk: its statements get what is left of the phase's
 * time (*budget; 0 with no deadline).  False when too little is left
 * for a chunk (the SET or RESET after would run under a timer about to
 * fire), or when the limit could not be set. */
#define CHUNK_MIN_MS 200
static bool
chunk_time(struct leader *l, int64_t deadline, int64_t *budget)
{
	*budget = 0;
	if (deadline == 0)
		return true;
	*budget = deadline - now_mono_ms();
	return *budget >= CHUNK_MIN_MS &&
	    store_limit_statements(l->store, *budget) == 0;
}

/* A chunk cancelled by its time limit with more time than
 * postgres.lock_timeout (so not in a wait for a lock, which ends first
 * as a lock timeout): the next try takes half as many rows (down to
 * one), so that a slow table still moves.  Returns whether it halved. */
static bool
chunk_timed_out(struct leader *l, int *chunk, int64_t budget,
    const char *phase)
{
	if (!store_timed_out(l->store) || *chunk <= 1 || phase_ms(l) == 0 ||
	    budget <= store_lock_timeout_ms(l->store))
		return false;
	*chunk /= 2;
	log_warn("compensation chunk halved", "phase=%s rows=%d hint=%s",
	    phase, *chunk, log_quote((char[300]){ 0 }, 300, "a chunk took "
	    "longer than postgres.lock_timeout and a second (5 s at the "
	    "least): a table that references t_transactional_message "
	    "without an index on its column, or a slow trigger?"));
	return true;
}

/* A chunk cancelled by its time limit, with no more time than
 * postgres.lock_timeout: the phase's end cut it (or a lock wait), not
 * its size. */
static bool
out_of_time(const struct leader *l, int64_t budget)
{
	return store_timed_out(l->store) && phase_ms(l) > 0 &&
	    budget <= store_lock_timeout_ms(l->store);
}

/* A chunk that took under a quarter of its time: the next may take
 * twice as many rows, up to max. */
static void
chunk_went(int *chunk, int max, int64_t budget, int64_t took)
{
	if (*chunk < max && budget > 0 && took * 4 < budget)
		*chunk = *chunk * 2 < max ? *chunk * 2 : max;
}

/* The session's statements unlimited again (the role's or database's
 * statement_timeout): the relay's claims and marks run on it.  One it
 * cannot reset is closed, and the relay opens a new one. */
static void
limits_off(struct leader *l)
{
	if (store_lock_timeout_ms(l->store) <= 0 ||
	    !store_connected(l->store) ||
	    store_limit_statements(l->store, 0) == 0 ||
	    store_limit_statements(l->store, 0) == 0)
		return;
	log_warn("postgres session closed: its statement_timeout could not "
	    "be reset", "error=%s", log_quote((char[600]){ 0 }, 600,
	    store_error(l->store)));
	store_disconnect(l->store);
}

/*
 * Deletes SUCCESS rows past relay.retention, a few chunks per pass, and
 * says how many; *more: the purge goes on at the next pass.  A purge
 * that fails is logged and tried again at the next purge interval, and
 * the rest of the compensation goes on:
 * before, a role without DELETE failed every compensation at the purge,
 * so the row gauges were never set and an alert on dead rows never
 * fired.  A row the database refuses to delete (one an application
 * table references, a trigger's exception) is left out: the oldest, it
 * failed every pass, and retention was never kept again.
 */
static void
purge_sent(struct leader *l, int64_t deadline, bool *more)
{
	struct pass_refusals refused = { 0 };
	int64_t n, purged = 0, budget, started;
	bool halved = false;
	int used;

	*more = false;
	skip_list_expire(&l->purge_skip);
	for (int i = 0; i < PURGE_CHUNKS_PER_TICK; i++) {
		*more = true;
		if (!chunk_time(l, deadline, &budget))
			break;
		started = now_mono_ms();
		used = l->purge_chunk;
		if (store_purge_sent(l->store, l->conf.retention_ms, used,
		    deadline, &l->purge_skip.rows, &n) == -1) {
			halved = chunk_timed_out(l, &l->purge_chunk, budget,
			    "purge");
			/* Cut by the phase's end, not too big: the next
			 * compensation goes on, with nothing to say. */
			if (!halved && out_of_time(l, budget))
				break;
			log_event_limited(&l->purge_log, LOG_WARN,
			    "sent rows not purged", "purged_before=%" PRId64
			    " retry_in_ms=%d error=%s%s", purged, halved ? 0 :
			    PURGE_INTERVAL_MS, log_quote((char[600]){ 0 },
			    600, store_error(l->store)),
			    store_permission_denied(l->store) ? " hint=\"grant "
			    "DELETE on t_transactional_message to this role "
			    "(examples/roles.sql), or set relay.retention: "
			    "0\"" : "");
			*more = halved;
			break;
		}
		chunk_went(&l->purge_chunk, PURGE_CHUNK, budget,
		    now_mono_ms() - started);
		pass_refusals_add(&refused, &l->purge_skip.rows);
		purged += n;
		*more = n > 0 &&
		    n + (int64_t)l->purge_skip.rows.refused >= used;
		if (!*more) {
			log_limit_reset(&l->purge_log);
			break;
		}
	}
	pass_refusals_log("sent rows refused to the purge", &refused,
	    &l->purge_skip);
	if (purged > 0)
		log_info("sent rows purged", "rows=%" PRId64
		    " older_than_ms=%" PRId64, purged, l->conf.retention_ms);
	/* A backlog, or a pass out of time or halved, goes on at the next
	 * compensation. */
	l->next_purge_ms = *more ? 0 : now_mono_ms() + PURGE_INTERVAL_MS;
}

/*
 * Marks rows out of retries DEAD, a few chunks per pass; returns how
 * many, or -1 when the session is gone.  A sweep refused on a live
 * session for a reason of every row (a lock timeout) is logged, and the
 * rest of the compensation goes on: before, it failed every
 * compensation, and the row gauges froze.  A row the database refuses
 * to mark (a trigger's exception) is left out: the lowest id, it failed
 * every pass, and no row that ran out of retries was DEAD again.
 * *more: the last chunk came back full.
 */
static int64_t
sweep_exhausted(struct leader *l, int64_t deadline, bool *more)
{
	struct pass_refusals refused = { 0 };
	int64_t n = 0, swept = 0, budget, started;
	bool lost = false;
	int used;

	*more = false;
	skip_list_expire(&l->sweep_skip);
	for (int i = 0; i < SWEEP_CHUNKS_PER_TICK; i++) {
		*more = true;
		if (!chunk_time(l, deadline, &budget))
			break;
		started = now_mono_ms();
		used = l->sweep_chunk;
		if (store_sweep_exhausted(l->store, used, deadline,
		    &l->sweep_skip.rows, &n) == -1) {
			/* The chunks before are DEAD all the same: they are
			 * counted and said below. */
			if (!store_connected(l->store)) {
				lost = true;
				break;
			}
			if (chunk_timed_out(l, &l->sweep_chunk, budget,
			    "sweep") || out_of_time(l, budget))
				break;	/* *more: the next pass goes on */
			*more = false;
			log_event_limited(&l->sweep_log, LOG_WARN,
			    "rows out of retries not marked dead", "error=%s",
			    log_quote((char[600]){ 0 }, 600,
			    store_error(l->store)));
			break;
		}
		chunk_went(&l->sweep_chunk, SWEEP_CHUNK, budget,
		    now_mono_ms() - started);
		log_limit_reset(&l->sweep_log);
		pass_refusals_add(&refused, &l->sweep_skip.rows);
		swept += n;
		*more = n > 0 &&
		    n + (int64_t)l->sweep_skip.rows.refused >= used;
		if (!*more)
			break;
	}
	pass_refusals_log("rows out of retries refused to the sweep",
	    &refused, &l->sweep_skip);
	if (swept > 0) {
		/* Rows that never had a try left (max_retry_times 0, or
		 * lowered) go DEAD here only, not at a relay's mark. */
		metrics_inc_dead((uint64_t)swept);
		log_warn("rows out of retries marked dead", "rows=%" PRId64,
		    swept);
	}
	return lost ? -1 : swept;
}

static void
compensate(struct leader *l)
{
	int64_t started = now_mono_ms();
	bool sweep_more, purge_more = false;

	if (sweep_exhausted(l, phase_deadline(l), &sweep_more) == -1)
		goto fail;
	if (l->conf.retention_ms > 0 && now_mono_ms() >= l->next_purge_ms)
		purge_sent(l, phase_deadline(l), &purge_more);
	limits_off(l);
	if (store_counts(l->store, false, &l->gauges.counts) == -1)
		goto fail;
	l->gauges.valid = true;
	l->gauges.counted_at_s = (int64_t)time(NULL);
	log_limit_reset(&l->compensation_log);
	/* A sweep or purge with more to do (its chunks full, its time up,
	 * its chunk halved): come back soon, but not at once (each pass
	 * counts the rows too). */
	l->next_compensation_ms = now_mono_ms() + (sweep_more || purge_more ?
	    leader_backlog_interval_ms(now_mono_ms() - started) :
	    leader_compensation_interval_ms(l->conf.poll_interval_ms,
	    now_mono_ms() - started));
	return;
fail:
	log_event_limited(&l->compensation_log, LOG_WARN, "compensation failed",
	    "error=%s", log_quote((char[600]){ 0 }, 600,
	    store_error(l->store)));
	limits_off(l);
	l->gauges.valid = false;
	l->next_compensation_ms = now_mono_ms() + l->conf.poll_interval_ms;
}

bool
leader_tick(struct leader *l)
{
	update_leadership(l);
	if (l->is_leader && store_connected(l->store) &&
	    now_mono_ms() >= l->next_compensation_ms)
		compensate(l);
	return l->is_leader;
}

bool
leader_is_leader(const struct leader *l)
{
	return l->is_leader;
}

enum leader_backend
leader_backend(const struct leader *l)
{
	return l->election;
}

bool
leader_redis_up(const struct leader *l)
{
	/* A holder riding out an outage still elects with Redis, but its
	 * connection is down: the gauge says so from the first failure. */
	return l->lock != NULL && l->redis_was_up &&
	    lock_redis_up(l->lock);
}

uint64_t
leader_redis_reconnects(const struct leader *l)
{
	return l->lock != NULL ? lock_reconnects(l->lock) : 0;
}

int64_t
leader_next_tick_ms(const struct leader *l)
{
	int64_t next = 1000, now = now_mono_ms();

	/* Standing aside for want of a store session, or after giving the
	 * key up (give_up_the_key), the lock has nothing to do however
	 * overdue its next step looks: counted, it asked for a wake-up at
	 * once, again and again, for the whole time aside. */
	if (standing_aside(l, now)) {
		if (l->aside_until_ms - now < next)
			next = l->aside_until_ms - now;
	} else if (l->lock != NULL && (store_connected(l->store) ||
	    lock_held(l->lock)) && lock_next_tick_ms(l->lock) < next) {
		next = lock_next_tick_ms(l->lock);
	}
	/* Compensation waits for the store; counting it while the store
	 * is down would ask for a wake-up at once, again and again. */
	if (l->is_leader && store_connected(l->store)) {
		int64_t comp = l->next_compensation_ms - now;
		if (comp < next)
			next = comp;
	}
	return next < 0 ? 0 : next;
}

const struct leader_gauges *
leader_gauges(const struct leader *l)
{
	return &l->gauges;
}

void
leader_release(struct leader *l)
{
	if (l->lock != NULL)
		lock_release(l->lock);
	let_advisory_lock_go(l);
	set_leader(l, false, LEADER_BACKEND_NONE);
}
