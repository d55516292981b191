/*
 * Unit tests for the config module (daemon/config*.c): defaults, every
 * type's good and bad values, the scalar parsers alone, the corpus of
 * broken files with their exact errors, secrets, the sample config
 * documenting every key, dump and reload.
 * Run from the repo root (or set OUTBOXD_SRCDIR to it).
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "config.h"
#include "config_value.h"
#include "secret.h"
#include "util.h"

/* A password no output may ever contain. */
#define SECRET "s3cr3t-Hunter2-do-not-print"
#define CONNINFO_AT_IN_PATH "postgres.conninfo: an \"@\" after the " \
	"first \"/\" of the URI: libpq reads the user and password only " \
	"before that \"/\", so write \"/\" in them as %2F and \"@\" as %40"
#define CONNINFO_AT_IN_QUERY "postgres.conninfo: an \"@\" after the " \
	"\"?\" of a URI with no \"user@\" before the host: libpq reads all " \
	"before that \"@\" as the user and password, so write \"@\" in the " \
	"parameters as %40"
#define CONNINFO_AT_IN_HOST "postgres.conninfo: two \"@\" before the " \
	"host's end: libpq ends the user and password at the first, and " \
	"takes the rest for the host name, so write \"@\" in them as %40"
#define CONNINFO_HIDDEN "postgres.conninfo: libpq cannot parse it (its " \
	"message is not shown: it may quote the password); a value with " \
	"spaces or quotes goes in single quotes, with \\' and \\\\ inside"

/* What one load produced: its return, errors and (if it loaded) dump. */
struct result {
	int rc;
	char *errs;
	char *dump;
	struct config c;
};

static const char *
srcdir(void)
{
	const char *d = getenv("OUTBOXD_SRCDIR");

	return d != NULL && *d != '\0' ? d : ".";
}

static char *
src_path(char *buf, size_t size, const char *rel)
{
	snprintf(buf, size, "%s/%s", srcdir(), rel);
	return buf;
}

static char *
read_file(const char *path, size_t *lenp)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long len;

	ck_assert_msg(f != NULL, "cannot open %s: %s", path, strerror(errno));
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	len = ftell(f);
	ck_assert_int_ge(len, 0);
	rewind(f);
	buf = xmalloc((size_t)len + 1);
	ck_assert_uint_eq(fread(buf, 1, (size_t)len, f), (size_t)len);
	buf[len] = '\0';
	fclose(f);
	if (lenp != NULL)
		*lenp = (size_t)len;
	return buf;
}

static void
write_file(const char *path, const char *text, mode_t mode)
{
	FILE *f = fopen(path, "w");

	ck_assert_msg(f != NULL, "cannot create %s", path);
	fputs(text, f);
	fclose(f);
	ck_assert_int_eq(chmod(path, mode), 0);
}

static char *
dump_of(const struct config *c)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);

	config_dump(c, f);
	fclose(f);
	return buf;
}

/* Loads yaml as "t.yml"; keeps the config when it loaded. */
static void
load(struct result *r, const char *yaml)
{
	size_t len = 0;
	FILE *f = open_memstream(&r->errs, &len);

	memset(&r->c, 0, sizeof(r->c));
	r->rc = config_load_string(&r->c, "t.yml", yaml, strlen(yaml), f);
	fclose(f);
	r->dump = r->rc == 0 ? dump_of(&r->c) : NULL;
}

static void
result_free(struct result *r)
{
	config_free(&r->c);
	free(r->errs);
	free(r->dump);
}

static void
assert_loads(const char *yaml, struct result *r)
{
	load(r, yaml);
	ck_assert_msg(r->rc == 0, "did not load:\n%s\nerrors:\n%s", yaml,
	    r->errs);
	ck_assert_str_eq(r->errs, "");
}

static void
assert_errors(const char *yaml, const char *want)
{
	struct result r;

	load(&r, yaml);
	ck_assert_msg(r.rc == -1, "loaded but should not:\n%s", yaml);
	ck_assert_str_eq(r.errs, want);
	result_free(&r);
}

static char *
defaults_dump(void)
{
	struct config c;
	char *d;

	config_defaults(&c);
	d = dump_of(&c);
	config_free(&c);
	return d;
}

/* ---- defaults ---- */

START_TEST(test_defaults)
{
	struct config c;

	config_defaults(&c);
	ck_assert_int_eq(c.log_level, LOG_INFO);
	ck_assert_str_eq(c.store.conninfo,
	    "host=127.0.0.1 port=5432 dbname=outbox user=outboxd");
	ck_assert_ptr_null(c.store.password);
	ck_assert_int_eq(c.store.connect_timeout_ms, 5000);
	ck_assert_int_eq(c.store.lock_timeout_ms, 5000);
	ck_assert_str_eq(c.store.application_name, "outboxd");
	ck_assert_uint_eq(c.broker.n_nodes, 1);
	ck_assert_str_eq(c.broker.nodes[0].host, "127.0.0.1");
	ck_assert_int_eq(c.broker.nodes[0].port, 5672);
	ck_assert_str_eq(c.broker.vhost, "/");
	ck_assert_str_eq(c.broker.user, "guest");
	ck_assert_str_eq(c.broker.password, "guest");
	ck_assert_int_eq(c.broker.heartbeat_s, 0);
	ck_assert_int_eq(c.broker.connect_timeout_ms, 5000);
	ck_assert_int_eq(c.broker.confirm_timeout_ms, 10000);
	ck_assert_uint_eq(c.broker.max_payload, 16u * 1024 * 1024);
	ck_assert_int_eq(c.broker.frame_max, 131072);
	ck_assert(!c.broker.tls);
	ck_assert_ptr_null(c.broker.tls_ca_file);
	ck_assert_ptr_null(c.broker.tls_cert_file);
	ck_assert_ptr_null(c.broker.tls_key_file);
	ck_assert(c.broker.tls_verify_peer);
	ck_assert(c.broker.tls_verify_hostname);
	ck_assert(c.lock.enabled);
	ck_assert_str_eq(c.lock.host, "127.0.0.1");
	ck_assert_int_eq(c.lock.port, 6379);
	ck_assert_ptr_null(c.lock.username);
	ck_assert_ptr_null(c.lock.password);
	ck_assert_int_eq(c.lock.database, 0);
	ck_assert_str_eq(c.lock.key, "outboxd:leader");
	ck_assert_int_eq(c.lock.ttl_ms, 30000);
	ck_assert_int_eq(c.lock.connect_timeout_ms, 2000);
	ck_assert_int_eq(c.relay.batch_size, 500);
	ck_assert_int_eq(c.relay.poll_interval_ms, 5000);
	ck_assert_int_eq(c.relay.shutdown_timeout_ms, 30000);
	ck_assert_int_eq(c.relay.mode, RELAY_PARALLEL);
	ck_assert(!c.relay.ordering_by_key);
	ck_assert_int_eq(c.relay.retention_ms, 7LL * 86400000);
	ck_assert_int_eq(c.relay.backoff.strategy, BACKOFF_EXPONENTIAL);
	ck_assert_int_eq(c.relay.backoff.jitter, JITTER_NONE);
	ck_assert_double_eq_tol(c.relay.backoff.jitter_factor, 0.2, 1e-12);
	ck_assert_int_eq(c.relay.backoff.max_ms, 3600000);
	ck_assert_int_eq(c.relay.backoff.init_ms, 10000);
	ck_assert_double_eq_tol(c.relay.backoff.factor, 2.0, 1e-12);
	ck_assert_int_eq(c.relay.reconnect.strategy, BACKOFF_EXPONENTIAL);
	ck_assert_int_eq(c.relay.reconnect.jitter, JITTER_EQUAL);
	ck_assert_int_eq(c.relay.reconnect.init_ms, 100);
	ck_assert_double_eq_tol(c.relay.reconnect.factor, 2.0, 1e-12);
	ck_assert_int_eq(c.relay.reconnect.max_ms, 30000);
	ck_assert_ptr_null(backoff_params_check(&c.relay.backoff));
	ck_assert_ptr_null(backoff_params_check(&c.relay.reconnect));
	ck_assert_str_eq(c.http.listen, "127.0.0.1:9187");
	ck_assert_ptr_null(c.path);
	config_free(&c);
	config_free(&c);	/* a freed config is empty, not dangling */
}
END_TEST

START_TEST(test_empty_files_are_defaults)
{
	static const char *const empties[] = {
		"", "\n", "# nothing but a comment\n", "---\n", "~\n",
		"log:\npostgres:\n", "{}\n",
	};
	char *want = defaults_dump();

	for (size_t i = 0; i < sizeof(empties) / sizeof(empties[0]); i++) {
		struct result r;

		assert_loads(empties[i], &r);
		ck_assert_str_eq(r.dump, want);
		ck_assert_str_eq(r.c.path, "t.yml");
		result_free(&r);
	}
	free(want);
}
END_TEST

START_TEST(test_full_file)
{
	static const char yaml[] =
	    "log:\n"
	    "  level: debug\n"
	    "postgres:\n"
	    "  conninfo: \"host=db1,db2 target_session_attrs=read-write\"\n"
	    "  password: '" SECRET "'\n"
	    "  connect_timeout: 3s\n"
	    "  application_name: relay-a\n"
	    "rabbitmq:\n"
	    "  nodes: [\"r1:5671\", \"[::1]:5673\", r3]\n"
	    "  vhost: prod\n"
	    "  user: outboxd\n"
	    "  heartbeat: 30s\n"
	    "  connect_timeout: 1s\n"
	    "  confirm_timeout: 2m\n"
	    "  max_payload: 64KiB\n"
	    "  frame_max: 4096\n"
	    "  tls:\n"
	    "    enabled: true\n"
	    "    ca_file: /etc/ca.pem\n"
	    "    cert_file: /etc/c.pem\n"
	    "    key_file: /etc/k.pem\n"
	    "    verify_peer: false\n"
	    "    verify_hostname: False\n"
	    "redis:\n"
	    "  enabled: false\n"
	    "  address: unix:/run/redis.sock\n"
	    "  username: relay\n"
	    "  database: 15\n"
	    "  key: \"lock:x\"\n"
	    "  ttl: 10m\n"
	    "  connect_timeout: 100ms\n"
	    "relay:\n"
	    "  batch_size: 10000\n"
	    "  poll_interval: 10ms\n"
	    "  shutdown_timeout: 0\n"
	    "  mode: single-active\n"
	    "  ordering: business_key\n"
	    "  retention: 0\n"
	    "backoff:\n"
	    "  strategy: fibonacci\n"
	    "  jitter: proportional\n"
	    "  jitter_factor: 0.5\n"
	    "  max: 30d\n"
	    "reconnect:\n"
	    "  strategy: fixed\n"
	    "  jitter: full\n"
	    "  init: 1ms\n"
	    "  factor: 100\n"
	    "  max: 1h\n"
	    "http:\n"
	    "  listen: \"\"\n";
	struct result r;
	struct config *c = &r.c;

	assert_loads(yaml, &r);
	ck_assert_int_eq(c->log_level, LOG_DEBUG);
	ck_assert_str_eq(c->store.conninfo,
	    "host=db1,db2 target_session_attrs=read-write");
	ck_assert_str_eq(c->store.password, SECRET);
	ck_assert_int_eq(c->store.connect_timeout_ms, 3000);
	ck_assert_str_eq(c->store.application_name, "relay-a");
	ck_assert_uint_eq(c->broker.n_nodes, 3);
	ck_assert_str_eq(c->broker.nodes[0].host, "r1");
	ck_assert_int_eq(c->broker.nodes[0].port, 5671);
	ck_assert_str_eq(c->broker.nodes[1].host, "::1");
	ck_assert_int_eq(c->broker.nodes[1].port, 5673);
	ck_assert_str_eq(c->broker.nodes[2].host, "r3");
	ck_assert_int_eq(c->broker.nodes[2].port, 5672);
	ck_assert_str_eq(c->broker.vhost, "prod");
	ck_assert_str_eq(c->broker.user, "outboxd");
	ck_assert_str_eq(c->broker.password, "guest");
	ck_assert_int_eq(c->broker.heartbeat_s, 30);
	ck_assert_int_eq(c->broker.connect_timeout_ms, 1000);
	ck_assert_int_eq(c->broker.confirm_timeout_ms, 120000);
	ck_assert_uint_eq(c->broker.max_payload, 65536);
	ck_assert_int_eq(c->broker.frame_max, 4096);
	ck_assert(c->broker.tls);
	ck_assert_str_eq(c->broker.tls_ca_file, "/etc/ca.pem");
	ck_assert_str_eq(c->broker.tls_cert_file, "/etc/c.pem");
	ck_assert_str_eq(c->broker.tls_key_file, "/etc/k.pem");
	ck_assert(!c->broker.tls_verify_peer);
	ck_assert(!c->broker.tls_verify_hostname);
	ck_assert(!c->lock.enabled);
	ck_assert_str_eq(c->lock.host, "unix:/run/redis.sock");
	ck_assert_int_eq(c->lock.port, 0);
	ck_assert_str_eq(c->lock.username, "relay");
	ck_assert_int_eq(c->lock.database, 15);
	ck_assert_str_eq(c->lock.key, "lock:x");
	ck_assert_int_eq(c->lock.ttl_ms, 600000);
	ck_assert_int_eq(c->lock.connect_timeout_ms, 100);
	ck_assert_int_eq(c->relay.batch_size, 10000);
	ck_assert_int_eq(c->relay.poll_interval_ms, 10);
	ck_assert_int_eq(c->relay.shutdown_timeout_ms, 0);
	ck_assert_int_eq(c->relay.mode, RELAY_SINGLE_ACTIVE);
	ck_assert(c->relay.ordering_by_key);
	ck_assert_int_eq(c->relay.retention_ms, 0);
	ck_assert_int_eq(c->relay.backoff.strategy, BACKOFF_FIBONACCI);
	ck_assert_int_eq(c->relay.backoff.jitter, JITTER_PROPORTIONAL);
	ck_assert_double_eq_tol(c->relay.backoff.jitter_factor, 0.5, 1e-12);
	ck_assert_int_eq(c->relay.backoff.max_ms, 30LL * 86400000);
	ck_assert_int_eq(c->relay.reconnect.strategy, BACKOFF_FIXED);
	ck_assert_int_eq(c->relay.reconnect.jitter, JITTER_FULL);
	ck_assert_int_eq(c->relay.reconnect.init_ms, 1);
	ck_assert_double_eq_tol(c->relay.reconnect.factor, 100, 1e-12);
	ck_assert_int_eq(c->relay.reconnect.max_ms, 3600000);
	ck_assert_str_eq(c->http.listen, "");
	ck_assert_ptr_null(strstr(r.dump, SECRET));
	result_free(&r);
}
END_TEST

/* Loading into a struct that already holds a config replaces it (main.c
 * calls config_defaults() first); valgrind checks nothing leaks. */
START_TEST(test_load_replaces)
{
	static const char a[] = "postgres: {password: " SECRET "}\n"
	    "rabbitmq: {nodes: [a, b]}\n";
	static const char b[] = "relay: {batch_size: 7}\n";
	struct config c;

	config_defaults(&c);
	ck_assert_int_eq(config_load_string(&c, "a.yml", a, strlen(a), stderr),
	    0);
	ck_assert_uint_eq(c.broker.n_nodes, 2);
	ck_assert_int_eq(config_load_string(&c, "b.yml", b, strlen(b), stderr),
	    0);
	ck_assert_ptr_null(c.store.password);
	ck_assert_uint_eq(c.broker.n_nodes, 1);
	ck_assert_int_eq(c.relay.batch_size, 7);
	ck_assert_str_eq(c.path, "b.yml");
	config_free(&c);
}
END_TEST

/* ---- every type, good and bad, one key at a time ---- */

/* Long values, for the length limits. */
#define L50 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
#define L100 L50 L50

/*
 * want is the key's dump line when the value loads, or, after '!', the
 * exact error message (after "t.yml:L:C: ") when it does not.
 */
static const struct value_case {
	const char *key;
	const char *value;
	const char *want;
} value_cases[] = {
	/* enum */
	{ "log.level", "debug", "log.level: debug" },
	{ "log.level", "error", "log.level: error" },
	{ "log.level", "warn", "log.level: warn" },
	{ "log.level", "INFO", "!log.level: expected one of debug, info, "
	    "warn or error, got \"INFO\"" },
	{ "relay.mode", "single-active", "relay.mode: single-active" },
	{ "relay.ordering", "business_key", "relay.ordering: business_key" },
	{ "relay.ordering", "true", "!relay.ordering: expected one of none "
	    "or business_key, got \"true\"" },
	{ "backoff.strategy", "ethernet", "backoff.strategy: ethernet" },
	{ "backoff.jitter", "decorrelated", "backoff.jitter: decorrelated" },
	{ "reconnect.strategy", "random", "!reconnect: jitter applies only "
	    "to the exponential, fixed and fibonacci strategies (random and "
	    "ethernet are random already)" },
	/* string */
	{ "postgres.application_name", "\"\"",
	    "postgres.application_name: \"\"" },
	{ "postgres.application_name", "'a \"b\"'",
	    "postgres.application_name: \"a \\\"b\\\"\"" },
	{ "postgres.application_name", "12", "postgres.application_name: "
	    "\"12\"" },
	{ "postgres.application_name", "\"a\\0b\"", "!postgres."
	    "application_name: must not contain a NUL byte" },
	{ "rabbitmq.vhost", "\"\"", "!rabbitmq.vhost: must not be empty" },
	{ "redis.key", "\"\"", "!redis.key: must not be empty" },
	{ "redis.username", "~", "redis.username: <unset>" },
	{ "redis.username", "\"\"", "!redis.username: must not be empty" },
	{ "rabbitmq.tls.ca_file", "/ca.pem", "rabbitmq.tls.ca_file: "
	    "\"/ca.pem\"" },
	{ "postgres.conninfo", "[a]", "!postgres.conninfo: expected a "
	    "string, got a list" },
	/* What libpq cannot parse fails at load, with libpq's message
	 * unless the text may hold a password. */
	{ "postgres.conninfo", "hots=x", "!postgres.conninfo: invalid "
	    "connection option \"hots\"" },
	{ "postgres.conninfo", "\"ho\\x01st=h\"", "!postgres.conninfo: "
	    "invalid connection option \"ho?st\"" },
	{ "postgres.conninfo", "\"host=h password='" SECRET "'junk\"",
	    "!" CONNINFO_HIDDEN },
	{ "postgres.conninfo", "\"postgresql://u:" SECRET "@h?junk\"",
	    "!" CONNINFO_HIDDEN },
	/* A "/" or "?" in the password: libpq quoted its rest. */
	{ "postgres.conninfo", "\"postgresql://u:Xy7/Qz?" SECRET "@h/db\"",
	    "!" CONNINFO_HIDDEN },
	{ "postgres.conninfo", "\"postgresql://u:Xy7?Qz/" SECRET "@h/db\"",
	    "!" CONNINFO_HIDDEN },
	/* A "/" in a URI's password ends libpq's user info: the password
	 * would read as host, port and database, unredacted. */
	{ "postgres.conninfo", "\"postgresql://app:Xy7/" SECRET "@db:5432/x\"",
	    "!" CONNINFO_AT_IN_PATH },
	{ "postgres.conninfo", "\"postgresql://app:123/" SECRET "@db/x\"",
	    "!" CONNINFO_AT_IN_PATH },
	{ "postgres.conninfo", "\"postgresql://a&password=q/&u:pw@c\"",
	    "!" CONNINFO_AT_IN_PATH },
	{ "postgres.conninfo", "\"postgresql://db/x%40y?user=a@b\"",
	    "postgres.conninfo: \"postgresql://db/x%40y?user=a@b\"" },
	/* With no "user@", libpq's search for one runs past the "?" to an
	 * "@" in a parameter: the text before it became user and password,
	 * nothing to redact, and `outboxd config` printed it whole. */
	{ "postgres.conninfo", "\"postgresql://db.example?sslmode=require&"
	    "password=" SECRET "@dor\"", "!" CONNINFO_AT_IN_QUERY },
	{ "postgres.conninfo", "\"postgresql://h?password=a:" SECRET
	    "@c/d\"", "!" CONNINFO_AT_IN_QUERY },
	/* An "@" in the password: libpq takes the rest for the host name,
	 * which connection errors print. */
	{ "postgres.conninfo", "\"postgresql://u:" SECRET "@" SECRET "@h/x\"",
	    "!" CONNINFO_AT_IN_HOST },
	{ "postgres.conninfo", "\"postgresql://u:" SECRET "@" SECRET
	    "@h?sslmode=require\"", "!" CONNINFO_AT_IN_HOST },
	/* A "/" first ends that search; so does a "user@". */
	{ "postgres.conninfo", "\"postgresql://h?password=" SECRET "/x@y\"",
	    "postgres.conninfo: \"postgresql://h/?password=<set>\"" },
	{ "postgres.conninfo", "\"postgresql://u@h?application_name=a@b\"",
	    "postgres.conninfo: \"postgresql://u@h/?application_name=a@b\"" },
	/* A port libpq would refuse at connect time fails at load. */
	{ "postgres.conninfo", "\"host=db port=abc\"", "!postgres.conninfo: "
	    "the port must be a number from 1 to 65535, or a list of them; "
	    "got \"abc\"" },
	{ "postgres.conninfo", "\"host=db port=70000 password=" SECRET "\"",
	    "!postgres.conninfo: the port must be a number from 1 to 65535, "
	    "or a list of them (the value is not shown: it may be part of a "
	    "password)" },
	{ "postgres.conninfo", "\"host=a,b,c port=5432,,5433\"",
	    "postgres.conninfo: \"host=a,b,c port=5432,,5433\"" },
	/* int */
	{ "relay.workers", "16", "relay.workers: 16" },
	{ "relay.workers", "0", "!relay.workers: must be between 1 and 16, "
	    "got 0" },
	{ "relay.workers", "17", "!relay.workers: must be between 1 and 16, "
	    "got 17" },
	{ "relay.batch_size", "1", "relay.batch_size: 1" },
	{ "relay.batch_size", "+10000", "relay.batch_size: 10000" },
	{ "relay.batch_size", "\"42\"", "relay.batch_size: 42" },
	{ "relay.batch_size", "0", "!relay.batch_size: must be between 1 and "
	    "10000, got 0" },
	{ "relay.batch_size", "-1", "!relay.batch_size: must be between 1 "
	    "and 10000, got -1" },
	{ "relay.batch_size", "99999999999999999999", "!relay.batch_size: "
	    "must be between 1 and 10000, got 99999999999999999999" },
	{ "relay.batch_size", "0x10", "!relay.batch_size: expected an "
	    "integer, got \"0x10\"" },
	{ "relay.batch_size", "1 000", "!relay.batch_size: expected an "
	    "integer, got \"1 000\"" },
	{ "relay.batch_size", "null", "!relay.batch_size: needs a value" },
	{ "redis.database", "15", "redis.database: 15" },
	{ "redis.database", "-0", "redis.database: 0" },
	{ "rabbitmq.frame_max", "2147483647",
	    "rabbitmq.frame_max: 2147483647" },
	{ "rabbitmq.frame_max", "2147483648", "!rabbitmq.frame_max: must be "
	    "between 4096 and 2147483647, got 2147483648" },
	/* bool */
	{ "redis.enabled", "false", "redis.enabled: false" },
	{ "redis.enabled", "TRUE", "redis.enabled: true" },
	{ "redis.enabled", "no", "!redis.enabled: expected true or false, "
	    "got \"no\"" },
	{ "redis.enabled", "{}", "!redis.enabled: expected true or false, "
	    "got a mapping" },
	{ "relay.pipeline", "true", "relay.pipeline: true" },
	{ "relay.pipeline", "1", "!relay.pipeline: expected true or false, "
	    "got \"1\"" },
	/* duration */
	{ "relay.poll_interval", "250ms", "relay.poll_interval: 250ms" },
	{ "relay.poll_interval", "1h", "relay.poll_interval: 1h" },
	{ "relay.poll_interval", "60m", "relay.poll_interval: 1h" },
	{ "relay.poll_interval", "10", "!relay.poll_interval: \"10\" needs a "
	    "unit such as 10s" },
	{ "relay.poll_interval", "0", "!relay.poll_interval: must be between "
	    "10ms and 1h, got 0" },
	{ "relay.poll_interval", "1.5s", "!relay.poll_interval: expected a "
	    "duration such as 250ms, 10s, 5m, 1h or 2d, got \"1.5s\"" },
	{ "relay.poll_interval", "10sec", "!relay.poll_interval: expected a "
	    "duration such as 250ms, 10s, 5m, 1h or 2d, got \"10sec\"" },
	{ "relay.poll_interval", "s", "!relay.poll_interval: expected a "
	    "duration such as 250ms, 10s, 5m, 1h or 2d, got \"s\"" },
	{ "relay.shutdown_timeout", "0", "relay.shutdown_timeout: 0" },
	{ "postgres.lock_timeout", "0", "postgres.lock_timeout: 0" },
	{ "postgres.lock_timeout", "5m", "postgres.lock_timeout: 5m" },
	{ "postgres.lock_timeout", "6m", "!postgres.lock_timeout: must be "
	    "between 0 and 5m, got 6m" },
	{ "relay.shutdown_timeout", "000", "relay.shutdown_timeout: 0" },
	{ "relay.shutdown_timeout", "0s", "relay.shutdown_timeout: 0" },
	{ "relay.retention", "3650d", "relay.retention: 3650d" },
	{ "relay.retention", "0", "relay.retention: 0" },
	{ "relay.retention", "99999999999d", "!relay.retention: must be "
	    "between 0 and 3650d, got 99999999999d" },
	{ "rabbitmq.heartbeat", "60s", "rabbitmq.heartbeat: 1m" },
	{ "rabbitmq.heartbeat", "10m", "rabbitmq.heartbeat: 10m" },
	{ "rabbitmq.heartbeat", "2500ms", "!rabbitmq.heartbeat: must be "
	    "whole seconds, got 2500ms" },
	{ "backoff.max", "1ms", "backoff.max: 1ms" },
	{ "backoff.max", "0", "!backoff.max: must be between 1ms and 30d, "
	    "got 0" },
	{ "reconnect.init", "1m", "!reconnect: init (1m) must not be more "
	    "than max (30s)" },
	{ "reconnect.init", "30s", "reconnect.init: 30s" },
	/* size */
	{ "rabbitmq.max_payload", "1024", "rabbitmq.max_payload: 1KiB" },
	{ "rabbitmq.max_payload", "1025", "rabbitmq.max_payload: 1025" },
	{ "rabbitmq.max_payload", "2048B", "rabbitmq.max_payload: 2KiB" },
	{ "rabbitmq.max_payload", "64KiB", "rabbitmq.max_payload: 64KiB" },
	{ "rabbitmq.max_payload", "512MiB", "rabbitmq.max_payload: 512MiB" },
	{ "rabbitmq.max_payload", "10kB", "rabbitmq.max_payload: 10000" },
	{ "rabbitmq.max_payload", "2MB", "rabbitmq.max_payload: 2000000" },
	{ "rabbitmq.max_payload", "513MiB", "!rabbitmq.max_payload: must be "
	    "between 1KiB and 512MiB, got 513MiB" },
	{ "rabbitmq.max_payload", "1GB", "!rabbitmq.max_payload: must be "
	    "between 1KiB and 512MiB, got 1GB" },
	{ "rabbitmq.max_payload", "1023", "!rabbitmq.max_payload: must be "
	    "between 1KiB and 512MiB, got 1023" },
	{ "rabbitmq.max_payload", "99999999999GiB", "!rabbitmq.max_payload: "
	    "must be between 1KiB and 512MiB, got 99999999999GiB" },
	{ "rabbitmq.max_payload", "16mb", "!rabbitmq.max_payload: expected "
	    "a size such as 512, 64KiB, 16MiB or 1GiB, got \"16mb\"" },
	{ "rabbitmq.max_payload", "-1KiB", "!rabbitmq.max_payload: expected "
	    "a size such as 512, 64KiB, 16MiB or 1GiB, got \"-1KiB\"" },
	/* float */
	{ "backoff.jitter_factor", "0", "backoff.jitter_factor: 0" },
	{ "backoff.jitter_factor", "1", "backoff.jitter_factor: 1" },
	{ "backoff.jitter_factor", ".25", "backoff.jitter_factor: 0.25" },
	{ "backoff.jitter_factor", "5e-1", "backoff.jitter_factor: 0.5" },
	{ "backoff.jitter_factor", "-0.1", "!backoff.jitter_factor: must be "
	    "between 0 and 1, got -0.1" },
	{ "backoff.jitter_factor", "nan", "!backoff.jitter_factor: expected "
	    "a number, got \"nan\"" },
	{ "backoff.jitter_factor", ".inf", "!backoff.jitter_factor: expected "
	    "a number, got \".inf\"" },
	{ "backoff.jitter_factor", "0x1p-1", "!backoff.jitter_factor: "
	    "expected a number, got \"0x1p-1\"" },
	{ "reconnect.factor", "1.5", "reconnect.factor: 1.5" },
	/* Every digit that counts: %g once showed this as 1. */
	{ "reconnect.factor", "1.0000001", "reconnect.factor: 1.0000001" },
	{ "backoff.jitter_factor", "0.1234567",
	    "backoff.jitter_factor: 0.1234567" },
	{ "reconnect.factor", "101", "!reconnect.factor: must be between 1 "
	    "and 100, got 101" },
	/* list of host:port */
	{ "rabbitmq.nodes", "rabbit", "rabbitmq.nodes: [\"rabbit:5672\"]" },
	{ "rabbitmq.nodes", "[\"[fe80::1%eth0]:1\", \"a.b-c_d:65535\"]",
	    "rabbitmq.nodes: [\"[fe80::1%eth0]:1\", \"a.b-c_d:65535\"]" },
	{ "rabbitmq.nodes", "[a, b, c, d, e, f, g, h]", "rabbitmq.nodes: "
	    "[\"a:5672\", \"b:5672\", \"c:5672\", \"d:5672\", \"e:5672\", "
	    "\"f:5672\", \"g:5672\", \"h:5672\"]" },
	{ "rabbitmq.nodes", "{a: 1}", "!rabbitmq.nodes: expected a list of "
	    "\"host:port\", got a mapping" },
	{ "rabbitmq.nodes", "\"r:-1\"", "!rabbitmq.nodes: port must be a "
	    "number from 1 to 65535, got \"r:-1\"" },
	{ "rabbitmq.nodes", "\"r:\"", "!rabbitmq.nodes: port must be a "
	    "number from 1 to 65535, got \"r:\"" },
	{ "rabbitmq.nodes", "\"r:+5\"", "!rabbitmq.nodes: port must be a "
	    "number from 1 to 65535, got \"r:+5\"" },
	{ "rabbitmq.nodes", "\"[::1]x\"", "!rabbitmq.nodes: port must be a "
	    "number from 1 to 65535, got \"[::1]x\"" },
	{ "rabbitmq.nodes", "\"u:" SECRET "@h\"", "!rabbitmq.nodes: must be "
	    "\"host:port\", without a user name or password" },
	/* address */
	{ "redis.address", "redis", "redis.address: \"redis:6379\"" },
	{ "redis.address", "\"[::1]:7000\"", "redis.address: "
	    "\"[::1]:7000\"" },
	{ "redis.address", "unix:/tmp/r.sock", "redis.address: "
	    "\"unix:/tmp/r.sock\"" },
	{ "redis.address", "\"unix:\"", "!redis.address: a unix socket path "
	    "must be absolute, got \"unix:\"" },
	{ "redis.address", "\"\"", "!redis.address: expected \"host:port\", "
	    "got \"\"" },
	/* sun_path holds 107 bytes and a NUL: hiredis cut longer ones. */
	{ "redis.address", "unix:/" L100 "xxxxxx", "redis.address: \"unix:/"
	    L100 "xxxxxx\"" },
	{ "redis.address", "unix:/" L100 "xxxxxxx", "!redis.address: a unix "
	    "socket path must be shorter than 108 bytes, got 108" },
	/* An AMQP shortstr: longer, every connect failed. */
	{ "rabbitmq.vhost", L100 L100 "x" L50 "xxxx", "rabbitmq.vhost: \""
	    L100 L100 "x" L50 "xxxx\"" },
	{ "rabbitmq.vhost", L100 L100 "xx" L50 "xxxx", "!rabbitmq.vhost: is "
	    "256 bytes long, at most 255 allowed" },
	/* listen */
	{ "http.listen", "\"0.0.0.0:80\"", "http.listen: \"0.0.0.0:80\"" },
	{ "http.listen", "\"[::]:9187\"", "http.listen: \"[::]:9187\"" },
	{ "http.listen", "\"\"", "http.listen: \"\"" },
	{ "http.listen", "~", "!http.listen: needs a value" },
	{ "http.listen", "\"[::]\"", "!http.listen: needs a port, as in "
	    "\"127.0.0.1:9187\", got \"[::]\"" },
	/* secret */
	{ "postgres.password", "'" SECRET "'", "postgres.password: <set>" },
	{ "postgres.password", "~", "postgres.password: <unset>" },
	{ "postgres.password", "[" SECRET "]", "!postgres.password: expected "
	    "a string, got a list" },
	{ "rabbitmq.password", "~", "rabbitmq.password: <set>" },
	{ "redis.password_env", "\"" SECRET "\"", "!redis.password_env: "
	    "expected the name of an environment variable" },
	{ "redis.password_file", "{a: b}", "!redis.password_file: expected a "
	    "string, got a mapping" },
};

/* Nests key under its sections: "a.b.c" → "a:\n  b:\n    c: value\n".
 * Returns the line and column where the value starts. */
static void
nest(char *buf, size_t size, const char *key, const char *value,
    int *line, int *col)
{
	char name[128];
	int depth = 0;
	size_t n = 0;
	char *seg, *save = NULL, *next;

	snprintf(name, sizeof(name), "%s", key);
	for (seg = strtok_r(name, ".", &save); seg != NULL; seg = next) {
		next = strtok_r(NULL, ".", &save);
		n += (size_t)snprintf(buf + n, size - n, "%*s%s:", depth * 2,
		    "", seg);
		if (next == NULL) {
			*col = depth * 2 + (int)strlen(seg) + 3;
			n += (size_t)snprintf(buf + n, size - n, " %s\n",
			    value);
		} else {
			n += (size_t)snprintf(buf + n, size - n, "\n");
		}
		depth++;
	}
	*line = depth;
}

START_TEST(test_values)
{
	const struct value_case *vc = &value_cases[_i];
	char yaml[512], want[512];
	struct result r;
	int line = 0, col = 0;

	nest(yaml, sizeof(yaml), vc->key, vc->value, &line, &col);
	load(&r, yaml);
	if (vc->want[0] == '!') {
		/* Cross-key rules point at the section's first key. */
		if (strncmp(vc->want + 1, vc->key, strlen(vc->key)) != 0)
			col = 2 * (line - 1) + 1;
		snprintf(want, sizeof(want), "t.yml:%d:%d: %s\n", line, col,
		    vc->want + 1);
		ck_assert_msg(r.rc == -1, "%s: %s loaded", vc->key, vc->value);
		ck_assert_str_eq(r.errs, want);
	} else {
		char *hit;

		ck_assert_msg(r.rc == 0, "%s: %s: %s", vc->key, vc->value,
		    r.errs);
		snprintf(want, sizeof(want), "\n%s\n", vc->want);
		hit = strstr(r.dump, want);
		ck_assert_msg(hit != NULL || strncmp(r.dump, want + 1,
		    strlen(want + 1)) == 0, "%s: %s: want \"%s\" in\n%s",
		    vc->key, vc->value, vc->want, r.dump);
	}
	ck_assert_ptr_null(strstr(r.errs, SECRET));
	if (r.dump != NULL)
		ck_assert_ptr_null(strstr(r.dump, SECRET));
	result_free(&r);
}
END_TEST

/* Every name the backoff module knows loads to the same value. */
START_TEST(test_backoff_names_agree)
{
	for (int i = BACKOFF_EXPONENTIAL; i <= BACKOFF_ETHERNET; i++) {
		const char *name = backoff_strategy_name(
		    (enum backoff_strategy)i);
		enum backoff_strategy s;
		char yaml[128];
		struct result r;

		ck_assert_int_eq(backoff_strategy_parse(name, &s), 0);
		snprintf(yaml, sizeof(yaml), "reconnect:\n  strategy: %s\n"
		    "  jitter: none\n", name);
		assert_loads(yaml, &r);
		ck_assert_int_eq(r.c.relay.reconnect.strategy, s);
		result_free(&r);
	}
	for (int i = JITTER_NONE; i <= JITTER_DECORRELATED; i++) {
		const char *name = backoff_jitter_name((enum backoff_jitter)i);
		enum backoff_jitter j;
		char yaml[128];
		struct result r;

		ck_assert_int_eq(backoff_jitter_parse(name, &j), 0);
		snprintf(yaml, sizeof(yaml), "backoff:\n  jitter: %s\n", name);
		assert_loads(yaml, &r);
		ck_assert_int_eq(r.c.relay.backoff.jitter, j);
		result_free(&r);
	}
}
END_TEST

/* The retry backoff's first delay is each row's init_backoff, not the
 * 10s fallback: random with a cap under 10s is a valid setting.  The
 * reconnect backoff's init is a key, and is checked. */
START_TEST(test_random_backoff_cap)
{
	struct result r;

	assert_loads("backoff:\n  strategy: random\n  max: 5s\n", &r);
	ck_assert_int_eq(r.c.relay.backoff.strategy, BACKOFF_RANDOM);
	ck_assert_int_eq(r.c.relay.backoff.max_ms, 5000);
	result_free(&r);
	assert_errors("reconnect:\n  strategy: random\n  init: 10s\n"
	    "  max: 10s\n", "t.yml:3:3: reconnect: random needs the minimum "
	    "(initial delay) below the maximum\n");
}
END_TEST

/* An error about two settings points at the one the file gives (the
 * first named when it gives both), not at the section's first key. */
START_TEST(test_combination_errors_point_at_a_culprit)
{
	assert_errors("reconnect:\n  max: 1s\n  init: 5s\n",
	    "t.yml:3:3: reconnect: init (5s) must not be more than max "
	    "(1s)\n");
	assert_errors("reconnect:\n  init: 1s\n  factor: 3\n  max: 500ms\n",
	    "t.yml:2:3: reconnect: init (1s) must not be more than max "
	    "(500ms)\n");
	/* The default jitter (equal) meets the strategy written. */
	assert_errors("reconnect:\n  max: 5s\n  strategy: ethernet\n",
	    "t.yml:3:3: reconnect: jitter applies only to the exponential, "
	    "fixed and fibonacci strategies (random and ethernet are random "
	    "already)\n");
	assert_errors("backoff:\n  max: 5s\n  strategy: fixed\n"
	    "  jitter: decorrelated\n", "t.yml:4:3: backoff: decorrelated "
	    "jitter replaces the schedule: use it with the exponential "
	    "strategy\n");
}
END_TEST

/* A file of exactly the 1 MiB limit loads; one byte more does not. */
START_TEST(test_file_size_limit)
{
	char path[] = "/tmp/outboxd-check-config-XXXXXX";
	char *got = NULL;
	size_t len = 0, n = 1024 * 1024;
	char *buf = malloc(n + 1);
	struct config c;
	FILE *f;
	int fd;

	ck_assert_ptr_nonnull(buf);
	/* A comment line padded to the limit: every default. */
	memset(buf, ' ', n + 1);
	buf[0] = '#';
	buf[n - 1] = '\n';
	fd = mkstemp(path);
	ck_assert_int_ne(fd, -1);
	ck_assert_int_eq(write(fd, buf, n), (ssize_t)n);
	config_defaults(&c);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_load(&c, path, f), 0);
	fclose(f);
	ck_assert_str_eq(got, "");
	free(got);
	ck_assert_int_eq(write(fd, "\n", 1), 1);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_load(&c, path, f), -1);
	fclose(f);
	ck_assert_ptr_nonnull(strstr(got, "file is larger than 1 MiB"));
	free(got);
	config_free(&c);
	close(fd);
	unlink(path);
	free(buf);
}
END_TEST

START_TEST(test_nodes_limit)
{
	struct result r;

	assert_loads("rabbitmq:\n  nodes:\n    - a:1\n    - b\n"
	    "    - \"[2001:db8::5]:5671\"\n", &r);
	ck_assert_uint_eq(r.c.broker.n_nodes, 3);
	ck_assert_str_eq(r.c.broker.nodes[1].host, "b");
	ck_assert_int_eq(r.c.broker.nodes[1].port, 5672);
	ck_assert_str_eq(r.c.broker.nodes[2].host, "2001:db8::5");
	ck_assert_int_eq(r.c.broker.nodes[2].port, 5671);
	result_free(&r);
	assert_errors("rabbitmq:\n  nodes: [a, b, c, d, e, f, g, h, i]\n",
	    "t.yml:2:10: rabbitmq.nodes: at most 8 nodes are allowed, "
	    "got 9\n");
	/* Every bad node is reported, not just the first. */
	assert_errors("rabbitmq:\n  nodes: [\"a:0\", ok, \"::1\"]\n",
	    "t.yml:2:11: rabbitmq.nodes: port must be a number from 1 to "
	    "65535, got \"a:0\"\n"
	    "t.yml:2:22: rabbitmq.nodes: IPv6 addresses need brackets, as in "
	    "\"[::1]:5672\", got \"::1\"\n");
	/* An item that is not a scalar is reported where it is. */
	assert_errors("rabbitmq:\n  nodes: [a, [b]]\n",
	    "t.yml:2:14: rabbitmq.nodes: expected \"host:port\", got a "
	    "list\n");
}
END_TEST

/* A mapping of more keys than any file needs is refused whole: its
 * duplicate check is quadratic (minutes for a 1 MiB file of short
 * keys). */
START_TEST(test_mapping_keys_limit)
{
	char *yaml = xmalloc(1001 * 16 + 16);
	size_t len = 0;
	struct result r;

	len += (size_t)sprintf(yaml + len, "relay: {");
	for (int i = 0; i < 1001; i++)
		len += (size_t)sprintf(yaml + len, "%sk%d: 1", i ? ", " : "",
		    i);
	sprintf(yaml + len, "}\n");
	load(&r, yaml);
	ck_assert_int_ne(r.rc, 0);
	ck_assert_str_eq(r.errs, "t.yml:1:8: a mapping of 1001 keys: at most "
	    "1000 are allowed\n");
	result_free(&r);
	free(yaml);
}
END_TEST

START_TEST(test_value_echo_is_escaped_and_cut)
{
	assert_errors("log:\n  level: \"a\\tb\\e\\\"\"\n",
	    "t.yml:2:10: log.level: expected one of debug, info, warn or "
	    "error, got \"a\\x09b\\x1b\\\"\"\n");
	/* C1 controls too (UTF-8 C2 80..C2 9F): CSI starts a terminal's
	 * escape sequences as ESC [ does; "\xc3\xa9" is not one. */
	assert_errors("log:\n  level: \"a\\x85b\\x9b\\xe9\"\n",
	    "t.yml:2:10: log.level: expected one of debug, info, warn or "
	    "error, got \"a\\x85b\\x9b\xc3\xa9\"\n");
#define A10 "aaaaaaaaaa"
	/* 70 bytes in, the first 60 and "..." out. */
	assert_errors("log:\n  level: " A10 A10 A10 A10 A10 A10 A10 "\n",
	    "t.yml:2:10: log.level: expected one of debug, info, warn or "
	    "error, got \"" A10 A10 A10 A10 A10 A10 "...\"\n");
#undef A10
}
END_TEST

/* With no stream, errors go to the log (the daemon on SIGHUP). */
START_TEST(test_errors_logged_without_stream)
{
	static const char yaml[] = "relay:\n  batch_size: 0\n";
	struct config c;

	memset(&c, 0, sizeof(c));
	ck_assert_int_eq(config_load_string(&c, "t.yml", yaml, strlen(yaml),
	    NULL), -1);
	config_free(&c);
}
END_TEST

START_TEST(test_invalid_utf8)
{
	assert_errors("log:\n  level: \xff\xfe\n",
	    "t.yml:2:10: invalid input: invalid leading UTF-8 octet\n");
}
END_TEST

/* ---- the corpus of broken files ---- */

static int
name_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

START_TEST(test_corpus)
{
	char dir[4096], path[4200];
	char *names[256];
	size_t n = 0;
	struct dirent *de;
	DIR *d;

	/* The corpus's variable must really be unset. */
	unsetenv("OUTBOXD_TEST_SURELY_UNSET");
	src_path(dir, sizeof(dir), "tests/unit/config-corpus");
	d = opendir(dir);
	ck_assert_msg(d != NULL, "cannot open %s (run from the repo root or "
	    "set OUTBOXD_SRCDIR)", dir);
	while ((de = readdir(d)) != NULL && n < 256) {
		size_t len = strlen(de->d_name);

		if (len > 4 && strcmp(de->d_name + len - 4, ".yml") == 0)
			names[n++] = strdup(de->d_name);
	}
	closedir(d);
	qsort(names, n, sizeof(names[0]), name_cmp);
	ck_assert_uint_ge(n, 20);
	for (size_t i = 0; i < n; i++) {
		char *yaml, *want, *got = NULL;
		size_t len, glen = 0;
		struct config c;
		FILE *f;
		int rc;

		snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
		yaml = read_file(path, &len);
		snprintf(path + strlen(path) - 4, 5, ".err");
		want = read_file(path, NULL);
		memset(&c, 0, sizeof(c));
		f = open_memstream(&got, &glen);
		/* Named by the base name so the .err files do not depend on
		 * where the tree is. */
		rc = config_load_string(&c, names[i], yaml, len, f);
		fclose(f);
		ck_assert_msg(rc == -1, "%s loaded", names[i]);
		ck_assert_msg(strcmp(got, want) == 0,
		    "%s: errors differ\n--- want\n%s--- got\n%s", names[i],
		    want, got);
		ck_assert_ptr_null(strstr(got, "do-not-print"));
		config_free(&c);
		free(yaml);
		free(want);
		free(got);
		free(names[i]);
	}
}
END_TEST

/* ---- secrets ---- */

static char tmpdir[64];

static void
tmpdir_setup(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/check_config.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void
tmpdir_teardown(void)
{
	DIR *d = opendir(tmpdir);
	struct dirent *de;
	char path[512];

	ck_assert_ptr_nonnull(d);
	while ((de = readdir(d)) != NULL) {
		if (strcmp(de->d_name, ".") == 0 ||
		    strcmp(de->d_name, "..") == 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", tmpdir, de->d_name);
		ck_assert_int_eq(unlink(path), 0);
	}
	closedir(d);
	ck_assert_int_eq(rmdir(tmpdir), 0);
}

START_TEST(test_secret_from_env)
{
	struct result r;

	setenv("OUTBOXD_TEST_PG", SECRET, 1);
	setenv("OUTBOXD_TEST_EMPTY", "", 1);
	unsetenv("OUTBOXD_TEST_UNSET");
	assert_loads("postgres:\n  password_env: OUTBOXD_TEST_PG\n"
	    "rabbitmq:\n  password_env: OUTBOXD_TEST_PG\n", &r);
	ck_assert_str_eq(r.c.store.password, SECRET);
	ck_assert_str_eq(r.c.broker.password, SECRET);
	ck_assert_str_eq(r.c.store_password_src.env, "OUTBOXD_TEST_PG");
	ck_assert_ptr_null(strstr(r.dump, SECRET));
	ck_assert_ptr_nonnull(strstr(r.dump, "\npostgres.password: <set>\n"));
	ck_assert_ptr_nonnull(strstr(r.dump,
	    "\npostgres.password_env: <set>\n"));
	ck_assert_ptr_nonnull(strstr(r.dump,
	    "\npostgres.password_file: <unset>\n"));
	result_free(&r);
	assert_errors("redis:\n  password_env: OUTBOXD_TEST_UNSET\n",
	    "t.yml:2:17: redis.password_env: the environment variable is not "
	    "set\n");
	assert_errors("redis:\n  password_env: OUTBOXD_TEST_EMPTY\n",
	    "t.yml:2:17: redis.password_env: the environment variable is "
	    "empty\n");
	unsetenv("OUTBOXD_TEST_PG");
	unsetenv("OUTBOXD_TEST_EMPTY");
}
END_TEST

/* A variable filled from a file keeps its newline (an env_file, a
 * Kubernetes secret --from-file): one line end goes, as for a
 * password_file; the password went to the server with it before. */
START_TEST(test_secret_from_env_drops_one_line_end)
{
	struct result r;

	setenv("OUTBOXD_TEST_LF", SECRET "\n", 1);
	setenv("OUTBOXD_TEST_CRLF", SECRET "\r\n", 1);
	setenv("OUTBOXD_TEST_TWO", SECRET "\n\n", 1);
	assert_loads("postgres:\n  password_env: OUTBOXD_TEST_LF\n"
	    "rabbitmq:\n  password_env: OUTBOXD_TEST_CRLF\n"
	    "redis:\n  password_env: OUTBOXD_TEST_TWO\n", &r);
	ck_assert_str_eq(r.c.store.password, SECRET);
	ck_assert_str_eq(r.c.broker.password, SECRET);
	/* Only one: anything more is the password's own. */
	ck_assert_str_eq(r.c.lock.password, SECRET "\n");
	result_free(&r);
	unsetenv("OUTBOXD_TEST_LF");
	unsetenv("OUTBOXD_TEST_CRLF");
	unsetenv("OUTBOXD_TEST_TWO");
}
END_TEST

/* A variable holding only a line end is as empty as one holding
 * nothing: it was taken as a one-byte password. */
START_TEST(test_secret_from_env_only_line_end)
{
	setenv("OUTBOXD_TEST_LF", "\n", 1);
	setenv("OUTBOXD_TEST_CRLF", "\r\n", 1);
	assert_errors("redis:\n  password_env: OUTBOXD_TEST_LF\n",
	    "t.yml:2:17: redis.password_env: the environment variable is "
	    "empty\n");
	assert_errors("redis:\n  password_env: OUTBOXD_TEST_CRLF\n",
	    "t.yml:2:17: redis.password_env: the environment variable is "
	    "empty\n");
	unsetenv("OUTBOXD_TEST_LF");
	unsetenv("OUTBOXD_TEST_CRLF");
}
END_TEST

START_TEST(test_secret_from_file)
{
	char good[128], open_file[128], empty[128], yaml[512];
	struct result r;

	tmpdir_setup();
	snprintf(good, sizeof(good), "%s/good", tmpdir);
	snprintf(open_file, sizeof(open_file), "%s/open", tmpdir);
	snprintf(empty, sizeof(empty), "%s/empty", tmpdir);
	write_file(good, SECRET "\r\nsecond line\n", 0600);
	write_file(open_file, SECRET "\n", 0644);
	write_file(empty, "\n" SECRET "\n", 0400);

	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s\n", good);
	assert_loads(yaml, &r);
	ck_assert_str_eq(r.c.lock.password, SECRET);
	ck_assert_str_eq(r.c.lock_password_src.file, good);
	ck_assert_ptr_null(strstr(r.dump, SECRET));
	ck_assert_ptr_nonnull(strstr(r.dump, "\nredis.password: <set>\n"));
	result_free(&r);

	/* No trailing newline is fine too. */
	write_file(good, SECRET, 0600);
	assert_loads(yaml, &r);
	ck_assert_str_eq(r.c.lock.password, SECRET);
	result_free(&r);

	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s\n",
	    open_file);
	/* Owned by a user other than root: its group may not read it. */
	if (geteuid() == 0)
		ck_assert_int_eq(chown(open_file, 65534, 65534), 0);
	assert_errors(yaml, "t.yml:2:18: redis.password_file: the file is "
	    "accessible by group or others (mode 0644); run chmod 600 on "
	    "it (only a file owned by root may be readable by its group)\n");
	ck_assert_int_eq(chmod(open_file, 0640), 0);
	assert_errors(yaml, "t.yml:2:18: redis.password_file: the file is "
	    "accessible by group or others (mode 0640); run chmod 600 on "
	    "it (only a file owned by root may be readable by its group)\n");
	/* Owned by root, its group may read it (a Kubernetes secret with
	 * fsGroup: root, 0440), but others may not, nor may the group
	 * write.  Only root can make such a file. */
	if (geteuid() == 0) {
		ck_assert_int_eq(chown(open_file, 0, 0), 0);
		ck_assert_int_eq(chmod(open_file, 0440), 0);
		assert_loads(yaml, &r);
		ck_assert_str_eq(r.c.lock.password, SECRET);
		result_free(&r);
		ck_assert_int_eq(chmod(open_file, 0660), 0);
		assert_errors(yaml, "t.yml:2:18: redis.password_file: the file "
		    "is accessible by others, or its group may do more than "
		    "read it (mode 0660); give it mode 0640 or less (a "
		    "Kubernetes secret: defaultMode 0440, with the pod's "
		    "fsGroup)\n");
		ck_assert_int_eq(chmod(open_file, 0604), 0);
		assert_errors(yaml, "t.yml:2:18: redis.password_file: the file "
		    "is accessible by others, or its group may do more than "
		    "read it (mode 0604); give it mode 0640 or less (a "
		    "Kubernetes secret: defaultMode 0440, with the pod's "
		    "fsGroup)\n");
	}
	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s\n", empty);
	assert_errors(yaml, "t.yml:2:18: redis.password_file: the file's "
	    "first line is empty\n");
	/* A file that does not exist (yet) is told apart: the daemon
	 * exits 1 for it, which a service manager restarts. */
	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s/none\n",
	    tmpdir);
	load(&r, yaml);
	ck_assert_int_eq(r.rc, CONFIG_SECRET_ABSENT);
	ck_assert_str_eq(r.errs, "t.yml:2:18: redis.password_file: cannot "
	    "open the file: No such file or directory\n");
	result_free(&r);
	/* With any other problem, it is a config error. */
	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s/none\n"
	    "relay:\n  batch_size: 0\n", tmpdir);
	load(&r, yaml);
	ck_assert_int_eq(r.rc, -1);
	result_free(&r);
	snprintf(yaml, sizeof(yaml), "redis:\n  password_file: %s/none\n"
	    "postgres:\n  password_file: %s\n", tmpdir, open_file);
	load(&r, yaml);
	ck_assert_int_eq(r.rc, -1);
	result_free(&r);
	tmpdir_teardown();
}
END_TEST

/* A password file is read again before each connection: new text is
 * taken, the same text leaves the password as it was, and a file that
 * cannot be read now keeps the last password read. */
START_TEST(test_secret_reread)
{
	char path[128], *password = xstrdup(SECRET), *before;

	tmpdir_setup();
	snprintf(path, sizeof(path), "%s/pw", tmpdir);
	secret_reread(&password, NULL, "redis.password_file");
	ck_assert_str_eq(password, SECRET);
	write_file(path, SECRET "\n", 0600);
	before = password;
	secret_reread(&password, path, "redis.password_file");
	ck_assert_ptr_eq(password, before);
	write_file(path, "rotated-" SECRET "\r\n", 0600);
	secret_reread(&password, path, "redis.password_file");
	ck_assert_str_eq(password, "rotated-" SECRET);
	ck_assert_int_eq(chmod(path, 0644), 0);
	secret_reread(&password, path, "redis.password_file");
	ck_assert_str_eq(password, "rotated-" SECRET);
	ck_assert_int_eq(unlink(path), 0);
	secret_reread(&password, path, "redis.password_file");
	ck_assert_str_eq(password, "rotated-" SECRET);
	secret_free(password);
	/* Unset until the file is read. */
	password = NULL;
	write_file(path, SECRET "\n", 0600);
	secret_reread(&password, path, "redis.password_file");
	ck_assert_str_eq(password, SECRET);
	secret_free(password);
	tmpdir_teardown();
}
END_TEST

/* New text in the same password file needs no restart: it is read
 * again at the next connection.  Another file, or another source, does. */
START_TEST(test_reload_password_file)
{
	char path[128], other[128], yaml[256], yaml2[256];
	struct result ra, rb;
	char *got = NULL;
	size_t len = 0;
	FILE *f;

	tmpdir_setup();
	snprintf(path, sizeof(path), "%s/pw", tmpdir);
	snprintf(other, sizeof(other), "%s/pw2", tmpdir);
	write_file(path, SECRET "\n", 0600);
	write_file(other, SECRET "\n", 0600);
	snprintf(yaml, sizeof(yaml), "redis: {password_file: %s}\n", path);
	assert_loads(yaml, &ra);
	ck_assert_str_eq(ra.c.lock.password_file, path);
	ck_assert_ptr_null(ra.c.store.password_file);
	write_file(path, "rotated-" SECRET "\n", 0600);
	assert_loads(yaml, &rb);
	ck_assert_str_eq(rb.c.lock.password, "rotated-" SECRET);
	ck_assert_int_eq(config_reload_check(&ra.c, &rb.c, NULL), 0);
	result_free(&rb);

	snprintf(yaml2, sizeof(yaml2), "redis: {password_file: %s}\n", other);
	assert_loads(yaml2, &rb);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload_check(&ra.c, &rb.c, f), 1);
	fclose(f);
	ck_assert_str_eq(got, "redis.password_file changed; restart outboxd "
	    "to apply it\n");
	free(got);
	result_free(&rb);

	assert_loads("redis: {password: other-" SECRET "}\n", &rb);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload_check(&ra.c, &rb.c, f), 2);
	fclose(f);
	ck_assert_str_eq(got, "redis.password changed; restart outboxd to "
	    "apply it\nredis.password_file changed; restart outboxd to "
	    "apply it\n");
	free(got);
	result_free(&rb);
	result_free(&ra);
	tmpdir_teardown();
}
END_TEST

START_TEST(test_secret_file_too_long)
{
	char path[128], yaml[256], *big;

	tmpdir_setup();
	snprintf(path, sizeof(path), "%s/big", tmpdir);
	big = xmalloc(5000);
	memset(big, 'x', 4999);
	big[4999] = '\0';
	write_file(path, big, 0600);
	free(big);
	snprintf(yaml, sizeof(yaml), "postgres:\n  password_file: %s\n", path);
	assert_errors(yaml, "t.yml:2:18: postgres.password_file: the file's "
	    "first line is longer than 1023 bytes\n");
	tmpdir_teardown();
}
END_TEST

/* A password pasted into the wrong key, or sitting beside errors, never
 * shows up in errors or in the dump. */
START_TEST(test_secret_never_printed)
{
	static const char *const yamls[] = {
		"postgres:\n  password: " SECRET "\n  password_env: X\n",
		"postgres:\n  password_env: " SECRET "\n",
		"postgres:\n  password_env: \"" SECRET " \"\n",
		"postgres:\n  password_file: /" SECRET "\n",
		"postgres:\n  password: " SECRET "\nrelay:\n  batch_size: 0\n",
		"rabbitmq:\n  nodes: [\"guest:" SECRET "@rabbit:5672\"]\n",
		"rabbitmq:\n  password: [" SECRET "]\n",
		"redis:\n  password: {" SECRET ": 1}\n",
		"redis:\n  password: " SECRET "\n  password: " SECRET "\n",
	};

	unsetenv(SECRET);
	unsetenv("Hunter2pasted");
	/* A password that happens to be a valid variable name. */
	assert_errors("postgres:\n  password_env: Hunter2pasted\n",
	    "t.yml:2:17: postgres.password_env: the environment variable is "
	    "not set\n");
	for (size_t i = 0; i < sizeof(yamls) / sizeof(yamls[0]); i++) {
		struct result r;

		load(&r, yamls[i]);
		ck_assert_msg(r.rc == -1 || r.rc == CONFIG_SECRET_ABSENT,
		    "%s loaded", yamls[i]);
		ck_assert_msg(strstr(r.errs, SECRET) == NULL, "leaked: %s",
		    r.errs);
		result_free(&r);
	}
}
END_TEST

static const struct conninfo_case {
	const char *conninfo;
	const char *dump;
} conninfo_cases[] = {
	{ "host=db password=" SECRET " dbname=x",
	    "host=db password=<set> dbname=x" },
	{ "host=db password = '" SECRET " \\' x' user=u",
	    "host=db password = <set> user=u" },
	{ "password=" SECRET, "password=<set>" },
	{ "postgresql://u:" SECRET "@db:5432/x?sslmode=require",
	    "postgresql://u:<set>@db:5432/x?sslmode=require" },
	{ "postgres://db/x?user=u&password=" SECRET "&sslmode=disable",
	    "postgres://db/x?user=u&password=<set>&sslmode=disable" },
	{ "postgresql://u@db1,db2/x?target_session_attrs=read-write",
	    "postgresql://u@db1,db2/x?target_session_attrs=read-write" },
	{ "host=db passfile=/x", "host=db passfile=/x" },
	/* libpq treats sslpassword, the client key's passphrase, as a
	 * password too. */
	{ "host=db sslpassword=" SECRET " sslkey=/k",
	    "host=db sslpassword=<set> sslkey=/k" },
	{ "postgresql://db/x?ssl%70assword=" SECRET "&sslmode=require",
	    "postgresql://db/x?ssl%70assword=<set>&sslmode=require" },
	/* The "/" that ended libpq's search for user info was inside the
	 * redacted value: one goes before the "?" instead. */
	{ "postgresql://?password=q/&user=a@c",
	    "postgresql:///?password=<set>&user=a@c" },
	/* A backslash escapes a space in an unquoted value; a quoted value
	 * may run into the next keyword (found by fuzz_config). */
	{ "password=" SECRET "\\ tail host=x", "password=<set> host=x" },
	{ "password='" SECRET "'host=x", "password=<set> host=x" },
	/* User info ends at the first "@": the query after it counts. */
	{ "postgresql://u@h?password=" SECRET "@x",
	    "postgresql://u@h/?password=<set>" },
	/* ... and so does a ":" in it: libpq reads no password in the user
	 * info, only the parameter (which printed "password=" SECRET
	 * ":<set>@x"). */
	{ "postgresql://u@h?password=" SECRET ":" SECRET "@x",
	    "postgresql://u@h/?password=<set>" },
	{ "postgresql://u:" SECRET "@h?password=" SECRET ":" SECRET "@x",
	    "postgresql://u:<set>@h/?password=<set>" },
};

/* Undoes the dump's escapes (\" \\ \xHH, a C1 control's as UTF-8) of
 * the n bytes at s. */
static char *
unescape(const char *s, size_t n)
{
	char *out = xmalloc(n + 1), *o = out;

	for (size_t i = 0; i < n; i++) {
		unsigned v;

		if (s[i] != '\\') {
			*o++ = s[i];
			continue;
		}
		ck_assert_uint_lt(i + 1, n);
		if (s[++i] != 'x') {
			*o++ = s[i];
			continue;
		}
		ck_assert_int_eq(sscanf(s + i + 1, "%2x", &v), 1);
		i += 2;
		if (v >= 0x80)
			*o++ = (char)0xc2;
		*o++ = (char)v;
	}
	*o = '\0';
	return out;
}

START_TEST(test_dump_redacts_conninfo)
{
	const struct conninfo_case *cc = &conninfo_cases[_i];
	char yaml[512], want[512], *info;
	PQconninfoOption *opts;
	struct result r;
	size_t n;

	/* YAML single quotes: a quote is written twice. */
	n = (size_t)snprintf(yaml, sizeof(yaml), "postgres:\n  conninfo: '");
	for (const char *p = cc->conninfo; *p != '\0'; p++) {
		if (*p == '\'')
			yaml[n++] = '\'';
		yaml[n++] = *p;
	}
	snprintf(yaml + n, sizeof(yaml) - n, "'\n");
	assert_loads(yaml, &r);
	ck_assert_str_eq(r.c.store.conninfo, cc->conninfo);
	snprintf(want, sizeof(want), "\npostgres.conninfo: \"%s\"\n",
	    cc->dump);
	ck_assert_msg(strstr(r.dump, want) != NULL, "want %s in\n%s", want,
	    r.dump);
	ck_assert_ptr_null(strstr(r.dump, SECRET));
	/* What libpq reads in the dump: no password but the marker. */
	info = strstr(r.dump, "\npostgres.conninfo: \"") + 21;
	info = unescape(info, strcspn(info, "\n") - 1);
	opts = PQconninfoParse(info, NULL);
	ck_assert_ptr_nonnull(opts);
	for (PQconninfoOption *o = opts; o->keyword != NULL; o++)
		ck_assert_msg(o->dispchar[0] != '*' || o->val == NULL ||
		    strcmp(o->val, "<set>") == 0, "libpq reads %s=%s in %s",
		    o->keyword, o->val, info);
	PQconninfoFree(opts);
	free(info);
	result_free(&r);
}
END_TEST

/* C1 controls (UTF-8 C2 80..C2 9F) are escaped as the code point, as
 * YAML reads \x85 in double quotes: raw, they reached the terminal, and
 * YAML folds a raw NEL as a line break, so the dump read back as another
 * value. */
START_TEST(test_dump_escapes_c1_controls)
{
	static const char key[] = "a\xc2\x85" "b\xc2\x9b" "c\xc2\xa0";
	char yaml[256];
	const char *v;
	struct result r, back;

	assert_loads("redis:\n  key: \"a\\x85b\\x9bc\\xa0\"\n"
	    "postgres:\n  conninfo: \"postgresql://h/x?application_name="
	    "\\x9b\\x85\"\n", &r);
	ck_assert_str_eq(r.c.lock.key, key);
	/* U+00A0 is no control: it stays as it is. */
	v = strstr(r.dump, "\nredis.key: \"a\\x85b\\x9bc\xc2\xa0\"\n");
	ck_assert_msg(v != NULL, "redis.key not escaped in\n%s", r.dump);
	ck_assert_ptr_nonnull(strstr(r.dump, "\npostgres.conninfo: "
	    "\"postgresql://h/x?application_name=\\x9b\\x85\"\n"));
	/* The dumped value, put back in a file, loads as the same. */
	v += strlen("\nredis.key: ");
	snprintf(yaml, sizeof(yaml), "redis:\n  key: %.*s\n",
	    (int)strcspn(v, "\n"), v);
	assert_loads(yaml, &back);
	ck_assert_str_eq(back.c.lock.key, key);
	result_free(&back);
	result_free(&r);
}
END_TEST

/* ---- the sample config ---- */

START_TEST(test_sample_loads_as_defaults)
{
	char path[4096], *want, *got;
	struct config c;

	/* As main.c does it: defaults first, then the file over them. */
	config_defaults(&c);
	src_path(path, sizeof(path), "config/outboxd.yml");
	ck_assert_int_eq(config_load(&c, path, stderr), 0);
	ck_assert_str_eq(c.path, path);
	got = dump_of(&c);
	want = defaults_dump();
	/* The sample shows the defaults, so it must mean exactly them. */
	ck_assert_str_eq(got, want);
	free(got);
	free(want);
	config_free(&c);
}
END_TEST

/* WatchdogSec= of the shipped unit, in ms. */
static int64_t
unit_watchdog_ms(void)
{
	char path[4096], *unit, *at;
	long s;

	unit = read_file(src_path(path, sizeof(path),
	    "systemd/outboxd.service"), NULL);
	at = strstr(unit, "\nWatchdogSec=");
	ck_assert_msg(at != NULL, "no WatchdogSec= in %s", path);
	s = strtol(at + strlen("\nWatchdogSec="), NULL, 10);
	free(unit);
	return (int64_t)s * 1000;
}

/*
 * The longest step: /healthz's stall limit and what WatchdogSec= must
 * exceed.  A pipelined relay awaits one batch more, and the claim and
 * the compensation's three statements before it each wait for the
 * table lock.  Before, neither counted, and a claim waiting
 * postgres.lock_timeout after a compensation that had waited as long
 * read as a stall.
 */
START_TEST(test_longest_step)
{
	struct config c;

	config_defaults(&c);
	/* confirms 2 x 10 s; sweep and purge 2 x 6 s, count and claim
	 * 2 x 5 s; connects 5 + 2 + 5 s */
	ck_assert_int_eq(config_longest_step_ms(&c), 54000);
	c.relay.pipeline = true;
	ck_assert_int_eq(config_longest_step_ms(&c), 64000);
	/* The shipped unit's watchdog outlasts either with the defaults. */
	ck_assert_int_gt(unit_watchdog_ms(), config_longest_step_ms(&c));
	/* A short lock_timeout: the sweep and the purge still get 5 s
	 * each (leader.c), the count and the claim their 1 s. */
	c.store.lock_timeout_ms = 1000;
	ck_assert_int_eq(config_longest_step_ms(&c), 30000 + 2 * 5000 +
	    2 * 1000 + 12000);
	c.store.lock_timeout_ms = 0;
	c.relay.pipeline = false;
	ck_assert_int_eq(config_longest_step_ms(&c), 32000);
	c.broker.confirm_timeout_ms = 1000;
	c.store.connect_timeout_ms = 1000;
	c.broker.connect_timeout_ms = 1000;
	c.lock.connect_timeout_ms = 1000;
	ck_assert_int_eq(config_longest_step_ms(&c), 10000);
	config_free(&c);
}
END_TEST

static bool
is_comment(const char *line)
{
	line += strspn(line, " ");
	return *line == '#';
}

/* "# password_file: /x": a commented-out key, which starts its own
 * documentation block rather than belonging to the key below it. */
static bool
is_commented_key(const char *line)
{
	const char *const *keys = config_keys();
	size_t len;

	line += strspn(line, " ");
	if (*line++ != '#')
		return false;
	line += *line == ' ';
	len = strspn(line, "abcdefghijklmnopqrstuvwxyz_");
	if (len == 0 || line[len] != ':')
		return false;
	for (size_t k = 0; keys[k] != NULL; k++) {
		const char *last = strrchr(keys[k], '.');

		last = last ? last + 1 : keys[k];
		if (strlen(last) == len && strncmp(last, line, len) == 0)
			return true;
	}
	return false;
}

/*
 * Every key of the table appears in config/outboxd.yml, set or commented
 * out ("# password_env: X"), with a comment on its line or in the comment
 * block right above it that gives its default.  Nesting is followed by
 * indentation, as the sample file is written in plain block style.
 */
START_TEST(test_sample_documents_every_key)
{
	char path[4096], *text, *save = NULL, *line;
	char *lines[1024];
	char stack[8][64];
	int indents[8], depth = 0;
	size_t n = 0;
	const char *const *keys = config_keys();
	size_t nkeys = 0;
	bool *found;

	for (nkeys = 0; keys[nkeys] != NULL; nkeys++)
		;
	found = xcalloc(nkeys, sizeof(*found));
	src_path(path, sizeof(path), "config/outboxd.yml");
	text = read_file(path, NULL);
	for (line = strtok_r(text, "\n", &save); line != NULL && n < 1024;
	    line = strtok_r(NULL, "\n", &save))
		lines[n++] = line;
	for (size_t i = 0; i < n; i++) {
		const char *l = lines[i];
		int indent = (int)strspn(l, " ");
		bool commented = false;
		char name[64], full[256];
		size_t len;

		l += indent;
		if (*l == '#') {
			/* "# key: value" is a commented-out key. */
			l++;
			if (*l == ' ')
				l++;
			commented = true;
		}
		len = strspn(l, "abcdefghijklmnopqrstuvwxyz_");
		if (len == 0 || len >= sizeof(name) || l[len] != ':' ||
		    (l[len + 1] != ' ' && l[len + 1] != '\0'))
			continue;
		memcpy(name, l, len);
		name[len] = '\0';
		while (depth > 0 && indents[depth - 1] >= indent)
			depth--;
		full[0] = '\0';
		for (int d = 0; d < depth; d++) {
			strcat(full, stack[d]);
			strcat(full, ".");
		}
		strcat(full, name);
		for (size_t k = 0; k < nkeys; k++) {
			bool doc = false;

			if (strcmp(keys[k], full) != 0)
				continue;
			/* The comment block right above, or on the line. */
			if (!commented && strchr(l + len, '#') != NULL &&
			    strstr(l + len, "Default") != NULL)
				doc = true;
			for (size_t j = i; j > 0 && is_comment(lines[j - 1]) &&
			    !is_commented_key(lines[j - 1]); j--)
				if (strstr(lines[j - 1], "Default") != NULL)
					doc = true;
			ck_assert_msg(doc, "config/outboxd.yml: %s (line %zu) "
			    "has no comment giving its default", full, i + 1);
			found[k] = true;
		}
		if (!commented && depth < 8 && (l[len + 1] == '\0')) {
			/* A section: later deeper lines nest under it. */
			snprintf(stack[depth], sizeof(stack[depth]), "%s",
			    name);
			indents[depth++] = indent;
		}
	}
	for (size_t k = 0; k < nkeys; k++)
		ck_assert_msg(found[k], "config/outboxd.yml does not document "
		    "%s", keys[k]);
	free(found);
	free(text);
}
END_TEST

START_TEST(test_keys_and_dump_agree)
{
	const char *const *keys = config_keys();
	struct config c;
	char *dump, *p;
	size_t n;

	config_defaults(&c);
	dump = dump_of(&c);
	p = dump;
	for (n = 0; keys[n] != NULL; n++) {
		size_t len = strlen(keys[n]);

		/* Dotted lower-case names, unique, dumped in table order. */
		ck_assert_uint_eq(strspn(keys[n],
		    "abcdefghijklmnopqrstuvwxyz_."), len);
		for (size_t j = 0; j < n; j++)
			ck_assert_str_ne(keys[j], keys[n]);
		ck_assert_msg(strncmp(p, keys[n], len) == 0 &&
		    strncmp(p + len, ": ", 2) == 0, "dump line for %s",
		    keys[n]);
		p = strchr(p, '\n') + 1;
	}
	ck_assert_str_eq(p, "");
	ck_assert_uint_eq(n, 53);
	free(dump);
	config_free(&c);
}
END_TEST

/* ---- files, check, reload ---- */

START_TEST(test_load_file_errors)
{
	char *got = NULL;
	size_t len = 0;
	struct config c;
	FILE *f;

	config_defaults(&c);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_load(&c, "/nonexistent/outboxd.yml", f), -1);
	fclose(f);
	ck_assert_str_eq(got, "/nonexistent/outboxd.yml: No such file or "
	    "directory\n");
	ck_assert_ptr_null(c.store.conninfo);	/* left empty, not stale */
	free(got);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_load(&c, "/", f), -1);
	fclose(f);
	ck_assert_str_eq(got, "/: Is a directory\n");
	free(got);
	config_free(&c);
}
END_TEST

START_TEST(test_check_file)
{
	char path[4096], bad[128], *got = NULL, *errs = NULL;
	size_t len = 0, elen = 0;
	FILE *f, *e;

	src_path(path, sizeof(path), "config/outboxd.yml");
	f = open_memstream(&got, &len);
	e = open_memstream(&errs, &elen);
	ck_assert_int_eq(config_check_file(path, f, e), 0);
	fclose(f);
	fclose(e);
	ck_assert_str_eq(got, "configuration OK\n");
	ck_assert_str_eq(errs, "");
	free(got);
	free(errs);

	/* The errors go to err (stderr), nothing to out. */
	tmpdir_setup();
	snprintf(bad, sizeof(bad), "%s/bad.yml", tmpdir);
	write_file(bad, "relay:\n  batch_size: 0\n  mode: x\n", 0600);
	f = open_memstream(&got, &len);
	e = open_memstream(&errs, &elen);
	ck_assert_int_eq(config_check_file(bad, f, e), 1);
	fclose(f);
	fclose(e);
	snprintf(path, sizeof(path),
	    "%s:2:15: relay.batch_size: must be between 1 and 10000, got 0\n"
	    "%s:3:9: relay.mode: expected one of parallel or single-active, "
	    "got \"x\"\n", bad, bad);
	ck_assert_str_eq(errs, path);
	ck_assert_str_eq(got, "");
	free(got);
	free(errs);
	tmpdir_teardown();
}
END_TEST

START_TEST(test_reload_check)
{
	static const char a[] =
	    "log: {level: info}\n"
	    "postgres: {password: " SECRET "}\n"
	    "relay: {batch_size: 10, mode: parallel}\n";
	static const char b[] =
	    "log: {level: debug}\n"
	    "postgres: {password: other-" SECRET "}\n"
	    "rabbitmq: {nodes: [\"r:1\"], heartbeat: 5s}\n"
	    "redis: {address: \"unix:/r.sock\"}\n"
	    "relay: {batch_size: 20, mode: single-active, retention: 1d}\n"
	    "backoff: {strategy: fixed}\n"
	    "http: {listen: \"\"}\n";
	struct result ra, rb, rc;
	char *got = NULL;
	size_t len = 0;
	FILE *f;

	assert_loads(a, &ra);
	assert_loads(b, &rb);
	assert_loads(a, &rc);
	ck_assert_int_eq(config_reload_check(&ra.c, &rc.c, NULL), 0);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload_check(&ra.c, &rb.c, f), 6);
	fclose(f);
	ck_assert_str_eq(got,
	    "postgres.password changed; restart outboxd to apply it\n"
	    "rabbitmq.nodes changed; restart outboxd to apply it\n"
	    "rabbitmq.heartbeat changed; restart outboxd to apply it\n"
	    "redis.address changed; restart outboxd to apply it\n"
	    "relay.mode changed; restart outboxd to apply it\n"
	    "http.listen changed; restart outboxd to apply it\n");
	ck_assert_ptr_null(strstr(got, SECRET));
	free(got);

	config_apply_reloadable(&ra.c, &rb.c);
	/* Reloadable keys moved over ... */
	ck_assert_int_eq(ra.c.log_level, LOG_DEBUG);
	ck_assert_int_eq(ra.c.relay.batch_size, 20);
	ck_assert_int_eq(ra.c.relay.retention_ms, 86400000);
	ck_assert_int_eq(ra.c.relay.backoff.strategy, BACKOFF_FIXED);
	/* ... the others stayed as they were. */
	ck_assert_int_eq(ra.c.relay.mode, RELAY_PARALLEL);
	ck_assert_str_eq(ra.c.store.password, SECRET);
	ck_assert_str_eq(ra.c.broker.nodes[0].host, "127.0.0.1");
	ck_assert_str_eq(ra.c.lock.host, "127.0.0.1");
	ck_assert_str_eq(ra.c.http.listen, "127.0.0.1:9187");
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload_check(&ra.c, &rb.c, f), 6);
	fclose(f);
	free(got);
	result_free(&ra);
	result_free(&rb);
	result_free(&rc);
}
END_TEST

START_TEST(test_reload_keeps_old_on_error)
{
	char path[128], *got = NULL;
	const struct relay_conf *relay;
	struct config cur;
	size_t len = 0;
	FILE *f;

	tmpdir_setup();
	snprintf(path, sizeof(path), "%s/outboxd.yml", tmpdir);
	write_file(path, "relay:\n  batch_size: 10\n  mode: parallel\n",
	    0600);
	memset(&cur, 0, sizeof(cur));
	ck_assert_int_eq(config_load(&cur, path, stderr), 0);
	relay = &cur.relay;	/* what the relay module would hold */

	write_file(path, "relay:\n  batch_size: 0\n", 0600);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload(&cur, f), -1);
	fclose(f);
	ck_assert_ptr_nonnull(strstr(got, "relay.batch_size: must be"));
	free(got);
	ck_assert_int_eq(relay->batch_size, 10);
	ck_assert_str_eq(cur.path, path);

	/* An empty file (a truncate before a write) is every default; a
	 * pipe or FIFO holds nothing the second time (or blocks). */
	write_file(path, "", 0600);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload(&cur, f), -1);
	fclose(f);
	ck_assert_msg(strstr(got, "empty (which would mean every default)") !=
	    NULL, "%s", got);
	free(got);
	ck_assert(unlink(path) == 0 && mkfifo(path, 0600) == 0);
	f = open_memstream(&got, &len);
	ck_assert_int_eq(config_reload(&cur, f), -1);
	fclose(f);
	ck_assert_msg(strstr(got, "not a regular file") != NULL, "%s", got);
	free(got);
	ck_assert_int_eq(unlink(path), 0);
	ck_assert_int_eq(relay->batch_size, 10);

	write_file(path, "relay:\n  batch_size: 30\n  mode: single-active\n",
	    0600);
	ck_assert_int_eq(config_reload(&cur, stderr), 0);
	ck_assert_int_eq(relay->batch_size, 30);
	ck_assert_int_eq(relay->mode, RELAY_PARALLEL);
	config_free(&cur);
	tmpdir_teardown();
}
END_TEST

/* The scalar parsers on their own: the codes say what is wrong. */
START_TEST(test_value_parsers)
{
	static const struct {
		const char *s;
		int rc;
		int64_t ms;
	} durations[] = {
		{ "0", 0, 0 }, { "000", 0, 0 }, { "250ms", 0, 250 },
		{ "30s", 0, 30000 }, { "5m", 0, 300000 }, { "1h", 0, 3600000 },
		{ "30", -2, 0 }, { "", -1, 0 }, { "s", -1, 0 }, { "5x", -1, 0 },
		{ "-5s", -1, 0 }, { "99999999999999999999d", -3, 0 },
	};
	static const struct {
		const char *s;
		int rc;
		int64_t bytes;
	} sizes[] = {
		{ "0", 0, 0 }, { "512", 0, 512 }, { "512B", 0, 512 },
		{ "4KiB", 0, 4096 }, { "4MiB", 0, 4194304 },
		{ "1GiB", 0, 1073741824 }, { "4kB", 0, 4000 },
		{ "4MB", 0, 4000000 }, { "4 MiB", -1, 0 }, { "4mib", -1, 0 },
		{ "-4", -1, 0 }, { "", -1, 0 },
		{ "9223372036854775808", -2, 0 }, { "9007199254740993GiB", -2, 0 },
	};
	char buf[64], *host = NULL, why[256];
	int64_t v;
	double d;
	int port;

	for (size_t i = 0; i < sizeof(durations) / sizeof(durations[0]); i++) {
		v = -1;
		ck_assert_msg(config_parse_duration(durations[i].s, &v) ==
		    durations[i].rc, "duration \"%s\"", durations[i].s);
		if (durations[i].rc == 0)
			ck_assert_int_eq(v, durations[i].ms);
	}
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		v = -1;
		ck_assert_msg(config_parse_size(sizes[i].s, &v) == sizes[i].rc,
		    "size \"%s\"", sizes[i].s);
		if (sizes[i].rc == 0)
			ck_assert_int_eq(v, sizes[i].bytes);
	}
	ck_assert_int_eq(config_parse_int("+42", &v), 0);
	ck_assert_int_eq(v, 42);
	ck_assert_int_eq(config_parse_int("-7", &v), 0);
	ck_assert_int_eq(v, -7);
	ck_assert_int_eq(config_parse_int("4 2", &v), -1);
	ck_assert_int_eq(config_parse_int("0x10", &v), -1);
	ck_assert_int_eq(config_parse_int("99999999999999999999", &v), -2);
	ck_assert_int_eq(config_parse_float("2.5", &d), 0);
	ck_assert_double_eq(d, 2.5);
	ck_assert_int_eq(config_parse_float("1e3", &d), 0);
	ck_assert_double_eq(d, 1000);
	ck_assert_int_eq(config_parse_float("nan", &d), -1);
	ck_assert_int_eq(config_parse_float("inf", &d), -1);
	ck_assert_int_eq(config_parse_float("0x1p3", &d), -1);
	ck_assert_int_eq(config_parse_float("1e999", &d), -1);
	ck_assert_int_eq(config_parse_float(".", &d), -1);

	ck_assert_str_eq(config_fmt_duration(buf, sizeof(buf), 0), "0");
	ck_assert_str_eq(config_fmt_duration(buf, sizeof(buf), 30000), "30s");
	ck_assert_str_eq(config_fmt_size(buf, sizeof(buf), 4194304), "4MiB");
	ck_assert_str_eq(config_fmt_size(buf, sizeof(buf), 1000), "1000");
	ck_assert_str_eq(config_fmt_size(buf, sizeof(buf), 0), "0");

	ck_assert_int_eq(config_parse_hostport("db:5433", 0, 5432, &host,
	    &port, why, sizeof(why)), 0);
	ck_assert_str_eq(host, "db");
	ck_assert_int_eq(port, 5433);
	free(host);
	ck_assert_int_eq(config_parse_hostport("[::1]:6380", 0, 6379, &host,
	    &port, why, sizeof(why)), 0);
	ck_assert_str_eq(host, "::1");
	ck_assert_int_eq(port, 6380);
	free(host);
	ck_assert_int_eq(config_parse_hostport("mq", 5672, 5672, &host,
	    &port, why, sizeof(why)), 0);
	ck_assert_str_eq(host, "mq");
	ck_assert_int_eq(port, 5672);
	free(host);
	ck_assert_int_eq(config_parse_hostport("mq", 0, 5672, &host, &port,
	    why, sizeof(why)), -1);
	ck_assert_ptr_nonnull(strstr(why, "needs a port"));
	ck_assert_int_eq(config_parse_hostport("::1:80", 0, 80, &host, &port,
	    why, sizeof(why)), -1);
	ck_assert_ptr_nonnull(strstr(why, "need brackets"));
	ck_assert_int_eq(config_parse_hostport("u:pw@db:5432", 0, 5432, &host,
	    &port, why, sizeof(why)), -1);
	ck_assert_ptr_null(strstr(why, "pw"));
	ck_assert_int_eq(config_parse_hostport("db:70000", 0, 5432, &host,
	    &port, why, sizeof(why)), -1);
	ck_assert_ptr_nonnull(strstr(why, "1 to 65535"));
	ck_assert_int_eq(config_parse_hostport("amqp://mq:5672", 0, 5672,
	    &host, &port, why, sizeof(why)), -1);
	ck_assert_ptr_nonnull(strstr(why, "not a URL"));
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("config");
	TCase *tc = tcase_create("config");
	SRunner *sr;
	int failed;

	tcase_add_test(tc, test_defaults);
	tcase_add_test(tc, test_empty_files_are_defaults);
	tcase_add_test(tc, test_full_file);
	tcase_add_test(tc, test_load_replaces);
	tcase_add_loop_test(tc, test_values, 0,
	    (int)(sizeof(value_cases) / sizeof(value_cases[0])));
	tcase_add_test(tc, test_value_parsers);
	tcase_add_test(tc, test_backoff_names_agree);
	tcase_add_test(tc, test_random_backoff_cap);
	tcase_add_test(tc, test_combination_errors_point_at_a_culprit);
	tcase_add_test(tc, test_file_size_limit);
	tcase_add_test(tc, test_nodes_limit);
	tcase_add_test(tc, test_mapping_keys_limit);
	tcase_add_test(tc, test_value_echo_is_escaped_and_cut);
	tcase_add_test(tc, test_errors_logged_without_stream);
	tcase_add_test(tc, test_invalid_utf8);
	tcase_add_test(tc, test_corpus);
	tcase_add_test(tc, test_secret_from_env);
	tcase_add_test(tc, test_secret_from_env_drops_one_line_end);
	tcase_add_test(tc, test_secret_from_env_only_line_end);
	tcase_add_test(tc, test_secret_from_file);
	tcase_add_test(tc, test_secret_reread);
	tcase_add_test(tc, test_reload_password_file);
	tcase_add_test(tc, test_secret_file_too_long);
	tcase_add_test(tc, test_secret_never_printed);
	tcase_add_loop_test(tc, test_dump_redacts_conninfo, 0,
	    (int)(sizeof(conninfo_cases) / sizeof(conninfo_cases[0])));
	tcase_add_test(tc, test_dump_escapes_c1_controls);
	tcase_add_test(tc, test_sample_loads_as_defaults);
	tcase_add_test(tc, test_longest_step);
	tcase_add_test(tc, test_sample_documents_every_key);
	tcase_add_test(tc, test_keys_and_dump_agree);
	tcase_add_test(tc, test_load_file_errors);
	tcase_add_test(tc, test_check_file);
	tcase_add_test(tc, test_reload_check);
	tcase_add_test(tc, test_reload_keeps_old_on_error);
	/* Generous, for valgrind. */
	tcase_set_timeout(tc, 120);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
