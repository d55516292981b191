/*
 * Integration-test helpers: SQL, an AMQP consumer written straight on
 * rabbitmq-c, outboxd as a child process, and deadline-bound waits.
 */
#include "testlib.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <amqp.h>
#include <amqp_tcp_socket.h>

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
	struct tl_amqp *a = calloc(1, sizeof(*a));
	amqp_socket_t *sock;
	int port = atoi(tl_env("OUTBOXD_AMQP_PORT"));

	ck_assert_ptr_nonnull(a);
	a->conn = amqp_new_connection();
	sock = amqp_tcp_socket_new(a->conn);
	ck_assert_msg(amqp_socket_open(sock, "127.0.0.1", port) ==
	    AMQP_STATUS_OK, "cannot connect to rabbitmq on %d", port);
	check_reply(amqp_login(a->conn, "/", 0, 131072, 0,
	    AMQP_SASL_METHOD_PLAIN, "guest", "guest"), "login");
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
	m->body = malloc(env.message.body.len + 1);
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
tl_collect(struct tl_amqp *a, unsigned *counts, long long max_id,
    size_t want, int idle_timeout_ms, int total_timeout_ms)
{
	size_t got = 0, distinct = 0;
	int64_t deadline = tl_ms() + total_timeout_ms;
	struct tl_msg m;

	while (distinct < want && tl_ms() < deadline &&
	    tl_next(a, idle_timeout_ms, &m)) {
		got++;
		if (m.message_id >= 0 && m.message_id < max_id) {
			if (counts[m.message_id]++ == 0)
				distinct++;
		}
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

/* Writes section: then its base lines and the extra "section.key: v"
 * lines that belong to it. */
static void
write_config(FILE *f, const char *extra)
{
	char base_pg[512], base_amqp[128], base_redis[128];

	snprintf(base_pg, sizeof(base_pg), "  conninfo: \"%s\"\n",
	    tl_env("OUTBOXD_PG_CONNINFO"));
	snprintf(base_amqp, sizeof(base_amqp), "  nodes: [\"127.0.0.1:%s\"]\n",
	    tl_env("OUTBOXD_AMQP_PORT"));
	snprintf(base_redis, sizeof(base_redis),
	    "  address: \"127.0.0.1:%s\"\n", tl_env("OUTBOXD_REDIS_PORT"));
	for (int s = 0; sections[s] != NULL; s++) {
		const char *name = sections[s];
		size_t nlen = strlen(name);
		bool has_http_listen = false;

		fprintf(f, "%s:\n", name);
		if (strcmp(name, "postgres") == 0)
			fputs(base_pg, f);
		else if (strcmp(name, "rabbitmq") == 0)
			fputs(base_amqp, f);
		else if (strcmp(name, "redis") == 0)
			fputs(base_redis, f);
		else if (strcmp(name, "reconnect") == 0)
			fputs("  max: 1s\n", f);
		for (const char *p = extra; p != NULL && *p != '\0';) {
			const char *eol = strchr(p, '\n');
			size_t len = eol ? (size_t)(eol - p) : strlen(p);

			if (len > nlen && strncmp(p, name, nlen) == 0 &&
			    p[nlen] == '.') {
				fprintf(f, "  %.*s\n", (int)(len - nlen - 1),
				    p + nlen + 1);
				if (strcmp(name, "http") == 0)
					has_http_listen = true;
			}
			p = eol ? eol + 1 : p + len;
		}
		/* Several instances in one test must not fight for a port. */
		if (strcmp(name, "http") == 0 && !has_http_listen)
			fputs("  listen: \"\"\n", f);
		if (strcmp(name, "log") == 0 && (extra == NULL ||
		    strstr(extra, "log.level") == NULL))
			fputs("  level: info\n", f);
	}
}

pid_t
tl_outboxd_start(const char *extra_yaml)
{
	static int seq;
	char cfg[512], logpath[512];
	const char *dir = tl_env("OUTBOXD_SERVERS_DIR");
	FILE *f;
	pid_t pid;
	int slot = -1;

	for (int i = 0; i < MAX_CHILDREN; i++)
		if (children[i].pid == 0) {
			slot = i;
			break;
		}
	ck_assert_msg(slot >= 0, "too many outboxd children");
	seq++;
	snprintf(cfg, sizeof(cfg), "%s/test-%d-%d.yml", dir, (int)getpid(),
	    seq);
	snprintf(logpath, sizeof(logpath), "%s/test-%d-%d.log", dir,
	    (int)getpid(), seq);
	f = fopen(cfg, "w");
	ck_assert_ptr_nonnull(f);
	write_config(f, extra_yaml);
	fclose(f);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		if (fd >= 0) {
			dup2(fd, STDERR_FILENO);
			dup2(fd, STDOUT_FILENO);
			close(fd);
		}
		execl(tl_env("OUTBOXD_BIN"), "outboxd", "-c", cfg, "run",
		    (char *)NULL);
		_exit(127);
	}
	children[slot].pid = pid;
	snprintf(children[slot].log, sizeof(children[slot].log), "%s",
	    logpath);
	return pid;
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

bool
tl_log_contains(pid_t pid, const char *needle)
{
	FILE *f = fopen(tl_outboxd_log(pid), "r");
	char line[8192];
	bool found = false;

	if (f == NULL)
		return false;
	while (!found && fgets(line, sizeof(line), f) != NULL)
		found = strstr(line, needle) != NULL;
	fclose(f);
	return found;
}

void
tl_servers(const char *cmd, const char *service)
{
	char line[1024];
	const char *src = getenv("OUTBOXD_SRCDIR");

	snprintf(line, sizeof(line), "%s/tests/servers.sh %s '%s' %s",
	    src ? src : ".", cmd, tl_env("OUTBOXD_SERVERS_DIR"), service);
	ck_assert_msg(system(line) == 0, "failed: %s", line);
}
