/*
 * Relay: the cycle of the spec.  Claim due rows (locked in one
 * transaction), publish them with confirms, mark each by its outcome and
 * commit; reconnect with backoff when a server goes away.
 */
#include "relay.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "metrics.h"
#include "refused.h"
#include "suspects.h"

enum side_state {
	SIDE_FREE,
	SIDE_CLAIMED,		/* rows locked, messages prepared */
	SIDE_PUBLISHED,		/* outcomes known, marks not yet written */
};

/* A batch in hand and the session whose transaction holds its rows;
 * the arrays are grown to batch_size and reused. */
struct side {
	struct store *store;
	enum side_state state;
	struct store_batch batch;
	size_t nmsg;
	int broker_rc;		/* of the publish: -1 connection lost */
	int64_t claimed_us, published_us, confirmed_us;
	int64_t claim_ms;	/* when the refused table was read */
	struct broker_msg *msgs;
	struct broker_result *results;
	struct store_mark *marks;
	size_t *msg_row;	/* msgs[k] publishes rows[msg_row[k]] */
	char (*errors)[320];	/* last_error text per row */
	/* Why each failed row failed: counted, with the row's log line,
	 * once its mark commits (a rolled-back mark changed nothing). */
	enum metrics_failure *why;
	int *attempt;		/* each row's attempt, from 1 (set at claim) */
	/* The batch in the order it is sent (side_order): msgs[0..n_plain)
	 * at once, then n_group suspects together, then the rest one by
	 * one; the spare arrays, grown when first needed, sort them. */
	size_t n_plain, n_group;
	size_t spare_cap;
	struct broker_msg *spare_msgs;
	size_t *spare_row;
	unsigned char *level;
	/* msgs[flight_from..flight_to) were at the broker when the last
	 * publish ended; later ones were never sent. */
	size_t flight_from, flight_to;
};

/* A server's connection, as the reconnect pacing sees it. */
struct link {
	struct backoff_cursor retry;
	int64_t retry_at;	/* no connect before (monotonic ms) */
	int64_t up_ms;		/* when the connection was made; 0: down */
	bool proven;		/* it did work: a batch marked, a confirm */
};

struct relay {
	struct relay_conf conf;
	struct store *store;
	struct broker *broker;
	struct suspects *suspects;	/* shared by the process's relays */
	struct refused *refused;	/* shared too */
	struct backoff_rng rng;
	struct relay_stats stats;
	bool include_retries;
	int wake_fd;		/* readable: stop waiting; -1 none */
	int kick_fd;		/* a worker's: backlog found; -1 none */
	/* Reconnect pacing, one per server. */
	struct link store_link, broker_link;
	bool store_was_up;
	/* The sessions are to be ended once the cycle or run is over
	 * (cycle_failed): a batch still at the broker points into its
	 * session's result, which ending the session frees. */
	bool drop_asked;
	/* Whether each server was ever connected: only a connection after
	 * that counts as a reconnect. */
	bool store_ever_up, broker_ever_up;
	/* A claim or mark that failed on a live session (a lock timeout, a
	 * privilege, a full disk) is paced like a reconnect: failing at
	 * once again would spin, and a failed mark republishes its batch. */
	struct backoff_cursor cycle_retry;
	int64_t cycle_retry_at;		/* monotonic ms */
	/* The lines each fault repeats at every try, kept to a burst and
	 * then one a second (short reconnect pacing would flood). */
	struct log_limit store_log, broker_log, cycle_log;
	int64_t failing_since_ms;	/* 0: the last cycle went through */
	bool last_claim_cut;	/* the last batch was cut by its bytes */
	/* Idle waits in a row in which rows were due but no claim took
	 * any, and the time before which no claim tries again unless a
	 * NOTIFY or a kick comes (idle_timeout). */
	unsigned due_unclaimed;
	int64_t unclaimed_until_ms;	/* monotonic; 0: none */
	/* The batches in hand: sides[0] on the main session; sides[1] on
	 * the second session of a pipelined relay (store NULL otherwise). */
	struct side sides[2];
	size_t cap;		/* of each side's arrays */
};

struct relay *
relay_new(const struct relay_conf *conf, struct store *store,
    struct store *pipeline_store, struct broker *broker,
    struct suspects *suspects, struct refused *refused)
{
	struct relay *r = xcalloc(1, sizeof(*r));

	r->store = store;
	r->sides[0].store = store;
	r->sides[1].store = pipeline_store;
	r->broker = broker;
	r->suspects = suspects;
	r->refused = refused;
	r->include_retries = true;
	r->wake_fd = -1;
	r->kick_fd = -1;
	backoff_rng_seed_random(&r->rng);
	relay_set_conf(r, conf);
	backoff_cursor_init(&r->store_link.retry, &conf->reconnect);
	backoff_cursor_init(&r->broker_link.retry, &conf->reconnect);
	backoff_cursor_init(&r->cycle_retry, &conf->reconnect);
	r->stats.last_progress_ms = now_mono_ms();
	return r;
}

void
relay_free(struct relay *r)
{
	if (r == NULL)
		return;
	for (size_t k = 0; k < 2; k++) {
		struct side *x = &r->sides[k];

		free(x->msgs);
		free(x->results);
		free(x->marks);
		free(x->msg_row);
		free(x->errors);
		free(x->why);
		free(x->attempt);
		free(x->spare_msgs);
		free(x->spare_row);
		free(x->level);
	}
	free(r);
}

static void
clamp_wait(int64_t *until_ms, int64_t max_ms)
{
	int64_t latest = now_mono_ms() + max_ms;

	if (*until_ms > latest)
		*until_ms = latest;
}

void
relay_set_conf(struct relay *r, const struct relay_conf *conf)
{
	size_t n = (size_t)conf->batch_size;

	r->conf = *conf;
	r->store_link.retry.params = conf->reconnect;
	r->broker_link.retry.params = conf->reconnect;
	r->cycle_retry.params = conf->reconnect;
	/* A wait set by the old pacing ends within the new one's longest:
	 * lowering reconnect.max by a reload takes effect at once. */
	clamp_wait(&r->store_link.retry_at, conf->reconnect.max_ms);
	clamp_wait(&r->broker_link.retry_at, conf->reconnect.max_ms);
	clamp_wait(&r->cycle_retry_at, conf->reconnect.max_ms);
	clamp_wait(&r->unclaimed_until_ms, conf->poll_interval_ms);
	if (n <= r->cap)
		return;
	/* Between steps: no side holds a batch.  The second side only
	 * exists in a pipelined relay. */
	for (size_t k = 0; k < (r->sides[1].store != NULL ? 2 : 1); k++) {
		struct side *x = &r->sides[k];

		x->msgs = xrealloc(x->msgs, n * sizeof(*x->msgs));
		x->results = xrealloc(x->results, n * sizeof(*x->results));
		x->marks = xrealloc(x->marks, n * sizeof(*x->marks));
		x->msg_row = xrealloc(x->msg_row, n * sizeof(*x->msg_row));
		x->errors = xrealloc(x->errors, n * sizeof(*x->errors));
		x->why = xrealloc(x->why, n * sizeof(*x->why));
		x->attempt = xrealloc(x->attempt, n * sizeof(*x->attempt));
	}
	r->cap = n;
}

void
relay_set_retries(struct relay *r, bool on)
{
	/* Retries in or out: the rows a claim can take changed. */
	if (on != r->include_retries)
		r->unclaimed_until_ms = 0;
	r->include_retries = on;
}

void
relay_set_wake_fd(struct relay *r, int fd)
{
	r->wake_fd = fd;
}

void
relay_set_kick_fd(struct relay *r, int kick_fd)
{
	r->kick_fd = kick_fd;
}

const struct relay_stats *
relay_stats(const struct relay *r)
{
	return &r->stats;
}

bool
relay_store_up(const struct relay *r)
{
	return store_connected(r->store);
}

bool
relay_broker_up(const struct relay *r)
{
	return broker_connected(r->broker);
}

enum mark_kind
relay_reschedule(const struct backoff_params *global,
    const struct outbox_row *row, bool permanent, struct backoff_rng *rng,
    int64_t *delay_ms, const char **note)
{
	struct backoff_params p = *global;

	*delay_ms = 0;
	*note = NULL;
	if (permanent || row->current_retry_times + 1 >= row->max_retry_times)
		return MARK_DEAD;
	/* The row's own backoff replaces the global start and growth; a
	 * row with unusable values still gets retried, on the defaults. */
	p.init_ms = row->init_backoff_ms;
	p.factor = row->backoff_factor;
	p.max_attempts = 0;
	if (backoff_params_check(&p) != NULL) {
		*note = backoff_params_check(&p);
		p = *global;
		p.max_attempts = 0;
	}
	*delay_ms = backoff_delay(&p, row->current_retry_times, 0, rng);
	if (*delay_ms < 0)	/* the strategy gave up (ethernet: 16) */
		return MARK_DEAD;
	return MARK_RETRY;
}

static const char *
outcome_name(enum broker_outcome o)
{
	switch (o) {
	case BROKER_ACKED:
		return "acked";
	case BROKER_NACKED:
		return "nacked";
	case BROKER_RETURNED:
		return "unroutable";
	case BROKER_REJECTED:
		return "rejected";
	case BROKER_UNKNOWN:
		break;
	}
	return "unknown";
}

static enum metrics_failure
failure_reason(const struct broker_result *res)
{
	switch (res->outcome) {
	case BROKER_NACKED:
		return METRICS_FAIL_NACKED;
	case BROKER_RETURNED:
		return METRICS_FAIL_UNROUTABLE;
	default:
		/* Permanent and not too large: a name or headers that no
		 * AMQP frame can carry. */
		return res->oversized ? METRICS_FAIL_OVERSIZED :
		    res->permanent ? METRICS_FAIL_BAD_ROW :
		    METRICS_FAIL_REJECTED;
	}
}

/* Marks row i of x as failed with reason, choosing retry or dead. */
static void
mark_failed(struct relay *r, struct side *x, size_t i, const char *reason,
    bool permanent, enum metrics_failure why)
{
	const struct outbox_row *row = &x->batch.rows[i];
	struct store_mark *m = &x->marks[i];
	const char *note;

	m->kind = relay_reschedule(&r->conf.backoff, row, permanent, &r->rng,
	    &m->delay_ms, &note);
	if (note != NULL)
		snprintf(x->errors[i], sizeof(x->errors[i]),
		    "%s (row backoff ignored: %s)", reason, note);
	else
		snprintf(x->errors[i], sizeof(x->errors[i]), "%s", reason);
	m->error = x->errors[i];
	x->why[i] = why;
}

/* x's n marks are committed: what they say is true now, so it is
 * counted and the failed rows are logged.  (The batch's rows are gone
 * with the commit; the marks are not.) */
static void
count_marks(struct relay *r, const struct side *x, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		const struct store_mark *m = &x->marks[i];

		switch (m->kind) {
		case MARK_SUCCESS:
			r->stats.published++;
			metrics_inc_published(1);
			break;
		case MARK_DEAD:
			metrics_inc_failed(x->why[i], 1);
			metrics_inc_dead(1);
			r->stats.dead++;
			log_warn("message dead", "id=%" PRId64 " attempts=%d "
			    "error=%s", m->id, x->attempt[i],
			    log_quote((char[340]){ 0 }, 340, m->error));
			break;
		case MARK_RETRY:
			metrics_inc_failed(x->why[i], 1);
			r->stats.retried++;
			log_info("message failed", "id=%" PRId64 " attempt=%d "
			    "retry_in_ms=%" PRId64 " error=%s", m->id,
			    x->attempt[i], m->delay_ms,
			    log_quote((char[340]){ 0 }, 340, m->error));
			break;
		case MARK_RELEASE:
			break;
		}
	}
}

/* Turns claimed row i of x into a message, or marks it failed up
 * front. */
static bool
prepare_message(struct relay *r, struct side *x, size_t i,
    struct broker_msg *msg)
{
	const struct outbox_row *row = &x->batch.rows[i];

	if (row->row_error != NULL) {
		mark_failed(r, x, i, row->row_error, true,
		    METRICS_FAIL_BAD_ROW);
		return false;
	}
	if (*row->exchange_name == '\0' && *row->routing_key == '\0') {
		/* The default exchange routes by queue name, and no queue
		 * is named "": such a row could never be delivered. */
		mark_failed(r, x, i, "no route: routing_key and queue_name "
		    "are both empty on the default exchange", true,
		    METRICS_FAIL_BAD_ROW);
		return false;
	}
	if (!row->has_content) {
		/* A producer that writes the two rows in separate
		 * transactions may commit the content a moment later. */
		mark_failed(r, x, i, "no content row for this message",
		    false, METRICS_FAIL_NO_CONTENT);
		return false;
	}
	if (row->content_unfetched) {
		char reason[128];

		/* The claim left it in the database (see CLAIM_SQL); the
		 * broker module refuses such a body in the same words. */
		mark_failed(r, x, i, strfmt(reason, sizeof(reason), "rejected: "
		    BROKER_PAYLOAD_TOO_LARGE, row->content_len,
		    r->conf.max_payload), true,
		    METRICS_FAIL_OVERSIZED);
		return false;
	}
	memset(msg, 0, sizeof(*msg));
	msg->id = row->id;
	msg->exchange = row->exchange_name;
	msg->exchange_type = row->exchange_type;
	msg->routing_key = row->routing_key;
	msg->body = row->content;
	msg->body_len = row->content_len;
	msg->content_type = *row->content_type ? row->content_type : NULL;
	msg->timestamp_s = row->create_time_s;
	msg->business_module = *row->business_module ? row->business_module :
	    NULL;
	msg->business_key = *row->business_key ? row->business_key : NULL;
	msg->attempt = row->current_retry_times + 1;
	msg->header_keys = row->header_keys;
	msg->header_values = row->header_values;
	msg->n_headers = row->n_headers;
	return true;
}

/*
 * A connection lost within STABLE_CONNECTION_MS of being made, before it
 * did any work, counts as a failed connect: the next one waits with the
 * reconnect pacing.  A broker that took each connection and dropped it
 * at the first batch was otherwise met again at once, some 150 times a
 * second, each time logging the loss and sending part of the batch
 * again.  A connection that lasted, or did work (a batch marked; a
 * message the broker answered for, or took the blame for the loss: a
 * row that closes connections is not the server's fault), means a
 * server that works: the reconnect is immediate, and the pacing starts
 * over.  Returns how long the lost connection lasted when it was such a
 * failed connect, else -1.
 */
#define STABLE_CONNECTION_MS 10000

static int64_t
link_lost(struct link *l)
{
	int64_t lasted;
	bool worked;

	if (l->up_ms == 0)
		return -1;
	lasted = now_mono_ms() - l->up_ms;
	worked = l->proven || lasted >= STABLE_CONNECTION_MS;
	l->up_ms = 0;
	l->proven = false;
	if (worked) {
		backoff_cursor_reset(&l->retry);
		return -1;
	}
	return lasted;
}

/* A lost connection: see link_lost(). */
static void
pace_after_loss(struct link *l, struct log_limit *log, const char *server)
{
	int64_t lasted = link_lost(l), wait;

	if (lasted < 0)
		return;
	wait = backoff_cursor_next(&l->retry);
	l->retry_at = now_mono_ms() + wait;
	log_event_limited(log, LOG_WARN, "connection short-lived", "server=%s "
	    "lasted_ms=%" PRId64 " retry_in_ms=%" PRId64, server, lasted,
	    wait);
}

static void
link_up(struct link *l)
{
	l->up_ms = now_mono_ms();
	l->proven = false;
}

/* Ends the relay's sessions; the next ensure_store() opens new ones. */
static void
drop_sessions(struct relay *r)
{
	/* Dropped on purpose (read-only, stale statements): a session that
	 * lasted, or marked a batch, is reconnected at once; a new one that
	 * failed the same way waits with the pacing.  A trigger's error
	 * with such a SQLSTATE (0A000 raised, 25006 from a standby through
	 * dblink) failed every mark of every new session, and the batch
	 * went out again every few milliseconds. */
	pace_after_loss(&r->store_link, &r->store_log, "postgres");
	store_disconnect(r->store);
	if (r->sides[1].store != NULL)
		store_disconnect(r->sides[1].store);
	r->store_was_up = false;
}

/*
 * A claim or mark failed: with the session still up, wait before the
 * next cycle (the reconnect pacing), and remember since when cycles
 * fail, for /healthz.  Returns the wait in ms (0: the session is gone,
 * and the reconnect paces instead).
 */
static int64_t
cycle_failed(struct relay *r, struct store *failed)
{
	int64_t now = now_mono_ms(), wait = 0;
	bool ending = false;

	r->stats.store_errors++;
	/* A session whose server no longer takes writes (a standby now, or
	 * made read-only) fails every claim for as long as it lasts; a new
	 * session may reach the new primary (libpq skips read-only hosts
	 * for the relay, see store_conf.read_write). */
	if (failed != NULL && store_session_read_only(failed)) {
		log_error("postgres session read-only", "reconnect=true "
		    "error=%s", log_quote((char[600]){ 0 }, 600,
		    store_error(failed)));
		ending = true;
	} else if (failed != NULL && store_statements_stale(failed)) {
		log_error("postgres statements stale", "reconnect=true "
		    "error=%s", log_quote((char[600]){ 0 }, 600,
		    store_error(failed)));
		ending = true;
	}
	r->drop_asked = r->drop_asked || ending;
	/* A session that died is the reconnect's to report ("postgres
	 * unavailable"), not /healthz's "failing", which sent the operator
	 * after locks and privileges for as long as a worker could not
	 * reconnect (max_connections full after a restart).  The failed
	 * session, not only the main one: a pipelined relay's second
	 * session that died was paced as a failing cycle, reconnect.init
	 * and more, where a reconnect at once would do. */
	if (ending || !store_connected(r->store) ||
	    (failed != NULL && !store_connected(failed))) {
		/* Rows held for their refused marks keep it failing, as
		 * cycle_done does: /healthz said healthy after the
		 * reconnect, with the rows still held. */
		if (refused_count(r->refused) == 0)
			r->failing_since_ms = 0;
		else if (r->failing_since_ms == 0)
			r->failing_since_ms = now;
		return 0;
	}
	if (r->failing_since_ms == 0)
		r->failing_since_ms = now;
	wait = backoff_cursor_next(&r->cycle_retry);
	r->cycle_retry_at = now + wait;
	return wait;
}

/* Ends the sessions if cycle_failed asked for it, now that no batch
 * needs them.  Ended at once, a pipelined run went on to await and
 * resend a batch whose messages pointed into a freed result. */
static void
drop_if_asked(struct relay *r)
{
	if (!r->drop_asked)
		return;
	r->drop_asked = false;
	drop_sessions(r);
}

static void
cycle_done(struct relay *r)
{
	if (r->failing_since_ms == 0)
		return;
	backoff_cursor_reset(&r->cycle_retry);
	/* Rows whose marks were refused still wait for a try: failing
	 * until they are marked (refused_marks). */
	if (refused_count(r->refused) > 0)
		return;
	log_info("relaying again", "failed_for_ms=%" PRId64,
	    now_mono_ms() - r->failing_since_ms);
	r->failing_since_ms = 0;
	log_limit_reset(&r->cycle_log);
}

int64_t
relay_failing_ms(const struct relay *r)
{
	return r->failing_since_ms == 0 ? 0 :
	    now_mono_ms() - r->failing_since_ms + 1;
}

/*
 * Puts x's messages in the order they are sent: those of no suspect
 * first, then the suspects that lost one connection, then those that
 * lost two (suspects.h).  Without suspects in the process, as claimed.
 */
static void
side_order(struct relay *r, struct side *x)
{
	int64_t now = now_mono_ms();
	size_t out = 0, count[3] = { 0, 0, 0 };

	x->n_plain = x->nmsg;
	x->n_group = 0;
	if (!suspects_any(r->suspects) || x->nmsg == 0)
		return;
	if (x->spare_cap < x->nmsg) {
		x->spare_msgs = xrealloc(x->spare_msgs,
		    r->cap * sizeof(*x->spare_msgs));
		x->spare_row = xrealloc(x->spare_row,
		    r->cap * sizeof(*x->spare_row));
		x->level = xrealloc(x->level, r->cap * sizeof(*x->level));
		x->spare_cap = r->cap;
	}
	for (size_t k = 0; k < x->nmsg; k++) {
		x->level[k] = (unsigned char)suspects_level(r->suspects,
		    x->msgs[k].id, now);
		count[x->level[k]]++;
	}
	if (count[SUSPECT_NONE] == x->nmsg)
		return;
	for (unsigned level = SUSPECT_NONE; level <= SUSPECT_ALONE; level++)
		for (size_t k = 0; k < x->nmsg; k++)
			if (x->level[k] == level) {
				x->spare_msgs[out] = x->msgs[k];
				x->spare_row[out++] = x->msg_row[k];
			}
	memcpy(x->msgs, x->spare_msgs, x->nmsg * sizeof(*x->msgs));
	memcpy(x->msg_row, x->spare_row, x->nmsg * sizeof(*x->msg_row));
	x->n_plain = count[SUSPECT_NONE];
	x->n_group = count[SUSPECT_GROUP];
	log_info("sending suspects apart", "rows=%zu together=%zu alone=%zu",
	    x->nmsg, x->n_group, count[SUSPECT_ALONE]);
}

/*
 * A claim failed on a row it cannot read in UTF-8 (a database in
 * WIN1252 with an unassigned byte in a name, say), as every claim that
 * reaches that row would: every row behind it waited.  Such rows are
 * made DEAD, for the operator to mend and replay.  One whose DEAD mark
 * the database refuses is held out of the claims, as a row whose marks
 * are refused is (refused_marks): before, it failed every claim.
 * Returns how many rows were found, or -1 with the store's error.
 */
static int
mark_unreadable(struct relay *r, struct side *x,
    const struct store_claim_opts *opts)
{
	struct store_unreadable_found f;
	int64_t now = now_mono_ms(), paced = 0, wait;
	enum refused_entry entry;

	if (store_mark_unreadable_dead(x->store, opts, &f) == -1)
		return -1;
	for (size_t i = 0; i < f.n_dead; i++) {
		metrics_inc_failed(METRICS_FAIL_BAD_ROW, 1);
		metrics_inc_dead(1);
		r->stats.dead++;
		if (i >= ARRAY_LEN(f.dead))
			continue;
		refused_clear(r->refused, f.dead[i].id);
		log_warn("message dead", "id=%" PRId64 " error=%s",
		    f.dead[i].id, log_quote((char[400]){ 0 }, 400,
		    f.dead[i].error));
	}
	if (f.n_dead > ARRAY_LEN(f.dead))
		log_warn("more messages dead, unreadable", "rows=%zu",
		    f.n_dead - ARRAY_LEN(f.dead));
	/* More held rows than the table takes: the next claim meets them
	 * again at once, so the relay waits as for a failed cycle. */
	if (f.n_held > ARRAY_LEN(f.held))
		paced = cycle_failed(r, NULL);
	else if (f.n_held > 0 && r->failing_since_ms == 0)
		r->failing_since_ms = now;
	for (size_t i = 0; i < f.n_held && i < ARRAY_LEN(f.held); i++) {
		wait = refused_hold(r->refused, f.held[i].id,
		    r->conf.reconnect.init_ms, r->conf.reconnect.max_ms, now,
		    &entry);
		if (entry == REFUSED_EVICTED && paced == 0)
			paced = cycle_failed(r, NULL);
		r->stats.released++;
		metrics_inc_released(1);
		log_event_limited(&r->cycle_log, LOG_ERROR, "marking failed",
		    "id=%" PRId64 " retry_in_ms=%" PRId64 " error=%s",
		    f.held[i].id, paced > wait ? paced : wait,
		    log_quote((char[600]){ 0 }, 600, f.held[i].error));
	}
	return (int)(f.n_dead + f.n_held);
}

/*
 * Claims a batch on x's session and prepares its messages; rows that
 * cannot be sent are marked failed up front.  Returns the batch size,
 * or -1 with the store's error (the session's transaction rolled back).
 */
static int
side_claim(struct relay *r, struct side *x, int64_t lock_timeout_ms)
{
	struct store_claim_opts opts = { .limit = r->conf.batch_size,
		.ordered_by_key = r->conf.ordering_by_key,
		.include_retries = r->include_retries,
		.lock_timeout_ms = lock_timeout_ms,
		.max_payload = r->conf.max_payload,
		.max_batch_bytes = RELAY_BATCH_BYTES };
	int64_t skip[STORE_SKIP_MAX];

	opts.skip_ids = skip;
	x->claim_ms = now_mono_ms();
	opts.n_skip = refused_held(r->refused, x->claim_ms, skip,
	    STORE_SKIP_MAX);
	x->claimed_us = now_mono_us();
	if (store_claim(x->store, &opts, &x->batch) == -1) {
		if (!store_untranslatable(x->store) ||
		    mark_unreadable(r, x, &opts) <= 0)
			return -1;
		/* The rows it held are left out of the claim again. */
		opts.n_skip = refused_held(r->refused, x->claim_ms, skip,
		    STORE_SKIP_MAX);
		if (store_claim(x->store, &opts, &x->batch) == -1)
			return -1;
	}
	x->nmsg = 0;
	r->last_claim_cut = x->batch.cut_short;
	/* Rows came: no wait before the next claim (idle_timeout).  Reset
	 * here, not by the caller: a pipelined run reports only its last
	 * claim's count. */
	if (x->batch.n > 0) {
		r->due_unclaimed = 0;
		r->unclaimed_until_ms = 0;
	}
	for (size_t i = 0; i < x->batch.n; i++) {
		x->marks[i].id = x->batch.rows[i].id;
		x->marks[i].kind = MARK_RELEASE;
		x->marks[i].error = NULL;
		x->marks[i].delay_ms = 0;
		x->attempt[i] = x->batch.rows[i].current_retry_times + 1;
		if (prepare_message(r, x, i, &x->msgs[x->nmsg]))
			x->msg_row[x->nmsg++] = i;
	}
	side_order(r, x);
	x->state = x->batch.n > 0 ? SIDE_CLAIMED : SIDE_FREE;
	return (int)x->batch.n;
}

/*
 * Publishes x's messages in side_order's parts: the batch's own in one
 * go, then its suspects together, then each of the rest alone, until a
 * part loses the connection or the broker blocks publishing.  Parts
 * start only within rabbitmq.confirm_timeout of the first send, so that
 * a batch takes less than twice that (main.c gives its transaction that
 * long).  Returns what the last part's publish returned; what was not
 * sent is BROKER_UNKNOWN.
 */
static int
side_publish(struct relay *r, struct side *x)
{
	int64_t until_ms = now_mono_ms() +
	    broker_confirm_timeout_ms(r->broker);
	size_t from = 0, to;
	int rc = 0;

	x->published_us = now_mono_us();
	x->flight_from = 0;
	x->flight_to = 0;
	while (from < x->nmsg) {
		to = from < x->n_plain ? x->n_plain :
		    from < x->n_plain + x->n_group ? x->n_plain + x->n_group :
		    from + 1;
		if (from > 0 && (now_mono_ms() >= until_ms ||
		    broker_blocked_ms(r->broker) > 0))
			break;
		x->flight_from = from;
		x->flight_to = to;
		rc = broker_publish_batch(r->broker, x->msgs + from, to - from,
		    x->results + from);
		if (rc == -1)
			break;
		from = to;
	}
	for (size_t k = x->flight_to; k < x->nmsg; k++) {
		x->results[k].outcome = BROKER_UNKNOWN;
		x->results[k].permanent = false;
		x->results[k].oversized = false;
		x->results[k].sent = false;
		x->results[k].reason[0] = '\0';
	}
	return rc;
}

/*
 * Message k of x was in flight when the connection was lost: one loss
 * more for its row (suspects.h).  Returns true when that is the third
 * in a row and it was alone at the broker: the loss is its own doing,
 * and counts an attempt.
 */
static bool
lost_alone(struct relay *r, struct side *x, size_t k)
{
	enum suspect_level before = suspects_lost(r->suspects,
	    x->msgs[k].id, now_mono_ms());

	return before == SUSPECT_ALONE && x->flight_to - x->flight_from == 1;
}

/* x's publish ended with broker_rc: each row's mark follows its
 * message's outcome. */
static void
side_settle(struct relay *r, struct side *x, int broker_rc)
{
	bool answered = false;

	x->confirmed_us = now_mono_us();
	x->broker_rc = broker_rc;
	for (size_t k = 0; k < x->nmsg; k++) {
		size_t i = x->msg_row[k];
		const struct broker_result *res = &x->results[k];

		/* The broker answered for it, or it takes the blame for the
		 * loss (below): the connection was not lost for nothing. */
		answered = answered || res->outcome != BROKER_UNKNOWN;
		if (res->outcome != BROKER_UNKNOWN)
			suspects_clear(r->suspects, x->msgs[k].id);
		switch (res->outcome) {
		case BROKER_ACKED:
			x->marks[i].kind = MARK_SUCCESS;
			break;
		case BROKER_UNKNOWN:
			/* Never sent (the connection went, or the broker
			 * blocked, before its turn): not a possible
			 * duplicate, nor a loss of its own making. */
			if (!res->sent) {
				x->marks[i].kind = MARK_RELEASE;
				break;
			}
			if (broker_rc == -1 && k >= x->flight_from &&
			    k < x->flight_to && lost_alone(r, x, k)) {
				char reason[300];

				snprintf(reason, sizeof(reason), "connection "
				    "lost: the broker connection was lost "
				    "three times in a row with this message "
				    "unconfirmed, the last time with it alone "
				    "in flight (%s)", broker_error(r->broker));
				mark_failed(r, x, i, reason, false,
				    METRICS_FAIL_CONNECTION_LOST);
				answered = true;
				break;
			}
			/* No confirm: it may have arrived, or not.  Leave
			 * the row due; at-least-once covers the rest. */
			x->marks[i].kind = MARK_RELEASE;
			r->stats.released++;
			metrics_inc_released(1);
			break;
		default: {
			char reason[300];

			snprintf(reason, sizeof(reason), "%s: %s",
			    outcome_name(res->outcome), res->reason);
			mark_failed(r, x, i, reason, res->permanent,
			    failure_reason(res));
			break;
		}
		}
	}
	if (answered)
		r->broker_link.proven = true;
	if (broker_rc == -1) {
		/* The broker module logged why; the rows it could not
		 * confirm stay due. */
		r->stats.broker_errors++;
		broker_disconnect(r->broker);
	}
	x->state = SIDE_PUBLISHED;
}

/*
 * The database refused some of x's marks (store_finish returned 1): the
 * rows it made DEAD instead are counted as such, with the refusal as
 * their error.  A row whose every mark was refused stays due, and is
 * left out of the claims until its next try (refused.h); the relay
 * goes on with the other rows.  It paced itself instead, and a backlog
 * behind such a row went one batch per reconnect.max.  It still does
 * when no mark of the batch went through and some refusal is new (a
 * trigger that refuses every update), or when more rows are refused
 * than the table holds: then holding rows back lets the next batch meet
 * the same refusal at once.
 * /healthz says failing meanwhile (cycle_done).  Returns how many rows
 * stayed due.
 */
static size_t
refused_marks(struct relay *r, struct side *x, size_t n)
{
	int64_t now = now_mono_ms(), paced = 0;
	size_t left = 0, written = 0;
	enum refused_entry entry;
	bool evicted = false, fresh = false;

	for (size_t i = 0; i < n; i++) {
		struct store_mark *m = &x->marks[i];

		written += m->kind != MARK_RELEASE;
		if (m->refused == NULL)
			continue;
		x->why[i] = METRICS_FAIL_MARK_REFUSED;
		if (m->kind != MARK_RELEASE)
			continue;
		left++;
		/* A released row's delay is unused: its wait, for the log. */
		m->delay_ms = refused_hold(r->refused, m->id,
		    r->conf.reconnect.init_ms, r->conf.reconnect.max_ms, now,
		    &entry);
		evicted = evicted || entry == REFUSED_EVICTED;
		fresh = fresh || entry != REFUSED_AGAIN;
	}
	if (left == 0)
		return 0;
	/* New refusals and no mark through: each batch meets them anew.
	 * Rows refused before, back alone for their try, are no sign. */
	if (evicted || (written == 0 && fresh))
		paced = cycle_failed(r, NULL);
	else if (r->failing_since_ms == 0)
		r->failing_since_ms = now;
	for (size_t i = 0; i < n; i++) {
		const struct store_mark *m = &x->marks[i];

		if (m->refused == NULL || m->kind != MARK_RELEASE)
			continue;
		r->stats.released++;
		metrics_inc_released(1);
		log_event_limited(&r->cycle_log, LOG_ERROR, "marking failed",
		    "id=%" PRId64 " retry_in_ms=%" PRId64 " error=%s", m->id,
		    paced > m->delay_ms ? paced : m->delay_ms,
		    log_quote((char[600]){ 0 }, 600, m->refused));
	}
	return left;
}

/* Writes x's marks and commits.  Returns 0, or -1 when that failed: the
 * rows roll back to due, and confirmed ones will be sent again, which
 * at-least-once allows. */
static int
side_mark(struct relay *r, struct side *x)
{
	size_t n = x->batch.n, left;
	int rc;

	x->state = SIDE_FREE;
	rc = store_finish(x->store, &x->batch, x->marks, n);
	if (rc == -1) {
		int64_t wait = cycle_failed(r, x->store);

		log_event_limited(&r->cycle_log, LOG_ERROR, "marking failed",
		    "rows=%zu retry_in_ms=%" PRId64 " error=%s", n, wait,
		    log_quote((char[600]){ 0 }, 600, store_error(x->store)));
		return -1;
	}
	r->store_link.proven = true;
	left = rc == 1 ? refused_marks(r, x, n) : 0;
	for (size_t i = 0; i < n && refused_count(r->refused) > 0; i++)
		if (x->marks[i].kind != MARK_RELEASE)
			refused_clear(r->refused, x->marks[i].id);
	count_marks(r, x, n);
	if (left == 0)
		cycle_done(r);
	r->stats.batches++;
	r->stats.last_batch_us = now_mono_us() - x->claimed_us;
	r->stats.last_confirm_us = x->confirmed_us - x->published_us;
	metrics_observe_batch((double)r->stats.last_batch_us / 1e6);
	/* The broker's share, when it had one: a batch of rows that could
	 * not be published, or whose connection was lost, filed a time
	 * near 0 s and dragged the quantiles down. */
	if (x->nmsg > 0 && x->broker_rc == 0)
		metrics_observe_confirm((double)r->stats.last_confirm_us /
		    1e6);
	if (x->broker_rc == 0)
		r->stats.last_progress_ms = now_mono_ms();
	log_debug("batch done", "rows=%zu published=%zu batch_us=%" PRId64,
	    n, x->nmsg, r->stats.last_batch_us);
	return 0;
}

/*
 * A claim found no row, yet rows whose hold had ended were in the
 * refused table: those still due are locked by another relay (or wait
 * behind their key); the others are gone (deleted, marked by another
 * instance) and are forgotten, and /healthz's failing with them, which
 * lasted REFUSED_FORGET_MS, two minutes, after the operator deleted
 * the row.  A relay that leaves retries to the leader cannot tell: it
 * would not have claimed them.
 */
static void
forget_vanished(struct relay *r, struct side *x)
{
	int64_t ended[STORE_SKIP_MAX];
	bool due[STORE_SKIP_MAX];
	size_t n;

	if (!r->include_retries)
		return;
	n = refused_ended(r->refused, x->claim_ms, ended, STORE_SKIP_MAX);
	if (n == 0)
		return;
	if (store_still_due(x->store, ended, n, due) == -1) {
		log_event_limited(&r->cycle_log, LOG_WARN,
		    "refused rows not checked", "error=%s",
		    log_quote((char[600]){ 0 }, 600, store_error(x->store)));
		return;
	}
	for (size_t i = 0; i < n; i++)
		if (!due[i]) {
			refused_clear(r->refused, ended[i]);
			log_info("refused row gone", "id=%" PRId64, ended[i]);
		}
}

/* The claim that starts a cycle or a pipelined run, on sides[0]: the
 * batch size, or -1 (logged, and the next cycle paced). */
static int
claim_first(struct relay *r, size_t *claimed)
{
	struct side *x = &r->sides[0];
	int n = side_claim(r, x, 0);

	*claimed = n > 0 ? (size_t)n : 0;
	if (n == -1) {
		int64_t wait = cycle_failed(r, x->store);

		log_event_limited(&r->cycle_log, LOG_ERROR, "claim failed",
		    "retry_in_ms=%" PRId64 " error=%s", wait,
		    log_quote((char[600]){ 0 }, 600, store_error(x->store)));
	} else if (n == 0) {
		forget_vanished(r, x);
		cycle_done(r);
	}
	return n;
}

static int
cycle(struct relay *r, size_t *claimed)
{
	struct side *x = &r->sides[0];
	int n = claim_first(r, claimed);

	if (n <= 0)
		return n;
	/* The confirm histogram is the broker's share of the batch: from
	 * the first publish, not from the claim. */
	side_settle(r, x, side_publish(r, x));
	if (side_mark(r, x) == -1)
		return -1;
	return x->broker_rc;
}

int
relay_cycle(struct relay *r, size_t *claimed)
{
	int rc = cycle(r, claimed);

	drop_if_asked(r);
	return rc;
}

/* Whether the wake fd is readable: a stop (or, for the main relay, a
 * reload) is asked, and no new connect or claim should start. */
static bool
woken(const struct relay *r)
{
	struct pollfd pfd = { .fd = r->wake_fd, .events = POLLIN };

	return r->wake_fd >= 0 && poll(&pfd, 1, 0) == 1;
}

/*
 * A pipelined run (relay.pipeline): the relay's two sessions take
 * turns, so that the broker gets the next batch the moment it has
 * confirmed the last, and the database work is done while the broker
 * works:
 *
 *	claim A; send A
 *	claim B (while A is at the broker); await A
 *	send B; mark A and claim C on A's session (while B is at the
 *	broker); await B; send C; ...
 *
 * One batch at a time is unconfirmed, as in a plain cycle, so failures
 * end the same way: what the broker did not confirm stays due.  Runs
 * while batches come full, until until_ms; sets *backlog when it
 * stopped with one still full.  Nothing is held when it returns.
 * Returns -1 when a server failed, else 0.
 */
#define PIPELINE_LOCK_WAIT_MS 100
#define PIPELINE_RUN_MS 1000

static int
relay_pipeline(struct relay *r, int64_t until_ms, bool *backlog,
    size_t *claimed)
{
	struct side *cur = &r->sides[0], *next = &r->sides[1], *t;
	int n = claim_first(r, claimed), rc = 0;
	bool full, more = false;

	*backlog = false;
	if (n <= 0)
		return n;
	for (;;) {
		full = cur->batch.n == (size_t)r->conf.batch_size ||
		    cur->batch.cut_short;
		/* A batch with suspects goes in parts, each awaited
		 * (side_publish): nothing overlaps it, and the last batch
		 * is marked first, so that its transaction does not idle
		 * through the parts as well. */
		if (cur->n_plain < cur->nmsg) {
			/* A failed mark may have doomed cur's session too
			 * (drop_if_asked, after the run): its rows would go
			 * out, part by part, on a session about to end,
			 * their locks with it, for another relay to claim
			 * and send as well.  The run ends here, and cur, not
			 * sent yet, goes back. */
			if (next->state == SIDE_PUBLISHED &&
			    side_mark(r, next) == -1) {
				store_abort(cur->store, &cur->batch);
				cur->state = SIDE_FREE;
				rc = -1;
				break;
			}
			side_settle(r, cur, side_publish(r, cur));
			if (cur->broker_rc == -1)
				break;
		} else {
			cur->published_us = now_mono_us();
			cur->flight_from = 0;
			cur->flight_to = cur->nmsg;
			if (broker_send_batch(r->broker, cur->msgs, cur->nmsg,
			    cur->results) == -1) {
				side_settle(r, cur, -1);
				rc = -1;
				break;
			}
		}
		/* The broker works on cur meanwhile. */
		if (next->state == SIDE_PUBLISHED && side_mark(r, next) == -1)
			rc = -1;
		/*
		 * Claim the next batch, while the broker still works.  This
		 * claim waits for the table lock while cur's session holds
		 * it: a lock request queued behind cur (a migration) would
		 * wait for cur, and cur for this claim.  So it gives way
		 * within PIPELINE_LOCK_WAIT_MS; the next run's first claim,
		 * with nothing held, waits as long as configured.  Stopped
		 * with cur full (by the clock, or by a claim that gave way),
		 * more is due: the caller goes on at once.
		 */
		more = rc == 0 && full;
		/* Paced (a mark refused, rows left due): the next claim
		 * waits too, or the run sent those rows again at once. */
		if (more && now_mono_ms() < until_ms &&
		    now_mono_ms() >= r->cycle_retry_at &&
		    broker_blocked_ms(r->broker) == 0 && !woken(r)) {
			n = side_claim(r, next, PIPELINE_LOCK_WAIT_MS);
			*claimed = n > 0 ? (size_t)n : 0;
			more = n == -1;
			if (n == -1)
				log_info("pipelined claim gave way", "error=%s",
				    log_quote((char[600]){ 0 }, 600,
				    store_error(next->store)));
		}
		if (cur->state == SIDE_CLAIMED)
			side_settle(r, cur, broker_await_batch(r->broker));
		/* A stop or reload asked during that wait ends the run: the
		 * batch claimed meanwhile goes back unsent (it was sent, and
		 * its confirms awaited, on the way to the stop). */
		if (cur->broker_rc == -1 || broker_blocked_ms(r->broker) > 0 ||
		    next->state != SIDE_CLAIMED || woken(r))
			break;
		t = cur;
		cur = next;
		next = t;
	}
	/* A batch claimed but not sent goes back untouched. */
	if (next->state == SIDE_CLAIMED) {
		store_abort(next->store, &next->batch);
		next->state = SIDE_FREE;
	}
	if (next->state == SIDE_PUBLISHED && side_mark(r, next) == -1)
		rc = -1;
	if (cur->state == SIDE_PUBLISHED && side_mark(r, cur) == -1)
		rc = -1;
	if (cur->broker_rc == -1)
		rc = -1;
	*backlog = rc == 0 && more;
	return rc;
}

/*
 * Brings one server up if it is down and its retry time has come.
 * Returns true when it is up.
 */
static bool
ensure_store(struct relay *r)
{
	struct store *second = r->sides[1].store, *down;
	int64_t now = now_mono_ms();

	if (store_connected(r->store) &&
	    (second == NULL || store_connected(second)))
		return true;
	if (r->store_was_up) {
		down = store_connected(r->store) ? second : r->store;
		log_error("postgres connection lost", "error=%s",
		    log_quote((char[600]){ 0 }, 600, store_error(down)));
		drop_sessions(r);	/* paced there */
	}
	if (now < r->store_link.retry_at)
		return false;
	/* A worker is kicked by the main relay instead of listening; the
	 * second session of a pipelined relay only claims and marks. */
	down = r->store;
	if (store_connect(r->store) == 0 &&
	    (r->kick_fd >= 0 || store_listen(r->store) == 0) &&
	    (second == NULL || store_connected(second) ||
	    store_connect((down = second)) == 0)) {
		log_info("postgres connected", second != NULL ? "sessions=2" :
		    NULL);
		if (r->store_ever_up)
			metrics_inc_reconnect(METRICS_SERVER_POSTGRES);
		r->store_ever_up = true;
		link_up(&r->store_link);
		log_limit_reset(&r->store_log);
		r->store_was_up = true;
		return true;
	}
	r->store_link.retry_at = now +
	    backoff_cursor_next(&r->store_link.retry);
	log_event_limited(&r->store_log, LOG_WARN, "postgres unavailable",
	    "retry_in_ms=%" PRId64 " error=%s", r->store_link.retry_at - now,
	    log_quote((char[600]){ 0 }, 600, store_error(down)));
	store_disconnect(r->store);
	if (second != NULL)
		store_disconnect(second);
	return false;
}

static bool
ensure_broker(struct relay *r)
{
	int64_t now = now_mono_ms();

	if (broker_connected(r->broker))
		return true;
	pace_after_loss(&r->broker_link, &r->broker_log, "rabbitmq");
	if (now < r->broker_link.retry_at)
		return false;
	if (broker_connect(r->broker) == 0) {
		if (r->broker_ever_up)
			metrics_inc_reconnect(METRICS_SERVER_RABBITMQ);
		r->broker_ever_up = true;
		link_up(&r->broker_link);
		log_limit_reset(&r->broker_log);
		return true;
	}
	r->broker_link.retry_at = now +
	    backoff_cursor_next(&r->broker_link.retry);
	log_event_limited(&r->broker_log, LOG_WARN, "rabbitmq unavailable",
	    "retry_in_ms=%" PRId64, r->broker_link.retry_at - now);
	return false;
}

/* Sleeps timeout_ms, or less when a signal comes or the wake fd is
 * readable.  The main relay has no wake fd: poll() skips the -1, and a
 * SIGTERM still cuts the wait short (a sleep that resumed after EINTR
 * held every stop with a server down for up to a second). */
static void
nap(struct relay *r, int64_t timeout_ms)
{
	struct pollfd pfd = { .fd = r->wake_fd, .events = POLLIN };

	if (timeout_ms <= 0)
		return;
	if (poll(&pfd, 1, (int)timeout_ms) == -1 && errno != EINTR)
		log_warn("poll failed", "error=%s",
		    log_quote((char[128]){ 0 }, 128, strerror(errno)));
}

/* Takes the NOTIFYs read so far: 1 when there were any (new rows: the
 * next claim need not wait, see idle_timeout), 0 when none, -1 when the
 * session failed (dropped). */
static int
take_notifies(struct relay *r)
{
	switch (store_drain_notifies(r->store)) {
	case -1:
		store_disconnect(r->store);
		return -1;
	case 0:
		return 0;
	default:
		r->unclaimed_until_ms = 0;
		return 1;
	}
}

/* Waits for a NOTIFY on the store's socket, a signal, the wake fd, a
 * kick or timeout_ms.  Returns false when a signal or an error cut the
 * wait short. */
static bool
wait_for_work(struct relay *r, int64_t timeout_ms)
{
	struct pollfd pfd[3] = {
		{ .fd = store_socket(r->store), .events = POLLIN },
		{ .fd = r->wake_fd, .events = POLLIN },
		{ .fd = r->kick_fd, .events = POLLIN },
	};
	uint64_t kicks;

	if (timeout_ms <= 0)
		return true;
	if (pfd[0].fd < 0) {
		nap(r, timeout_ms);
		return true;
	}
	/* A NOTIFY that came in during the last query (idle_timeout's) was
	 * read into libpq's queue, where poll() cannot see it: without this
	 * check a row committed meanwhile waited up to MIN_IDLE_WAIT_MS or
	 * the poll interval (bench: p99 354 ms at 1,000 msg/s). */
	if (take_notifies(r) != 0)
		return true;
	/* poll() skips negative fds: no wake or kick fd, fewer entries. */
	if (poll(pfd, 3, (int)timeout_ms) == -1) {
		if (errno != EINTR)
			log_warn("poll failed", "error=%s",
			    log_quote((char[128]){ 0 }, 128,
			    strerror(errno)));
		return false;
	}
	if (pfd[0].revents != 0)
		(void)take_notifies(r);
	/* Read, or a kick would end every later wait at once (a busy loop,
	 * in standby above all).  Non-blocking: another read may have won. */
	if (pfd[2].revents != 0) {
		(void)!read(r->kick_fd, &kicks, sizeof(kicks));
		r->unclaimed_until_ms = 0;	/* a backlog, says the kicker */
	}
	return true;
}

/*
 * Waits timeout_ms, or until the wake fd (a signal, a stop) or the
 * session's end, reading the NOTIFYs meanwhile and dropping them
 * (wait_for_work returns at each).  Not read, they piled up in libpq
 * while the broker was down (the leader's compensation queries read
 * them in: 60 bytes per producer commit, for the whole outage), or in
 * the kernel, holding PostgreSQL's NOTIFY queue back; and a standby
 * that returned at each one went round its loop once per commit.
 */
static void
wait_dropping_wakeups(struct relay *r, int64_t timeout_ms)
{
	int64_t until = now_mono_ms() + timeout_ms, left;

	while (store_connected(r->store) && !woken(r) &&
	    (left = until - now_mono_ms()) > 0)
		if (!wait_for_work(r, left))
			break;
}

/*
 * How long until there may be work: the next due row or poll_interval.
 * A due row that the claim skipped (held back by per-key ordering, or
 * locked by another instance) must not turn this into a busy loop, and
 * while such rows stay, the wait doubles up to poll_interval: every
 * claim walks them all, and a key held behind a row in its backoff
 * (up to backoff.max) kept each relay walking its rows four times a
 * second, most of a core of PostgreSQL's for 20,000 such rows.
 */
#define MIN_IDLE_WAIT_MS 250
#define MAX_IDLE_DOUBLINGS 10

static int64_t
idle_timeout(struct relay *r, size_t claimed, int64_t max_wait_ms)
{
	int64_t wait = r->conf.poll_interval_ms, due;

	if (store_next_due_in(r->store, r->include_retries, &due) == -1) {
		log_error("next-due query failed", "error=%s",
		    log_quote((char[600]){ 0 }, 600, store_error(r->store)));
		r->stats.store_errors++;
		store_disconnect(r->store);
		return 0;
	}
	if (due == 0 && claimed == 0) {	/* due, yet no claim took it */
		/* A row held back for its refused marks is due, and no
		 * claim takes it before its hold ends. */
		int64_t held = refused_wait_ms(r->refused, now_mono_ms()),
		    skipped = (int64_t)MIN_IDLE_WAIT_MS << (r->due_unclaimed <
		    MAX_IDLE_DOUBLINGS ? r->due_unclaimed : MAX_IDLE_DOUBLINGS);

		if (held > skipped)
			skipped = held;
		if (skipped < wait)
			wait = skipped;
		r->due_unclaimed++;
		r->unclaimed_until_ms = now_mono_ms() + wait;
		log_debug("due rows not claimed", "times=%u wait_ms=%" PRId64,
		    r->due_unclaimed, wait);
	} else {
		r->due_unclaimed = 0;
		r->unclaimed_until_ms = 0;
		if (due == 0)
			wait = MIN_IDLE_WAIT_MS;
		else if (due > 0 && due < wait)
			wait = due;
	}
	return wait < max_wait_ms ? wait : max_wait_ms;
}

/* rabbitmq-c answers heartbeats and notices a closed connection only
 * when called: do it while idle too. */
static void
tick_broker(struct relay *r)
{
	if (broker_connected(r->broker) && broker_tick(r->broker) == -1)
		broker_disconnect(r->broker);
}

/*
 * Brings both servers up; when one is still down, sleeps until its
 * retry time (within max_wait_ms) and returns false.
 */
#define MIN_RETRY_WAIT_MS 10
static bool
connections_up(struct relay *r, int64_t max_wait_ms)
{
	/* Both, not `&&`: with PostgreSQL down the broker's retry time must
	 * still move on, or the wait below would be in the past and the
	 * loop would spin at full CPU while both servers are away.  But
	 * not after a stop that came during the first connect: the second
	 * could take rabbitmq.connect_timeout per node. */
	bool store_up = ensure_store(r);
	bool broker_up = broker_connected(r->broker) ||
	    (!woken(r) && ensure_broker(r));
	int64_t retry_at = INT64_MAX, wait;

	if (store_up && broker_up)
		return true;
	if (!store_up)
		retry_at = r->store_link.retry_at;
	if (!broker_up && r->broker_link.retry_at < retry_at)
		retry_at = r->broker_link.retry_at;
	wait = retry_at - now_mono_ms();
	if (wait < MIN_RETRY_WAIT_MS)
		wait = MIN_RETRY_WAIT_MS;
	if (wait > max_wait_ms)
		wait = max_wait_ms;
	/* The one that is up is kept read: the session's NOTIFYs, the
	 * broker's heartbeats and closes. */
	if (store_up) {
		wait_dropping_wakeups(r, wait);
		return false;
	}
	if (broker_up)
		tick_broker(r);
	nap(r, wait);
	return false;
}


/*
 * While the broker blocks publishing (a memory or disk alarm), nothing
 * is claimed: the rows wait in the outbox, where they cost the broker
 * nothing.  Waits for the broker's next words (the unblock), a signal or
 * the wake fd, within max_wait_ms.
 */
static void
wait_for_unblock(struct relay *r, int64_t max_wait_ms)
{
	struct pollfd pfd[2] = {
		{ .fd = -1, .events = POLLIN },
		{ .fd = r->wake_fd, .events = POLLIN },
	};

	/* Frames rabbitmq-c read ahead never wake poll(): take them first. */
	tick_broker(r);
	if (broker_blocked_ms(r->broker) == 0)
		return;
	pfd[0].fd = broker_socket(r->broker);
	if (poll(pfd, 2, (int)max_wait_ms) == -1 && errno != EINTR)
		log_warn("poll failed", "error=%s",
		    log_quote((char[128]){ 0 }, 128, strerror(errno)));
	tick_broker(r);
}

int64_t
relay_blocked_ms(const struct relay *r)
{
	return broker_blocked_ms(r->broker);
}

bool
relay_step(struct relay *r, int64_t max_wait_ms)
{
	size_t claimed = 0;
	int64_t paced;

	if (!connections_up(r, max_wait_ms))
		return false;
	/* A signal that came outside a wait (during a claim, a mark or a
	 * connect) did not cut one short: it is seen here, before new
	 * work, not after the next wait (up to a second). */
	if (woken(r))
		return false;
	/* libpq keeps each NOTIFY it reads during any query on the session
	 * (the leader's compensation runs on it too) until it is taken,
	 * and only an idle wait took them: through a backlog, or a broker
	 * alarm, of hours, the process grew by some 50 bytes per producer
	 * commit.  What comes next claims anyway, or waits to: they are
	 * spent. */
	if (store_connected(r->store) && take_notifies(r) == -1)
		return false;	/* connections_up reconnects next step */
	if (broker_blocked_ms(r->broker) > 0) {
		wait_for_unblock(r, max_wait_ms);
		return false;
	}
	paced = r->cycle_retry_at - now_mono_ms();
	if (paced > 0) {
		nap(r, paced < max_wait_ms ? paced : max_wait_ms);
		tick_broker(r);
		return false;
	}
	/* Due rows that no claim took, and nothing new since: the claim
	 * waits for its time (idle_timeout), across the caller's turns. */
	paced = r->unclaimed_until_ms - now_mono_ms();
	if (r->unclaimed_until_ms != 0 && paced > 0) {
		(void)wait_for_work(r, paced < max_wait_ms ? paced :
		    max_wait_ms);
		tick_broker(r);
		return false;
	}
	if (r->sides[1].store != NULL) {
		bool backlog;

		/* A run of batches, bounded so that the caller still renews
		 * its locks and sees a stop in time. */
		int rc = relay_pipeline(r, now_mono_ms() + (max_wait_ms <
		    PIPELINE_RUN_MS ? max_wait_ms : PIPELINE_RUN_MS),
		    &backlog, &claimed);

		drop_if_asked(r);
		if (rc == -1)
			return false;
		if (backlog)
			return true;
	} else if (relay_cycle(r, &claimed) == -1)
		return false;	/* connections_up reconnects next step */
	/* A full batch means a backlog: claim again at once.  With per-key
	 * ordering, a batch holds one row per key, so the next row of each
	 * key is due right after this one: go again too. */
	if (claimed == (size_t)r->conf.batch_size || (claimed > 0 &&
	    r->last_claim_cut))
		return true;
	if (claimed > 0 && r->conf.ordering_by_key)
		return false;
	/* Notifications that arrived during the cycle are for rows it may
	 * not have seen: drain them, and if any, go round again. */
	if (take_notifies(r) > 0)
		return false;
	if (store_connected(r->store))
		(void)wait_for_work(r, idle_timeout(r, claimed,
		    max_wait_ms));
	tick_broker(r);
	return false;
}

void
relay_standby(struct relay *r, int64_t max_wait_ms)
{
	/* A hot standby keeps both connections up, so that it is ready
	 * (and healthy) the moment it becomes leader, but claims nothing;
	 * its wake-ups are read and dropped. */
	r->failing_since_ms = 0;	/* it claims nothing to fail */
	if (!connections_up(r, max_wait_ms))
		return;
	wait_dropping_wakeups(r, max_wait_ms);
	tick_broker(r);
}
