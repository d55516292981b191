/*
 * Config: YAML (libyaml) into a validated struct config.  One table says,
 * for every key, its type, bounds, default, reloadability and field; load,
 * defaults, dump and reload all walk it.  This file holds the table and
 * the loader; secrets, the dump and reload have files of their own.
 */
#include "config_internal.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "backoff.h"
#include "config_value.h"
#include "log.h"
#include "secret.h"

/* A config file is a few kilobytes; anything this big is a mistake. */
#define CONFIG_MAX_BYTES	(1024 * 1024)

/* Enums are stored through an int lvalue; make sure they are int-sized. */
_Static_assert(sizeof(enum log_level) == sizeof(int), "enum size");
_Static_assert(sizeof(enum relay_mode) == sizeof(int), "enum size");
_Static_assert(sizeof(enum backoff_strategy) == sizeof(int), "enum size");
_Static_assert(sizeof(enum backoff_jitter) == sizeof(int), "enum size");

static const struct enum_name log_levels[] = {
	{ "debug", LOG_DEBUG }, { "info", LOG_INFO }, { "warn", LOG_WARN },
	{ "error", LOG_ERROR }, { NULL, 0 },
};
static const struct enum_name relay_modes[] = {
	{ "parallel", RELAY_PARALLEL },
	{ "single-active", RELAY_SINGLE_ACTIVE }, { NULL, 0 },
};
static const struct enum_name orderings[] = {
	{ "none", 0 }, { "business_key", 1 }, { NULL, 0 },
};
static const struct enum_name strategies[] = {
	{ "exponential", BACKOFF_EXPONENTIAL }, { "fixed", BACKOFF_FIXED },
	{ "random", BACKOFF_RANDOM }, { "fibonacci", BACKOFF_FIBONACCI },
	{ "ethernet", BACKOFF_ETHERNET }, { NULL, 0 },
};
static const struct enum_name jitters[] = {
	{ "none", JITTER_NONE }, { "proportional", JITTER_PROPORTIONAL },
	{ "full", JITTER_FULL }, { "equal", JITTER_EQUAL },
	{ "decorrelated", JITTER_DECORRELATED }, { NULL, 0 },
};

#define OFF(f)	offsetof(struct config, f)
#define MS(n)	((int64_t)(n))
#define SEC(n)	((int64_t)(n) * 1000)
#define MIN(n)	((int64_t)(n) * 60000)
#define HOUR(n)	((int64_t)(n) * 3600000)
#define DAY(n)	((int64_t)(n) * 86400000)
#define KIB(n)	((int64_t)(n) * 1024)
#define MIB(n)	((int64_t)(n) * 1024 * 1024)

/* Keep in step with config/outboxd.yml and docs/CONFIG.md (a test
 * checks the sample file documents every key). */
const struct key cfg_keys[] = {
	{ .name = "log.level", .type = T_ENUM, .flags = F_RELOAD,
	  .off = OFF(log_level), .def = "info", .names = log_levels },

	{ .name = "postgres.conninfo", .type = T_STRING, .flags = F_CONNINFO,
	  .off = OFF(store.conninfo),
	  .def = "host=127.0.0.1 port=5432 dbname=outbox user=outboxd" },
	{ .name = "postgres.password", .type = T_SECRET, .group = 1,
	  .off = OFF(store.password) },
	{ .name = "postgres.password_env", .type = T_SECRET_ENV, .group = 1,
	  .off = OFF(store_password_src.env) },
	{ .name = "postgres.password_file", .type = T_SECRET_FILE, .group = 1,
	  .off = OFF(store_password_src.file) },
	{ .name = "postgres.connect_timeout", .type = T_DURATION,
	  .off = OFF(store.connect_timeout_ms), .def = "5s",
	  .min = MS(100), .max = MIN(5) },
	{ .name = "postgres.lock_timeout", .type = T_DURATION,
	  .off = OFF(store.lock_timeout_ms), .def = "5s",
	  .min = 0, .max = MIN(5) },
	{ .name = "postgres.application_name", .type = T_STRING,
	  .off = OFF(store.application_name), .def = "outboxd" },

	{ .name = "rabbitmq.nodes", .type = T_NODES, .off = OFF(broker),
	  .def = "127.0.0.1:5672", .port = 5672 },
	{ .name = "rabbitmq.vhost", .type = T_STRING, .flags = F_NONEMPTY,
	  .off = OFF(broker.vhost), .def = "/", .max = 255 },
	{ .name = "rabbitmq.user", .type = T_STRING, .flags = F_NONEMPTY,
	  .off = OFF(broker.user), .def = "guest" },
	{ .name = "rabbitmq.password", .type = T_SECRET, .group = 2,
	  .off = OFF(broker.password), .def = "guest" },
	{ .name = "rabbitmq.password_env", .type = T_SECRET_ENV, .group = 2,
	  .off = OFF(broker_password_src.env) },
	{ .name = "rabbitmq.password_file", .type = T_SECRET_FILE, .group = 2,
	  .off = OFF(broker_password_src.file) },
	{ .name = "rabbitmq.heartbeat", .type = T_DURATION, .flags = F_SECONDS,
	  .off = OFF(broker.heartbeat_s), .def = "0", .min = 0,
	  .max = MIN(10) },
	{ .name = "rabbitmq.connect_timeout", .type = T_DURATION,
	  .off = OFF(broker.connect_timeout_ms), .def = "5s",
	  .min = MS(100), .max = MIN(5) },
	{ .name = "rabbitmq.confirm_timeout", .type = T_DURATION,
	  .off = OFF(broker.confirm_timeout_ms), .def = "10s",
	  .min = MS(100), .max = MIN(10) },
	{ .name = "rabbitmq.max_payload", .type = T_SIZE,
	  .off = OFF(broker.max_payload), .def = "16MiB",
	  .min = KIB(1), .max = MIB(512) },
	{ .name = "rabbitmq.frame_max", .type = T_INT,
	  .off = OFF(broker.frame_max), .def = "131072",
	  .min = 4096, .max = INT32_MAX },
	{ .name = "rabbitmq.tls.enabled", .type = T_BOOL,
	  .off = OFF(broker.tls), .def = "false" },
	{ .name = "rabbitmq.tls.ca_file", .type = T_STRING,
	  .flags = F_OPTIONAL | F_NONEMPTY | F_ABSOLUTE,
	  .off = OFF(broker.tls_ca_file) },
	{ .name = "rabbitmq.tls.cert_file", .type = T_STRING,
	  .flags = F_OPTIONAL | F_NONEMPTY | F_ABSOLUTE,
	  .off = OFF(broker.tls_cert_file) },
	{ .name = "rabbitmq.tls.key_file", .type = T_STRING,
	  .flags = F_OPTIONAL | F_NONEMPTY | F_ABSOLUTE,
	  .off = OFF(broker.tls_key_file) },
	{ .name = "rabbitmq.tls.verify_peer", .type = T_BOOL,
	  .off = OFF(broker.tls_verify_peer), .def = "true" },
	{ .name = "rabbitmq.tls.verify_hostname", .type = T_BOOL,
	  .off = OFF(broker.tls_verify_hostname), .def = "true" },

	{ .name = "redis.enabled", .type = T_BOOL, .off = OFF(lock.enabled),
	  .def = "true" },
	{ .name = "redis.address", .type = T_ADDRESS, .off = OFF(lock.host),
	  .off2 = OFF(lock.port), .def = "127.0.0.1:6379", .port = 6379 },
	{ .name = "redis.username", .type = T_STRING,
	  .flags = F_OPTIONAL | F_NONEMPTY, .off = OFF(lock.username) },
	{ .name = "redis.password", .type = T_SECRET, .group = 3,
	  .off = OFF(lock.password) },
	{ .name = "redis.password_env", .type = T_SECRET_ENV, .group = 3,
	  .off = OFF(lock_password_src.env) },
	{ .name = "redis.password_file", .type = T_SECRET_FILE, .group = 3,
	  .off = OFF(lock_password_src.file) },
	{ .name = "redis.database", .type = T_INT, .off = OFF(lock.database),
	  .def = "0", .min = 0, .max = 15 },
	{ .name = "redis.key", .type = T_STRING, .flags = F_NONEMPTY,
	  .off = OFF(lock.key), .def = "outboxd:leader" },
	{ .name = "redis.ttl", .type = T_DURATION, .off = OFF(lock.ttl_ms),
	  .def = "30s", .min = SEC(1), .max = MIN(10) },
	{ .name = "redis.connect_timeout", .type = T_DURATION,
	  .off = OFF(lock.connect_timeout_ms), .def = "2s",
	  .min = MS(100), .max = MIN(1) },

	{ .name = "relay.batch_size", .type = T_INT, .flags = F_RELOAD,
	  .off = OFF(relay.batch_size), .def = "500", .min = 1,
	  .max = 10000 },
	{ .name = "relay.poll_interval", .type = T_DURATION, .flags = F_RELOAD,
	  .off = OFF(relay.poll_interval_ms), .def = "5s", .min = MS(10),
	  .max = HOUR(1) },
	{ .name = "relay.shutdown_timeout", .type = T_DURATION,
	  .flags = F_RELOAD, .off = OFF(relay.shutdown_timeout_ms),
	  .def = "30s", .min = 0, .max = HOUR(1) },
	{ .name = "relay.workers", .type = T_INT, .off = OFF(relay.workers),
	  .def = "2", .min = 1, .max = 16 },
	{ .name = "relay.pipeline", .type = T_BOOL, .off = OFF(relay.pipeline),
	  .def = "false" },
	{ .name = "relay.mode", .type = T_ENUM, .off = OFF(relay.mode),
	  .def = "parallel", .names = relay_modes },
	{ .name = "relay.ordering", .type = T_ENUM, .flags = F_AS_BOOL,
	  .off = OFF(relay.ordering_by_key), .def = "none",
	  .names = orderings },
	{ .name = "relay.retention", .type = T_DURATION, .flags = F_RELOAD,
	  .off = OFF(relay.retention_ms), .def = "7d", .min = 0,
	  .max = CONFIG_RETENTION_MAX_MS },

	{ .name = "backoff.strategy", .type = T_ENUM, .flags = F_RELOAD,
	  .off = OFF(relay.backoff.strategy), .def = "exponential",
	  .names = strategies },
	{ .name = "backoff.jitter", .type = T_ENUM, .flags = F_RELOAD,
	  .off = OFF(relay.backoff.jitter), .def = "none", .names = jitters },
	{ .name = "backoff.jitter_factor", .type = T_FLOAT, .flags = F_RELOAD,
	  .off = OFF(relay.backoff.jitter_factor), .def = "0.2",
	  .fmin = 0, .fmax = 1 },
	{ .name = "backoff.max", .type = T_DURATION, .flags = F_RELOAD,
	  .off = OFF(relay.backoff.max_ms), .def = "1h", .min = MS(1),
	  .max = CONFIG_BACKOFF_MAX_MS },

	{ .name = "reconnect.strategy", .type = T_ENUM, .flags = F_RELOAD,
	  .off = OFF(relay.reconnect.strategy), .def = "exponential",
	  .names = strategies },
	{ .name = "reconnect.jitter", .type = T_ENUM, .flags = F_RELOAD,
	  .off = OFF(relay.reconnect.jitter), .def = "equal",
	  .names = jitters },
	{ .name = "reconnect.init", .type = T_DURATION, .flags = F_RELOAD,
	  .off = OFF(relay.reconnect.init_ms), .def = "100ms", .min = MS(1),
	  .max = MIN(1) },
	{ .name = "reconnect.factor", .type = T_FLOAT, .flags = F_RELOAD,
	  .off = OFF(relay.reconnect.factor), .def = "2", .fmin = 1,
	  .fmax = 100 },
	{ .name = "reconnect.max", .type = T_DURATION, .flags = F_RELOAD,
	  .off = OFF(relay.reconnect.max_ms), .def = "30s", .min = MS(1),
	  .max = HOUR(1) },

	{ .name = "http.listen", .type = T_LISTEN, .off = OFF(http.listen),
	  .def = "127.0.0.1:9187", .port = 0 },
};

#define N_KEYS	ARRAY_LEN(cfg_keys)
const size_t cfg_n_keys = N_KEYS;

/*
 * A password from the environment, less one trailing line end, as the
 * first line of a password_file is: `X=$(cat f)` keeps none, but an
 * env_file or a Kubernetes secret made --from-file keeps the file's,
 * and the newline went to the server as part of the password ("password
 * authentication failed", with `outboxd check` content).  NULL when
 * nothing is left: a variable holding only a line end is empty (it was
 * taken as a one-byte password).
 */
static char *
env_secret(const char *val)
{
	char *secret = xstrdup(val);
	size_t len = strlen(secret);

	if (len > 0 && secret[len - 1] == '\n')
		secret[--len] = '\0';
	if (len > 0 && secret[len - 1] == '\r')
		secret[--len] = '\0';
	if (len == 0) {
		secret_free(secret);
		return NULL;
	}
	return secret;
}

/* The three passwords: a section's password, password_env, password_file
 * share a group number; index 0 is unused. */
static const char *const group_section[] = {
	NULL, "postgres", "rabbitmq", "redis",
};
#define N_GROUPS	ARRAY_LEN(group_section)

/* One problem found while loading; sorted by position before printing. */
struct problem {
	unsigned long line, col;	/* 1-based; line 0 = no position */
	size_t seq;			/* keeps equal positions in order */
	char *msg;
};

/* What the loader saw of each key. */
struct seen {
	bool present;		/* the key was written, whatever its value */
	bool refused;		/* its value was bad (reported) */
	bool given;		/* a valid, non-null value was set */
	yaml_mark_t key_mark, val_mark;
};

struct loader {
	const char *name;
	struct config *c;
	yaml_document_t *doc;
	struct problem *probs;
	size_t n_probs, cap_probs;
	size_t n_absent;	/* of them, password files that do not exist */
	struct seen seen[N_KEYS];
	/* While checking a value written through an alias (key: *name):
	 * the alias's place, where problems are reported, and the line of
	 * its anchor, where the value's text is. */
	const yaml_mark_t *alias_at;
	unsigned long anchor_line;
};

static bool
is_secret_type(enum key_type t)
{
	return t == T_SECRET || t == T_SECRET_ENV || t == T_SECRET_FILE;
}

static void problem(struct loader *, const yaml_mark_t *, const char *, ...)
    __attribute__((format(printf, 3, 4)));

static void
problem(struct loader *L, const yaml_mark_t *mark, const char *fmt, ...)
{
	char buf[1024];
	struct problem *p;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (L->alias_at != NULL) {
		size_t len = strlen(buf);

		mark = L->alias_at;
		snprintf(buf + len, sizeof(buf) - len, " (through an alias; "
		    "the anchor is at line %lu)", L->anchor_line);
	}
	if (L->n_probs == L->cap_probs) {
		L->cap_probs = L->cap_probs ? L->cap_probs * 2 : 8;
		L->probs = xrealloc(L->probs,
		    L->cap_probs * sizeof(*L->probs));
	}
	p = &L->probs[L->n_probs];
	/* libyaml counts lines and columns from 0; people count from 1. */
	p->line = mark ? (unsigned long)mark->line + 1 : 0;
	p->col = mark ? (unsigned long)mark->column + 1 : 0;
	p->seq = L->n_probs++;
	p->msg = xstrdup(buf);
}

static int
problem_cmp(const void *a, const void *b)
{
	const struct problem *x = a, *y = b;

	if (x->line != y->line)
		return x->line < y->line ? -1 : 1;
	if (x->col != y->col)
		return x->col < y->col ? -1 : 1;
	return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Prints a problem to errs, or logs it when there is no stream (reload
 * in the daemon, whose stderr is the log). */
static void
problem_emit(const char *name, unsigned long line, unsigned long col,
    const char *msg, FILE *errs)
{
	char qname[512], qmsg[1024];

	if (errs != NULL) {
		if (line > 0)
			fprintf(errs, "%s:%lu:%lu: %s\n", name, line, col, msg);
		else
			fprintf(errs, "%s: %s\n", name, msg);
		return;
	}
	log_error("config error", "file=%s line=%lu col=%lu error=%s",
	    log_quote(qname, sizeof(qname), name), line, col,
	    log_quote(qmsg, sizeof(qmsg), msg));
}

/* YAML's null: an empty plain scalar, "~" or "null".  Quoted "" is a
 * real empty string. */
static bool
is_null(const yaml_node_t *n)
{
	const char *s;

	if (n->type != YAML_SCALAR_NODE ||
	    n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
		return false;
	s = (const char *)n->data.scalar.value;
	return *s == '\0' || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
	    strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

static const char *
node_kind(const yaml_node_t *n)
{
	switch (n->type) {
	case YAML_SEQUENCE_NODE:
		return "a list";
	case YAML_MAPPING_NODE:
		return "a mapping";
	default:
		return "a single value";
	}
}

/* "a, b or c", for messages and the docs. */
static void
enum_list(char *buf, size_t size, const struct enum_name *names)
{
	size_t n = 0;

	buf[0] = '\0';
	for (const struct enum_name *e = names; e->name != NULL; e++) {
		const char *sep = e == names ? "" :
		    e[1].name == NULL ? " or " : ", ";
		int w = snprintf(buf + n, size - n, "%s%s", sep, e->name);

		if (w < 0 || (size_t)w >= size - n)
			break;
		n += (size_t)w;
	}
}

/* What a key wants, for "expected ..., got ..." messages. */
static const char *
type_wants(const struct key *k, char *buf, size_t size)
{
	char list[256];

	switch (k->type) {
	case T_INT:
		return "an integer";
	case T_BOOL:
		return "true or false";
	case T_DURATION:
		return "a duration such as 250ms, 10s, 5m, 1h or 2d";
	case T_SIZE:
		return "a size such as 512, 64KiB, 16MiB or 1GiB";
	case T_FLOAT:
		return "a number";
	case T_ENUM:
		enum_list(list, sizeof(list), k->names);
		return strfmt(buf, size, "one of %s", list);
	case T_NODES:
		return "a list of \"host:port\"";
	case T_ADDRESS:
	case T_LISTEN:
		return "\"host:port\"";
	default:
		return "a string";
	}
}

static void
nodes_clear(struct broker_conf *b)
{
	for (size_t i = 0; i < b->n_nodes; i++) {
		free(b->nodes[i].host);
		b->nodes[i].host = NULL;
	}
	b->n_nodes = 0;
}

void
cfg_string_set(char **dst, const char *s, bool secret)
{
	if (secret)
		secret_free(*dst);
	else
		free(*dst);
	*dst = s ? xstrdup(s) : NULL;
}

static bool
env_name_ok(const char *s)
{
	if (!isalpha((unsigned char)*s) && *s != '_')
		return false;
	for (; *s != '\0'; s++)
		if (!isalnum((unsigned char)*s) && *s != '_')
			return false;
	return true;
}

/*
 * Parses s as k's value and stores it in c.  On error returns -1 with the
 * reason in why, to be printed after "key: ".  Values of secret keys are
 * never put in why.
 */
static int
value_set(struct config *c, const struct key *k, const char *s, char *why,
    size_t whysz)
{
	char q[ECHO_MAX * 4 + 8], lo[32], hi[32], wants[300];
	void *f = field(c, k->off);
	int64_t v;
	double d;
	int rc;

	config_echo(q, sizeof(q), s);
	switch (k->type) {
	case T_STRING:
	case T_SECRET:
	case T_SECRET_FILE:
		if (*s == '\0' &&
		    ((k->flags & F_NONEMPTY) || k->type != T_STRING)) {
			strfmt(why, whysz, "must not be empty");
			return -1;
		}
		/* A protocol's limit (an AMQP shortstr): past it every
		 * connect failed, after a `check` that said OK. */
		if (k->type == T_STRING && k->max > 0 &&
		    (int64_t)strlen(s) > k->max) {
			strfmt(why, whysz, "is %zu bytes long, at most %" PRId64
			    " allowed", strlen(s), k->max);
			return -1;
		}
		/* A relative path was found where `outboxd check` ran and
		 * then not by the service, which runs in / (systemd). The
		 * value of a password_file is not echoed: a password may
		 * have been pasted there by mistake. */
		if (((k->flags & F_ABSOLUTE) || k->type == T_SECRET_FILE) &&
		    *s != '/') {
			strfmt(why, whysz, "must be an absolute path (outboxd "
			    "opens it from its working directory, not the "
			    "config file's)%s%s", k->type == T_SECRET_FILE ?
			    "" : ", got ", k->type == T_SECRET_FILE ? "" : q);
			return -1;
		}
		/* A conninfo may hold a password. */
		cfg_string_set(f, s, k->type == T_SECRET ||
		    (k->flags & F_CONNINFO));
		return 0;
	case T_SECRET_ENV:
		if (!env_name_ok(s)) {
			strfmt(why, whysz, "expected the name of an "
			    "environment variable");
			return -1;
		}
		cfg_string_set(f, s, false);
		return 0;
	case T_INT:
		rc = config_parse_int(s, &v);
		if (rc == -1) {
			strfmt(why, whysz, "expected an integer, got %s", q);
			return -1;
		}
		if (rc == -2 || v < k->min || v > k->max) {
			strfmt(why, whysz, "must be between %" PRId64 " and %"
			    PRId64 ", got %s", k->min, k->max, s);
			return -1;
		}
		*(int *)f = (int)v;
		return 0;
	case T_BOOL:
		if (strcmp(s, "true") == 0 || strcmp(s, "True") == 0 ||
		    strcmp(s, "TRUE") == 0)
			*(bool *)f = true;
		else if (strcmp(s, "false") == 0 || strcmp(s, "False") == 0 ||
		    strcmp(s, "FALSE") == 0)
			*(bool *)f = false;
		else {
			strfmt(why, whysz, "expected true or false, got %s", q);
			return -1;
		}
		return 0;
	case T_DURATION:
		rc = config_parse_duration(s, &v);
		if (rc == -1) {
			strfmt(why, whysz, "expected %s, got %s",
			    type_wants(k, wants, sizeof(wants)), q);
			return -1;
		}
		if (rc == -2) {
			strfmt(why, whysz, "%s needs a unit such as 10s", q);
			return -1;
		}
		if (rc == -3 || v < k->min || v > k->max) {
			strfmt(why, whysz, "must be between %s and %s, got %s",
			    config_fmt_duration(lo, sizeof(lo), k->min),
			    config_fmt_duration(hi, sizeof(hi), k->max), s);
			return -1;
		}
		if (k->flags & F_SECONDS) {
			if (v % 1000 != 0) {
				strfmt(why, whysz, "must be whole seconds, "
				    "got %s", s);
				return -1;
			}
			*(int *)f = (int)(v / 1000);
		} else {
			*(int64_t *)f = v;
		}
		return 0;
	case T_SIZE:
		rc = config_parse_size(s, &v);
		if (rc == -1) {
			strfmt(why, whysz, "expected %s, got %s",
			    type_wants(k, wants, sizeof(wants)), q);
			return -1;
		}
		if (rc == -2 || v < k->min || v > k->max) {
			strfmt(why, whysz, "must be between %s and %s, got %s",
			    config_fmt_size(lo, sizeof(lo), k->min),
			    config_fmt_size(hi, sizeof(hi), k->max), s);
			return -1;
		}
		*(size_t *)f = (size_t)v;
		return 0;
	case T_FLOAT:
		if (config_parse_float(s, &d) != 0) {
			strfmt(why, whysz, "expected a number, got %s", q);
			return -1;
		}
		if (d < k->fmin || d > k->fmax) {
			strfmt(why, whysz, "must be between %g and %g, got %s",
			    k->fmin, k->fmax, s);
			return -1;
		}
		*(double *)f = d;
		return 0;
	case T_ENUM:
		for (const struct enum_name *e = k->names; e->name; e++) {
			if (strcmp(s, e->name) != 0)
				continue;
			if (k->flags & F_AS_BOOL)
				*(bool *)f = e->value != 0;
			else
				*(int *)f = e->value;
			return 0;
		}
		strfmt(why, whysz, "expected %s, got %s",
		    type_wants(k, wants, sizeof(wants)), q);
		return -1;
	case T_NODES: {
		struct broker_conf *b = f;
		char *host;
		int port;

		if (config_parse_hostport(s, k->port, k->port, &host, &port, why,
		    whysz) != 0)
			return -1;
		nodes_clear(b);
		b->nodes[0].host = host;
		b->nodes[0].port = port;
		b->n_nodes = 1;
		return 0;
	}
	case T_ADDRESS: {
		char *host;
		int port = 0;

		/* A unix socket keeps its prefix so the lock module can
		 * tell it from a host name; its port is 0. */
		if (strncmp(s, "unix:", 5) == 0) {
			if (s[5] != '/') {
				strfmt(why, whysz, "a unix socket path must "
				    "be absolute, got %s", q);
				return -1;
			}
			/* hiredis cuts a longer one short, and connects to
			 * another path than the logs name. */
			if (strlen(s + 5) >= sizeof(((struct sockaddr_un *)
			    NULL)->sun_path)) {
				strfmt(why, whysz, "a unix socket path must be "
				    "shorter than %zu bytes, got %zu",
				    sizeof(((struct sockaddr_un *)NULL)->
				    sun_path), strlen(s + 5));
				return -1;
			}
			host = xstrdup(s);
		} else if (config_parse_hostport(s, k->port, k->port, &host, &port,
		    why, whysz) != 0) {
			return -1;
		}
		free(*(char **)f);
		*(char **)f = host;
		*(int *)field(c, k->off2) = port;
		return 0;
	}
	case T_LISTEN: {
		char *host, *herr;
		/* http_listen_check's message repeats the value first. */
		size_t skip = strlen("http.listen ") + strlen(s) + 2;
		size_t herrsz = skip + 300;
		int port;

		if (*s != '\0') {
			if (config_parse_hostport(s, 0, 9187, &host, &port, why,
			    whysz) != 0)
				return -1;
			free(host);
			/* The endpoint binds numeric addresses only: what it
			 * would refuse at start-up is refused here, so that
			 * `outboxd check` never passes it (found by
			 * tests/fuzz/fuzz_config). */
			herr = xmalloc(herrsz);
			if (http_listen_check(s, herr, herrsz) != 0) {
				strfmt(why, whysz, "%s, got %s",
				    strlen(herr) > skip ? herr + skip : herr,
				    q);
				free(herr);
				return -1;
			}
			free(herr);
		}
		cfg_string_set(f, s, false);
		return 0;
	}
	}
	strfmt(why, whysz, "unknown key type");
	return -1;
}

static int
key_find(const char *name)
{
	for (size_t i = 0; i < N_KEYS; i++)
		if (strcmp(cfg_keys[i].name, name) == 0)
			return (int)i;
	return -1;
}

/* A section is a proper prefix of some key: "rabbitmq", "rabbitmq.tls". */
static bool
is_section(const char *path)
{
	size_t n = strlen(path);

	for (size_t i = 0; i < N_KEYS; i++)
		if (strncmp(cfg_keys[i].name, path, n) == 0 &&
		    cfg_keys[i].name[n] == '.')
			return true;
	return false;
}

/* Edit distance counting a swap of neighbours as one edit ("levle" is
 * one typo from "level"), ignoring case; SIZE_MAX for long names. */
static size_t
edit_distance(const char *a, const char *b)
{
	size_t la = strlen(a), lb = strlen(b);
	size_t prev2[65], prev[65], cur[65];

	if (la > 64 || lb > 64)
		return SIZE_MAX;
	for (size_t j = 0; j <= lb; j++)
		prev[j] = j;
	for (size_t i = 1; i <= la; i++) {
		int ca = tolower((unsigned char)a[i - 1]);

		cur[0] = i;
		for (size_t j = 1; j <= lb; j++) {
			int cb = tolower((unsigned char)b[j - 1]);
			size_t best = prev[j - 1] + (ca != cb);

			if (prev[j] + 1 < best)
				best = prev[j] + 1;
			if (cur[j - 1] + 1 < best)
				best = cur[j - 1] + 1;
			if (i > 1 && j > 1 &&
			    ca == tolower((unsigned char)b[j - 2]) &&
			    cb == tolower((unsigned char)a[i - 2]) &&
			    prev2[j - 2] + 1 < best)
				best = prev2[j - 2] + 1;
			cur[j] = best;
		}
		memcpy(prev2, prev, sizeof(prev));
		memcpy(prev, cur, sizeof(cur));
	}
	return prev[lb];
}

/*
 * Finds what an unknown key under prefix probably meant: a sibling spelt
 * nearly the same ("nodez" → "nodes"), else a key or section of the same
 * name in another section ("relay.jitter" → "backoff.jitter").  Every
 * key and every section is a candidate.  Returns false if nothing fits.
 */
static bool
suggest(const char *prefix, const char *name, char *out, size_t size)
{
	size_t plen = strlen(prefix), best = SIZE_MAX;
	bool found = false;

	for (int pass = 0; pass < 2 && !found; pass++) {
		for (size_t i = 0; i < N_KEYS; i++) {
			const char *k = cfg_keys[i].name, *seg = k;

			for (const char *p = k;; p++) {
				char path[128], s[64];
				size_t seglen, d;
				bool sibling;

				if (*p != '.' && *p != '\0')
					continue;
				/* path = k[0, p), its last segment seg. */
				seglen = (size_t)(p - seg);
				if ((size_t)(p - k) >= sizeof(path) ||
				    seglen >= sizeof(s))
					break;
				memcpy(path, k, (size_t)(p - k));
				path[p - k] = '\0';
				memcpy(s, seg, seglen);
				s[seglen] = '\0';
				sibling = (plen == 0 && seg == k) ||
				    (plen > 0 && seg == k + plen + 1 &&
				    strncmp(k, prefix, plen) == 0);
				if (pass == 0 && sibling) {
					d = edit_distance(name, s);
					if (d < best && d <= 2 &&
					    d * 3 <= seglen) {
						best = d;
						strfmt(out, size, "%s", path);
						found = true;
					}
				} else if (pass == 1 && !sibling &&
				    strcasecmp(name, s) == 0) {
					strfmt(out, size, "%s", path);
					return true;
				}
				if (*p == '\0')
					break;
				seg = p + 1;
			}
		}
	}
	return found;
}

static yaml_node_t *
node_get(struct loader *L, int index)
{
	return yaml_document_get_node(L->doc, index);
}

/* One item of rabbitmq.nodes into *out; false (reported) if bad. */
static bool
parse_node_item(struct loader *L, const struct key *k, yaml_node_t *item,
    struct broker_node *out)
{
	char why[512];
	const char *s;

	if (item->type != YAML_SCALAR_NODE) {
		problem(L, &item->start_mark, "%s: expected \"host:port\", "
		    "got %s", k->name, node_kind(item));
		return false;
	}
	s = is_null(item) ? "" : (const char *)item->data.scalar.value;
	if (strlen(s) != item->data.scalar.length && !is_null(item)) {
		problem(L, &item->start_mark, "%s: must not contain a NUL "
		    "byte", k->name);
		return false;
	}
	if (config_parse_hostport(s, k->port, k->port, &out->host, &out->port,
	    why, sizeof(why)) != 0) {
		problem(L, &item->start_mark, "%s: %s", k->name, why);
		return false;
	}
	return true;
}

static bool alias_enter(struct loader *, const yaml_mark_t *,
    const yaml_node_t *);
static void alias_done(struct loader *, bool);

static void
nodes_from_list(struct loader *L, const struct key *k, yaml_node_t *list,
    bool *ok)
{
	struct broker_node tmp[BROKER_MAX_NODES];
	struct broker_conf *b = field(L->c, k->off);
	yaml_node_item_t *it = list->data.sequence.items.start;
	size_t n = (size_t)(list->data.sequence.items.top - it), got = 0;

	*ok = false;
	if (n == 0) {
		problem(L, &list->start_mark, "%s: needs at least one node",
		    k->name);
		return;
	}
	if (n > BROKER_MAX_NODES) {
		problem(L, &list->start_mark, "%s: at most %d nodes are "
		    "allowed, got %zu", k->name, BROKER_MAX_NODES, n);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		yaml_node_t *item = node_get(L, it[i]);
		/* An item written as *name: reported at the list. */
		bool alias = alias_enter(L, &list->start_mark, item);

		if (parse_node_item(L, k, item, &tmp[got]))
			got++;
		alias_done(L, alias);
	}
	if (got < n) {
		for (size_t i = 0; i < got; i++)
			free(tmp[i].host);
		return;
	}
	nodes_clear(b);
	memcpy(b->nodes, tmp, n * sizeof(tmp[0]));
	b->n_nodes = n;
	*ok = true;
}

/*
 * libyaml's document keeps no place for an alias: its value node is the
 * anchor's, written before the key (an alias cannot point forward).
 * Problems in such a value are reported at the key, naming the anchor's
 * line.  Returns whether it set that up, for alias_done().
 */
static bool
alias_enter(struct loader *L, const yaml_mark_t *at, const yaml_node_t *vn)
{
	if (L->alias_at != NULL || vn->start_mark.index >= at->index)
		return false;
	L->alias_at = at;
	L->anchor_line = (unsigned long)vn->start_mark.line + 1;
	return true;
}

static void
alias_done(struct loader *L, bool entered)
{
	if (entered)
		L->alias_at = NULL;
}

static void key_check(struct loader *, int ki, yaml_node_t *kn,
    yaml_node_t *vn);

static void
key_set(struct loader *L, int ki, yaml_node_t *kn, yaml_node_t *vn)
{
	bool alias = alias_enter(L, &kn->start_mark, vn);

	key_check(L, ki, kn, vn);
	alias_done(L, alias);
}

static void
key_check(struct loader *L, int ki, yaml_node_t *kn, yaml_node_t *vn)
{
	const struct key *k = &cfg_keys[ki];
	struct seen *sn = &L->seen[ki];
	char why[1024], wants[300];
	const char *s;
	bool ok;

	/* The same key twice in one mapping is caught by walk(); this is
	 * one written both flat and nested (log.level: and log: {level:}),
	 * where the later would silently win. */
	if (sn->present) {
		problem(L, &kn->start_mark, "duplicate key \"%s\" (first at "
		    "line %lu)", k->name,
		    (unsigned long)sn->key_mark.line + 1);
		return;
	}
	sn->present = true;
	sn->key_mark = kn->start_mark;
	sn->val_mark = L->alias_at != NULL ? *L->alias_at : vn->start_mark;
	if (vn->type == YAML_SEQUENCE_NODE && k->type == T_NODES) {
		nodes_from_list(L, k, vn, &ok);
		sn->given = ok;
		return;
	}
	if (vn->type != YAML_SCALAR_NODE) {
		problem(L, &vn->start_mark, "%s: expected %s, got %s", k->name,
		    type_wants(k, wants, sizeof(wants)), node_kind(vn));
		return;
	}
	s = (const char *)vn->data.scalar.value;
	if (strlen(s) != vn->data.scalar.length) {
		problem(L, &vn->start_mark, "%s: must not contain a NUL byte",
		    k->name);
		return;
	}
	if (is_null(vn)) {
		/* An empty secret is the same as leaving it out, so that a
		 * commented-out value under the key does not surprise. */
		if (is_secret_type(k->type))
			return;
		if (k->flags & F_OPTIONAL) {
			cfg_string_set(field(L->c, k->off), NULL, false);
			return;
		}
		problem(L, &vn->start_mark, "%s: needs a value", k->name);
		return;
	}
	if (value_set(L->c, k, s, why, sizeof(why)) != 0) {
		problem(L, &vn->start_mark, "%s: %s", k->name, why);
		sn->refused = true;
		return;
	}
	sn->given = true;
}

/*
 * More keys in one mapping than any file needs: every key spelled out
 * flat is under a hundred.  The duplicate check compares each key with
 * those before it: 20,000 short keys (180 KB) took 2.3 s, and a 1 MiB
 * file, by the square, over a minute, at a `check` and, through SIGHUP,
 * on the main loop (where the watchdog kills the daemon).
 */
#define MAPPING_KEYS_MAX 1000

static void
walk(struct loader *L, yaml_node_t *map, const char *prefix)
{
	yaml_node_pair_t *pairs = map->data.mapping.pairs.start;
	size_t n = (size_t)(map->data.mapping.pairs.top - pairs);

	if (n > MAPPING_KEYS_MAX) {
		problem(L, &map->start_mark, "a mapping of %zu keys: at most "
		    "%d are allowed", n, MAPPING_KEYS_MAX);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		yaml_node_t *kn = node_get(L, pairs[i].key);
		yaml_node_t *vn = node_get(L, pairs[i].value);
		char path[256], q[ECHO_MAX * 4 + 8], hint[256];
		const char *name;
		bool dup = false;
		int ki;

		if (kn->type != YAML_SCALAR_NODE) {
			problem(L, &kn->start_mark, "expected a key name, got "
			    "%s", node_kind(kn));
			continue;
		}
		name = (const char *)kn->data.scalar.value;
		for (size_t j = 0; j < i && !dup; j++) {
			yaml_node_t *other = node_get(L, pairs[j].key);

			if (other->type == YAML_SCALAR_NODE &&
			    strcmp((const char *)other->data.scalar.value,
			    name) == 0) {
				dup = true;
				strfmt(path, sizeof(path), "%s%s%s", prefix,
				    *prefix ? "." : "", name);
				problem(L, &kn->start_mark, "duplicate key %s "
				    "(first at line %lu)",
				    config_echo(q, sizeof(q), path),
				    (unsigned long)other->start_mark.line + 1);
			}
		}
		if (dup)
			continue;
		if ((size_t)snprintf(path, sizeof(path), "%s%s%s", prefix,
		    *prefix ? "." : "", name) >= sizeof(path) ||
		    strlen(name) != kn->data.scalar.length) {
			problem(L, &kn->start_mark, "unknown key %s",
			    config_echo(q, sizeof(q), name));
			continue;
		}
		ki = key_find(path);
		if (ki >= 0) {
			key_set(L, ki, kn, vn);
		} else if (is_section(path)) {
			bool alias = alias_enter(L, &kn->start_mark, vn);

			if (vn->type == YAML_MAPPING_NODE)
				walk(L, vn, path);
			else if (!is_null(vn))
				problem(L, &vn->start_mark, "%s: expected a "
				    "mapping, got %s", path, node_kind(vn));
			alias_done(L, alias);
		} else if (suggest(prefix, name, hint, sizeof(hint))) {
			problem(L, &kn->start_mark, "unknown key %s (did you "
			    "mean \"%s\"?)", config_echo(q, sizeof(q), path), hint);
		} else {
			problem(L, &kn->start_mark, "unknown key %s",
			    config_echo(q, sizeof(q), path));
		}
	}
}

/* Enforces at most one source per password and reads env and files. */
static void
secrets_resolve(struct loader *L)
{
	for (size_t g = 1; g < N_GROUPS; g++) {
		const struct key *given[3];
		int idx[3], n = 0;
		char why[1024];
		char *secret = NULL;

		for (size_t i = 0; i < N_KEYS; i++) {
			if (cfg_keys[i].group != (int)g || !L->seen[i].given)
				continue;
			given[n] = &cfg_keys[i];
			idx[n++] = (int)i;
		}
		if (n == 0)
			continue;
		if (n > 1) {
			/* Point at whichever came second in the file. */
			const yaml_mark_t *m = &L->seen[idx[0]].key_mark;

			for (int i = 1; i < n; i++)
				if (L->seen[idx[i]].key_mark.index > m->index)
					m = &L->seen[idx[i]].key_mark;
			problem(L, m, "%s: set only one of password, "
			    "password_env and password_file", group_section[g]);
			continue;
		}
		if (given[0]->type == T_SECRET)
			continue;	/* already stored */
		if (given[0]->type == T_SECRET_ENV) {
			const char *var = *(char **)field(L->c, given[0]->off);
			const char *val = getenv(var);

			/* Not named, for the same reason as files. */
			if (val == NULL)
				strfmt(why, sizeof(why), "the environment "
				    "variable is not set");
			else if ((secret = env_secret(val)) == NULL)
				strfmt(why, sizeof(why), "the environment "
				    "variable is empty");
		} else {
			bool absent;

			secret = secret_file_read(*(char **)field(L->c,
			    given[0]->off), why, sizeof(why), &absent);
			if (secret == NULL && absent)
				L->n_absent++;
		}
		if (secret == NULL) {
			problem(L, &L->seen[idx[0]].val_mark, "%s: %s",
			    given[0]->name, why);
			continue;
		}
		for (size_t i = 0; i < N_KEYS; i++) {
			char **dst = field(L->c, cfg_keys[i].off);

			if (cfg_keys[i].group != (int)g ||
			    cfg_keys[i].type != T_SECRET)
				continue;
			secret_free(*dst);
			*dst = secret;
		}
	}
}

/* The mark of the first key given under section, for errors that are
 * about the section as a whole; NULL if none was given. */
static const yaml_mark_t *
section_mark(struct loader *L, const char *section)
{
	const yaml_mark_t *m = NULL;
	size_t n = strlen(section);

	for (size_t i = 0; i < N_KEYS; i++) {
		if (!L->seen[i].given ||
		    strncmp(cfg_keys[i].name, section, n) != 0 ||
		    cfg_keys[i].name[n] != '.')
			continue;
		if (m == NULL || L->seen[i].key_mark.index < m->index)
			m = &L->seen[i].key_mark;
	}
	return m;
}

/* For a problem with keys of section that backoff_params_check_keys
 * named: the first of them the file gives, else the section's first key
 * (the backoff keys of rows, such as init, are no settings). */
static const yaml_mark_t *
culprit_mark(struct loader *L, const char *section, const char *keys[2])
{
	char name[64];
	int ki;

	for (int i = 0; i < 2 && keys[i] != NULL; i++) {
		snprintf(name, sizeof(name), "%s.%s", section, keys[i]);
		if ((ki = key_find(name)) >= 0 && L->seen[ki].given)
			return &L->seen[ki].key_mark;
	}
	return section_mark(L, section);
}

/* Whether a conninfo may hold a password: a password keyword or
 * parameter (sslpassword too, or a name %-encoded in a URI), or a URI's
 * user:password@ -- wherever its "@" is: a "/" or "?" in the password
 * ends the user part for libpq, which then quoted the rest of the
 * password as a query parameter in its message. */
static bool
conninfo_may_hold_password(const char *s)
{
	const char *at;

	return strstr(s, "password") != NULL || strchr(s, '%') != NULL ||
	    conninfo_uri_password(s, &at) != NULL ||
	    (conninfo_is_uri(s) && strchr(s, '@') != NULL);
}

/* Whether every entry of a port list ("5432", "5432,5433", "" for the
 * default) is a port number, as libpq will want at connect time. */
static bool
port_list_ok(const char *v)
{
	while (*v != '\0') {
		size_t n = strcspn(v, ",");
		long port = 0;
		size_t i = 0;

		while (i < n && v[i] == ' ')
			i++;
		if (i < n) {
			for (; i < n && v[i] >= '0' && v[i] <= '9'; i++)
				if ((port = port * 10 + (v[i] - '0')) > 65535)
					return false;
			while (i < n && v[i] == ' ')
				i++;
			if (i < n || port < 1)
				return false;
		}
		v += n;
		if (*v == ',')
			v++;
	}
	return true;
}

/* Quotes the port only where it cannot be a piece of a password. */
static void
port_problem(struct loader *L, const yaml_mark_t *m, const char *ci,
    const char *port)
{
	char q[ECHO_MAX * 4 + 8];

	if (conninfo_may_hold_password(ci))
		problem(L, m, "postgres.conninfo: the port must be a number "
		    "from 1 to 65535, or a list of them (the value is not "
		    "shown: it may be part of a password)");
	else
		problem(L, m, "postgres.conninfo: the port must be a number "
		    "from 1 to 65535, or a list of them; got %s",
		    config_echo(q, sizeof(q), port));
}

/*
 * libpq takes a URI's user info only before the first "/" after "//".
 * A password holding "/" (common in generated ones) therefore becomes
 * host, port and database name: the connection fails later with the
 * password's start in the message, and nothing in the text reads as a
 * password to redact.  An "@" in the path is the tell.
 */
static bool
uri_path_has_at(const char *s)
{
	const char *auth = strstr(s, "://") + 3;
	const char *slash = strchr(auth, '/'), *q = strchr(auth, '?');

	if (slash == NULL || (q != NULL && q < slash))
		return false;
	return memchr(slash, '@', q != NULL ? (size_t)(q - slash) :
	    strlen(slash)) != NULL;
}

/* PQconninfoFree, with the values libpq marks secret (dispchar "*":
 * password, sslpassword) wiped first. */
static void
conninfo_options_free(PQconninfoOption *opts)
{
	for (PQconninfoOption *o = opts; o->keyword != NULL; o++)
		if (o->dispchar[0] == '*' && o->val != NULL)
			explicit_bzero(o->val, strlen(o->val));
	PQconninfoFree(opts);
}

/*
 * With no "user@" before the "?", libpq's search for one runs on into
 * the parameters, to the first "@" before a "/": an "@" in a parameter
 * (a password, typically) makes all before it user name and password,
 * which nothing redacts, and the rest the host.
 */
static bool
uri_query_has_user_at(const char *s)
{
	const char *auth = strstr(s, "://") + 3;
	size_t n = strcspn(auth, "@/");

	return auth[n] == '@' && memchr(auth, '?', n) != NULL;
}

/*
 * Two "@" before the host's end: libpq ends the user info at the first,
 * so a password holding an "@" lends its rest to the host name, which
 * connection errors print ("could not translate host name").
 */
static bool
uri_host_has_at(const char *s)
{
	const char *auth = strstr(s, "://") + 3, *first;
	size_t n = strcspn(auth, "/?");

	first = memchr(auth, '@', n);
	return first != NULL && memchr(first + 1, '@',
	    n - (size_t)(first + 1 - auth)) != NULL;
}

/*
 * A conninfo libpq cannot read fails here, in `outboxd check`, not at
 * the first connection; and the dump's redaction can rely on libpq's
 * reading of it.  libpq's message quotes the text it stumbled on, so it
 * is shown only when that text cannot be part of a password.
 */
static void
conninfo_check(struct loader *L)
{
	const char *ci = L->c->store.conninfo;
	int ki = key_find("postgres.conninfo");
	const yaml_mark_t *m = L->seen[ki].given ? &L->seen[ki].val_mark :
	    NULL;
	PQconninfoOption *opts;
	char *err = NULL;

	if (ci == NULL)
		return;
	opts = PQconninfoParse(ci, &err);
	if (opts != NULL) {
		if (conninfo_is_uri(ci) && uri_path_has_at(ci))
			problem(L, m, "postgres.conninfo: an \"@\" after the "
			    "first \"/\" of the URI: libpq reads the user "
			    "and password only before that \"/\", so write "
			    "\"/\" in them as %%2F and \"@\" as %%40");
		else if (conninfo_is_uri(ci) && uri_host_has_at(ci))
			problem(L, m, "postgres.conninfo: two \"@\" before "
			    "the host's end: libpq ends the user and "
			    "password at the first, and takes the rest for "
			    "the host name, so write \"@\" in them as %%40");
		else if (conninfo_is_uri(ci) && uri_query_has_user_at(ci))
			problem(L, m, "postgres.conninfo: an \"@\" after the "
			    "\"?\" of a URI with no \"user@\" before the "
			    "host: libpq reads all before that \"@\" as the "
			    "user and password, so write \"@\" in the "
			    "parameters as %%40");
		else
			for (PQconninfoOption *o = opts; o->keyword != NULL;
			    o++)
				if (strcmp(o->keyword, "port") == 0 &&
				    o->val != NULL && !port_list_ok(o->val))
					port_problem(L, m, ci, o->val);
		conninfo_options_free(opts);
		return;
	}
	if (err == NULL) {
		fprintf(stderr, "outboxd: out of memory parsing a conninfo\n");
		abort();
	}
	if (conninfo_may_hold_password(ci)) {
		problem(L, m, "postgres.conninfo: libpq cannot parse it (its "
		    "message is not shown: it may quote the password); a "
		    "value with spaces or quotes goes in single quotes, "
		    "with \\' and \\\\ inside");
	} else {
		size_t n = strlen(err);

		while (n > 0 && (err[n - 1] == '\n' || err[n - 1] == ' '))
			err[--n] = '\0';
		problem(L, m, "postgres.conninfo: %s",
		    str_replace_controls(err, '?'));
	}
	/* It may quote the password. */
	explicit_bzero(err, strlen(err));
	PQfreemem(err);
}

/* Rules that span several keys. */
static void
cross_check(struct loader *L)
{
	struct broker_conf *b = &L->c->broker;
	struct backoff_params rows_backoff;
	const char *msg, *keys[2];
	int ki;

	secrets_resolve(L);
	/* Read again at each connection (secret.h); config owns them. */
	L->c->store.password_file = L->c->store_password_src.file;
	L->c->broker.password_file = L->c->broker_password_src.file;
	L->c->lock.password_file = L->c->lock_password_src.file;
	conninfo_check(L);
	/* The relay's claim leaves longer contents in the database. */
	L->c->relay.max_payload = b->max_payload;
	/* Unless the other one is there and refused (reported already). */
	if ((b->tls_cert_file == NULL) != (b->tls_key_file == NULL) &&
	    !L->seen[key_find(b->tls_cert_file != NULL ?
	    "rabbitmq.tls.key_file" : "rabbitmq.tls.cert_file")].refused) {
		bool cert = b->tls_cert_file != NULL;

		ki = key_find(cert ? "rabbitmq.tls.cert_file" :
		    "rabbitmq.tls.key_file");
		problem(L, L->seen[ki].given ? &L->seen[ki].val_mark : NULL,
		    "%s: needs rabbitmq.tls.%s too", cfg_keys[ki].name,
		    cert ? "key_file" : "cert_file");
	}
	/* The rows bring the retry backoff's first delay (init_backoff):
	 * the 10s fallback is no setting, so it is not checked against
	 * backoff.max (random with max: 5s is fine for rows that start
	 * below 5s; a row that does not gets its note and the cap). */
	rows_backoff = L->c->relay.backoff;
	rows_backoff.init_ms = rows_backoff.strategy == BACKOFF_RANDOM ? 0 : 1;
	msg = backoff_params_check_keys(&rows_backoff, keys);
	if (msg != NULL)
		problem(L, culprit_mark(L, "backoff", keys), "backoff: %s",
		    msg);
	msg = backoff_params_check_keys(&L->c->relay.reconnect, keys);
	if (msg != NULL)
		problem(L, culprit_mark(L, "reconnect", keys), "reconnect: %s",
		    msg);
	/* The cap would silently win over the first delay: surely a slip. */
	if (L->c->relay.reconnect.init_ms > L->c->relay.reconnect.max_ms) {
		char init[32], max[32];

		keys[0] = "init";
		keys[1] = "max";
		problem(L, culprit_mark(L, "reconnect", keys),
		    "reconnect: init (%s) must not be more than max (%s)",
		    config_fmt_duration(init, sizeof(init),
		    L->c->relay.reconnect.init_ms),
		    config_fmt_duration(max, sizeof(max),
		    L->c->relay.reconnect.max_ms));
	}
}

static void
syntax_problem(struct loader *L, const yaml_parser_t *parser,
    const char *yaml, size_t len)
{
	yaml_mark_t m;

	if (parser->error == YAML_MEMORY_ERROR) {
		fprintf(stderr, "outboxd: out of memory parsing YAML\n");
		abort();
	}
	if (parser->error == YAML_READER_ERROR) {
		/* Reader errors carry a byte offset, not a mark. */
		memset(&m, 0, sizeof(m));
		for (size_t i = 0; i < parser->problem_offset && i < len; i++) {
			if (yaml[i] == '\n') {
				m.line++;
				m.column = 0;
			} else {
				m.column++;
			}
		}
		problem(L, &m, "invalid input: %s", parser->problem);
		return;
	}
	if (parser->context != NULL)
		problem(L, &parser->problem_mark, "syntax error: %s (%s at "
		    "line %lu)", parser->problem, parser->context,
		    (unsigned long)parser->context_mark.line + 1);
	else
		problem(L, &parser->problem_mark, "syntax error: %s",
		    parser->problem ? parser->problem : "unknown");
}

static int
load(struct config *c, const char *name, const char *yaml, size_t len,
    FILE *errs)
{
	yaml_parser_t parser;
	yaml_document_t doc, extra;
	struct loader *L;
	yaml_node_t *root;
	int rc = -1;

	L = xcalloc(1, sizeof(*L));
	L->name = name;
	L->c = c;
	L->doc = &doc;
	config_free(c);
	config_defaults(c);
	if (!yaml_parser_initialize(&parser)) {
		fprintf(stderr, "outboxd: out of memory\n");
		abort();
	}
	yaml_parser_set_input_string(&parser,
	    (const unsigned char *)(yaml ? yaml : ""), yaml ? len : 0);
	if (!yaml_parser_load(&parser, &doc)) {
		syntax_problem(L, &parser, yaml, len);
		goto fail;
	}
	root = yaml_document_get_root_node(&doc);
	if (root == NULL || is_null(root)) {
		/* An empty file (or only comments): every default. */
	} else if (root->type != YAML_MAPPING_NODE) {
		problem(L, &root->start_mark, "expected a mapping of "
		    "sections, got %s", node_kind(root));
	} else {
		walk(L, root, "");
	}
	/* Every later document is read to the stream's end, so that none
	 * is silently ignored; an empty one (a trailing "---") is
	 * harmless. */
	for (bool more = true, told = false; more;) {
		if (!yaml_parser_load(&parser, &extra)) {
			syntax_problem(L, &parser, yaml, len);
			break;
		}
		root = yaml_document_get_root_node(&extra);
		more = root != NULL;	/* no root: the stream ended */
		if (more && !is_null(root) && !told) {
			problem(L, &extra.start_mark, "only one YAML document "
			    "is allowed");
			told = true;
		}
		cfg_document_wipe(&extra);
		yaml_document_delete(&extra);
	}
	cross_check(L);
	cfg_document_wipe(&doc);
	yaml_document_delete(&doc);
fail:
	cfg_parser_wipe(&parser);
	yaml_parser_delete(&parser);
	if (L->n_probs > 0)
		qsort(L->probs, L->n_probs, sizeof(*L->probs), problem_cmp);
	for (size_t i = 0; i < L->n_probs; i++) {
		problem_emit(name, L->probs[i].line, L->probs[i].col,
		    L->probs[i].msg, errs);
		free(L->probs[i].msg);
	}
	if (L->n_probs == 0) {
		c->path = xstrdup(name);
		rc = 0;
	} else {
		if (L->n_probs == L->n_absent)
			rc = CONFIG_SECRET_ABSENT;
		config_free(c);
	}
	free(L->probs);
	free(L);
	return rc;
}

void
config_defaults(struct config *c)
{
	char why[512];

	memset(c, 0, sizeof(*c));
	/* init_ms and factor of relay.backoff have no key: rows bring
	 * their own.  These are the fallbacks. */
	backoff_params_default(&c->relay.backoff);
	backoff_params_default(&c->relay.reconnect);
	for (size_t i = 0; i < N_KEYS; i++) {
		if (cfg_keys[i].def == NULL)
			continue;
		if (value_set(c, &cfg_keys[i], cfg_keys[i].def, why,
		    sizeof(why)) != 0) {
			/* A bad default is a bug in the table above. */
			fprintf(stderr, "outboxd: default of %s: %s\n",
			    cfg_keys[i].name, why);
			abort();
		}
	}
}

int
config_load_string(struct config *c, const char *name, const char *yaml,
    size_t len, FILE *errs)
{
	return load(c, name, yaml, len, errs);
}

/*
 * again: a reload's read, of the file a running daemon was started with.
 * A pipe (`-c /dev/stdin`, `-c <(envsubst < tmpl)`) holds nothing then:
 * read as an empty document, every default, it set relay.retention back
 * to 7 days (and the leader purged what the file kept), the backoff, the
 * batch size and the log level with it; a FIFO held the main loop in its
 * open until a writer came.  An empty file is as likely a tool's
 * truncate before its write.  So a reload takes a regular file that is
 * not empty, checked on what it reads, not on a path that may change.
 */
static int
load_file(struct config *c, const char *path, FILE *errs, bool again)
{
	char *buf = NULL;
	size_t len = 0, cap = 0;
	struct stat st;
	int fd, rc = -1;

	config_free(c);
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY |
	    (again ? O_NONBLOCK : 0));
	if (fd == -1) {
		problem_emit(path, 0, 0, strerror(errno), errs);
		return -1;
	}
	if (again && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
		problem_emit(path, 0, 0, "not a regular file (a pipe or FIFO "
		    "is read once, at the start): restart outboxd to change "
		    "the config", errs);
		goto fail;
	}
	/* Read to EOF rather than trust st_size: /dev/stdin works too. */
	for (;;) {
		char *nbuf;
		ssize_t r;

		if (len > CONFIG_MAX_BYTES) {
			problem_emit(path, 0, 0, "file is larger than 1 MiB",
			    errs);
			goto fail;
		}
		if (len == cap) {
			/* One byte past the limit tells a file of exactly
			 * 1 MiB from a larger one. */
			cap = cap ? cap * 2 : 8192;
			if (cap > CONFIG_MAX_BYTES)
				cap = CONFIG_MAX_BYTES + 1;
			/* Grow by hand so the old copy, which may hold a
			 * password, is wiped rather than left in free(). */
			nbuf = xmalloc(cap);
			if (buf != NULL) {
				memcpy(nbuf, buf, len);
				explicit_bzero(buf, len);
				free(buf);
			}
			buf = nbuf;
		}
		r = read(fd, buf + len, cap - len);
		if (r == -1 && errno == EINTR)
			continue;
		if (r == -1) {
			problem_emit(path, 0, 0, strerror(errno), errs);
			goto fail;
		}
		if (r == 0)
			break;
		len += (size_t)r;
	}
	if (again && len == 0) {
		problem_emit(path, 0, 0, "empty (which would mean every "
		    "default): write the file whole, then reload", errs);
		goto fail;
	}
	rc = load(c, path, buf, len, errs);
fail:
	if (buf != NULL) {
		explicit_bzero(buf, cap);
		free(buf);
	}
	close(fd);
	return rc;
}

int
config_load(struct config *c, const char *path, FILE *errs)
{
	return load_file(c, path, errs, false);
}

int
config_load_again(struct config *c, const char *path, FILE *errs)
{
	return load_file(c, path, errs, true);
}

void
config_free(struct config *c)
{
	if (c == NULL)
		return;
	for (size_t i = 0; i < N_KEYS; i++) {
		const struct key *k = &cfg_keys[i];
		void *f = field(c, k->off);

		switch (k->type) {
		case T_STRING:
			/* A conninfo may hold a password. */
			if (k->flags & F_CONNINFO)
				secret_free(*(char **)f);
			else
				free(*(char **)f);
			break;
		case T_SECRET_ENV:
		case T_SECRET_FILE:
		case T_LISTEN:
		case T_ADDRESS:
			free(*(char **)f);
			break;
		case T_SECRET:
			secret_free(*(char **)f);
			break;
		case T_NODES:
			nodes_clear(f);
			break;
		default:
			break;
		}
	}
	free(c->path);
	memset(c, 0, sizeof(*c));
}

const char *const *
config_keys(void)
{
	static const char *names[N_KEYS + 1];

	if (names[0] == NULL)
		for (size_t i = 0; i < N_KEYS; i++)
			names[i] = cfg_keys[i].name;
	return names;
}

/*
 * The longest a step may take by its time limits.  A batch's confirms:
 * twice rabbitmq.confirm_timeout for a batch sent in parts
 * (side_publish in relay.c), once more for a pipelined relay, whose
 * step first awaits the batch before.  The leader's compensation
 * (leader.c) sweeps and purges, each within postgres.lock_timeout and a
 * second, 5 s at the least (statement_timeout), and counts, which waits
 * postgres.lock_timeout at most for the table's lock; the claim after
 * it waits as long.  A connect to each server, every RabbitMQ node in
 * turn.  At least 10 s, so that a slow fsync is no alarm.  With
 * postgres.lock_timeout 0 a claim blocked on a table lock has no limit,
 * nor has the compensation: the stall is what catches it.
 */
int64_t
config_longest_step_ms(const struct config *c)
{
	int64_t lt = c->store.lock_timeout_ms;
	int64_t phase = lt <= 0 ? 0 : lt + 1000 > 5000 ? lt + 1000 : 5000;
	int64_t ms = c->broker.confirm_timeout_ms * (c->relay.pipeline ?
	    3 : 2) + phase * 2 + lt * 2 +
	    c->store.connect_timeout_ms + c->lock.connect_timeout_ms +
	    c->broker.connect_timeout_ms * (int64_t)c->broker.n_nodes;

	return ms > 10000 ? ms : 10000;
}

int
config_check_file(const char *path, FILE *out, FILE *err)
{
	struct config c;

	memset(&c, 0, sizeof(c));
	if (config_load(&c, path, err) != 0)
		return 1;
	config_free(&c);
	fprintf(out, "configuration OK\n");
	return 0;
}
