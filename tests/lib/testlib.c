/*
 * Integration-test helpers: SQL, an AMQP consumer written straight on
 * rabbitmq-c, outboxd as a child process, and deadline-bound waits.
 */
#include "testlib.h"
#include "util.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <hiredis/hiredis.h>

const char *
tl_env(const char *name)
{
	const char *v = getenv(name);

	if (v == NULL || *v == '\0')
		ck_abort_msg("%s is not set: run integration suites through "
		    "tests/run-integration.sh (make integration)", name);
	return v;
}

int64_t
tl_ms(void)
{
	static int64_t start;
	struct timespec ts;
	int64_t now;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
	if (start == 0)
		start = now;
	return now - start;
}

static void
nap_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

/* --- PostgreSQL ---------------------------------------------------------- */

PGconn *
tl_pg(void)
{
	PGconn *c = PQconnectdb(tl_env("OUTBOXD_PG_CONNINFO"));

	ck_assert_msg(PQstatus(c) == CONNECTION_OK, "postgres: %s",
	    PQerrorMessage(c));
	PQclear(PQexec(c, "SET client_min_messages = warning"));
	return c;
}

static PGresult *
vquery(PGconn *c, const char *fmt, va_list ap)
{
	char sql[8192];
	PGresult *res;

	vsnprintf(sql, sizeof(sql), fmt, ap);
	res = PQexec(c, sql);
	ck_assert_msg(PQresultStatus(res) == PGRES_COMMAND_OK ||
	    PQresultStatus(res) == PGRES_TUPLES_OK, "SQL failed: %s\n%s",
	    sql, PQerrorMessage(c));
	return res;
}

void
tl_sql(PGconn *c, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	PQclear(vquery(c, fmt, ap));
	va_end(ap);
}

long long
tl_sql_int(PGconn *c, const char *fmt, ...)
{
	va_list ap;
	PGresult *res;
	long long v = -1;

	va_start(ap, fmt);
	res = vquery(c, fmt, ap);
	va_end(ap);
	if (PQntuples(res) > 0 && !PQgetisnull(res, 0, 0))
		v = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
	PQclear(res);
	return v;
}

char *
tl_sql_text(PGconn *c, char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	PGresult *res;

	va_start(ap, fmt);
	res = vquery(c, fmt, ap);
	va_end(ap);
	snprintf(buf, size, "%s", PQntuples(res) > 0 ? PQgetvalue(res, 0, 0) :
	    "");
	PQclear(res);
	return buf;
}

void
tl_reset_db(PGconn *c)
{
	tl_sql(c, "TRUNCATE t_transactional_message CASCADE");
}

long long
tl_wait_sql_int(PGconn *c, long long want, int timeout_ms, const char *fmt,
    ...)
{
	char sql[4096];
	va_list ap;
	int64_t deadline = tl_ms() + timeout_ms;
	long long v;

	va_start(ap, fmt);
	vsnprintf(sql, sizeof(sql), fmt, ap);
	va_end(ap);
	for (;;) {
		v = tl_sql_int(c, "%s", sql);
		if (v == want || tl_ms() >= deadline)
			return v;
		nap_ms(50);
	}
}

/* --- RabbitMQ ------------------------------------------------------------ */

struct tl_amqp {
	amqp_connection_state_t conn;
};

static void
check_reply(amqp_rpc_reply_t r, const char *what)
{
	if (r.reply_type == AMQP_RESPONSE_NORMAL)
		return;
	if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
	    r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
		amqp_channel_close_t *m = r.reply.decoded;
		ck_abort_msg("%s: %d %.*s", what, m->reply_code,
		    (int)m->reply_text.len, (char *)m->reply_text.bytes);
	}
	ck_abort_msg("%s failed (reply type %d, library error %s)", what,
	    r.reply_type, amqp_error_string2(r.library_error));
}

struct tl_amqp *
tl_amqp_open(void)
{
	return tl_amqp_open_as("guest", "guest");
}

struct tl_amqp *
tl_amqp_open_as(const char *user, const char *password)
{
	struct tl_amqp *a = xcalloc(1, sizeof(*a));
	amqp_socket_t *sock;
	int port = atoi(tl_env("OUTBOXD_AMQP_PORT"));

	ck_assert_ptr_nonnull(a);
	a->conn = amqp_new_connection();
	sock = amqp_tcp_socket_new(a->conn);
	ck_assert_msg(amqp_socket_open(sock, "127.0.0.1", port) ==
	    AMQP_STATUS_OK, "cannot connect to rabbitmq on %d", port);
	check_reply(amqp_login(a->conn, "/", 0, 131072, 0,
	    AMQP_SASL_METHOD_PLAIN, user, password), "login");
	amqp_channel_open(a->conn, 1);
	check_reply(amqp_get_rpc_reply(a->conn), "channel.open");
	return a;
}

void
tl_amqp_close(struct tl_amqp *a)
{
	if (a == NULL)
		return;
	amqp_channel_close(a->conn, 1, AMQP_REPLY_SUCCESS);
	amqp_connection_close(a->conn, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(a->conn);
	free(a);
}

void
tl_queue(struct tl_amqp *a, const char *queue, const char *exchange,
    const char *routing_key)
{
	amqp_queue_declare(a->conn, 1, amqp_cstring_bytes(queue), 0, 1, 0, 0,
	    amqp_empty_table);
	check_reply(amqp_get_rpc_reply(a->conn), "queue.declare");
	amqp_queue_purge(a->conn, 1, amqp_cstring_bytes(queue));
	check_reply(amqp_get_rpc_reply(a->conn), "queue.purge");
	if (exchange != NULL && *exchange != '\0') {
		amqp_queue_bind(a->conn, 1, amqp_cstring_bytes(queue),
		    amqp_cstring_bytes(exchange),
		    amqp_cstring_bytes(routing_key), amqp_empty_table);
		check_reply(amqp_get_rpc_reply(a->conn), "queue.bind");
	}
}

void
tl_exchange(struct tl_amqp *a, const char *name, const char *type)
{
	amqp_exchange_declare(a->conn, 1, amqp_cstring_bytes(name),
	    amqp_cstring_bytes(type), 0, 1, 0, 0, amqp_empty_table);
	check_reply(amqp_get_rpc_reply(a->conn), "exchange.declare");
}

void
tl_exchange_transient(struct tl_amqp *a, const char *name, const char *type)
{
	amqp_exchange_declare(a->conn, 1, amqp_cstring_bytes(name),
	    amqp_cstring_bytes(type), 0, 0, 1, 0, amqp_empty_table);
	check_reply(amqp_get_rpc_reply(a->conn), "exchange.declare");
}

void
tl_exchange_delete(struct tl_amqp *a, const char *name)
{
	amqp_exchange_delete(a->conn, 1, amqp_cstring_bytes(name), 0);
	check_reply(amqp_get_rpc_reply(a->conn), "exchange.delete");
}

void
tl_consume(struct tl_amqp *a, const char *queue)
{
	amqp_basic_qos(a->conn, 1, 0, 1000, 0);
	check_reply(amqp_get_rpc_reply(a->conn), "basic.qos");
	amqp_basic_consume(a->conn, 1, amqp_cstring_bytes(queue),
	    amqp_empty_bytes, 0, 1, 0, amqp_empty_table);
	check_reply(amqp_get_rpc_reply(a->conn), "basic.consume");
}

static void
copy_bytes(char *dst, size_t size, amqp_bytes_t b)
{
	size_t n = b.len < size - 1 ? b.len : size - 1;

	memcpy(dst, b.bytes, n);
	dst[n] = '\0';
}

static void
read_headers(struct tl_msg *m, const amqp_table_t *t)
{
	for (int i = 0; i < t->num_entries; i++) {
		const amqp_table_entry_t *e = &t->entries[i];
		char key[128];

		copy_bytes(key, sizeof(key), e->key);
		if (strcmp(key, "attempt") == 0) {
			if (e->value.kind == AMQP_FIELD_KIND_I32)
				m->attempt = e->value.value.i32;
			else if (e->value.kind == AMQP_FIELD_KIND_I64)
				m->attempt = (int)e->value.value.i64;
			else if (e->value.kind == AMQP_FIELD_KIND_U32)
				m->attempt = (int)e->value.value.u32;
			continue;
		}
		if (e->value.kind != AMQP_FIELD_KIND_UTF8 &&
		    e->value.kind != AMQP_FIELD_KIND_BYTES)
			continue;
		if (strcmp(key, "business_module") == 0)
			copy_bytes(m->business_module,
			    sizeof(m->business_module), e->value.value.bytes);
		else if (strcmp(key, "business_key") == 0)
			copy_bytes(m->business_key, sizeof(m->business_key),
			    e->value.value.bytes);
		else if (m->extra_header[0] == '\0') {
			char val[128];

			copy_bytes(val, sizeof(val), e->value.value.bytes);
			snprintf(m->extra_header, sizeof(m->extra_header),
			    "%s=%s", key, val);
		}
	}
}

bool
tl_next(struct tl_amqp *a, int timeout_ms, struct tl_msg *m)
{
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
	amqp_envelope_t env;
	amqp_rpc_reply_t r;
	amqp_basic_properties_t *p;

	memset(m, 0, sizeof(*m));
	amqp_maybe_release_buffers(a->conn);
	r = amqp_consume_message(a->conn, &env, &tv, 0);
	if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_TIMEOUT)
		return false;
	check_reply(r, "consume");
	m->body = xmalloc(env.message.body.len + 1);
	memcpy(m->body, env.message.body.bytes, env.message.body.len);
	m->body[env.message.body.len] = '\0';
	m->body_len = env.message.body.len;
	p = &env.message.properties;
	m->message_id = -1;
	m->attempt = -1;
	if (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG) {
		char id[32];
		copy_bytes(id, sizeof(id), p->message_id);
		m->message_id = strtoll(id, NULL, 10);
	}
	if (p->_flags & AMQP_BASIC_DELIVERY_MODE_FLAG)
		m->delivery_mode = p->delivery_mode;
	if (p->_flags & AMQP_BASIC_CONTENT_TYPE_FLAG)
		copy_bytes(m->content_type, sizeof(m->content_type),
		    p->content_type);
	if (p->_flags & AMQP_BASIC_TIMESTAMP_FLAG)
		m->timestamp = p->timestamp;
	if (p->_flags & AMQP_BASIC_HEADERS_FLAG)
		read_headers(m, &p->headers);
	copy_bytes(m->routing_key, sizeof(m->routing_key), env.routing_key);
	amqp_destroy_envelope(&env);
	return true;
}

void
tl_msg_free(struct tl_msg *m)
{
	free(m->body);
	m->body = NULL;
}

size_t
tl_collect(struct tl_amqp *a, unsigned *counts, long long first,
    long long n, size_t want, int idle_timeout_ms, int total_timeout_ms)
{
	size_t got = 0, distinct = 0;
	int64_t deadline = tl_ms() + total_timeout_ms;
	struct tl_msg m;

	while (distinct < want && tl_ms() < deadline &&
	    tl_next(a, idle_timeout_ms, &m)) {
		got++;
		if (m.message_id >= first && m.message_id < first + n &&
		    counts[m.message_id - first]++ == 0)
			distinct++;
		tl_msg_free(&m);
	}
	return got;
}

void
tl_mark_end(struct tl_amqp *a, const char *queue, char *marker, size_t size)
{
	static unsigned seq;

	snprintf(marker, size, "tl-end %d %u", (int)getpid(), ++seq);
	ck_assert_int_eq(amqp_basic_publish(a->conn, 1, amqp_empty_bytes,
	    amqp_cstring_bytes(queue), 0, 0, NULL,
	    amqp_cstring_bytes(marker)), AMQP_STATUS_OK);
}

bool
tl_next_before(struct tl_amqp *a, const char *marker, int64_t deadline,
    struct tl_msg *m)
{
	int64_t left = deadline - tl_ms();

	ck_assert_msg(left > 0 && tl_next(a, (int)left, m), "the end marker "
	    "\"%s\" did not come back in time", marker);
	if (strcmp(m->body, marker) != 0)
		return true;
	tl_msg_free(m);
	return false;
}

size_t
tl_collect_to_end(struct tl_amqp *a, const char *queue, unsigned *counts,
    long long first, long long n, int total_timeout_ms)
{
	char marker[64];
	size_t got = 0;
	int64_t deadline = tl_ms() + total_timeout_ms;
	struct tl_msg m;

	tl_mark_end(a, queue, marker, sizeof(marker));
	while (tl_next_before(a, marker, deadline, &m)) {
		got++;
		if (m.message_id >= first && m.message_id < first + n)
			counts[m.message_id - first]++;
		tl_msg_free(&m);
	}
	return got;
}

/* --- outboxd and the servers -------------------------------------------- */

#define MAX_CHILDREN 16

static struct {
	pid_t pid;
	char log[512];
} children[MAX_CHILDREN];

static const char *const sections[] = { "log", "postgres", "rabbitmq",
	"redis", "relay", "backoff", "reconnect", "http", NULL };

/* Whether the "section.key:" that starts line is set in yaml. */
static bool
key_set_in(const char *line, const char *yaml)
{
	const char *colon = strchr(line, ':');
	size_t klen = colon != NULL ? (size_t)(colon - line) + 1 : 0;

	for (const char *p = yaml; klen > 0 && p != NULL && *p != '\0';) {
		if (strncmp(p, line, klen) == 0)
			return true;
		p = strchr(p, '\n');
		p = p != NULL ? p + 1 : NULL;
	}
	return false;
}

/* Writes the "section.key: value" lines of extra that belong to name,
 * as its keys, but for those that own sets; returns how many. */
static int
put_section_keys(FILE *f, const char *name, const char *extra,
    const char *own)
{
	size_t nlen = strlen(name);
	int n = 0;

	for (const char *p = extra; p != NULL && *p != '\0';) {
		const char *eol = strchr(p, '\n');
		size_t len = eol ? (size_t)(eol - p) : strlen(p);

		if (len > nlen && strncmp(p, name, nlen) == 0 &&
		    p[nlen] == '.' && !key_set_in(p, own)) {
			fprintf(f, "  %.*s\n", (int)(len - nlen - 1),
			    p + nlen + 1);
			n++;
		}
		p = eol ? eol + 1 : p + len;
	}
	return n;
}

/* Writes the base line "  key: value" of section unless extra sets
 * "section.key" itself (a duplicate key is a config error). */
static void
put_base_key(FILE *f, const char *section, const char *line,
    const char *extra)
{
	const char *key = line + 2;
	char dotted[64];

	snprintf(dotted, sizeof(dotted), "%s.%.*s:", section,
	    (int)strcspn(key, ":"), key);
	if (extra == NULL || !key_set_in(dotted, extra))
		fputs(line, f);
}

/*
 * Writes section: then its base lines and the extra "section.key: v"
 * lines that belong to it.  OUTBOXD_TEST_YAML, in the same form, goes
 * into every config, but for the keys a test sets itself: a whole suite
 * runs again in another mode (the Makefile's pipelined runs).
 */
static void
write_config(FILE *f, const char *extra)
{
	const char *every = getenv("OUTBOXD_TEST_YAML");
	char base_pg[512], base_amqp[128], base_redis[128];

	snprintf(base_pg, sizeof(base_pg), "  conninfo: \"%s\"\n",
	    tl_env("OUTBOXD_PG_CONNINFO"));
	snprintf(base_amqp, sizeof(base_amqp), "  nodes: [\"127.0.0.1:%s\"]\n",
	    tl_env("OUTBOXD_AMQP_PORT"));
	snprintf(base_redis, sizeof(base_redis),
	    "  address: \"127.0.0.1:%s\"\n", tl_env("OUTBOXD_REDIS_PORT"));
	for (int s = 0; sections[s] != NULL; s++) {
		const char *name = sections[s];
		int own;

		fprintf(f, "%s:\n", name);
		if (strcmp(name, "postgres") == 0)
			put_base_key(f, name, base_pg, extra);
		else if (strcmp(name, "rabbitmq") == 0)
			put_base_key(f, name, base_amqp, extra);
		else if (strcmp(name, "redis") == 0)
			put_base_key(f, name, base_redis, extra);
		else if (strcmp(name, "reconnect") == 0)
			put_base_key(f, name, "  max: 1s\n", extra);
		own = put_section_keys(f, name, extra, NULL);
		(void)put_section_keys(f, name, every, extra);
		/* Several instances in one test must not fight for a port. */
		if (strcmp(name, "http") == 0 && own == 0)
			fputs("  listen: \"\"\n", f);
		if (strcmp(name, "log") == 0 && (extra == NULL ||
		    strstr(extra, "log.level") == NULL))
			fputs("  level: info\n", f);
	}
}

/* A free slot in children[]; aborts the test when there is none. */
static int
claim_slot(void)
{
	for (int i = 0; i < MAX_CHILDREN; i++)
		if (children[i].pid == 0)
			return i;
	ck_abort_msg("too many outboxd children");
	return -1;
}

pid_t
tl_fork_bound(void)
{
	pid_t parent = getpid(), pid = fork();

	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		/* The parent may be gone already. */
		if (getppid() != parent)
			_exit(127);
	}
	return pid;
}

/*
 * Forks `outboxd -c cfg run` with stdout and stderr in logpath and
 * records it in children[slot].  The daemon is killed when the test's
 * process ends, so a failed test cannot leave one running to take the
 * next tests' rows or ports.
 */
static pid_t
spawn_outboxd(int slot, const char *cfg, const char *logpath)
{
	const char *bin = tl_env("OUTBOXD_BIN");
	pid_t pid = tl_fork_bound();

	if (pid == 0) {
		int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		if (fd >= 0) {
			dup2(fd, STDERR_FILENO);
			dup2(fd, STDOUT_FILENO);
			close(fd);
		}
		execl(bin, "outboxd", "-c", cfg, "run", (char *)NULL);
		_exit(127);
	}
	children[slot].pid = pid;
	snprintf(children[slot].log, sizeof(children[slot].log), "%s",
	    logpath);
	return pid;
}

pid_t
tl_outboxd_start(const char *extra_yaml)
{
	static int seq;
	char cfg[512], logpath[512];
	const char *dir = tl_env("OUTBOXD_SERVERS_DIR");
	FILE *f;
	int slot = claim_slot();

	seq++;
	snprintf(cfg, sizeof(cfg), "%s/test-%d-%d.yml", dir, (int)getpid(),
	    seq);
	snprintf(logpath, sizeof(logpath), "%s/test-%d-%d.log", dir,
	    (int)getpid(), seq);
	f = fopen(cfg, "w");
	ck_assert_ptr_nonnull(f);
	write_config(f, extra_yaml);
	fclose(f);
	return spawn_outboxd(slot, cfg, logpath);
}

const char *
tl_outboxd_log(pid_t pid)
{
	for (int i = 0; i < MAX_CHILDREN; i++)
		if (children[i].pid == pid)
			return children[i].log;
	return "";
}

static void
forget_child(pid_t pid)
{
	for (int i = 0; i < MAX_CHILDREN; i++)
		if (children[i].pid == pid)
			children[i].pid = 0;
}

int
tl_outboxd_stop(pid_t pid, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	int status;

	kill(pid, SIGTERM);
	while (tl_ms() < deadline) {
		pid_t r = waitpid(pid, &status, WNOHANG);

		if (r == pid) {
			forget_child(pid);
			return WIFEXITED(status) ? WEXITSTATUS(status) :
			    128 + WTERMSIG(status);
		}
		nap_ms(20);
	}
	tl_outboxd_kill(pid);
	return -1;
}

void
tl_outboxd_kill(pid_t pid)
{
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	forget_child(pid);
}

int
tl_file_lines(const char *path, const char *needle, const char *needle2)
{
	FILE *f = fopen(path, "r");
	char line[8192];
	int n = 0;

	if (f == NULL)
		return 0;
	while (fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, needle) != NULL &&
		    (needle2 == NULL || strstr(line, needle2) != NULL);
	fclose(f);
	return n;
}

bool
tl_log_contains(pid_t pid, const char *needle)
{
	return tl_file_lines(tl_outboxd_log(pid), needle, NULL) > 0;
}

void
tl_servers(const char *cmd, const char *service)
{
	char line[1024];
	const char *src = getenv("OUTBOXD_SRCDIR");

	/* setsid: Check kills a test's process group when the test ends,
	 * and a server started here must outlive the test. */
	snprintf(line, sizeof(line), "setsid -w '%s/tests/servers.sh' %s '%s' %s",
	    src ? src : ".", cmd, tl_env("OUTBOXD_SERVERS_DIR"), service);
	ck_assert_msg(system(line) == 0, "failed: %s", line);
}

/* --- outboxd as a command, and its endpoints ----------------------------- */

void
tl_config_write(char *path, size_t size, const char *extra_yaml)
{
	static int cfg_seq;
	FILE *f;

	snprintf(path, size, "%s/cfg-%d-%d.yml", tl_env("OUTBOXD_SERVERS_DIR"),
	    (int)getpid(), ++cfg_seq);
	f = fopen(path, "w");
	ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
	write_config(f, extra_yaml);
	ck_assert_int_eq(fclose(f), 0);
}

pid_t
tl_outboxd_start_file(const char *cfg_path)
{
	static int log_seq;
	char logpath[512];
	int slot = claim_slot();

	snprintf(logpath, sizeof(logpath), "%s/daemon-%d-%d.log",
	    tl_env("OUTBOXD_SERVERS_DIR"), (int)getpid(), ++log_seq);
	return spawn_outboxd(slot, cfg_path, logpath);
}

int
tl_outboxd_wait(pid_t pid, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	int status;

	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);

		if (r == pid) {
			forget_child(pid);
			return WIFEXITED(status) ? WEXITSTATUS(status) :
			    128 + WTERMSIG(status);
		}
		if (r == -1 || tl_ms() >= deadline)
			return -1;
		nap_ms(10);
	}
}

/* Whether sig's bit is set in a hexadecimal mask of /proc/PID/status. */
static bool
mask_has(const char *hex, int sig)
{
	unsigned long long mask = strtoull(hex, NULL, 16);

	return (mask >> (sig - 1)) & 1ULL;
}

bool
tl_signal_taken(pid_t pid, int sig, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;
	char path[64], line[256];

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	for (;;) {
		FILE *f = fopen(path, "r");
		bool pending = false;

		if (f == NULL)
			return true;	/* gone: nothing is pending */
		while (fgets(line, sizeof(line), f) != NULL) {
			if (strncmp(line, "ShdPnd:", 7) == 0 &&
			    mask_has(line + 7, sig))
				pending = true;
			if (strncmp(line, "SigPnd:", 7) == 0 &&
			    mask_has(line + 7, sig))
				pending = true;
		}
		fclose(f);
		if (!pending)
			return true;
		if (tl_ms() >= deadline)
			return false;
		nap_ms(5);
	}
}

/* Appends what fd has to buf[size] (keeping *len); false at EOF. */
static bool
drain_fd(int fd, char *buf, size_t size, size_t *len)
{
	char tmp[4096];
	ssize_t n = read(fd, tmp, sizeof(tmp));

	if (n < 0 && errno == EINTR)
		return true;
	if (n <= 0)
		return false;
	if (buf != NULL && size > 0) {
		size_t room = size - 1 - *len;
		size_t take = (size_t)n < room ? (size_t)n : room;

		memcpy(buf + *len, tmp, take);
		*len += take;
		buf[*len] = '\0';
	}
	return true;
}

int
tl_run(const char *const argv[], char *out, size_t outsz, char *err,
    size_t errsz, int timeout_ms)
{
	int po[2], pe[2], status;
	int64_t deadline = tl_ms() + timeout_ms;
	size_t olen = 0, elen = 0;
	bool oopen = true, eopen = true;
	pid_t pid;

	if (out != NULL && outsz > 0)
		out[0] = '\0';
	if (err != NULL && errsz > 0)
		err[0] = '\0';
	ck_assert_int_eq(pipe(po), 0);
	ck_assert_int_eq(pipe(pe), 0);
	pid = tl_fork_bound();
	if (pid == 0) {
		dup2(po[1], STDOUT_FILENO);
		dup2(pe[1], STDERR_FILENO);
		close(po[0]);
		close(po[1]);
		close(pe[0]);
		close(pe[1]);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	close(po[1]);
	close(pe[1]);
	while (oopen || eopen) {
		struct pollfd pfd[2] = { { .fd = oopen ? po[0] : -1,
			.events = POLLIN }, { .fd = eopen ? pe[0] : -1,
			.events = POLLIN } };
		int64_t left = deadline - tl_ms();

		if (left <= 0)
			break;
		if (poll(pfd, 2, (int)left) <= 0)
			continue;
		if (pfd[0].revents != 0)
			oopen = drain_fd(po[0], out, outsz, &olen);
		if (pfd[1].revents != 0)
			eopen = drain_fd(pe[0], err, errsz, &elen);
	}
	close(po[0]);
	close(pe[0]);
	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);

		if (r == pid)
			return WIFEXITED(status) ? WEXITSTATUS(status) :
			    128 + WTERMSIG(status);
		if (tl_ms() >= deadline) {
			kill(pid, SIGKILL);
			waitpid(pid, NULL, 0);
			return -1;
		}
		nap_ms(10);
	}
}

int
tl_outboxd_cli(char *out, size_t outsz, char *err, size_t errsz,
    const char *cfg, ...)
{
	const char *argv[32];
	const char *a;
	size_t n = 0;
	va_list ap;

	argv[n++] = tl_env("OUTBOXD_BIN");
	if (cfg != NULL) {
		argv[n++] = "-c";
		argv[n++] = cfg;
	}
	va_start(ap, cfg);
	while ((a = va_arg(ap, const char *)) != NULL && n < 31)
		argv[n++] = a;
	va_end(ap);
	argv[n] = NULL;
	return tl_run(argv, out, outsz, err, errsz, 60000);
}

static int
tcp_connect_local(int port)
{
	struct sockaddr_in sin = { .sin_family = AF_INET,
		.sin_port = htons((uint16_t)port) };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd == -1)
		return -1;
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (connect(fd, (struct sockaddr *)&sin, sizeof(sin)) == -1) {
		close(fd);
		return -1;
	}
	return fd;
}

bool
tl_port_open(int port)
{
	int fd = tcp_connect_local(port);

	if (fd == -1)
		return false;
	close(fd);
	return true;
}

int
tl_sockopt(int fd, int level, int name)
{
	int v = -1;
	socklen_t len = sizeof(v);

	ck_assert_msg(getsockopt(fd, level, name, &v, &len) == 0,
	    "getsockopt(%d, %d)", level, name);
	return v;
}

int
tl_free_port(void)
{
	struct sockaddr_in sin = { .sin_family = AF_INET };
	socklen_t len = sizeof(sin);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ck_assert_msg(fd != -1, "socket: %s", strerror(errno));
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_msg(bind(fd, (struct sockaddr *)&sin, sizeof(sin)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&sin, &len) == 0,
	    "no free port: %s", strerror(errno));
	close(fd);
	return ntohs(sin.sin_port);
}

double
tl_metric(const char *text, const char *name)
{
	size_t len = strlen(name);

	for (const char *p = text; p != NULL && *p != '\0';) {
		if (strncmp(p, name, len) == 0 && p[len] == ' ')
			return strtod(p + len + 1, NULL);
		p = strchr(p, '\n');
		if (p != NULL)
			p++;
	}
	return NAN;
}

int
tl_http_get(int port, const char *path, char *body, size_t size)
{
	struct timeval tv = { 10, 0 };
	char req[512], *resp, *sep;
	size_t cap = 1 << 20, len = 0;
	int fd, code = -1;
	ssize_t n;

	if (body != NULL && size > 0)
		body[0] = '\0';
	fd = tcp_connect_local(port);
	if (fd == -1)
		return -1;
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	/* HTTP/1.0 and Connection: close: the body ends at EOF. */
	snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n"
	    "Connection: close\r\n\r\n", path, port);
	if (write(fd, req, strlen(req)) != (ssize_t)strlen(req)) {
		close(fd);
		return -1;
	}
	resp = xmalloc(cap);
	while (len < cap - 1 && (n = read(fd, resp + len, cap - 1 - len)) > 0)
		len += (size_t)n;
	resp[len] = '\0';
	close(fd);
	if (sscanf(resp, "HTTP/1.%*d %d", &code) != 1)
		code = -1;
	sep = strstr(resp, "\r\n\r\n");
	if (sep != NULL && body != NULL && size > 0)
		snprintf(body, size, "%s", sep + 4);
	free(resp);
	return code;
}

bool
tl_redis_exists(const char *key)
{
	redisContext *c = redisConnect("127.0.0.1",
	    atoi(tl_env("OUTBOXD_REDIS_PORT")));
	redisReply *r;
	bool exists;

	ck_assert_msg(c != NULL && c->err == 0, "redis: %s", c ? c->errstr :
	    "out of memory");
	r = redisCommand(c, "EXISTS %s", key);
	ck_assert_msg(r != NULL && r->type == REDIS_REPLY_INTEGER,
	    "redis EXISTS: %s", r == NULL ? c->errstr : "unexpected reply");
	exists = r->integer > 0;
	freeReplyObject(r);
	redisFree(c);
	return exists;
}

/* Whether every thread of pid is in the stopped state ('T'). */
static bool
all_threads_stopped(pid_t pid)
{
	char path[320], line[512];
	bool stopped = true;
	DIR *dir;
	struct dirent *e;

	snprintf(path, sizeof(path), "/proc/%ld/task", (long)pid);
	if ((dir = opendir(path)) == NULL)
		return false;
	while (stopped && (e = readdir(dir)) != NULL) {
		FILE *f;
		char *paren;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/%ld/task/%s/stat",
		    (long)pid, e->d_name);
		if ((f = fopen(path, "r")) == NULL)
			continue;
		if (fgets(line, sizeof(line), f) != NULL &&
		    (paren = strrchr(line, ')')) != NULL)
			stopped = paren[2] == 'T' || paren[2] == 't';
		fclose(f);
	}
	closedir(dir);
	return stopped;
}

bool
tl_wait_stopped(pid_t pid, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;

	while (!all_threads_stopped(pid)) {
		if (tl_ms() >= deadline)
			return false;
		nap_ms(5);
	}
	return true;
}

pid_t
tl_rabbitmq_pid(void)
{
	char path[512];
	FILE *f;
	int pid = 0;

	snprintf(path, sizeof(path), "%s/rabbitmq/rabbitmq.pid",
	    tl_env("OUTBOXD_SERVERS_DIR"));
	f = fopen(path, "r");
	if (f != NULL) {
		if (fscanf(f, "%d", &pid) != 1)
			pid = 0;
		fclose(f);
	}
	return (pid_t)pid;
}

void
tl_rabbitmq_freeze(bool freeze)
{
	pid_t pid = tl_rabbitmq_pid();

	/* Thawing uses no ck_assert: it also runs outside any test. */
	if (!freeze) {
		if (pid > 0)
			(void)kill(pid, SIGCONT);
		return;
	}
	ck_assert_msg(pid > 0, "no rabbitmq pid in the servers directory");
	ck_assert_msg(kill(pid, SIGSTOP) == 0, "kill %d: %s", pid,
	    strerror(errno));
	/* SIGSTOP lands asynchronously: a broker still running for a few
	 * moments could confirm what the test means to leave unconfirmed. */
	ck_assert_msg(tl_wait_stopped(pid, 10000), "rabbitmq (pid %d) did "
	    "not stop", pid);
}

/*
 * CPU time pid has used, user plus system (fields 14 and 15 of
 * /proc/PID/stat), in clock ticks; -1 if it cannot be read.  The command
 * name in field 2 may hold spaces and parentheses: count from its last
 * ')'.
 */
static long long
cpu_ticks(pid_t pid)
{
	char path[64], buf[1024], *p;
	unsigned long long ut, st;
	size_t n;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	if (f == NULL)
		return -1;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	p = strrchr(buf, ')');
	/* state (3), ppid to tpgid (4-8), flags to cmajflt (9-13). */
	if (p == NULL || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u "
	    "%*u %*u %*u %llu %llu", &ut, &st) != 2)
		return -1;
	return (long long)(ut + st);
}

double
tl_cpu_share(pid_t pid, int window_ms)
{
	long long t0 = cpu_ticks(pid), t1;
	int64_t w0 = tl_ms(), w1;

	nap_ms(window_ms);
	t1 = cpu_ticks(pid);
	w1 = tl_ms();
	ck_assert_msg(t0 >= 0 && t1 >= 0, "cannot read /proc/%d/stat",
	    (int)pid);
	return (double)(t1 - t0) / (double)sysconf(_SC_CLK_TCK) /
	    ((double)(w1 - w0) / 1000.0);
}

long
tl_proc_kib(pid_t pid, const char *field)
{
	char path[64], line[256];
	size_t len = strlen(field);
	long kib = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f) != NULL)
		if (strncmp(line, field, len) == 0 && line[len] == ':')
			kib = atol(line + len + 1);
	fclose(f);
	ck_assert_msg(kib > 0, "%s: no %s", path, field);
	return kib;
}

pid_t
tl_fake_amqp(const char *mode, int *port)
{
	const char *src = getenv("OUTBOXD_SRCDIR");
	char script[600], port_arg[16];
	int64_t deadline = tl_ms() + 20000;
	pid_t fake;

	*port = tl_free_port();
	snprintf(script, sizeof(script), "%s/tests/integration/fake_amqp.py",
	    src != NULL ? src : ".");
	snprintf(port_arg, sizeof(port_arg), "%d", *port);
	fake = tl_fork_bound();
	if (fake == 0) {
		execlp("python3", "python3", script, port_arg, mode,
		    (char *)NULL);
		_exit(127);
	}
	while (!tl_port_open(*port) && tl_ms() < deadline)
		nap_ms(20);
	ck_assert_msg(tl_port_open(*port), "the fake broker (%s) did not "
	    "start", script);
	return fake;
}

int
tl_slowdown(void)
{
	const char *v = getenv("OUTBOXD_TEST_SLOWDOWN");
	int f = v != NULL ? atoi(v) : 1;

	return f > 0 ? f : 1;
}
