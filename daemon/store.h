/*
 * Store: the PostgreSQL side (libpq).  Claims due outbox rows in a
 * transaction that holds their row locks (FOR UPDATE SKIP LOCKED) until
 * their outcome is written, wakes on NOTIFY, and applies the schema.
 */
#ifndef OUTBOXD_STORE_H
#define OUTBOXD_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

struct store_conf {
	char *conninfo;		/* libpq keyword=value string or URI */
	char *password;		/* secret: never logged; NULL = from conninfo */
	/* postgres.password_file, read again before each connection
	 * (secret.h); NULL: the password above is fixed. */
	const char *password_file;
	int64_t connect_timeout_ms;
	char *application_name;
	/* A session idle inside a transaction this long is ended by the
	 * server, so a hung instance cannot hold its batch's rows forever.
	 * 0 = the server's default.  Set from rabbitmq.confirm_timeout. */
	int64_t idle_in_transaction_timeout_ms;
	/* The relay's sessions: plans kept on the indexes whatever the
	 * statistics say (see store_connect).  Off for the CLI. */
	bool index_plans;
	/* Longest wait for a lock (a table locked by a migration, say)
	 * before a statement fails; 0 = no limit.  A claim takes the table
	 * lock its marks need before it claims (store_claim), so a mark
	 * only ever waits for an index's lock, briefly. */
	int64_t lock_timeout_ms;
	/* The relay's sessions: only a server that takes writes will do
	 * (target_session_attrs=read-write unless the conninfo sets it), so
	 * that libpq passes over a standby in a host list and a read-only
	 * server is reported at connect, not by every claim.  Off for the
	 * CLI's status and dead-row list, which read a standby fine. */
	bool read_write;
};

/* Message states, as in seed 001 plus DEAD for exhausted rows. */
enum message_status {
	STATUS_PENDING = 0,
	STATUS_SUCCESS = 1,
	STATUS_FAIL = 2,
	STATUS_DEAD = 3,
};

/* A claimed row.  Strings point into the batch and live until the batch
 * is finished; none is NULL ("" where the column was NULL). */
struct outbox_row {
	int64_t id;
	const char *exchange_name;
	const char *exchange_type;
	const char *routing_key;	/* routing_key, else queue_name */
	const char *content_type;	/* "" = not set */
	const char *business_module;
	const char *business_key;
	int current_retry_times;
	int max_retry_times;
	int64_t init_backoff_ms;
	double backoff_factor;
	int64_t create_time_s;
	const unsigned char *content;
	size_t content_len;
	bool has_content;		/* false: no content row at all */
	bool content_unfetched;		/* over the claim's max_payload:
					 * content NULL, content_len set */
	const char *const *header_keys;
	const char *const *header_values;
	size_t n_headers;
	const char *row_error;		/* non-NULL: the row itself is bad */
};

struct store_batch {
	struct outbox_row *rows;
	size_t n;
	/* Rows were left out (locked, untouched until the batch ends) to
	 * keep the batch within max_batch_bytes: there is more to claim. */
	bool cut_short;
};

/* What to write for one claimed row when the batch finishes. */
enum mark_kind {
	MARK_SUCCESS,	/* confirmed: SUCCESS, next_schedule_time NULL */
	MARK_RETRY,	/* failed: FAIL, retries+1, due again after delay_ms */
	MARK_DEAD,	/* failed for good: DEAD, retries+1 */
	MARK_RELEASE,	/* outcome unknown: leave the row untouched */
};

struct store_mark {
	int64_t id;
	enum mark_kind kind;
	int64_t delay_ms;
	const char *error;	/* last_error for RETRY and DEAD */
	/* Set by store_finish() when the database refused this row's
	 * mark: why, in words for last_error and the log (valid until the
	 * next store_finish); kind is then what was written instead. */
	const char *refused;
};

struct store_claim_opts {
	int limit;
	bool ordered_by_key;	/* skip rows with an older unsent same key */
	bool include_retries;	/* FAIL rows too, not only PENDING ones */
	/* > 0: wait at most this long for the table lock, instead of
	 * postgres.lock_timeout.  A pipelined relay's claim, made while its
	 * other session holds a batch open, must give way quickly to a
	 * lock request queued behind that batch (see relay.c). */
	int64_t lock_timeout_ms;
	/* 0 = no bound.  Contents longer than max_payload are not fetched
	 * (content_unfetched); the batch ends where its contents pass
	 * max_batch_bytes (its first row is always in). */
	size_t max_payload;
	size_t max_batch_bytes;
	/* Rows left out of this claim: those whose marks the database
	 * refuses wait for their next try (refused.h). */
	const int64_t *skip_ids;
	size_t n_skip;
};

/* The most rows the relay leaves out of one claim. */
#define STORE_SKIP_MAX 64

struct store;

struct store *store_new(const struct store_conf *);
void store_free(struct store *);
int store_connect(struct store *) WARN_UNUSED;
bool store_connected(const struct store *);
void store_disconnect(struct store *);
const char *store_error(const struct store *);
/* The socket to poll for NOTIFY wake-ups, or -1. */
int store_socket(const struct store *);
/* For tests: the session's value of a setting (current_setting). */
int store_setting(struct store *, const char *name, char *buf, size_t size)
    WARN_UNUSED;
/* For tests: the session's statistics (tuples read) go to the shared
 * views before this returns; PostgreSQL itself reports at most once a
 * second, and a session that goes idle sooner reports 10 s later. */
int store_flush_stats(struct store *) WARN_UNUSED;

/* Applies every migration in order (idempotent). */
int store_migrate(struct store *) WARN_UNUSED;
/* LISTEN on the wake-up channel. */
int store_listen(struct store *) WARN_UNUSED;
/* Reads pending input; returns how many notifications arrived, or -1. */
int store_drain_notifies(struct store *) WARN_UNUSED;

/*
 * Opens a transaction and claims up to opts->limit due rows with their
 * content, oldest next_schedule_time first.  The rows stay locked until
 * store_finish() or store_abort().  batch->n may be 0 (the transaction is
 * then already closed).
 */
int store_claim(struct store *, const struct store_claim_opts *,
    struct store_batch *) WARN_UNUSED;
/*
 * Writes the marks and commits, then releases the batch: 0, or -1 with
 * the store's error (rolled back: the rows are due again untouched).
 * When the database refuses the batch's marks for an error that one row
 * can cause (a trigger's exception, a constraint; not a timeout, a full
 * disk or a privilege), the refused rows are found by halving, in the
 * same transaction, the rows still locked (only when the COMMIT itself
 * refused them, in a new one, on the rows still as claimed: another
 * session may have taken some meanwhile, which are left to it, as
 * MARK_RELEASE).
 * A row whose own mark is refused is made DEAD instead, with why in
 * last_error; if even that is refused it is left untouched (RELEASE).
 * Either way its mark's refused is set, and 1 is returned.
 */
int store_finish(struct store *, struct store_batch *,
    struct store_mark *marks, size_t n) WARN_UNUSED;
/* Whether an error of this SQLSTATE can come from one row, so that
 * store_finish() marks the batch again row by row (pure). */
bool store_sqlstate_row_specific(const char *sqlstate);
/* The last statement failed because the session cannot write (SQLSTATE
 * 25006): its server became a standby, or was made read-only, after the
 * session began.  Only a new session can go on, maybe on another host. */
bool store_session_read_only(const struct store *);
/* The last statement failed because the session's prepared statements
 * no longer fit: a column the claim returns changed type (ALTER TABLE),
 * or they were deallocated.  They are prepared once per session, so
 * every claim failed the same way until a new session. */
bool store_statements_stale(const struct store *);
/* The last statement failed for want of a privilege (SQLSTATE 42501):
 * the role lacks a grant that examples/roles.sql gives. */
bool store_permission_denied(const struct store *);
/* The last statement was cancelled by statement_timeout (SQLSTATE 57014,
 * or by pg_cancel_backend). */
bool store_timed_out(const struct store *);
/* postgres.lock_timeout, in ms (0: none). */
int64_t store_lock_timeout_ms(const struct store *);
/* Limits each statement of the session to ms (statement_timeout); 0
 * gives the role's or database's own back (RESET). */
int store_limit_statements(struct store *, int64_t ms);
/*
 * The last statement failed because a value has no form in UTF-8, the
 * encoding outboxd reads in (SQLSTATE 22P05), or is not valid in the
 * database's own (22021): text stored in a database in WIN1252 with
 * one of its unassigned bytes (0x81), say.  Every claim that reaches
 * such a row fails.
 */
bool store_untranslatable(const struct store *);

/* A row store_mark_unreadable_dead found. */
struct store_unreadable {
	int64_t id;
	char error[320];	/* its last_error now, or the refusal */
};

/* What store_mark_unreadable_dead found: the rows it made DEAD, and
 * those whose DEAD mark the database refused (a trigger's exception, a
 * constraint), which stay due, untouched.  n_dead and n_held count them
 * all; the arrays hold the first of each. */
#define STORE_UNREADABLE_KEPT 8
struct store_unreadable_found {
	size_t n_dead, n_held;
	struct store_unreadable dead[STORE_UNREADABLE_KEPT];
	struct store_unreadable held[STORE_SKIP_MAX];
};

/*
 * After a claim with opts failed so (store_untranslatable): reads the
 * text of each row that claim would take, one by one, and makes DEAD
 * those that cannot be read, with the database's words in last_error,
 * in a transaction of its own (outside a batch).  0, or -1 with the
 * store's error (nothing marked).
 */
int store_mark_unreadable_dead(struct store *,
    const struct store_claim_opts *opts, struct store_unreadable_found *)
    WARN_UNUSED;
/* Rolls back (rows become due again untouched) and releases the batch. */
void store_abort(struct store *, struct store_batch *);

/* Row counts for status, metrics and the health check. */
struct store_counts {
	int64_t pending;	/* PENDING and FAIL rows, due or not */
	int64_t due;		/* due now */
	int64_t dead;
	int64_t sent;		/* SUCCESS; -1 when not counted (costly) */
	double oldest_due_age_s; /* 0 when nothing is due */
};

int store_counts(struct store *, bool count_sent, struct store_counts *)
    WARN_UNUSED;

/*
 * Rows a sweep or a purge leaves out: the database refused to change
 * them (a trigger's exception, a constraint; 23503 for a sent row that
 * an application table still references).  Each pass takes the oldest
 * rows first, so one such row was in every chunk, failed it, and
 * stopped every pass after it.  The caller keeps it between passes, and
 * empties it now and then to try the rows again.  Once it is full, a
 * refused chunk fails the call as before, and a refused part of one is
 * left as it is: finding each row costs statements, every pass.
 */
#define STORE_SKIP_ROWS_MAX 256
struct store_skip {
	int64_t ids[STORE_SKIP_ROWS_MAX];
	size_t n;
	size_t refused;		/* found by the last call, all of them */
	int64_t first;		/* the first of them */
	char why[320];	/* the last call's first refusal */
};

/* Compensation, run by the leader: rows whose retries ran out (e.g.
 * max_retry_times lowered by hand) become DEAD, up to chunk of them;
 * sets *n to how many.  Rows in skip are left out, and rows refused are
 * added to it (NULL: none left out, a refusal fails the call).  When a
 * refusal makes it try the rows apart, each statement of that gets what
 * is left until deadline (now_mono_ms() time; 0: no limit). */
int store_sweep_exhausted(struct store *, int chunk, int64_t deadline,
    struct store_skip *, int64_t *n) WARN_UNUSED;
/* Deletes up to `chunk` SUCCESS rows (and their content) last edited
 * more than older_than_ms ago; sets *n to how many were deleted.  skip
 * and deadline as for store_sweep_exhausted. */
int store_purge_sent(struct store *, int64_t older_than_ms, int chunk,
    int64_t deadline, struct store_skip *, int64_t *n) WARN_UNUSED;
/* Which dead rows a listing or a replay takes; a NULL field takes any.
 * After an outage of one exchange, say, its rows alone are replayed. */
struct dead_filter {
	const char *exchange;		/* exchange_name ("" = the default) */
	const char *routing_key;	/* routing_key, else queue_name */
	const char *error;		/* a part of last_error */
};

/* Makes dead rows due again with their retry count reset: one id, or,
 * when id is 0, every dead row that filter (NULL: any) takes.  Sets *n;
 * wakes the relays. */
int store_replay_dead(struct store *, int64_t id, const struct dead_filter *,
    int64_t *n) WARN_UNUSED;

/* One dead row, for listing. */
struct dead_row {
	int64_t id;
	const char *exchange_name;
	const char *routing_key;
	const char *business_key;
	int retries;
	const char *edit_time;
	const char *last_error;
};
/* Calls fn for up to limit dead rows that filter (NULL: any) takes,
 * newest first. */
int store_list_dead(struct store *, int limit, const struct dead_filter *,
    void (*fn)(const struct dead_row *, void *), void *arg) WARN_UNUSED;

/* Session-level PostgreSQL advisory lock: the leader election fallback
 * while Redis is unreachable.  *held is set to the outcome. */
int store_try_leader_lock(struct store *, bool *held) WARN_UNUSED;
/* Lets the lock go; -1 (store_error says why) when the server would not,
 * and the session was closed to let it go. */
int store_release_leader_lock(struct store *);

/* Which of ids[0..n) are still due (due[i]), whether or not locked by
 * another session; outside a batch.  0, or -1 with the store's error. */
int store_still_due(struct store *, const int64_t *ids, size_t n, bool *due)
    WARN_UNUSED;
/* Milliseconds until the earliest future due time (> 0), or -1 if none. */
int store_next_due_in(struct store *, bool include_retries, int64_t *ms)
    WARN_UNUSED;

#endif
