/*
 * The Redis leader lock: SET NX PX with a random token, renewed by a
 * compare-and-PEXPIRE script and released by compare-and-DEL, so an
 * instance only ever extends or deletes its own key.
 */
#include "lock.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/time.h>

#include <hiredis/hiredis.h>

#include "log.h"
#include "secret.h"

#define TOKEN_BYTES 16
#define UNIX_PREFIX "unix:"
#define DEFAULT_KEY "outboxd:leader"

/* Reply types lock_command accepts, as a mask of REDIS_REPLY_*. */
#define R(type) (1u << (type))

/*
 * KEYS[1] = key, ARGV[1] = our token, ARGV[2] = ttl in ms.  Returns 1
 * when renewed, 0 when the key is gone and -1 when it holds another
 * token, so the log can say which.
 */
static const char renew_script[] =
    "local v = redis.call('GET', KEYS[1]) "
    "if v == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
    "if v then return -1 end "
    "return 0";

/* KEYS[1] = key, ARGV[1] = our token.  Returns 1 when deleted, 0 when
 * the key is gone and -1 when it holds another token. */
static const char release_script[] =
    "local v = redis.call('GET', KEYS[1]) "
    "if v == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "if v then return -1 end "
    "return 0";

struct lock {
	bool enabled;
	char *host;
	const char *socket_path;	/* inside host, or NULL for TCP */
	int port;
	char *addr;			/* host:port or unix:path, for logs */
	char *username;
	char *password;
	char *password_file;	/* read again at each connect (secret.h) */
	int database;
	char *key;
	int64_t ttl_ms;
	int64_t connect_timeout_ms;

	redisContext *ctx;		/* NULL when not connected */
	/* ctx was idle since an earlier tick: the server (its timeout, a
	 * restart) or a proxy may have closed it meanwhile, which only the
	 * next command finds out. */
	bool ctx_idle;
	/* The last command was sent again (lock_command): its first
	 * copy may have run, so a "no" may be our own doing. */
	bool resent;
	/* The last command was answered with an error (READONLY from a
	 * replica, OOM, NOPERM): the connection works, and is kept. */
	bool refused;
	bool held;
	enum lock_state state;		/* what lock_tick returned last */
	char token[2 * TOKEN_BYTES + 1];
	/* The token of a lock lost while Redis could not be asked: the key
	 * may have outlived our view of it, and then only we can renew it
	 * (tokens are unique), so the next acquire tries that first. */
	char lost_token[2 * TOKEN_BYTES + 1];
	bool standby_logged;		/* "held by another" said already */
	int64_t renewed_at;		/* held: when the last good SET or
					 * renewal was sent */
	int64_t valid_until;		/* held: leader until then */
	int64_t next_at;		/* lock_tick's next piece of work */
	struct backoff_cursor reconnect;
	bool down_logged;		/* this outage was logged already */
	uint64_t connects;		/* connections established */
	uint64_t lost_count;
	char error[256];
};

static void lock_set_error(struct lock *, const char *, ...)
    __attribute__((format(printf, 2, 3)));
static redisReply *lock_command(struct lock *, int64_t, unsigned,
    const char *, const char *, ...) __attribute__((format(printf, 5, 6)));

/* Our view of the lock ends a safety margin before Redis's does: it
 * covers clock drift and the time a leader needs to notice. */
static int64_t
lock_validity(const struct lock *l)
{
	return l->ttl_ms - l->ttl_ms / 3;
}

static int64_t
lock_renew_every(const struct lock *l)
{
	return l->ttl_ms / 3;
}

static struct timeval
ms_to_timeval(int64_t ms)
{
	struct timeval tv;

	tv.tv_sec = (time_t)(ms / 1000);
	tv.tv_usec = (suseconds_t)(ms % 1000 * 1000);
	return tv;
}

/* Masks every copy of the secret: Redis never echoes AUTH arguments,
 * but a proxy in front of it might. */
static void
redact(char *s, const char *secret)
{
	size_t n;
	char *p;

	if (secret == NULL || *secret == '\0')
		return;
	n = strlen(secret);
	/* On from past each copy: a password of asterisks is found again
	 * in its own mask, and the loop never ended. */
	for (p = s; (p = strstr(p, secret)) != NULL; p += n)
		memset(p, '*', n);
}

static void
lock_set_error(struct lock *l, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(l->error, sizeof(l->error), fmt, ap);
	va_end(ap);
	redact(l->error, l->password);
}

/* hiredis rule: a context that saw an error is never used again. */
static void
lock_drop(struct lock *l)
{
	if (l->ctx != NULL) {
		redisFree(l->ctx);
		l->ctx = NULL;
	}
}

/*
 * Runs one command within what is left of the tick's budget (deadline,
 * monotonic ms).  Returns a reply of one of the types in `accept`, which
 * the caller frees; or NULL with the error set: the connection dropped
 * for I/O errors and timeouts, kept (l->refused) for an error reply or a
 * reply of another type.  Dropped, each try made a new connection
 * ("redis connected", a reconnect counted) to meet the same refusal.
 *
 * A connection idle since an earlier tick that turns out closed by the
 * other side is made again, and the command sent again, within the same
 * budget (l->resent says so).  The first copy may have run: the renew
 * script renews twice, harmlessly, and the callers of SET NX and of the
 * release read a "no" after a resend as possibly their own doing.
 * Before, with
 * a Redis `timeout` (or a proxy's) shorter than ttl/3, every standby
 * logged "redis unavailable" and fell back to the advisory lock at
 * every look, and the holder lost a renewal each time.
 */
static int WARN_UNUSED lock_connect(struct lock *, int64_t);

/* Whether a failed command met a connection that ended while idle:
 * closed by the other side, or found dead by keepalives (ETIMEDOUT; not
 * the socket timeout, EAGAIN, which spent the budget). */
static bool
closed_by_peer(const redisContext *ctx, int saved_errno)
{
	return ctx->err == REDIS_ERR_EOF || (ctx->err == REDIS_ERR_IO &&
	    (saved_errno == ECONNRESET || saved_errno == EPIPE ||
	    saved_errno == ETIMEDOUT));
}

static redisReply *
lock_command(struct lock *l, int64_t deadline, unsigned accept,
    const char *what, const char *fmt, ...)
{
	redisReply *reply;
	int64_t left;
	va_list ap;
	int saved_errno;
	bool was_idle = l->ctx_idle;

	l->ctx_idle = false;
	l->resent = false;
	l->refused = false;
	for (;;) {
		left = deadline - now_mono_ms();
		if (left <= 0) {
			lock_set_error(l, "%s %s: timed out", what, l->addr);
			goto fail;
		}
		/* SO_RCVTIMEO and SO_SNDTIMEO: a hung Redis costs at most
		 * the rest of the budget, not forever. */
		if (redisSetTimeout(l->ctx, ms_to_timeval(left)) != REDIS_OK) {
			lock_set_error(l, "%s %s: %s", what, l->addr,
			    l->ctx->errstr);
			goto fail;
		}
		va_start(ap, fmt);
		reply = redisvCommand(l->ctx, fmt, ap);
		saved_errno = errno;
		va_end(ap);
		if (reply != NULL || !was_idle ||
		    !closed_by_peer(l->ctx, saved_errno))
			break;
		log_debug("redis connection closed while idle; connecting "
		    "again", "error=%s", log_quote((char[200]){ 0 }, 200,
		    l->ctx->errstr));
		lock_drop(l);
		if (lock_connect(l, deadline) != 0)
			return NULL;	/* dropped, the error set */
		was_idle = false;
		l->resent = true;
	}
	if (reply == NULL) {
		/* A socket timeout reads as EAGAIN; say what it means. */
		if (l->ctx->err == REDIS_ERR_IO && (saved_errno == EAGAIN ||
		    saved_errno == EWOULDBLOCK))
			lock_set_error(l, "%s %s: timed out after %" PRId64
			    " ms", what, l->addr, left);
		else
			lock_set_error(l, "%s %s: %s", what, l->addr,
			    l->ctx->errstr);
		goto fail;
	}
	if (reply->type == REDIS_REPLY_ERROR)
		lock_set_error(l, "%s %s: %s", what, l->addr, reply->str);
	else if ((R(reply->type) & accept) == 0)
		lock_set_error(l, "%s %s: unexpected reply type %d", what,
		    l->addr, reply->type);
	else
		return reply;
	freeReplyObject(reply);
	l->refused = true;
	return NULL;
fail:
	lock_drop(l);
	return NULL;
}

/*
 * hiredis 0.14 takes a signal during its wait for the TCP handshake
 * (poll's EINTR) for a failed connect: a reload's SIGHUP in that moment
 * cost the connection, logged "redis unavailable" and sent a standby to
 * PostgreSQL's lock.  SIGHUP waits for the connect instead (its handler
 * only sets a flag, read once the tick is over).  A stop signal still
 * cuts the connect short: the daemon is on its way out.
 */
static redisContext *
connect_unsignalled(const struct lock *l, struct timeval tv)
{
	sigset_t reload, old;
	redisContext *ctx;

	sigemptyset(&reload);
	sigaddset(&reload, SIGHUP);
	(void)pthread_sigmask(SIG_BLOCK, &reload, &old);
	if (l->socket_path != NULL)
		ctx = redisConnectUnixWithTimeout(l->socket_path, tv);
	else
		ctx = redisConnectWithTimeout(l->host, l->port, tv);
	(void)pthread_sigmask(SIG_SETMASK, &old, NULL);
	return ctx;
}

/* Connects, authenticates and selects the database. */
static int
lock_connect(struct lock *l, int64_t deadline)
{
	struct timeval tv = ms_to_timeval(l->connect_timeout_ms);
	redisReply *reply;
	char qaddr[256];

	secret_reread(&l->password, l->password_file, "redis.password_file");
	l->ctx = connect_unsignalled(l, tv);
	if (l->ctx == NULL) {
		lock_set_error(l, "connect %s: out of memory", l->addr);
		goto fail;
	}
	if (l->ctx->err != 0) {
		lock_set_error(l, "connect %s: %s", l->addr, l->ctx->errstr);
		goto fail;
	}
	l->ctx_idle = false;
	/* A firewall or NAT that forgets an idle connection drops its
	 * packets silently: keepalives find that out between ticks, and
	 * the next command fails at once instead of at its timeout. */
	if (l->socket_path == NULL && redisEnableKeepAlive(l->ctx) !=
	    REDIS_OK) {
		/* hiredis marks the context failed: it is of no more use. */
		lock_set_error(l, "connect %s: keepalive: %s", l->addr,
		    l->ctx->errstr);
		goto fail;
	}
	/* A user without a password is an ACL "nopass" user, which still
	 * has to AUTH to stop being the default user. */
	if (l->username != NULL) {
		reply = lock_command(l, deadline, R(REDIS_REPLY_STATUS), "AUTH",
		    "AUTH %s %s", l->username,
		    l->password != NULL ? l->password : "");
		if (reply == NULL)
			goto fail;
		freeReplyObject(reply);
	} else if (l->password != NULL) {
		reply = lock_command(l, deadline, R(REDIS_REPLY_STATUS), "AUTH",
		    "AUTH %s", l->password);
		if (reply == NULL)
			goto fail;
		freeReplyObject(reply);
	}
	if (l->database != 0) {
		reply = lock_command(l, deadline, R(REDIS_REPLY_STATUS),
		    "SELECT", "SELECT %d", l->database);
		if (reply == NULL)
			goto fail;
		freeReplyObject(reply);
	}
	/* "Connected" means the server answered: a Redis that wants a
	 * password (or runs in protected mode) takes the connection and
	 * refuses every command, and each try looked like a reconnect. */
	if (l->username == NULL && l->password == NULL && l->database == 0) {
		reply = lock_command(l, deadline, R(REDIS_REPLY_STATUS), "PING",
		    "PING");
		if (reply == NULL)
			goto fail;
		freeReplyObject(reply);
	}
	log_info("redis connected", "addr=%s",
	    log_quote(qaddr, sizeof(qaddr), l->addr));
	l->connects++;
	return 0;
fail:
	lock_drop(l);
	return -1;
}

/* 128 random bits in hex: unique per holder and per acquisition, so a
 * stale holder can never pass for the current one. */
static void
lock_new_token(struct lock *l)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char raw[TOKEN_BYTES];
	size_t got = 0;
	ssize_t n;

	/* GRND_NONBLOCK: at early boot, a token from the fallback beats a
	 * daemon that hangs waiting for entropy. */
	while (got < sizeof(raw)) {
		n = getrandom(raw + got, sizeof(raw) - got, GRND_NONBLOCK);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	if (got < sizeof(raw)) {
		struct backoff_rng rng;
		uint64_t x;

		backoff_rng_seed_random(&rng);
		for (size_t i = 0; i < sizeof(raw); i += sizeof(x)) {
			x = backoff_rng_next(&rng);
			memcpy(raw + i, &x, sizeof(x));
		}
	}
	for (size_t i = 0; i < sizeof(raw); i++) {
		l->token[2 * i] = hex[raw[i] >> 4];
		l->token[2 * i + 1] = hex[raw[i] & 0x0f];
	}
	l->token[2 * TOKEN_BYTES] = '\0';
}

/* Redis answered: the outage, if any, is over. */
static void
lock_reachable(struct lock *l)
{
	l->error[0] = '\0';
	l->down_logged = false;
	backoff_cursor_reset(&l->reconnect);
}

/* A SET or renewal sent at `sent` succeeded. */
static void
lock_granted(struct lock *l, int64_t sent)
{
	l->held = true;
	l->renewed_at = sent;
	l->valid_until = sent + lock_validity(l);
	l->next_at = sent + lock_renew_every(l);
	l->state = LOCK_HELD;
	lock_reachable(l);
}

/* keep_token: Redis was not asked, so the key may still be ours. */
static void
lock_lost(struct lock *l, const char *reason, bool keep_token)
{
	char qkey[256], qreason[320];

	if (keep_token)
		memcpy(l->lost_token, l->token, sizeof(l->lost_token));
	else
		l->lost_token[0] = '\0';
	l->held = false;
	l->lost_count++;
	log_warn("leader lock lost", "key=%s reason=%s since_renewal_ms=%"
	    PRId64 " token=%s", log_quote(qkey, sizeof(qkey), l->key),
	    log_quote(qreason, sizeof(qreason), reason),
	    now_mono_ms() - l->renewed_at, l->token);
	l->token[0] = '\0';
}

/* The connection failed (and is dropped), or Redis refused the command
 * (the connection is kept): schedule the next try. */
static void
lock_unreachable(struct lock *l)
{
	char qaddr[256], qerr[320];
	int64_t delay;

	if (!l->refused)
		lock_drop(l);
	/* While held, retry often enough to renew before the validity
	 * runs out; otherwise pace reconnects with backoff. */
	if (l->held)
		delay = l->ttl_ms / 6 > 0 ? l->ttl_ms / 6 : 1;
	else
		delay = backoff_cursor_next(&l->reconnect);
	l->next_at = now_mono_ms() + delay;
	l->state = l->held ? LOCK_HELD : LOCK_UNAVAILABLE;
	log_event(l->down_logged ? LOG_DEBUG : LOG_WARN, "redis unavailable",
	    "addr=%s error=%s held=%s retry_ms=%" PRId64,
	    log_quote(qaddr, sizeof(qaddr), l->addr),
	    log_quote(qerr, sizeof(qerr), l->error),
	    l->held ? "true" : "false", delay);
	l->down_logged = true;
}

/* The renew script for token: 1 renewed, 0 no key, -1 another token;
 * NULL when Redis failed (l->error says why). */
static redisReply *
lock_renew_command(struct lock *l, int64_t deadline, const char *token)
{
	return lock_command(l, deadline, R(REDIS_REPLY_INTEGER), "renew",
	    "EVAL %s 1 %s %s %lld", renew_script, l->key, token,
	    (long long)l->ttl_ms);
}

/*
 * SET NX found a key.  If it carries the token of a lock we lost while
 * Redis could not be asked, nobody has taken it since: renew it rather
 * than wait out its ttl with no leader anywhere.  1 reclaimed, 0 not
 * ours, -1 Redis failed (l->error says why).
 */
static int
lock_reclaim(struct lock *l, int64_t deadline)
{
	redisReply *reply;
	int64_t sent = now_mono_ms();
	bool ours;
	char qkey[256];

	if (l->lost_token[0] == '\0')
		return 0;
	reply = lock_renew_command(l, deadline, l->lost_token);
	if (reply == NULL)
		return -1;
	ours = reply->integer == 1;
	freeReplyObject(reply);
	if (ours) {
		memcpy(l->token, l->lost_token, sizeof(l->token));
		lock_granted(l, sent);
		log_info("leader lock reclaimed", "key=%s token=%s ttl_ms=%"
		    PRId64, log_quote(qkey, sizeof(qkey), l->key), l->token,
		    l->ttl_ms);
	}
	l->lost_token[0] = '\0';
	return ours ? 1 : 0;
}

static void
lock_acquire(struct lock *l, int64_t deadline)
{
	redisReply *reply;
	int64_t sent;
	bool set;
	char qkey[256];

	/* A key that may still be ours (a hold lost while Redis did not
	 * answer, a SET whose answer never came) is asked for under the
	 * same token: whichever of them landed, it is known as ours. */
	if (l->lost_token[0] != '\0')
		memcpy(l->token, l->lost_token, sizeof(l->token));
	else
		lock_new_token(l);
	sent = now_mono_ms();
	reply = lock_command(l, deadline,
	    R(REDIS_REPLY_STATUS) | R(REDIS_REPLY_NIL), "SET",
	    "SET %s %s NX PX %lld", l->key, l->token, (long long)l->ttl_ms);
	if (reply == NULL) {
		/* It may have landed: then the key is ours, to reclaim at
		 * the next try (and to delete at a stop).  Forgotten, it
		 * kept every instance out for its whole ttl. */
		memcpy(l->lost_token, l->token, sizeof(l->lost_token));
		l->token[0] = '\0';
		lock_unreachable(l);
		return;
	}
	set = reply->type == REDIS_REPLY_STATUS;
	freeReplyObject(reply);
	/* Sent again on a new connection: the first copy may have set the
	 * key, under this token, which the reclaim then finds ours. */
	if (!set && l->resent)
		memcpy(l->lost_token, l->token, sizeof(l->lost_token));
	if (set) {
		l->lost_token[0] = '\0';
		l->standby_logged = false;
		lock_granted(l, sent);
		log_info("leader lock acquired", "key=%s token=%s ttl_ms=%"
		    PRId64, log_quote(qkey, sizeof(qkey), l->key), l->token,
		    l->ttl_ms);
		return;
	}
	switch (lock_reclaim(l, deadline)) {
	case 1:
		l->standby_logged = false;
		return;
	case -1:
		l->token[0] = '\0';
		lock_unreachable(l);
		return;
	}
	/* Someone else holds it; look again in a third of a ttl.  Said
	 * once, so that a deployment whose key another one holds (two
	 * outboxes sharing redis.key) can be told from a quiet standby. */
	l->token[0] = '\0';
	if (!l->standby_logged)
		log_info("leader lock held by another instance", "key=%s "
		    "hint=\"standing by; every outbox needs its own "
		    "redis.key\"", log_quote(qkey, sizeof(qkey), l->key));
	l->standby_logged = true;
	l->state = LOCK_NOT_HELD;
	l->next_at = now_mono_ms() + lock_renew_every(l);
	lock_reachable(l);
}

static void
lock_renew(struct lock *l, int64_t deadline)
{
	redisReply *reply;
	int64_t sent = now_mono_ms();

	reply = lock_renew_command(l, deadline, l->token);
	if (reply == NULL) {
		/* Past the validity we cannot know whether the key outlived
		 * us: another instance may be leader already. */
		if (now_mono_ms() >= l->valid_until)
			lock_lost(l, l->error, true);
		lock_unreachable(l);
		return;
	}
	if (reply->integer == 1) {
		lock_granted(l, sent);
	} else {
		lock_lost(l, reply->integer == 0 ? "key gone" :
		    "key holds another token", false);
		/* Report the loss now; compete again on the next tick. */
		l->state = LOCK_NOT_HELD;
		l->next_at = now_mono_ms();
		lock_reachable(l);
	}
	freeReplyObject(reply);
}

/*
 * The validity ran out without a renewal: a stall (a long step, a
 * paused VM), or Redis too slow or away.  If the key still carries our
 * token, nobody can have taken it, so it is renewed and stays ours;
 * before, a stall alone gave leadership up and took it back.
 */
static void
lock_expired(struct lock *l, int64_t now)
{
	redisReply *reply = NULL;
	char qkey[256];

	if (l->ctx != NULL)
		reply = lock_renew_command(l, now + l->connect_timeout_ms,
		    l->token);
	if (reply == NULL) {
		/* Not connected, or the command just failed: l->error says
		 * why, and reconnects follow the backoff now. */
		lock_lost(l, "not renewed in time", true);
		lock_unreachable(l);
		return;
	}
	if (reply->integer == 1) {
		log_warn("leader lock renewed late", "key=%s "
		    "since_renewal_ms=%" PRId64 " ttl_ms=%" PRId64,
		    log_quote(qkey, sizeof(qkey), l->key), now - l->renewed_at,
		    l->ttl_ms);
		lock_granted(l, now);
	} else {
		lock_lost(l, reply->integer == 0 ? "not renewed in time; "
		    "key gone" : "not renewed in time; key holds another "
		    "token", false);
		l->state = LOCK_NOT_HELD;
		l->next_at = now;
	}
	freeReplyObject(reply);
}

struct lock *
lock_new(const struct lock_conf *conf)
{
	struct lock *l = xcalloc(1, sizeof(*l));
	struct backoff_params p;
	char buf[300];

	l->enabled = conf->enabled;
	l->host = xstrdup(conf->host != NULL ? conf->host : "127.0.0.1");
	l->port = conf->port > 0 ? conf->port : 6379;
	if (strncmp(l->host, UNIX_PREFIX, strlen(UNIX_PREFIX)) == 0) {
		l->socket_path = l->host + strlen(UNIX_PREFIX);
		l->addr = xstrdup(l->host);
	} else {
		/* Brackets keep an IPv6 address readable next to its port. */
		l->addr = xstrdup(strfmt(buf, sizeof(buf),
		    strchr(l->host, ':') != NULL ? "[%s]:%d" : "%s:%d",
		    l->host, l->port));
	}
	l->username = conf->username != NULL ? xstrdup(conf->username) :
	    NULL;
	l->password = conf->password != NULL ? xstrdup(conf->password) :
	    NULL;
	l->password_file = conf->password_file != NULL ?
	    xstrdup(conf->password_file) : NULL;
	l->database = conf->database;
	l->key = xstrdup(conf->key != NULL ? conf->key : DEFAULT_KEY);
	/* Config enforces sane bounds; these only keep ttl/3 and the
	 * tick's budget above zero. */
	l->ttl_ms = conf->ttl_ms >= 3 ? conf->ttl_ms : 3;
	l->connect_timeout_ms = conf->connect_timeout_ms >= 1 ?
	    conf->connect_timeout_ms : 1;
	l->state = l->enabled ? LOCK_NOT_HELD : LOCK_HELD;
	l->next_at = 0;
	backoff_params_default(&p);
	p.init_ms = 1000;
	p.factor = 2.0;
	p.max_ms = 10000;
	/* Instances that lost Redis together should not return in step. */
	p.jitter = JITTER_PROPORTIONAL;
	p.jitter_factor = 0.2;
	backoff_cursor_init(&l->reconnect, &p);
	return l;
}

void
lock_free(struct lock *l)
{
	if (l == NULL)
		return;
	lock_drop(l);
	free(l->host);
	free(l->addr);
	free(l->username);
	secret_free(l->password);
	free(l->password_file);
	free(l->key);
	free(l);
}

void
lock_set_reconnect(struct lock *l, const struct backoff_params *p)
{
	/* The attempt count stays: a reload during an outage goes on
	 * from where the pacing is, as the relay's cursors do. */
	l->reconnect.params = *p;
}

uint64_t
lock_reconnects(const struct lock *l)
{
	return l->connects > 0 ? l->connects - 1 : 0;
}

enum lock_state
lock_tick(struct lock *l)
{
	int64_t now, deadline;

	if (!l->enabled)
		return LOCK_HELD;
	now = now_mono_ms();
	/* Whatever this tick sends first may meet a connection closed
	 * while idle (lock_command). */
	l->ctx_idle = l->ctx != NULL;
	if (l->held && now >= l->valid_until) {
		lock_expired(l, now);
		return l->state;
	}
	if (now < l->next_at)
		return l->state;
	/* One budget for connect, AUTH, SELECT and the command. */
	deadline = now + l->connect_timeout_ms;
	if (l->ctx == NULL && lock_connect(l, deadline) != 0) {
		/* As in lock_renew: a connect that took us past the
		 * validity is a loss, reported by this call. */
		if (l->held && now_mono_ms() >= l->valid_until)
			lock_lost(l, l->error, true);
		lock_unreachable(l);
		return l->state;
	}
	if (l->held)
		lock_renew(l, deadline);
	else
		lock_acquire(l, deadline);
	return l->state;
}

int64_t
lock_next_tick_ms(const struct lock *l)
{
	int64_t at, now;

	if (!l->enabled)
		return INT64_MAX;
	at = l->next_at;
	if (l->held && l->valid_until < at)
		at = l->valid_until;
	now = now_mono_ms();
	return at > now ? at - now : 0;
}

bool
lock_held(const struct lock *l)
{
	if (!l->enabled)
		return true;
	return l->held && now_mono_ms() < l->valid_until;
}

bool
lock_redis_up(const struct lock *l)
{
	return l->enabled && l->ctx != NULL;
}

void
lock_release(struct lock *l)
{
	redisReply *reply = NULL;
	int64_t deadline;
	const char *token;
	char qkey[256], qerr[320];

	if (l == NULL || !l->enabled)
		return;
	/* A key lost while Redis did not answer may have outlived the
	 * outage, under our token: it is deleted too, or the next leader
	 * waited out the rest of its ttl after a stop. */
	token = l->held ? l->token : l->lost_token;
	if (token[0] == '\0')
		return;
	deadline = now_mono_ms() + l->connect_timeout_ms;
	l->ctx_idle = l->ctx != NULL;
	if (l->ctx != NULL || lock_connect(l, deadline) == 0)
		reply = lock_command(l, deadline, R(REDIS_REPLY_INTEGER),
		    "release", "EVAL %s 1 %s %s", release_script, l->key,
		    token);
	if (reply == NULL) {
		/* A ttl from the last renewal (it said the whole ttl); a
		 * key lost before may be gone already. */
		int64_t left = l->held ? l->renewed_at + l->ttl_ms -
		    now_mono_ms() : l->ttl_ms;

		log_warn("leader lock not released", "key=%s error=%s "
		    "expires_within_ms=%" PRId64,
		    log_quote(qkey, sizeof(qkey), l->key),
		    log_quote(qerr, sizeof(qerr), l->error),
		    left > 0 ? left : 0);
		/* The key may outlive this under our token: kept, to be
		 * reclaimed at the next acquire or deleted at the next
		 * release.  Forgotten, it kept every instance out, this
		 * one too, for the rest of its ttl. */
		if (token != l->lost_token)
			memcpy(l->lost_token, token, sizeof(l->lost_token));
	} else if (reply->integer == 1) {
		log_info("leader lock released", "key=%s token=%s",
		    log_quote(qkey, sizeof(qkey), l->key), token);
	} else if (l->held && (reply->integer == -1 || !l->resent)) {
		/* Compare-and-delete left the other holder's key alone.  No
		 * key after a resend: its first copy may have deleted ours. */
		lock_lost(l, "not ours at release", false);
	}
	if (reply != NULL) {
		freeReplyObject(reply);
		l->lost_token[0] = '\0';
	}
	l->held = false;
	l->token[0] = '\0';
	l->state = l->ctx != NULL ? LOCK_NOT_HELD : LOCK_UNAVAILABLE;
	l->next_at = now_mono_ms();
}

const char *
lock_error(const struct lock *l)
{
	return l->error;
}

const char *
lock_token(const struct lock *l)
{
	return l->held ? l->token : "";
}

uint64_t
lock_lost_count(const struct lock *l)
{
	return l->lost_count;
}
