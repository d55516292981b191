/*
 * Store: PostgreSQL access for the relay.  A batch is claimed and marked
 * inside one transaction, so its row locks (FOR UPDATE SKIP LOCKED) keep
 * every other instance off those rows until their outcome is written.
 */
#include "store.h"

#include <endian.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include <libpq-fe.h>

#include "log.h"
#include "migrations.h"
#include "secret.h"
#include "util.h"

#define NOTIFY_CHANNEL "outboxd"

/* How long sent data may stay unacknowledged before the connection is
 * given up, in milliseconds: the keepalives' 10 s + 3 x 5 s, doubled. */
#define PG_USER_TIMEOUT_MS "30000"

#define SERVER_KEEPALIVES_SQL \
	"SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5;" \
	" SET tcp_keepalives_count = 3"

/* Due: unsent, not deleted, scheduled no later than now, retries left.
 * The ORDER BY expression matches t_transactional_message_due_idx. */
#define DUE_PREDICATE \
	"message_status IN (0, 2) AND NOT deleted" \
	" AND coalesce(next_schedule_time, '-infinity'::timestamptz) <= now()" \
	" AND current_retry_times < max_retry_times"

/*
 * Headers: a JSON object, or none (SQL NULL, or a JSON null, which is
 * what drivers write for "no headers"); anything else makes the row bad.
 *
 * The claim, in two forms: every due row (the leader, or any instance in
 * single-active mode), or only rows never tried (non-leaders, which leave
 * retries to the leader's compensation).  $2 turns per-key ordering on;
 * an empty business_key is no key, as in the message headers.
 *
 * The content is a lateral subquery probed by message_id (OFFSET 0 keeps
 * it one): planned for an empty table, a join became a walk of the whole
 * content table for each row.
 *
 * A create_time of 'infinity' or '-infinity' (valid timestamps) is taken
 * as now(): its conversion failed ("cannot convert infinity to bigint"),
 * and with it every claim, the row being the oldest due one.  A NULL
 * backoff or create_time (a table whose NOT NULL was dropped: the schema
 * check looks at columns and types only) is the column's default.
 * The id and the factor are cast to the widths they are read at: an
 * older table's integer id or real factor was read as 8 bytes, so the
 * row was published under a wrong message_id and never marked.  The
 * retry counts are clamped to int4 (one less for the attempt that is
 * added to it): an older table's bigint columns held values whose cast
 * failed ("integer out of range"), and with it every claim, the row
 * being due.
 *
 * Memory: a content longer than $3 (rabbitmq.max_payload, which refuses
 * it unsent) is not fetched, only its length (octet_length reads the
 * stored size, not the value), and the batch ends where its contents
 * pass $4 bytes (the first row is always in).  Before, a 1 GB row was
 * downloaded whole to be marked DEAD, and 500 rows of 16 MiB made one
 * 8 GiB batch; the process was killed, and after a restart the same
 * batch came first again.  The rows left out stay locked until the
 * batch's transaction ends, untouched.  The content comes with its
 * length from one probe by message_id; it stays in the database (a TOAST
 * pointer) for the rows not returned.
 *
 * Values no cast takes must not fail the claim, or one row stops every
 * claim: an infinite create_time is taken as now, and an infinite
 * init_backoff (PostgreSQL 17 has them) as the longest delay, which
 * backoff.max caps ('-infinity': a negative one, which is ignored).
 */
#define CLAIM_DUE(extra) \
    " SELECT * FROM t_transactional_message m" \
    " WHERE " DUE_PREDICATE extra \
    "  AND m.id <> ALL($5::int8[])" \
    "  AND ($2 = false OR coalesce(m.business_key, '') = ''" \
    "   OR NOT EXISTS (" \
    "   SELECT 1 FROM t_transactional_message o" \
    "   WHERE o.business_key = m.business_key AND o.id < m.id" \
    "    AND o.message_status IN (0, 2) AND NOT o.deleted))" \
    " ORDER BY coalesce(next_schedule_time, '-infinity'::timestamptz), id" \
    " LIMIT $1 FOR UPDATE SKIP LOCKED"

#define CLAIM_SQL(extra) \
    "WITH due AS (" CLAIM_DUE(extra) ")," \
    " sized AS (SELECT u.*, l.len, l.content," \
    "  sum(least(coalesce(l.len, 0), $3::int8)) OVER (ORDER BY" \
    "   coalesce(u.next_schedule_time, '-infinity'::timestamptz), u.id)" \
    "   - least(coalesce(l.len, 0), $3::int8) AS before" \
    "  FROM due u LEFT JOIN LATERAL (SELECT octet_length(c.content)" \
    "   AS len, c.content FROM t_transactional_message_content c" \
    "   WHERE c.message_id = u.id OFFSET 0) l ON true)" \
    " SELECT d.id::int8, d.exchange_name, d.exchange_type," \
    "  coalesce(nullif(d.routing_key, ''), d.queue_name)," \
    "  d.content_type, coalesce(d.business_module, '')," \
    "  coalesce(d.business_key, ''), least(greatest(" \
    "   d.current_retry_times, 0), 2147483646)::int4," \
    "  least(greatest(d.max_retry_times, 0), 2147483647)::int4," \
    "  CASE WHEN isfinite(d.init_backoff) IS NOT FALSE THEN" \
    "   (extract(epoch FROM coalesce(d.init_backoff," \
    "   interval '10 seconds')) * 1000)::int8" \
    "   WHEN d.init_backoff > interval '0' THEN 9223372036854775807" \
    "   ELSE -1 END," \
    "  coalesce(d.backoff_factor, 2)::float8," \
    "  extract(epoch FROM CASE WHEN isfinite(d.create_time)" \
    "   THEN d.create_time ELSE now() END)::int8," \
    "  CASE WHEN d.len <= $3::int8 THEN d.content END," \
    "  CASE WHEN d.headers IS NULL OR jsonb_typeof(d.headers) IN" \
    "   ('object', 'null')" \
    "   THEN NULL ELSE 'headers must be a JSON object, not '" \
    "   || jsonb_typeof(d.headers) END," \
    "  h.keys, h.vals, d.len::int8" \
    " FROM sized d" \
    " LEFT JOIN LATERAL (SELECT array_agg(key) AS keys," \
    "   array_agg(value) AS vals FROM jsonb_each_text(CASE WHEN" \
    "   jsonb_typeof(d.headers) = 'object' THEN d.headers END)" \
    "   WHERE value IS NOT NULL) h ON true" \
    " WHERE d.before < $4::int8" \
    " ORDER BY coalesce(d.next_schedule_time," \
    "  '-infinity'::timestamptz), d.id"

static const char claim_all_sql[] = CLAIM_SQL("");
static const char claim_new_sql[] = CLAIM_SQL(" AND m.message_status = 0");

/*
 * A row the claim cannot read (store_untranslatable): the claim's rows
 * by id alone, then each one's text alone, behind a savepoint, so that
 * one that fails is known and the others' reads go on.  The text read is
 * what the claim reads: the names, and an object's headers whole (a
 * key or value that fails fails both).  ($3 and $4 are the claim's,
 * unused here.)
 */
static const char unreadable_all_sql[] =
    "WITH due AS (" CLAIM_DUE("") ") SELECT id FROM due";
static const char unreadable_new_sql[] =
    "WITH due AS (" CLAIM_DUE(" AND m.message_status = 0") ")"
    " SELECT id FROM due";
#define UNREADABLE_PROBE_SQL \
	"SAVEPOINT outboxd_probe; SELECT exchange_name, exchange_type," \
	" coalesce(nullif(routing_key, ''), queue_name), content_type," \
	" business_module, business_key, CASE WHEN jsonb_typeof(headers) =" \
	" 'object' THEN headers::text END FROM t_transactional_message" \
	" WHERE id = %" PRId64 "; RELEASE outboxd_probe"
static const char mark_unreadable_sql[] =
    "UPDATE t_transactional_message SET message_status = 3,"
    " current_retry_times = least(greatest(current_retry_times, 0) + 1,"
    "  32767),"
    " last_error = $2, edit_time = statement_timestamp(),"
    " editor = 'outboxd', next_schedule_time = NULL WHERE id = $1";

/* The lock an UPDATE of the table takes; see store_claim. */
#define LOCK_FOR_MARKS \
	"LOCK TABLE t_transactional_message IN ROW EXCLUSIVE MODE"

enum claim_col {
	COL_ID, COL_EXCHANGE, COL_EXCHANGE_TYPE, COL_ROUTING_KEY,
	COL_CONTENT_TYPE, COL_MODULE, COL_KEY, COL_RETRIES, COL_MAX_RETRIES,
	COL_INIT_BACKOFF, COL_FACTOR, COL_CREATED, COL_CONTENT,
	COL_ROW_ERROR, COL_HEADER_KEYS, COL_HEADER_VALUES, COL_CONTENT_LEN,
	N_CLAIM_COLS
};

/* The marks' times are the mark's (statement_timestamp), not the
 * claim's (now() is the transaction's start): a batch's confirms can
 * take up to rabbitmq.confirm_timeout, and a retry delay counted from
 * the claim came due that much early. */
static const char mark_success_sql[] =
    "UPDATE t_transactional_message SET message_status = 1,"
    " next_schedule_time = NULL, edit_time = statement_timestamp(),"
    " editor = 'outboxd' WHERE id = ANY($1::int8[])";

/* Failed rows: FAIL (2) with a new due time, or DEAD (3). */
static const char mark_failed_sql[] =
    "UPDATE t_transactional_message t SET message_status = u.status,"
    " current_retry_times = least(greatest(t.current_retry_times, 0) + 1,"
    "  32767),"
    " last_error = u.error, edit_time = statement_timestamp(),"
    " editor = 'outboxd', next_schedule_time = CASE WHEN u.status = 2"
    "  THEN statement_timestamp() + u.delay_ms * interval '1 millisecond'"
    "  END"
    " FROM unnest($1::int8[], $2::int2[], $3::int8[], $4::text[])"
    "  AS u(id, status, delay_ms, error)"
    " WHERE t.id = u.id";

/*
 * Milliseconds until the earliest unsent row is due: NULL when there is
 * none, 0 when one is due already.  A NULL or infinite schedule is
 * clamped before the subtraction, which failed on them ("cannot
 * subtract infinite timestamps").  ORDER BY the due index's expression
 * and LIMIT 1 read one entry of it whatever the statistics say, where
 * min() could be planned as a read of every unsent row.
 */
#define NEXT_DUE_SQL(extra) \
    "SELECT (extract(epoch FROM (" \
    " SELECT least(greatest(next_schedule_time, now())," \
    "  now() + interval '1 day')" \
    " FROM t_transactional_message" \
    " WHERE message_status IN (0, 2) AND NOT deleted" \
    " AND current_retry_times < max_retry_times" extra \
    " ORDER BY coalesce(next_schedule_time, '-infinity'::timestamptz)" \
    " LIMIT 1) - now()) * 1000)::int8"

static const char next_due_all_sql[] = NEXT_DUE_SQL("");
static const char next_due_new_sql[] = NEXT_DUE_SQL(
    " AND message_status = 0");

/* A refused mark's text: the database's words and what was refused. */
#define STORE_REFUSAL_LEN 400

struct store {
	struct store_conf conf;
	PGconn *conn;
	PGresult *claimed;	/* the open batch's rows, or NULL */
	bool in_transaction;
	bool leader_lock_held;	/* session advisory lock, see below */
	size_t n_prepared;	/* this session's statements made so far */
	bool last_claim_full;	/* a backlog: plan the next claim afresh */
	/* Monotonic ms until which marks go under a savepoint: the
	 * database refused one lately (store_finish).  Kept across
	 * sessions: it is the table's triggers that refuse. */
	int64_t marks_guarded_until_ms;
	char error[1024];
	/* Reused across batches so a steady flow allocates nothing. */
	struct outbox_row *rows;
	size_t rows_cap;
	char *arena;		/* header strings, NUL-terminated */
	size_t arena_len, arena_cap;
	size_t *offs;		/* arena offsets: a row's keys, then values */
	size_t noffs, offs_cap;
	size_t *hdr_base;	/* per row: its first entry in offs */
	size_t hdr_base_cap;
	const char **header_ptrs;
	size_t header_ptrs_cap;
	char *buf;		/* array literals for the marks */
	size_t buf_len, buf_cap;
	/* The last failed statement's SQLSTATE and primary message. */
	char sqlstate[6];
	char refusal[256];
	/* Why marks were refused (store_mark.refused), one per row. */
	char (*refusals)[STORE_REFUSAL_LEN];
	size_t refusals_cap;
	/* This session's copy of the password: a password file is read
	 * again before each connection (secret.h). */
	char *password;
};

static void
set_error(struct store *s, const char *what, const char *detail)
{
	char msg[sizeof(s->error)];
	size_t len;

	snprintf(msg, sizeof(msg), "%s", detail ? detail : "");
	/* libpq messages end in a newline; logfmt lines must not. */
	len = strlen(msg);
	while (len > 0 && (msg[len - 1] == '\n' || msg[len - 1] == ' '))
		msg[--len] = '\0';
	snprintf(s->error, sizeof(s->error), "%s: %s", what, msg);
	s->sqlstate[0] = '\0';
	snprintf(s->refusal, sizeof(s->refusal), "%.255s", s->error);
}

/* Records a failed statement's error, with its SQLSTATE and primary
 * message, under `what`, and clears the result. */
static void
set_result_error(struct store *s, PGresult *res, const char *what)
{
	const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE),
	    *primary = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);

	set_error(s, what, PQerrorMessage(s->conn));
	snprintf(s->sqlstate, sizeof(s->sqlstate), "%s",
	    state != NULL ? state : "");
	if (primary != NULL)
		snprintf(s->refusal, sizeof(s->refusal), "%.255s", primary);
	PQclear(res);
}

struct store *
store_new(const struct store_conf *conf)
{
	struct store *s = xcalloc(1, sizeof(*s));

	s->conf = *conf;
	s->password = conf->password != NULL ? xstrdup(conf->password) :
	    NULL;
	return s;
}

void
store_free(struct store *s)
{
	if (s == NULL)
		return;
	store_disconnect(s);
	free(s->rows);
	free(s->arena);
	free(s->header_ptrs);
	free(s->offs);
	free(s->hdr_base);
	free(s->buf);
	free(s->refusals);
	secret_free(s->password);
	free(s);
}

const char *
store_error(const struct store *s)
{
	return s->error;
}

bool
store_connected(const struct store *s)
{
	return s->conn != NULL && PQstatus(s->conn) == CONNECTION_OK;
}

int
store_socket(const struct store *s)
{
	return s->conn ? PQsocket(s->conn) : -1;
}

void
store_disconnect(struct store *s)
{
	if (s->claimed != NULL) {
		PQclear(s->claimed);
		s->claimed = NULL;
	}
	if (s->conn != NULL) {
		PQfinish(s->conn);
		s->conn = NULL;
	}
	s->in_transaction = false;
	s->leader_lock_held = false;
	s->n_prepared = 0;
	s->last_claim_full = false;
}

/*
 * Checks a result that should carry no error, clears it, and records the
 * server's words under `what` when it failed.  Returns 0 or -1.
 */
static int
result_done(struct store *s, PGresult *res, const char *what)
{
	ExecStatusType st = PQresultStatus(res);

	if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
		set_result_error(s, res, what);
		return -1;
	}
	PQclear(res);
	return 0;
}

static int
prepare(struct store *s, const char *name, const char *sql, int nparams)
{
	return result_done(s, PQprepare(s->conn, name, sql, nparams, NULL),
	    name);
}

/* Runs a statement whose rows, if any, do not matter. */
static int
exec_command(struct store *s, const char *sql)
{
	return result_done(s, PQexec(s->conn, sql), "postgres");
}

/* Runs a parameterised statement; returns its result or NULL. */
static PGresult *
query(struct store *s, const char *what, const char *sql, int n,
    const char *const *params, ExecStatusType want)
{
	PGresult *res = PQexecParams(s->conn, sql, n, NULL, params, NULL,
	    NULL, 0);

	if (PQresultStatus(res) != want) {
		set_result_error(s, res, what);
		return NULL;
	}
	return res;
}

static void
log_notice(void *arg, const char *message)
{
	char text[512];
	size_t len;

	(void)arg;
	snprintf(text, sizeof(text), "%s", message);
	len = strlen(text);
	if (len > 0 && text[len - 1] == '\n')
		text[len - 1] = '\0';
	log_debug("postgres notice", "text=%s",
	    log_quote((char[600]){ 0 }, 600, text));
}

/* The statement that gives the session its configured lock_timeout
 * (0: the server's default). */
static const char *
lock_timeout_sql(const struct store *s, char *buf, size_t size)
{
	if (s->conf.lock_timeout_ms > 0)
		return strfmt(buf, size, "SET lock_timeout = %" PRId64,
		    s->conf.lock_timeout_ms);
	return "RESET lock_timeout";
}

int
store_connect(struct store *s)
{
	char timeout[32];
	/*
	 * Later entries override what the conninfo says; keepalives come
	 * first so that a conninfo can still override them.  Linux sends
	 * keepalive probes only while nothing sent is unacknowledged: a
	 * host that vanishes with a query on the wire is noticed only by
	 * the retransmissions' limit (tcp_retries2, some 15 minutes) unless
	 * TCP_USER_TIMEOUT bounds them.  Text comes in UTF-8 whatever the
	 * database's encoding: names and headers go to the broker as they
	 * are, and AMQP's are UTF-8 (a LATIN1 database's "café" reached
	 * the broker as other bytes, a name no consumer had bound).
	 */
	const char *keys[] = { "keepalives", "keepalives_idle",
		"keepalives_interval", "keepalives_count", "tcp_user_timeout",
		"target_session_attrs", "dbname", "connect_timeout",
		"application_name", "client_encoding", "password", NULL };
	const char *vals[] = { "1", "10", "5", "3", PG_USER_TIMEOUT_MS,
		s->conf.read_write ? "read-write" : NULL, s->conf.conninfo,
		timeout, s->conf.application_name ?
		s->conf.application_name : "outboxd", "UTF8", NULL, NULL };

	store_disconnect(s);
	secret_reread(&s->password, s->conf.password_file,
	    "postgres.password_file");
	vals[10] = s->password;
	/* libpq counts whole seconds and treats 1 as 2. */
	snprintf(timeout, sizeof(timeout), "%" PRId64,
	    (s->conf.connect_timeout_ms + 999) / 1000);
	if (s->password == NULL)
		keys[10] = NULL;
	s->conn = PQconnectdbParams(keys, vals, 1);
	if (PQstatus(s->conn) != CONNECTION_OK) {
		set_error(s, "postgres connect", PQerrorMessage(s->conn));
		goto fail;
	}
	/* Server notices ("relation exists, skipping") would otherwise go
	 * to stderr raw; keep every line logfmt. */
	PQsetNoticeProcessor(s->conn, log_notice, NULL);
	/*
	 * The server's end, with the server's defaults, keeps an orphaned
	 * session (and the leader's advisory lock, which fences the other
	 * instances) for 2 h 10 min after a network partition: it probes
	 * as this end does.  Ignored on a Unix socket; tcp_user_timeout
	 * is PostgreSQL 12's.
	 */
	if (exec_command(s, PQserverVersion(s->conn) >= 120000 ?
	    SERVER_KEEPALIVES_SQL "; SET tcp_user_timeout = "
	    PG_USER_TIMEOUT_MS : SERVER_KEEPALIVES_SQL) == -1)
		goto fail;
	/* The claim's FOR UPDATE SKIP LOCKED and the marks are written for
	 * READ COMMITTED.  Under a database or role default of REPEATABLE
	 * READ or SERIALIZABLE a claim that met a row marked since its
	 * snapshot failed (40001), and marks failed at COMMIT after their
	 * batch was published, which was then sent again. */
	if (exec_command(s, "SET default_transaction_isolation = "
	    "'read committed'") == -1)
		goto fail;
	if (s->conf.idle_in_transaction_timeout_ms > 0) {
		char set[96];

		snprintf(set, sizeof(set), "SET idle_in_transaction_session_"
		    "timeout = %" PRId64, s->conf.idle_in_transaction_timeout_ms);
		if (exec_command(s, set) == -1)
			goto fail;
	}
	if (s->conf.lock_timeout_ms > 0 &&
	    exec_command(s, lock_timeout_sql(s, (char[64]){ 0 }, 64)) == -1)
		goto fail;
	/*
	 * An outbox table's statistics are stale by nature, and PostgreSQL
	 * keeps one plan for a prepared statement after five runs.  Planned
	 * for a nearly empty outbox (a new install, a quiet hour), the claim
	 * read and sorted every due row, or hashed the whole content table,
	 * for each batch once a backlog built up, until autoanalyze ran: a
	 * benchmark drain of 100,000 rows took 65 s instead of 2.5 s.  Every
	 * statement the relay and the leader run is a walk along an index or
	 * a probe by id, so plans that read a table or a whole index
	 * (sequential and bitmap scans, hash and merge joins) are ruled out
	 * for their sessions.
	 */
	if (s->conf.index_plans && exec_command(s, "SET enable_seqscan = off;"
	    " SET enable_bitmapscan = off; SET enable_hashjoin = off;"
	    " SET enable_mergejoin = off") == -1)
		goto fail;
	return 0;
fail:
	store_disconnect(s);
	return -1;
}

int
store_setting(struct store *s, const char *name, char *buf, size_t size)
{
	const char *params[1] = { name };
	PGresult *res = query(s, "setting", "SELECT current_setting($1)", 1,
	    params, PGRES_TUPLES_OK);

	if (res == NULL)
		return -1;
	snprintf(buf, size, "%s", PQgetvalue(res, 0, 0));
	PQclear(res);
	return 0;
}

int
store_flush_stats(struct store *s)
{
	/* The force takes effect where the statement ends and the session
	 * goes idle: before PQexec sees ReadyForQuery. */
	PGresult *res = query(s, "flush stats",
	    "SELECT pg_stat_force_next_flush()", 0, NULL, PGRES_TUPLES_OK);

	if (res == NULL)
		return -1;
	PQclear(res);
	return 0;
}

static const struct statement {
	const char *name, *sql;
	int nparams;
} statements[] = {
	{ "claim_all", claim_all_sql, 5 },
	{ "claim_new", claim_new_sql, 5 },
	{ "mark_success", mark_success_sql, 1 },
	{ "mark_failed", mark_failed_sql, 4 },
	{ "next_due_all", next_due_all_sql, 0 },
	{ "next_due_new", next_due_new_sql, 0 },
};

/*
 * Prepares the relay's statements once per session, on first use: at
 * connect time the schema may not exist yet (`outboxd migrate`).  One
 * can fail after others succeeded (an UPDATE needs a lock that a
 * CREATE INDEX holds past lock_timeout): the next call goes on from
 * there, where starting over failed on "already exists" for good.
 */
static int
ensure_prepared(struct store *s)
{
	for (; s->n_prepared < ARRAY_LEN(statements); s->n_prepared++) {
		const struct statement *st = &statements[s->n_prepared];

		if (prepare(s, st->name, st->sql, st->nparams) == -1)
			return -1;
	}
	return 0;
}

int
store_listen(struct store *s)
{
	return exec_command(s, "LISTEN " NOTIFY_CHANNEL);
}

#define DRAIN_READS_MAX 256

int
store_drain_notifies(struct store *s)
{
	PGnotify *n;
	int count = 0, got, reads = 0;

	/* One read takes what fits libpq's buffer, some 900 of them: read
	 * until a read brings none, or the rest waited in the socket for
	 * the next query, which took them all into libpq's list at once.
	 * Bounded, against a flood that never lets up. */
	do {
		if (PQconsumeInput(s->conn) == 0) {
			set_error(s, "postgres", PQerrorMessage(s->conn));
			return -1;
		}
		for (got = 0; (n = PQnotifies(s->conn)) != NULL; got++)
			PQfreemem(n);
		count += got;	/* at most 256 reads of about 900 */
	} while (got > 0 && ++reads < DRAIN_READS_MAX);
	return count;
}

/*
 * A CREATE INDEX CONCURRENTLY that failed (as OPERATIONS.md suggests for
 * a big outbox) leaves an invalid index behind.  IF NOT EXISTS accepts
 * it and no query can use it, so the purge, say, would scan the table
 * again without a word: name it.  A warning, not a failure: the relay
 * works without it, and failing here would keep a deployment from
 * starting.
 */
static int
warn_invalid_indexes(struct store *s)
{
	PGresult *res = query(s, "migrate", "SELECT c.relname"
	    " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
	    " WHERE i.indrelid IN ('t_transactional_message'::regclass,"
	    "  't_transactional_message_content'::regclass)"
	    " AND NOT i.indisvalid ORDER BY 1", 0, NULL, PGRES_TUPLES_OK);

	if (res == NULL)
		return -1;
	for (int i = 0; i < PQntuples(res); i++)
		log_warn("index not valid", "index=%s hint=%s",
		    log_quote((char[200]){ 0 }, 200, PQgetvalue(res, i, 0)),
		    log_quote((char[200]){ 0 }, 200, "a CREATE INDEX"
		    " CONCURRENTLY failed: drop it and build it again"
		    " (OPERATIONS.md)"));
	PQclear(res);
	return 0;
}

/* The session lock that serialises instances migrating at once. */
#define MIGRATE_LOCK_KEY "7400313"
#define MIGRATE_LOCK_POLL_MS 200

/*
 * Takes the migration lock, waiting as long as another instance's run
 * lasts.  Polled, not waited for in one statement: a concurrent index
 * build of that run waits for every older transaction to end, and a
 * statement waiting for its lock would be one of them (a deadlock that
 * PostgreSQL breaks by cancelling one side).
 */
static int
migrate_lock(struct store *s)
{
	bool logged = false;

	for (;;) {
		PGresult *res = query(s, "migrate", "SELECT pg_try_advisory_"
		    "lock(" MIGRATE_LOCK_KEY ")", 0, NULL, PGRES_TUPLES_OK);
		bool taken;

		if (res == NULL)
			return -1;
		taken = *PQgetvalue(res, 0, 0) == 't';
		PQclear(res);
		if (taken)
			return 0;
		if (!logged)
			log_info("waiting for another migration", "lock=%s",
			    MIGRATE_LOCK_KEY);
		logged = true;
		sleep_ms(MIGRATE_LOCK_POLL_MS, NULL);
	}
}

/* Prefixes the store's error with the migration that caused it. */
static int
migration_failed(struct store *s, const struct migration *m)
{
	char saved[sizeof(s->error)], what[128];

	memcpy(saved, s->error, sizeof(saved));
	set_error(s, strfmt(what, sizeof(what), "migration %s", m->name),
	    saved);
	return -1;
}

static int
record_migration(struct store *s, const struct migration *m)
{
	const char *params[1] = { m->name };
	PGresult *res = query(s, "migrate", "INSERT INTO outboxd_migrations"
	    " (name) VALUES ($1)", 1, params, PGRES_COMMAND_OK);

	if (res == NULL)
		return -1;
	PQclear(res);
	return 0;
}

/* A migration and its record, in one transaction. */
static int
apply_in_transaction(struct store *s, const struct migration *m)
{
	if (exec_command(s, "BEGIN") == -1)
		return -1;
	if (exec_command(s, m->sql) == -1) {
		migration_failed(s, m);
		goto fail;
	}
	if (record_migration(s, m) == -1 || exec_command(s, "COMMIT") == -1)
		goto fail;
	return 0;
fail:
	/* Keep the real error; the rollback's own outcome adds nothing. */
	PQclear(PQexec(s->conn, "ROLLBACK"));
	return -1;
}

/* Whether the named index exists (1), is valid (2), or neither (0);
 * -1 when the query failed. */
static int
index_state(struct store *s, const char *name)
{
	const char *params[1] = { name };
	PGresult *res = query(s, "migrate", "SELECT i.indisvalid FROM pg_index"
	    " i WHERE i.indexrelid = to_regclass($1)", 1, params,
	    PGRES_TUPLES_OK);
	int state;

	if (res == NULL)
		return -1;
	state = PQntuples(res) == 0 ? 0 :
	    *PQgetvalue(res, 0, 0) == 't' ? 2 : 1;
	PQclear(res);
	return state;
}

/*
 * A migration that builds its index CONCURRENTLY, outside a transaction:
 * producers' inserts go on meanwhile.  Such a build that failed or was
 * cancelled (here or by hand) leaves an invalid index of the name, which
 * IF NOT EXISTS would take as done: it is dropped and built again.  The
 * record follows the build; a run that dies in between builds nothing
 * the next time, the index being there.
 */
static int
apply_online(struct store *s, const struct migration *m)
{
	int state = index_state(s, m->online_index);
	char what[128], detail[256];

	if (state == -1)
		return -1;
	if (state == 1) {
		char *ident = PQescapeIdentifier(s->conn, m->online_index,
		    strlen(m->online_index));
		char drop[256];

		if (ident == NULL) {
			set_error(s, "migrate", PQerrorMessage(s->conn));
			return -1;
		}
		log_warn("rebuilding an invalid index", "index=%s migration=%s",
		    m->online_index, m->name);
		strfmt(drop, sizeof(drop), "DROP INDEX CONCURRENTLY IF EXISTS "
		    "%s", ident);
		PQfreemem(ident);
		if (exec_command(s, drop) == -1)
			return migration_failed(s, m);
	}
	/* The build waits for every transaction open on the table; an
	 * operator watching a quiet migrate should know what it waits for. */
	log_info("building an index concurrently", "index=%s migration=%s "
	    "note=%s", m->online_index, m->name, log_quote((char[120]){ 0 },
	    120, "waits for transactions open on the table to end"));
	if (exec_command(s, m->sql) == -1)
		return migration_failed(s, m);
	state = index_state(s, m->online_index);
	if (state == -1)
		return -1;
	if (state != 2) {
		/* Only another session building the same name leaves it so:
		 * recording the migration now would hide that. */
		strfmt(detail, sizeof(detail), "index %s is %s after its "
		    "build; is another session building it?",
		    m->online_index, state == 0 ? "missing" : "not valid");
		set_error(s, strfmt(what, sizeof(what), "migration %s",
		    m->name), detail);
		return -1;
	}
	return record_migration(s, m);
}

/*
 * The tables' shape, checked around the migrations: 001 creates them IF
 * NOT EXISTS, so an outbox table from before outboxd (the seed's, in a
 * close translation) was taken as it was, and migrate said "schema up to
 * date" while claims could never work.  Only what outboxd relies on is
 * checked: every column, the types its SQL needs (NOT deleted, jsonb
 * headers, interval backoff, times with a time zone: `timestamp` made due
 * times follow each session's TimeZone, and failed 001's index; a
 * create_time without one gave each message an AMQP timestamp off by the
 * server's UTC offset, and an edit_time without one made `purge
 * --older-than` follow the TimeZone of the shell it ran from;
 * a domain counts as its base type) and one content row per message (two
 * make every claim fail).
 * The tables are found as the relay's statements find them, through
 * search_path: current_schema() is a first schema without them
 * ("$user") as well.
 */
#define SCHEMA_PROBLEMS_SQL \
	"WITH want(tbl, col, typ) AS (VALUES" \
	" ('t_transactional_message', 'id', NULL)," \
	" ('t_transactional_message', 'create_time'," \
	"  'timestamp with time zone')," \
	" ('t_transactional_message', 'edit_time'," \
	"  'timestamp with time zone')," \
	" ('t_transactional_message', 'editor', NULL)," \
	" ('t_transactional_message', 'deleted', 'boolean')," \
	" ('t_transactional_message', 'current_retry_times', NULL)," \
	" ('t_transactional_message', 'max_retry_times', NULL)," \
	" ('t_transactional_message', 'next_schedule_time'," \
	"  'timestamp with time zone')," \
	" ('t_transactional_message', 'message_status', NULL)," \
	" ('t_transactional_message', 'init_backoff', 'interval')," \
	" ('t_transactional_message', 'backoff_factor', NULL)," \
	" ('t_transactional_message', 'queue_name', NULL)," \
	" ('t_transactional_message', 'exchange_name', NULL)," \
	" ('t_transactional_message', 'exchange_type', NULL)," \
	" ('t_transactional_message', 'routing_key', NULL)," \
	" ('t_transactional_message', 'business_module', NULL)," \
	" ('t_transactional_message', 'business_key', NULL)," \
	" ('t_transactional_message', 'content_type', NULL)," \
	" ('t_transactional_message', 'headers', 'jsonb')," \
	" ('t_transactional_message', 'last_error', NULL)," \
	" ('t_transactional_message_content', 'message_id', NULL)," \
	" ('t_transactional_message_content', 'content', NULL))," \
	" problem(text) AS (" \
	"  SELECT w.tbl || '.' || w.col || CASE WHEN a.attname IS NULL" \
	"   THEN ' is missing' ELSE ' is ' || a.typ || ', not ' || w.typ END" \
	"  FROM want w LEFT JOIN (SELECT attrelid, attname," \
	"    format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype" \
	"    ELSE pa.atttypid END, NULL) AS typ" \
	"    FROM pg_attribute pa JOIN pg_type t ON t.oid = pa.atttypid" \
	"    WHERE pa.attnum > 0 AND NOT pa.attisdropped) a" \
	"   ON a.attrelid = to_regclass(w.tbl) AND a.attname = w.col" \
	"  WHERE to_regclass(w.tbl) IS NOT NULL AND (a.attname IS NULL" \
	"   OR (w.typ IS NOT NULL AND a.typ <> w.typ))" \
	"  UNION ALL" \
	"  SELECT 't_transactional_message_content.message_id has no unique" \
	" index (two content rows for one message stop every claim)'" \
	"  WHERE to_regclass('t_transactional_message_content') IS NOT NULL" \
	"   AND NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a" \
	"    ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]" \
	"    WHERE i.indrelid = to_regclass('t_transactional_message_content')" \
	"    AND i.indisunique AND i.indnatts = 1" \
	"    AND a.attname = 'message_id'))" \
	" SELECT string_agg(text, '; ' ORDER BY text) FROM problem"

static int
check_schema(struct store *s)
{
	PGresult *res = query(s, "migrate", SCHEMA_PROBLEMS_SQL, 0, NULL,
	    PGRES_TUPLES_OK);
	char msg[sizeof(s->error)];

	if (res == NULL)
		return -1;
	if (PQgetisnull(res, 0, 0)) {
		PQclear(res);
		return 0;
	}
	strfmt(msg, sizeof(msg), "the outbox tables are not what outboxd "
	    "needs (tables from before outboxd?): %s; change them as "
	    "sql/001_outbox_tables.sql defines them, then migrate again",
	    PQgetvalue(res, 0, 0));
	PQclear(res);
	set_error(s, "migrate", msg);
	return -1;
}

/*
 * The outbox's tables must be in the schema that migrate creates in, the
 * first schema of search_path that exists: CREATE TABLE IF NOT EXISTS
 * looks nowhere else.  Tables in public, and then a schema named as the
 * role (search_path's "$user", first by default): migrate built a
 * second, empty outbox there, and the relay read it.  Nothing was
 * delivered, and nothing said so.
 */
#define SCHEMA_PLACE_SQL \
	"SELECT n.nspname, current_schema() FROM unnest(ARRAY[" \
	"'outboxd_migrations', 't_transactional_message'," \
	" 't_transactional_message_content']) AS t(name)" \
	" JOIN pg_class c ON c.oid = to_regclass(t.name)" \
	" JOIN pg_namespace n ON n.oid = c.relnamespace" \
	" WHERE n.nspname IS DISTINCT FROM current_schema() LIMIT 1"

/* An outbox split already (by such a migrate, or by hand): the schemas
 * of search_path that hold one, in its order, when more than one does. */
#define SCHEMA_SPLIT_SQL \
	"SELECT string_agg(n.nspname, ', ' ORDER BY" \
	" array_position(current_schemas(false), n.nspname))" \
	" FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace" \
	" WHERE c.relname = 't_transactional_message'" \
	" AND c.relkind IN ('r', 'p')" \
	" AND n.nspname = ANY (current_schemas(false)) HAVING count(*) > 1"

static int
check_schema_place(struct store *s)
{
	PGresult *res = query(s, "migrate", SCHEMA_SPLIT_SQL, 0, NULL,
	    PGRES_TUPLES_OK);
	char msg[sizeof(s->error)];

	if (res == NULL)
		return -1;
	if (PQntuples(res) == 1) {
		strfmt(msg, sizeof(msg), "t_transactional_message is in more "
		    "than one schema of search_path (%s): outboxd reads the "
		    "first only, and producers may write to another; keep one "
		    "outbox (move the other's rows to it, then drop the other)",
		    PQgetvalue(res, 0, 0));
		PQclear(res);
		set_error(s, "migrate", msg);
		return -1;
	}
	PQclear(res);
	res = query(s, "migrate", SCHEMA_PLACE_SQL, 0, NULL, PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	if (PQntuples(res) == 0) {
		PQclear(res);
		return 0;
	}
	if (PQgetisnull(res, 0, 1))
		strfmt(msg, sizeof(msg), "the outbox tables are in schema "
		    "\"%s\", and no schema of search_path exists to migrate "
		    "in; set search_path to \"%s\" (postgres.conninfo: "
		    "options=-csearch_path=%s)", PQgetvalue(res, 0, 0),
		    PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 0));
	else
		strfmt(msg, sizeof(msg), "the outbox tables are in schema "
		    "\"%s\", but the first schema of search_path is \"%s\", "
		    "where migrate would create a second, empty outbox that "
		    "the relay would then read; put \"%s\" first in "
		    "search_path (postgres.conninfo: options=-csearch_path=%s,"
		    " or ALTER ROLE ... SET search_path), or move the tables",
		    PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1),
		    PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 0));
	PQclear(res);
	set_error(s, "migrate", msg);
	return -1;
}

int
store_migrate(struct store *s)
{
	char restore[96];
	int rc = -1;

	/* A migration waits for the locks it needs as long as it takes, and
	 * an index build takes as long as it does: a statement_timeout of
	 * the role or database cancelled CREATE INDEX CONCURRENTLY.  The
	 * relay's own lock_timeout and the session's statement_timeout are
	 * restored after. */
	if (exec_command(s, "SET lock_timeout = 0; SET statement_timeout = 0")
	    == -1)
		return -1;
	if (migrate_lock(s) == -1)
		goto restore;
	if (check_schema_place(s) == -1)
		goto unlock;
	if (exec_command(s, "CREATE TABLE IF NOT EXISTS outboxd_migrations ("
	    "name text PRIMARY KEY,"
	    " applied_at timestamptz NOT NULL DEFAULT now())") == -1)
		goto unlock;
	if (check_schema(s) == -1)
		goto unlock;
	for (const struct migration *m = migrations; m->name != NULL; m++) {
		const char *params[1] = { m->name };
		PGresult *res = query(s, "migrate", "SELECT 1 FROM "
		    "outboxd_migrations WHERE name = $1", 1, params,
		    PGRES_TUPLES_OK);
		bool applied;

		if (res == NULL)
			goto unlock;
		applied = PQntuples(res) == 1;
		PQclear(res);
		if (applied)
			continue;
		if ((m->online_index != NULL ? apply_online(s, m) :
		    apply_in_transaction(s, m)) == -1)
			goto unlock;
		log_info("migration applied", "name=%s", m->name);
	}
	if (check_schema(s) == -1)
		goto unlock;
	rc = 0;
unlock:
	/* Failed or not, the session lets go of the lock; a lost session
	 * already has. */
	PQclear(PQexec(s->conn, "SELECT pg_advisory_unlock(" MIGRATE_LOCK_KEY
	    ")"));
restore:
	PQclear(PQexec(s->conn, strfmt(restore, sizeof(restore), "%s; "
	    "RESET statement_timeout", lock_timeout_sql(s, (char[64]){ 0 },
	    64))));
	if (rc == 0)
		rc = warn_invalid_indexes(s);
	return rc;
}

/* --- reading binary results ------------------------------------------- */

/* A NULL reads as 0: PQgetvalue gives "" for it, and 8 bytes copied from
 * there were whatever followed in memory.  The claim gives the numbers it
 * reads a value; this is for a column it missed. */
static int64_t
get_int8(const PGresult *res, int row, int col)
{
	uint64_t v;

	if (PQgetisnull(res, row, col))
		return 0;
	memcpy(&v, PQgetvalue(res, row, col), sizeof(v));
	return (int64_t)be64toh(v);
}

static int32_t
get_int4(const PGresult *res, int row, int col)
{
	uint32_t v;

	if (PQgetisnull(res, row, col))
		return 0;
	memcpy(&v, PQgetvalue(res, row, col), sizeof(v));
	return (int32_t)be32toh(v);
}

static double
get_float8(const PGresult *res, int row, int col)
{
	uint64_t v;
	double d;

	if (PQgetisnull(res, row, col))
		return 0;
	memcpy(&v, PQgetvalue(res, row, col), sizeof(v));
	v = be64toh(v);
	memcpy(&d, &v, sizeof(d));
	return d;
}

/* Text arrives as raw bytes followed by a NUL in binary results too. */
static const char *
get_text(const PGresult *res, int row, int col)
{
	return PQgetisnull(res, row, col) ? "" : PQgetvalue(res, row, col);
}

static size_t
arena_add(struct store *s, const char *bytes, size_t len)
{
	size_t at = s->arena_len;

	if (s->arena_len + len + 1 > s->arena_cap) {
		s->arena_cap = (s->arena_len + len + 1) * 2;
		s->arena = xrealloc(s->arena, s->arena_cap);
	}
	memcpy(s->arena + at, bytes, len);
	s->arena[at + len] = '\0';
	s->arena_len += len + 1;
	return at;
}

/*
 * Decodes a one-dimensional text[] in binary format into arena offsets:
 * ndim, has_null, elem oid, then (size, lower bound) per dimension, then
 * (length, bytes) per element.  Returns the count, or -1 if malformed.
 */
static long
decode_text_array(struct store *s, const char *p, size_t len,
    size_t *offsets, size_t max)
{
	uint32_t ndim, count, elen;
	size_t pos;

	if (len < 12)
		return -1;
	memcpy(&ndim, p, 4);
	ndim = be32toh(ndim);
	if (ndim == 0)
		return 0;
	if (ndim != 1 || len < 20)
		return -1;
	memcpy(&count, p + 12, 4);
	count = be32toh(count);
	pos = 20;
	if (count > max)
		return -1;
	for (uint32_t i = 0; i < count; i++) {
		if (pos + 4 > len)
			return -1;
		memcpy(&elen, p + pos, 4);
		elen = be32toh(elen);
		pos += 4;
		if (elen == UINT32_MAX) {	/* NULL element: empty string */
			offsets[i] = arena_add(s, "", 0);
			continue;
		}
		if (pos + elen > len)
			return -1;
		offsets[i] = arena_add(s, p + pos, elen);
		pos += elen;
	}
	return (long)count;
}

#define MAX_HEADERS 64

/* Grows a reusable array to hold at least n elements of size sz. */
static void *
grow(void *p, size_t *cap, size_t n, size_t sz)
{
	if (n <= *cap)
		return p;
	*cap = n * 2;
	return xrealloc(p, *cap * sz);
}

/* The store's buffer holds the text of one statement's array
 * parameters: the claim's left-out ids, the marks' arrays. */
static void
buf_reset(struct store *s)
{
	s->buf_len = 0;
}

static void
buf_add(struct store *s, const char *bytes, size_t len)
{
	s->buf = grow(s->buf, &s->buf_cap, s->buf_len + len + 1, 1);
	memcpy(s->buf + s->buf_len, bytes, len);
	s->buf_len += len;
	s->buf[s->buf_len] = '\0';
}

static void
buf_add_int(struct store *s, int64_t v)
{
	char num[32];
	int n = snprintf(num, sizeof(num), "%" PRId64, v);

	buf_add(s, num, (size_t)n);
}

/* The ids as an int8[] literal, in the store's buffer. */
static const char *
ids_array(struct store *s, const int64_t *ids, size_t n)
{
	buf_reset(s);
	buf_add(s, "{", 1);
	for (size_t i = 0; i < n; i++) {
		if (i > 0)
			buf_add(s, ",", 1);
		buf_add_int(s, ids[i]);
	}
	buf_add(s, "}", 1);
	return s->buf;
}

/*
 * Copies one row's header keys then values into the arena and appends
 * their offsets to s->offs.  Returns the count, or -1 when malformed.
 */
static long
decode_headers(struct store *s, int i)
{
	const PGresult *res = s->claimed;
	size_t key_at[MAX_HEADERS], val_at[MAX_HEADERS];
	long nk, nv;

	if (PQgetisnull(res, i, COL_HEADER_KEYS))
		return 0;
	nk = decode_text_array(s, PQgetvalue(res, i, COL_HEADER_KEYS),
	    (size_t)PQgetlength(res, i, COL_HEADER_KEYS), key_at, MAX_HEADERS);
	nv = decode_text_array(s, PQgetvalue(res, i, COL_HEADER_VALUES),
	    (size_t)PQgetlength(res, i, COL_HEADER_VALUES), val_at,
	    MAX_HEADERS);
	if (nk < 0 || nk != nv)
		return -1;
	s->offs = grow(s->offs, &s->offs_cap, s->noffs + 2 * (size_t)nk,
	    sizeof(*s->offs));
	memcpy(s->offs + s->noffs, key_at, (size_t)nk * sizeof(size_t));
	memcpy(s->offs + s->noffs + nk, val_at, (size_t)nk * sizeof(size_t));
	s->noffs += 2 * (size_t)nk;
	return nk;
}

/*
 * RabbitMQ routes a message also to the routing keys listed in its CC
 * and BCC headers, and closes the channel on any other type there.
 * outboxd sends header values as strings, so such a row can only fail,
 * and each channel close sends the batch's unconfirmed window again:
 * refused here, before the broker sees it.  NULL: no such header.
 */
static const char *
routing_header_error(const struct outbox_row *r)
{
	for (size_t k = 0; k < r->n_headers; k++) {
		if (strcmp(r->header_keys[k], "CC") == 0)
			return "headers: \"CC\" is RabbitMQ's sender-selected "
			    "routing, which takes a list of routing keys, not "
			    "the string outboxd sends";
		if (strcmp(r->header_keys[k], "BCC") == 0)
			return "headers: \"BCC\" is RabbitMQ's sender-selected "
			    "routing, which takes a list of routing keys, not "
			    "the string outboxd sends";
	}
	return NULL;
}

static void
fill_row(struct store *s, int i, struct outbox_row *r)
{
	const PGresult *res = s->claimed;

	memset(r, 0, sizeof(*r));
	r->id = get_int8(res, i, COL_ID);
	r->exchange_name = get_text(res, i, COL_EXCHANGE);
	r->exchange_type = get_text(res, i, COL_EXCHANGE_TYPE);
	r->routing_key = get_text(res, i, COL_ROUTING_KEY);
	r->content_type = get_text(res, i, COL_CONTENT_TYPE);
	r->business_module = get_text(res, i, COL_MODULE);
	r->business_key = get_text(res, i, COL_KEY);
	r->current_retry_times = get_int4(res, i, COL_RETRIES);
	r->max_retry_times = get_int4(res, i, COL_MAX_RETRIES);
	r->init_backoff_ms = get_int8(res, i, COL_INIT_BACKOFF);
	r->backoff_factor = get_float8(res, i, COL_FACTOR);
	r->create_time_s = get_int8(res, i, COL_CREATED);
	/* content is NOT NULL: no length is a missing content row, a
	 * length without the content one over the claim's max_payload. */
	r->has_content = !PQgetisnull(res, i, COL_CONTENT_LEN);
	r->content_len = (size_t)get_int8(res, i, COL_CONTENT_LEN);
	r->content_unfetched = r->has_content &&
	    PQgetisnull(res, i, COL_CONTENT);
	if (r->has_content && !r->content_unfetched)
		r->content = (const unsigned char *)PQgetvalue(res, i,
		    COL_CONTENT);
	if (!PQgetisnull(res, i, COL_ROW_ERROR))
		r->row_error = PQgetvalue(res, i, COL_ROW_ERROR);
}

static void
fill_rows(struct store *s, struct store_batch *batch)
{
	size_t n = (size_t)PQntuples(s->claimed);

	s->rows = grow(s->rows, &s->rows_cap, n, sizeof(*s->rows));
	s->hdr_base = grow(s->hdr_base, &s->hdr_base_cap, n,
	    sizeof(*s->hdr_base));
	s->arena_len = 0;
	s->noffs = 0;
	/* Header strings go to the arena first, which may move while it
	 * grows; pointers into it are taken only once it is complete. */
	for (size_t i = 0; i < n; i++) {
		struct outbox_row *r = &s->rows[i];
		long count;

		fill_row(s, (int)i, r);
		s->hdr_base[i] = s->noffs;
		count = decode_headers(s, (int)i);
		if (count < 0) {
			r->row_error = "headers: more than 64 entries or a "
			    "malformed array";
			count = 0;
		}
		r->n_headers = (size_t)count;
	}
	s->header_ptrs = grow(s->header_ptrs, &s->header_ptrs_cap, s->noffs,
	    sizeof(*s->header_ptrs));
	for (size_t k = 0; k < s->noffs; k++)
		s->header_ptrs[k] = s->arena + s->offs[k];
	for (size_t i = 0; i < n; i++) {
		struct outbox_row *r = &s->rows[i];

		if (r->n_headers == 0)
			continue;
		r->header_keys = &s->header_ptrs[s->hdr_base[i]];
		r->header_values = r->header_keys + r->n_headers;
		if (r->row_error == NULL)
			r->row_error = routing_header_error(r);
	}
	batch->rows = s->rows;
	batch->n = n;
}

/* A claim's byte bound as the SQL takes it (int8): 0 is none. */
static uint64_t
claim_bound(size_t bytes)
{
	return bytes > 0 ? (uint64_t)bytes : INT64_MAX;
}

/* The bytes the claim counted against max_batch_bytes. */
static uint64_t
batch_bytes(const struct store_batch *batch,
    const struct store_claim_opts *opts)
{
	uint64_t sum = 0, cap = claim_bound(opts->max_payload);

	for (size_t i = 0; i < batch->n; i++) {
		uint64_t len = batch->rows[i].content_len;

		sum += len > cap ? cap : len;
	}
	return sum;
}

int
store_claim(struct store *s, const struct store_claim_opts *opts,
    struct store_batch *batch)
{
	char limit[16], max_payload[24], max_bytes[24];
	const char *params[5] = { limit, opts->ordered_by_key ? "t" : "f",
		max_payload, max_bytes, NULL };
	char begin[256];
	PGresult *res;

	batch->rows = NULL;
	batch->n = 0;
	batch->cut_short = false;
	snprintf(limit, sizeof(limit), "%d", opts->limit);
	params[4] = ids_array(s, opts->skip_ids, opts->n_skip);
	snprintf(max_payload, sizeof(max_payload), "%" PRIu64,
	    claim_bound(opts->max_payload));
	snprintf(max_bytes, sizeof(max_bytes), "%" PRIu64,
	    claim_bound(opts->max_batch_bytes));
	/*
	 * The table lock the marks will need is taken first, within
	 * lock_timeout: a lock that would block them (a CREATE INDEX, a LOCK
	 * TABLE) then holds the claim back before anything is published,
	 * instead of leaving a published batch unmarked.
	 *
	 * Cached plans of the claim were made for the table as it was then;
	 * while a backlog drains, plan each claim for the table as it is
	 * (0.2 ms per batch), with the scans of store_connect ruled out.
	 */
	if (ensure_prepared(s) == -1)
		return -1;
	strfmt(begin, sizeof(begin), "BEGIN; ");
	if (opts->lock_timeout_ms > 0)
		strfmt(begin + strlen(begin), sizeof(begin) - strlen(begin),
		    "SET LOCAL lock_timeout = %" PRId64 "; ",
		    opts->lock_timeout_ms);
	strfmt(begin + strlen(begin), sizeof(begin) - strlen(begin), "%s%s",
	    LOCK_FOR_MARKS, s->last_claim_full && s->conf.index_plans ?
	    "; SET LOCAL plan_cache_mode = force_custom_plan" : "");
	if (result_done(s, PQexec(s->conn, begin), "claim") == -1) {
		/* A lock timeout leaves the transaction open and failed. */
		if (s->conn != NULL)
			PQclear(PQexec(s->conn, "ROLLBACK"));
		return -1;
	}
	s->in_transaction = true;
	res = PQexecPrepared(s->conn, opts->include_retries ? "claim_all" :
	    "claim_new", 5, params, NULL, NULL, 1);
	if (PQresultStatus(res) != PGRES_TUPLES_OK) {
		set_result_error(s, res, "claim");
		store_abort(s, batch);
		return -1;
	}
	s->last_claim_full = PQntuples(res) >= opts->limit;
	if (PQntuples(res) == 0) {
		PQclear(res);
		s->in_transaction = false;
		return exec_command(s, "COMMIT");
	}
	s->claimed = res;
	/* A SET LOCAL lasts as long as the transaction: the batch's marks
	 * wait for their locks as long as configured again, not the
	 * claim's short wait (a pipelined relay's batch failed its marks
	 * when a trigger waited 100 ms for a lock, and went out twice). */
	if (opts->lock_timeout_ms > 0) {
		if (s->conf.lock_timeout_ms > 0)
			strfmt(begin, sizeof(begin), "SET LOCAL lock_timeout = "
			    "%" PRId64, s->conf.lock_timeout_ms);
		else
			strfmt(begin, sizeof(begin), "SET LOCAL lock_timeout "
			    "TO DEFAULT");
		if (exec_command(s, begin) == -1) {
			store_abort(s, batch);
			return -1;
		}
	}
	fill_rows(s, batch);
	/* Rows past the budget were left out only if the batch reached it
	 * (a batch that just reached it says "more" once too often). */
	batch->cut_short = batch_bytes(batch, opts) >=
	    claim_bound(opts->max_batch_bytes);
	return 0;
}

bool
store_untranslatable(const struct store *s)
{
	/* 22P05: a character with no equivalent in the client's encoding;
	 * 22021: bytes not valid in the database's own. */
	return strcmp(s->sqlstate, "22P05") == 0 ||
	    strcmp(s->sqlstate, "22021") == 0;
}

/*
 * Reads row id's text alone.  Returns 1 when it cannot be read so (the
 * database's words in why, its non-ASCII bytes as "?": they are to be
 * written into a database whose encoding may lack them), 0 when it
 * can, -1 on any other error.
 */
static int
probe_readable(struct store *s, int64_t id, char *why, size_t size)
{
	char sql[sizeof(UNREADABLE_PROBE_SQL) + 24];

	snprintf(sql, sizeof(sql), UNREADABLE_PROBE_SQL, id);
	if (exec_command(s, sql) == 0)
		return 0;
	if (!store_untranslatable(s))
		return -1;
	snprintf(why, size, "unreadable: a name or header has no UTF-8 "
	    "form: %s", s->refusal);
	for (char *p = why; *p != '\0'; p++)
		if ((unsigned char)*p >= 0x80)
			*p = '?';
	return exec_command(s, "ROLLBACK TO SAVEPOINT outboxd_probe; "
	    "RELEASE outboxd_probe") == 0 ? 1 : -1;
}

static bool row_specific(const struct store *);

/*
 * A part of a batch or chunk is written under the savepoint
 * outboxd_part, so that a row the database refuses takes back only that
 * part.  part_end closes it after the part's statements went through
 * (written) or failed: 1 when written, 0 when refused for an error one
 * row can cause (rolled back to the savepoint, the refusal kept in
 * s->refusal and s->sqlstate), -1 on any other error.
 */
/* The savepoint before a batch's marks (store_finish). */
#define MARKS_SAVEPOINT "outboxd_marks"

static int
part_begin(struct store *s)
{
	return exec_command(s, "SAVEPOINT outboxd_part");
}

static int
part_end(struct store *s, bool written)
{
	if (written)
		return exec_command(s, "RELEASE outboxd_part") == 0 ? 1 : -1;
	if (!row_specific(s))
		return -1;
	return exec_command(s, "ROLLBACK TO outboxd_part; "
	    "RELEASE outboxd_part") == 0 ? 0 : -1;
}

/*
 * Makes the unreadable row id DEAD with why, under a savepoint: a
 * refusal the row can cause (a trigger's exception, a constraint) is
 * rolled back and written to refusal.  1 when it is DEAD, 0 when
 * refused, -1 on any other error.
 */
static int
mark_unreadable_row(struct store *s, int64_t id, const char *why,
    char *refusal, size_t size)
{
	char idtext[24];
	const char *params[2] = { idtext, why };
	int rc;

	snprintf(idtext, sizeof(idtext), "%" PRId64, id);
	if (part_begin(s) == -1)
		return -1;
	rc = part_end(s, result_done(s, PQexecParams(s->conn,
	    mark_unreadable_sql, 2, NULL, params, NULL, NULL, 0),
	    "marking an unreadable row") == 0);
	if (rc == 0)
		snprintf(refusal, size, "the database refused to mark it dead "
		    "(a name or header has no UTF-8 form): %.200s (%s)",
		    s->refusal, s->sqlstate);
	return rc;
}

int
store_mark_unreadable_dead(struct store *s,
    const struct store_claim_opts *opts, struct store_unreadable_found *f)
{
	/* $3 and $4 typed, since nothing else says what they are. */
	static const Oid types[5] = { 0, 0, 20 /* int8 */, 20, 0 };
	char limit[16], lock[64], why[sizeof(f->dead[0].error)];
	char refusal[sizeof(f->held[0].error)];
	const char *params[5] = { limit, opts->ordered_by_key ? "t" : "f",
		NULL, NULL, NULL };
	PGresult *ids;
	int rc;

	f->n_dead = f->n_held = 0;
	if (s->conn == NULL)
		return -1;
	snprintf(limit, sizeof(limit), "%d", opts->limit);
	params[4] = ids_array(s, opts->skip_ids, opts->n_skip);
	strfmt(lock, sizeof(lock), "BEGIN; SET LOCAL lock_timeout = %" PRId64,
	    opts->lock_timeout_ms);
	if (exec_command(s, opts->lock_timeout_ms > 0 ? lock : "BEGIN") == -1)
		goto fail;
	ids = PQexecParams(s->conn, opts->include_retries ? unreadable_all_sql :
	    unreadable_new_sql, 5, types, params, NULL, NULL, 0);
	if (PQresultStatus(ids) != PGRES_TUPLES_OK) {
		set_result_error(s, ids, "claim");
		goto fail;
	}
	for (int i = 0; i < PQntuples(ids); i++) {
		int64_t id = strtoll(PQgetvalue(ids, i, 0), NULL, 10);
		struct store_unreadable *row = NULL;

		rc = probe_readable(s, id, why, sizeof(why));
		if (rc == 1)
			rc = mark_unreadable_row(s, id, why, refusal,
			    sizeof(refusal));
		else if (rc == 0)
			continue;
		if (rc == -1) {
			PQclear(ids);
			goto fail;
		}
		if (rc == 1 && f->n_dead++ < ARRAY_LEN(f->dead)) {
			row = &f->dead[f->n_dead - 1];
			snprintf(row->error, sizeof(row->error), "%s", why);
		} else if (rc == 0 && f->n_held++ < ARRAY_LEN(f->held)) {
			row = &f->held[f->n_held - 1];
			snprintf(row->error, sizeof(row->error), "%s",
			    refusal);
		}
		if (row != NULL)
			row->id = id;
	}
	PQclear(ids);
	if (exec_command(s, "COMMIT") == 0)
		return 0;
	f->n_dead = f->n_held = 0;
	return -1;
fail:
	f->n_dead = f->n_held = 0;
	if (s->conn != NULL && PQtransactionStatus(s->conn) != PQTRANS_IDLE)
		PQclear(PQexec(s->conn, "ROLLBACK"));
	return -1;
}

/* --- marking --------------------------------------------------------- */

/*
 * Appends a quoted array element, escaping what array syntax needs.  The
 * text is the broker's or a row's words, cut at a byte count: a bad byte
 * becomes "?", because PostgreSQL refuses invalid UTF-8 and that would
 * fail the whole batch's marks, every time it is claimed again.
 */
static void
buf_add_quoted(struct store *s, const char *str)
{
	const unsigned char *p = (const unsigned char *)str;
	size_t left = strlen(str);

	buf_add(s, "\"", 1);
	while (left > 0) {
		size_t len = utf8_seq_len(p, left);

		if (len == 0) {
			buf_add(s, "?", 1);
			len = 1;
		} else {
			if (*p == '"' || *p == '\\')
				buf_add(s, "\\", 1);
			buf_add(s, (const char *)p, len);
		}
		p += len;
		left -= len;
	}
	buf_add(s, "\"", 1);
}

/*
 * Builds the four array literals of mark_failed in s->buf, separated by
 * NULs, and returns their start offsets in at[].
 */
static size_t
build_failed_arrays(struct store *s, const struct store_mark *marks,
    size_t n, size_t at[4])
{
	size_t count = 0;

	buf_reset(s);
	for (int col = 0; col < 4; col++) {
		bool first = true;

		at[col] = s->buf_len;
		buf_add(s, "{", 1);
		for (size_t i = 0; i < n; i++) {
			const struct store_mark *m = &marks[i];

			if (m->kind != MARK_RETRY && m->kind != MARK_DEAD)
				continue;
			if (!first)
				buf_add(s, ",", 1);
			first = false;
			if (col == 0) {
				buf_add_int(s, m->id);
				count++;
			} else if (col == 1) {
				buf_add_int(s, m->kind == MARK_RETRY ?
				    STATUS_FAIL : STATUS_DEAD);
			} else if (col == 2) {
				buf_add_int(s, m->delay_ms);
			} else {
				buf_add_quoted(s, m->error ? m->error :
				    "unknown error");
			}
		}
		buf_add(s, "}", 2);	/* with its NUL as separator */
	}
	return count;
}

static int
exec_prepared(struct store *s, const char *name, int n,
    const char *const *params)
{
	return result_done(s, PQexecPrepared(s->conn, name, n, params, NULL,
	    NULL, 0), name);
}

static void
release_batch(struct store *s, struct store_batch *batch)
{
	if (s->claimed != NULL) {
		PQclear(s->claimed);
		s->claimed = NULL;
	}
	if (batch != NULL) {
		batch->rows = NULL;
		batch->n = 0;
	}
}

/*
 * A trigger's exception or a triggered action (P0, 09, 27, 2F, 38, 39),
 * a constraint (23, 44), a value out of range (22).  Lock and statement
 * timeouts, a full disk, a missing privilege or a lost session refuse
 * every row alike, and marking row by row would only repeat them.
 */
bool
store_sqlstate_row_specific(const char *sqlstate)
{
	static const char *const classes[] = { "P0", "09", "27", "2F", "38",
		"39", "23", "44", "22" };

	if (sqlstate == NULL || strlen(sqlstate) != 5)
		return false;
	for (size_t i = 0; i < ARRAY_LEN(classes); i++)
		if (strncmp(sqlstate, classes[i], 2) == 0)
			return true;
	return false;
}

bool
store_session_read_only(const struct store *s)
{
	return strcmp(s->sqlstate, "25006") == 0;
}

bool
store_statements_stale(const struct store *s)
{
	/* 0A000: "cached plan must not change result type"; 26000: the
	 * statement is gone (DEALLOCATE ALL, DISCARD ALL). */
	return strcmp(s->sqlstate, "0A000") == 0 ||
	    strcmp(s->sqlstate, "26000") == 0;
}

bool
store_permission_denied(const struct store *s)
{
	return strcmp(s->sqlstate, "42501") == 0;
}

bool
store_timed_out(const struct store *s)
{
	return strcmp(s->sqlstate, "57014") == 0;
}

int64_t
store_lock_timeout_ms(const struct store *s)
{
	return s->conf.lock_timeout_ms;
}

int
store_limit_statements(struct store *s, int64_t ms)
{
	char sql[64];

	if (ms <= 0)
		return exec_command(s, "RESET statement_timeout");
	return exec_command(s, strfmt(sql, sizeof(sql), "SET "
	    "statement_timeout = %" PRId64, ms));
}

/* Whether the last failed statement's error can come from one row, on
 * a session still up. */
static bool
row_specific(const struct store *s)
{
	return s->conn != NULL && PQstatus(s->conn) == CONNECTION_OK &&
	    store_sqlstate_row_specific(s->sqlstate);
}

/* Writes marks[0..n) in two statements (one for the sent rows, one for
 * the failed), so that a batch costs two round trips whatever its
 * size.  -1 with the error; the transaction is then aborted. */
static int
write_marks(struct store *s, const struct store_mark *marks, size_t n)
{
	size_t at[4], nsuccess = 0;
	bool first = true;

	buf_reset(s);
	buf_add(s, "{", 1);
	for (size_t i = 0; i < n; i++) {
		if (marks[i].kind != MARK_SUCCESS)
			continue;
		if (!first)
			buf_add(s, ",", 1);
		first = false;
		buf_add_int(s, marks[i].id);
		nsuccess++;
	}
	buf_add(s, "}", 1);
	if (nsuccess > 0) {
		const char *params[1] = { s->buf };

		if (exec_prepared(s, "mark_success", 1, params) == -1)
			return -1;
	}
	if (build_failed_arrays(s, marks, n, at) > 0) {
		const char *params[4] = { s->buf + at[0], s->buf + at[1],
			s->buf + at[2], s->buf + at[3] };

		if (exec_prepared(s, "mark_failed", 4, params) == -1)
			return -1;
	}
	return 0;
}

static int
cmp_id(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

	return (x > y) - (x < y);
}

/*
 * Ends the failed transaction and locks, in a new one, the rows of
 * marks[0..n) that are still as claimed (not sent, not dead, not locked
 * by another session); every other mark becomes MARK_RELEASE.  The rows
 * are free from the error on, which aborted the transaction: one round
 * trip, where a round trip for each of the four statements gave another
 * relay's claim four times as long to take them.  -1 with the error.
 */
static int
relock_marked_rows(struct store *s, struct store_mark *marks, size_t n)
{
	static const char head[] = "ROLLBACK; BEGIN; " LOCK_FOR_MARKS "; "
	    "SET CONSTRAINTS ALL IMMEDIATE; SELECT id FROM "
	    "t_transactional_message WHERE id = ANY('{",
	    tail[] = "}'::int8[]) AND message_status IN (0, 2) "
	    "ORDER BY id FOR UPDATE SKIP LOCKED";
	PGresult *res;
	int64_t *locked;
	size_t nlocked;
	bool first = true;

	buf_reset(s);
	buf_add(s, head, sizeof(head) - 1);
	for (size_t i = 0; i < n; i++) {
		if (marks[i].kind == MARK_RELEASE)
			continue;
		if (!first)
			buf_add(s, ",", 1);
		first = false;
		buf_add_int(s, marks[i].id);
	}
	buf_add(s, tail, sizeof(tail) - 1);
	res = PQexec(s->conn, s->buf);
	if (PQresultStatus(res) != PGRES_TUPLES_OK) {
		set_result_error(s, res, "relock");
		return -1;
	}
	nlocked = (size_t)PQntuples(res);
	locked = xcalloc(nlocked + 1, sizeof(*locked));
	for (size_t k = 0; k < nlocked; k++)
		locked[k] = strtoll(PQgetvalue(res, (int)k, 0), NULL, 10);
	PQclear(res);
	for (size_t i = 0; i < n; i++)
		if (marks[i].kind != MARK_RELEASE && bsearch(&marks[i].id,
		    locked, nlocked, sizeof(*locked), cmp_id) == NULL)
			marks[i].kind = MARK_RELEASE;
	free(locked);
	return 0;
}

/*
 * Room for the refusal texts of n rows, made before the first is handed
 * out: the marks point into it until the relay has logged them, so it
 * must not move meanwhile.  It was grown at need, and from a batch's
 * fifth refused row on the first four pointed into freed memory.
 */
static void
reserve_refusals(struct store *s, size_t n)
{
	if (n > s->refusals_cap) {
		s->refusals_cap = n;
		s->refusals = xrealloc(s->refusals, n * sizeof(*s->refusals));
	}
}

/*
 * One mark of the second try, under its own savepoint: when the
 * database refuses it, the row is made DEAD with why, or left alone
 * (MARK_RELEASE) if that is refused too.  -1 when a statement failed
 * for another reason.
 */
static int
write_mark_alone(struct store *s, struct store_mark *m, size_t *refused)
{
	struct store_mark dead;
	char *why;
	int rc;

	if (part_begin(s) == -1 ||
	    (rc = part_end(s, write_marks(s, m, 1) == 0)) == -1)
		return -1;
	if (rc == 1)
		return 0;
	why = s->refusals[(*refused)++];
	snprintf(why, STORE_REFUSAL_LEN, "the database refused to mark "
	    "it %s: %s (%s)", m->kind == MARK_SUCCESS ? "sent (it was "
	    "published and confirmed)" : m->kind == MARK_RETRY ?
	    "failed" : "dead", s->refusal, s->sqlstate);
	m->refused = why;
	dead = (struct store_mark){ .id = m->id, .kind = MARK_DEAD,
		.error = why };
	if (part_begin(s) == -1 ||
	    (rc = part_end(s, write_marks(s, &dead, 1) == 0)) == -1)
		return -1;
	if (rc == 1) {
		m->kind = MARK_DEAD;
		m->error = why;
	} else {
		m->kind = MARK_RELEASE;
	}
	return 0;
}

/* Below this many marks, a refused range is written row by row: halving
 * it further costs more round trips than it saves. */
#define MARK_SPLIT_MIN 8

/*
 * Finds the refused rows of marks[0..n) by halving: a range written
 * whole under a savepoint is done; a refused one is rolled back to it
 * and its halves tried.  One refused row in a batch of 10,000 costs
 * about 40 statements where row by row cost 30,000, which with a
 * database 2 ms away outlasted the stall limit and the watchdog, and
 * the restart met the same batch.  refused_whole says the caller saw
 * the range refused already, so it is halved without a try.
 */
static int
write_marks_halving(struct store *s, struct store_mark *marks, size_t n,
    bool refused_whole, size_t *refused)
{
	size_t live = 0, half, refused_before = *refused;
	int rc;

	for (size_t i = 0; i < n; i++)
		live += marks[i].kind != MARK_RELEASE;
	if (live == 0)
		return 0;
	if (live == 1 || n <= MARK_SPLIT_MIN) {
		for (size_t i = 0; i < n; i++)
			if (marks[i].kind != MARK_RELEASE &&
			    write_mark_alone(s, &marks[i], refused) == -1)
				return -1;
		return 0;
	}
	if (!refused_whole) {
		if (part_begin(s) == -1 ||
		    (rc = part_end(s, write_marks(s, marks, n) == 0)) == -1)
			return -1;
		if (rc == 1)
			return 0;
	}
	half = n / 2;
	if (write_marks_halving(s, marks, half, false, refused) == -1)
		return -1;
	/* With nothing refused in the first half, the refusal is in the
	 * second: its try is spared.  (Rows refused only together are
	 * halved on down to single rows, which are written.) */
	return write_marks_halving(s, marks + half, n - half,
	    *refused == refused_before, refused);
}

/*
 * store_finish()'s second try, after the batch's marks were refused for
 * an error one row can cause: the refused rows are found by halving the
 * batch, and made DEAD, or left alone.  locks_held: the marks were
 * guarded, and the transaction is rolled back to the savepoint before
 * them, which keeps the claim's row locks; otherwise a new transaction
 * locks the rows still as claimed.  Returns 0 or 1 as store_finish()
 * does, -1 when a statement failed for another reason (rolled back).
 */
static int
write_marks_again(struct store *s, struct store_mark *marks, size_t n,
    bool locks_held)
{
	size_t refused = 0;

	reserve_refusals(s, n);
	/* Deferred checks run at each mark, under its savepoint, where the
	 * COMMIT could not say which row they refused.  A rollback to a
	 * savepoint undoes SET CONSTRAINTS too. */
	if (locks_held) {
		if (exec_command(s, "ROLLBACK TO " MARKS_SAVEPOINT "; "
		    "SET CONSTRAINTS ALL IMMEDIATE") == -1)
			return -1;
	} else if (relock_marked_rows(s, marks, n) == -1) {
		return -1;
	}
	/* Held, the locks keep every mark's row as claimed, and the whole
	 * was just refused: no try of it again. */
	if (write_marks_halving(s, marks, n, locks_held, &refused) == -1)
		return -1;
	if (exec_command(s, "COMMIT") == -1)
		return -1;
	return refused > 0 ? 1 : 0;
}

/*
 * How long a store's marks stay guarded by a savepoint after the
 * database last refused one (store_finish).
 */
#define MARKS_GUARD_MS (10 * 60 * 1000)

int
store_finish(struct store *s, struct store_batch *batch,
    struct store_mark *marks, size_t n)
{
	bool guarded = now_mono_ms() < s->marks_guarded_until_ms,
	    locks_held = guarded;
	int rc;

	for (size_t i = 0; i < n; i++)
		marks[i].refused = NULL;
	/*
	 * A refused mark aborts the transaction, and its row locks go at
	 * once: another relay's claim can take the published, confirmed
	 * rows and publish them again.  Where the database refused a mark
	 * lately, the marks go under a savepoint, and a refusal rolls back
	 * to it, which keeps the claim's row locks for the second try.
	 * Deferred checks run before the COMMIT, in its round trip, so that
	 * their refusal is one under the savepoint too.  Not always: a row
	 * locked by the transaction and updated under its savepoint gets a
	 * MultiXact, and one a batch brings PostgreSQL's anti-wraparound
	 * vacuums of every table of the database within days at a busy
	 * relay's batch rate.
	 */
	if (guarded && exec_command(s, "SAVEPOINT " MARKS_SAVEPOINT) == -1) {
		store_abort(s, batch);
		return -1;
	}
	if (write_marks(s, marks, n) == 0) {
		if (exec_command(s, "SET CONSTRAINTS ALL IMMEDIATE; COMMIT")
		    == 0) {
			release_batch(s, batch);
			s->in_transaction = false;
			return 0;
		}
		if (!row_specific(s)) {
			store_abort(s, batch);
			return -1;
		}
		/* In error: the checks before the COMMIT refused, and the
		 * transaction is open; else the COMMIT itself, and it is
		 * gone. */
		locks_held = guarded &&
		    PQtransactionStatus(s->conn) == PQTRANS_INERROR;
	} else if (!row_specific(s)) {
		store_abort(s, batch);
		return -1;
	}
	s->marks_guarded_until_ms = now_mono_ms() + MARKS_GUARD_MS;
	rc = write_marks_again(s, marks, n, locks_held);
	if (rc == -1) {
		store_abort(s, batch);
		return -1;
	}
	release_batch(s, batch);
	s->in_transaction = false;
	return rc;
}

void
store_abort(struct store *s, struct store_batch *batch)
{
	release_batch(s, batch);
	if (s->in_transaction && s->conn != NULL)
		PQclear(PQexec(s->conn, "ROLLBACK"));
	s->in_transaction = false;
}

int
store_still_due(struct store *s, const int64_t *ids, size_t n, bool *due)
{
	const char *params[1];
	PGresult *res;

	for (size_t i = 0; i < n; i++)
		due[i] = false;
	if (n == 0)
		return 0;
	params[0] = ids_array(s, ids, n);
	res = query(s, "still_due", "SELECT id FROM t_transactional_message"
	    " WHERE id = ANY($1::int8[]) AND " DUE_PREDICATE, 1, params,
	    PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	for (int row = 0; row < PQntuples(res); row++) {
		int64_t id = strtoll(PQgetvalue(res, row, 0), NULL, 10);

		for (size_t i = 0; i < n; i++)
			due[i] = due[i] || ids[i] == id;
	}
	PQclear(res);
	return 0;
}

int
store_next_due_in(struct store *s, bool include_retries, int64_t *ms)
{
	PGresult *res;

	if (ensure_prepared(s) == -1)
		return -1;
	res = PQexecPrepared(s->conn, include_retries ? "next_due_all" :
	    "next_due_new", 0, NULL, NULL, NULL, 0);

	if (PQresultStatus(res) != PGRES_TUPLES_OK) {
		/* With its SQLSTATE, which says a stale statement or a
		 * read-only session as for the other statements. */
		set_result_error(s, res, "next_due");
		return -1;
	}
	if (PQgetisnull(res, 0, 0)) {
		*ms = -1;
	} else {
		int64_t v = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
		*ms = v < 0 ? 0 : v;
	}
	PQclear(res);
	return 0;
}

/* --- compensation and administration ---------------------------------- */

/* Runs a data-changing statement and reports how many rows it touched. */
static int
command_count(struct store *s, const char *what, const char *sql, int n,
    const char *const *params, int64_t *count)
{
	PGresult *res = query(s, what, sql, n, params, PGRES_COMMAND_OK);

	if (res == NULL)
		return -1;
	*count = strtoll(PQcmdTuples(res), NULL, 10);
	PQclear(res);
	return 0;
}

int
store_counts(struct store *s, bool count_sent, struct store_counts *c)
{
	PGresult *res;

	res = query(s, "counts", "SELECT count(*),"
	    " count(*) FILTER (WHERE coalesce(next_schedule_time,"
	    "  '-infinity'::timestamptz) <= now()"
	    "  AND current_retry_times < max_retry_times),"
	    /* Due since its schedule; without one (NULL, or '-infinity',
	     * which failed the subtraction and froze the leader's gauges
	     * with it), since it was written, if that is a finite time. */
	    " coalesce(extract(epoch FROM now() - min(CASE WHEN"
	    "  isfinite(next_schedule_time) THEN next_schedule_time"
	    "  WHEN isfinite(create_time) THEN create_time ELSE now() END)"
	    "  FILTER (WHERE"
	    "  coalesce(next_schedule_time, '-infinity'::timestamptz) <= now()"
	    "  AND current_retry_times < max_retry_times)), 0)::float8,"
	    " (SELECT count(*) FROM t_transactional_message"
	    "  WHERE message_status = 3 AND NOT deleted)"
	    " FROM t_transactional_message"
	    " WHERE message_status IN (0, 2) AND NOT deleted",
	    0, NULL, PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	c->pending = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
	c->due = strtoll(PQgetvalue(res, 0, 1), NULL, 10);
	c->oldest_due_age_s = strtod(PQgetvalue(res, 0, 2), NULL);
	c->dead = strtoll(PQgetvalue(res, 0, 3), NULL, 10);
	PQclear(res);
	c->sent = -1;
	if (!count_sent)
		return 0;
	res = query(s, "counts", "SELECT count(*) FROM t_transactional_message"
	    " WHERE message_status = 1", 0, NULL, PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	c->sent = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
	PQclear(res);
	return 0;
}

/* Its WHERE is the predicate of t_transactional_message_exhausted_idx
 * (sql/006), so it reads only rows out of retries, not the backlog; the
 * leader suite checks the plan.  A row locked by someone else (an open
 * psql transaction) is skipped until a later sweep: waiting for it held
 * the leader's main loop for lock_timeout at every poll, or for good
 * with no lock_timeout.  At most $1 rows a statement: an operator who
 * lowered max_retry_times over two million rows made one UPDATE that
 * outlasted the watchdog, which killed the leader, and the next one,
 * and rolled it back each time.  $2: the rows refused before. */
#define SWEEP_EXHAUSTED_IDS \
	"SELECT id FROM t_transactional_message" \
	" WHERE message_status IN (0, 2) AND NOT deleted" \
	" AND current_retry_times >= max_retry_times" \
	" AND id <> ALL ($2::int8[])" \
	" ORDER BY id LIMIT $1::int4 FOR UPDATE SKIP LOCKED"
#define SWEEP_EXHAUSTED(ids) \
	"UPDATE t_transactional_message" \
	" SET message_status = 3, next_schedule_time = NULL," \
	" edit_time = now(), editor = 'outboxd'," \
	" last_error = coalesce(last_error || '; ', '')" \
	"  || 'retries exhausted (max_retry_times = '" \
	"  || max_retry_times || ')'" \
	" WHERE id = ANY (" ids ")"

/* Its WHERE and ORDER BY are t_transactional_message_sent_idx (sql/007):
 * a pass reads the rows it deletes, oldest first, and stops, however
 * many younger sent rows the table keeps.  The ids come as an array, so
 * the rows are found by primary key whatever the planner guesses the
 * chunk to be (a semi-join may scan the table).  The leader suite checks
 * the plan and the reads.  The content rows go with their rows (ON
 * DELETE CASCADE).  A row locked by someone else (an open psql
 * transaction, a referencing insert's FOR KEY SHARE) is skipped, as in
 * the sweep: waiting for it held the leader's main loop for lock_timeout
 * at every pass, purged nothing while the lock lasted (the oldest row
 * is in every chunk), and with no lock_timeout held the loop for good;
 * the lock also rechecks the row is still sent.  $3: the rows refused
 * before. */
#define PURGE_SENT_IDS \
	"SELECT id FROM t_transactional_message" \
	" WHERE message_status = 1" \
	" AND edit_time < now() - $1::int8 * interval '1 millisecond'" \
	" AND id <> ALL ($3::int8[])" \
	" ORDER BY edit_time LIMIT $2::int4 FOR UPDATE SKIP LOCKED"
#define PURGE_SENT(ids) \
	"DELETE FROM t_transactional_message WHERE id = ANY (" ids ")"

/*
 * The row-apart path of a sweep or purge chunk runs a statement or two a
 * part, each under statement_timeout: before each, the limit becomes
 * what is left until deadline (a CLOCK_MONOTONIC ms; 0: none), and with
 * less than 200 ms left the chunk stops, an error like the timeout's (a
 * COMMIT under a timer about to fire could lose the chunk's work).  A
 * SET in the transaction stays after its COMMIT, and a ROLLBACK gives
 * the caller's limit back: the leader resets it after its pass.
 */
static int
within_deadline(struct store *s, const char *what, int64_t deadline)
{
	int64_t left = deadline - now_mono_ms();

	if (deadline == 0)
		return 0;
	if (left < 200) {
		set_error(s, what, "out of time for this pass (the rows are "
		    "tried apart, for one the database refuses)");
		snprintf(s->sqlstate, sizeof(s->sqlstate), "57014");
		return -1;
	}
	return store_limit_statements(s, left);
}

/*
 * Runs sql, which takes ids[0..n) as the int8[] $1, under a savepoint;
 * a part the database refuses for one of its rows is rolled back and
 * halved, down to single rows, which go to skip.  refused_whole: the
 * part is known to hold a refused row, so it is halved untried.  Adds
 * the rows changed to *done.  -1 on any other error (the transaction is
 * then aborted).
 */
static int
run_halving(struct store *s, const char *what, const char *sql,
    const int64_t *ids, size_t n, bool refused_whole, int64_t deadline,
    struct store_skip *skip, int64_t *done)
{
	size_t before = skip->refused, half;
	const char *params[1];
	int64_t count = 0;
	int rc;

	if (n == 0)
		return 0;
	/* A single row is tried even so: the chunk was read again since
	 * it was refused, and rows may be refused only together. */
	if (!refused_whole || n == 1) {
		if (within_deadline(s, what, deadline) == -1 ||
		    part_begin(s) == -1)
			return -1;
		params[0] = ids_array(s, ids, n);
		rc = part_end(s, command_count(s, what, sql, 1, params,
		    &count) == 0);
		if (rc == -1)
			return -1;
		if (rc == 1) {
			*done += count;
			return 0;
		}
	}
	/* Full: the rest of the part waits, as a refused chunk would. */
	if (skip->n == ARRAY_LEN(skip->ids))
		return 0;
	if (n == 1) {
		if (skip->refused++ == 0) {
			skip->first = ids[0];
			snprintf(skip->why, sizeof(skip->why), "%s (%s)",
			    s->refusal, s->sqlstate);
		}
		skip->ids[skip->n++] = ids[0];
		return 0;
	}
	half = n / 2;
	if (run_halving(s, what, sql, ids, half, false, deadline, skip,
	    done) == -1)
		return -1;
	/* Nothing refused in the first half: the refusal is in the
	 * second, whose try is spared. */
	return run_halving(s, what, sql, ids + half, n - half,
	    skip->refused == before, deadline, skip, done);
}

/*
 * A sweep or purge statement was refused for one of its rows: the chunk
 * again, in a transaction of its own, its rows locked by ids_sql (with
 * params), then by_ids_sql over them, halving to find the refused rows.
 */
static int
run_chunk_apart(struct store *s, const char *what, const char *ids_sql,
    int nparams, const char *const *params, const char *by_ids_sql,
    int64_t deadline, struct store_skip *skip, int64_t *n)
{
	size_t skipped_before = skip->n;
	PGresult *res;
	int64_t *ids;
	size_t nids;
	int rc;

	/* Deferred checks (a DEFERRABLE foreign key of the application's)
	 * run at each part, under its savepoint, where the COMMIT could not
	 * say which row they refused. */
	if (within_deadline(s, what, deadline) == -1 ||
	    exec_command(s, "BEGIN; SET CONSTRAINTS ALL IMMEDIATE") == -1 ||
	    (res = query(s, what, ids_sql, nparams, params,
	    PGRES_TUPLES_OK)) == NULL)
		goto fail;
	nids = (size_t)PQntuples(res);
	ids = xcalloc(nids + 1, sizeof(*ids));
	for (size_t i = 0; i < nids; i++)
		ids[i] = strtoll(PQgetvalue(res, (int)i, 0), NULL, 10);
	PQclear(res);
	rc = run_halving(s, what, by_ids_sql, ids, nids, false, deadline,
	    skip, n);
	free(ids);
	if (rc == 0 && exec_command(s, "COMMIT") == 0)
		return 0;
fail:
	/* Rows found refused before a later failure are not left out
	 * unsaid: the failure is what the caller logs. */
	*n = 0;
	skip->n = skipped_before;
	skip->refused = 0;
	if (s->conn != NULL && PQtransactionStatus(s->conn) != PQTRANS_IDLE)
		PQclear(PQexec(s->conn, "ROLLBACK"));
	return -1;
}

/* The sweep's or purge's chunk: one statement, and, when it is refused
 * for one of its rows, the chunk again row apart (run_chunk_apart). */
static int
run_chunk(struct store *s, const char *what, const char *chunk_sql,
    const char *ids_sql, const char *by_ids_sql, int nparams,
    const char **params, int64_t deadline, struct store_skip *skip,
    int64_t *n)
{
	*n = 0;
	if (skip != NULL) {
		skip->refused = 0;
		skip->why[0] = '\0';
	}
	/* The skipped ids are the last parameter. */
	params[nparams - 1] = skip != NULL ? ids_array(s, skip->ids,
	    skip->n) : "{}";
	if (command_count(s, what, chunk_sql, nparams, params, n) == 0)
		return 0;
	if (skip == NULL || !row_specific(s) ||
	    skip->n == ARRAY_LEN(skip->ids))
		return -1;
	params[nparams - 1] = ids_array(s, skip->ids, skip->n);
	return run_chunk_apart(s, what, ids_sql, nparams, params, by_ids_sql,
	    deadline, skip, n);
}

int
store_sweep_exhausted(struct store *s, int chunk, int64_t deadline,
    struct store_skip *skip, int64_t *n)
{
	char limit[16];
	const char *params[2] = { limit, NULL };

	snprintf(limit, sizeof(limit), "%d", chunk);
	return run_chunk(s, "sweep",
	    SWEEP_EXHAUSTED("ARRAY(" SWEEP_EXHAUSTED_IDS ")"),
	    SWEEP_EXHAUSTED_IDS, SWEEP_EXHAUSTED("$1::int8[]"), 2, params,
	    deadline, skip, n);
}

int
store_purge_sent(struct store *s, int64_t older_than_ms, int chunk,
    int64_t deadline, struct store_skip *skip, int64_t *n)
{
	char age[32], limit[16];
	const char *params[3] = { age, limit, NULL };

	snprintf(age, sizeof(age), "%" PRId64, older_than_ms);
	snprintf(limit, sizeof(limit), "%d", chunk);
	return run_chunk(s, "purge", PURGE_SENT("ARRAY(" PURGE_SENT_IDS ")"),
	    PURGE_SENT_IDS, PURGE_SENT("$1::int8[]"), 3, params, deadline,
	    skip, n);
}

/* The dead rows a dead_filter takes, with its fields as $2, $3 and $4
 * (NULL parameters take any row). */
#define DEAD_FILTER_SQL \
	" AND ($2::text IS NULL OR exchange_name = $2::text)" \
	" AND ($3::text IS NULL OR" \
	"  coalesce(nullif(routing_key, ''), queue_name) = $3::text)" \
	" AND ($4::text IS NULL OR strpos(last_error, $4::text) > 0)"

/* params[1..3] from f (NULL: no filter). */
static void
dead_filter_params(const struct dead_filter *f, const char *params[4])
{
	params[1] = f != NULL ? f->exchange : NULL;
	params[2] = f != NULL ? f->routing_key : NULL;
	params[3] = f != NULL ? f->error : NULL;
}

int
store_replay_dead(struct store *s, int64_t id, const struct dead_filter *f,
    int64_t *n)
{
	char idtext[32];
	const char *params[4] = { idtext };

	snprintf(idtext, sizeof(idtext), "%" PRId64, id);
	dead_filter_params(f, params);
	/* The rows and the wake-up in one transaction: a NOTIFY that
	 * failed after the rows were committed reported a replay that had
	 * happened as failed. */
	if (exec_command(s, "BEGIN") == -1)
		return -1;
	if (command_count(s, "replay", "UPDATE t_transactional_message"
	    " SET message_status = 0, current_retry_times = 0,"
	    " next_schedule_time = now(), edit_time = now(),"
	    " editor = 'outboxd replay',"
	    " max_retry_times = greatest(max_retry_times, 1)"
	    /* A deleted row stays dead: replayed, it would be
	     * PENDING yet never sent, and counted nowhere. */
	    " WHERE message_status = 3 AND NOT deleted"
	    " AND ($1::int8 = 0 OR id = $1::int8)" DEAD_FILTER_SQL,
	    4, params, n) == -1 ||
	    /* Replayed rows are due now: wake the relays (at the commit)
	     * rather than wait for their next poll. */
	    (*n > 0 && exec_command(s, "NOTIFY " NOTIFY_CHANNEL) == -1)) {
		PQclear(PQexec(s->conn, "ROLLBACK"));
		return -1;
	}
	return exec_command(s, "COMMIT");
}

/* The dead rows' listing; TEXT(x) gives how text column x is read. */
#define DEAD_LIST_SQL(TEXT) \
    "SELECT id, " TEXT("exchange_name") ", " \
    TEXT("coalesce(nullif(routing_key, ''), queue_name)") ", " \
    TEXT("coalesce(business_key, '')") ", current_retry_times," \
    " to_char(edit_time, 'YYYY-MM-DD\"T\"HH24:MI:SSOF'), " \
    TEXT("coalesce(last_error, '')") \
    " FROM t_transactional_message WHERE message_status = 3" \
    " AND NOT deleted" DEAD_FILTER_SQL " ORDER BY id DESC" \
    " LIMIT $1::int4"
#define AS_TEXT(x) x
/* The stored bytes, with those above 0x7f as \ooo: ASCII, which every
 * encoding has. */
#define AS_ESCAPED_BYTES(x) \
    "encode(convert_to(" x ", getdatabaseencoding()), 'escape')"

int
store_list_dead(struct store *s, int limit, const struct dead_filter *f,
    void (*fn)(const struct dead_row *, void *), void *arg)
{
	char lim[16];
	const char *params[4] = { lim };
	PGresult *res;

	snprintf(lim, sizeof(lim), "%d", limit);
	dead_filter_params(f, params);
	res = query(s, "dead", DEAD_LIST_SQL(AS_TEXT), 4, params,
	    PGRES_TUPLES_OK);
	/* A row made DEAD for text with no UTF-8 form (store_mark_
	 * unreadable_dead) is listed too, its bytes as escapes. */
	if (res == NULL && store_untranslatable(s))
		res = query(s, "dead", DEAD_LIST_SQL(AS_ESCAPED_BYTES), 4,
		    params, PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	for (int i = 0; i < PQntuples(res); i++) {
		struct dead_row d = {
			.id = strtoll(PQgetvalue(res, i, 0), NULL, 10),
			.exchange_name = PQgetvalue(res, i, 1),
			.routing_key = PQgetvalue(res, i, 2),
			.business_key = PQgetvalue(res, i, 3),
			.retries = atoi(PQgetvalue(res, i, 4)),
			.edit_time = PQgetvalue(res, i, 5),
			.last_error = PQgetvalue(res, i, 6),
		};
		fn(&d, arg);
	}
	PQclear(res);
	return 0;
}

/* Any fixed number will do, as long as every instance uses the same. */
#define LEADER_LOCK_KEY "7400314"

int
store_try_leader_lock(struct store *s, bool *held)
{
	PGresult *res;

	/* The lock is re-entrant per session: take it once, and know it
	 * is gone when the session is (store_disconnect clears the flag). */
	if (s->leader_lock_held) {
		*held = true;
		return 0;
	}
	res = query(s, "leader lock", "SELECT pg_try_advisory_lock("
	    LEADER_LOCK_KEY ")", 0, NULL, PGRES_TUPLES_OK);
	if (res == NULL)
		return -1;
	s->leader_lock_held = PQgetvalue(res, 0, 0)[0] == 't';
	*held = s->leader_lock_held;
	PQclear(res);
	return 0;
}

/* An advisory lock outlives a failed statement: a session that could not
 * let go of it, had it stayed open with the flag cleared, kept every
 * other instance from leading until it reconnected.  So such a session
 * is closed, which lets go. */
int
store_release_leader_lock(struct store *s)
{
	PGresult *res;
	bool released;

	if (!s->leader_lock_held || !store_connected(s)) {
		s->leader_lock_held = false;
		return 0;
	}
	res = query(s, "leader unlock", "SELECT pg_advisory_unlock("
	    LEADER_LOCK_KEY ")", 0, NULL, PGRES_TUPLES_OK);
	released = res != NULL && PQgetvalue(res, 0, 0)[0] == 't';
	if (res != NULL && !released)
		set_error(s, "leader unlock", "the session did not hold the "
		    "lock");
	PQclear(res);
	s->leader_lock_held = false;
	if (released)
		return 0;
	store_disconnect(s);
	return -1;
}
