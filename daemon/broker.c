/*
 * Broker: publishes outbox messages to RabbitMQ (rabbitmq-c 0.11) with
 * publisher confirms and says, per message, what the broker did with it.
 * 0.11 has no confirm helper: the confirm frames are read here.
 */
#include "broker.h"

#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "log.h"

/*
 * Channel 1 publishes with confirms.  Channel 2 runs exchange checks and
 * declares: the broker answers a refused one (404, 406) by closing the
 * channel, and that must never reset the publishing channel and its
 * delivery tags.  Channel 3 consumes (tests and CLI only).
 */
#define CH_PUB 1
#define CH_CHECK 2
#define CH_CONSUME 3

#define DRAIN_EVERY 64		/* publishes between reads of the acks */
#define DEFAULT_CONNECT_MS 10000
#define DEFAULT_CONFIRM_MS 30000
#define CLOSE_TIMEOUT_MS 1000	/* for a polite connection.close */
#define SHORTSTR_MAX 255	/* AMQP short strings: names, keys */
#define DEFAULT_CONTENT_TYPE "application/octet-stream"

enum slot_state { SLOT_PENDING, SLOT_SENT, SLOT_DONE };

/* What the current batch knows about msgs[i]. */
struct slot {
	unsigned char state;	/* enum slot_state */
	bool returned;		/* basic.return seen: its ack is no success */
	bool suspect;		/* unconfirmed when an unexplained channel
				 * close came: resent in ever smaller
				 * groups until the culprit is alone */
};

/*
 * One confirm window on channel 1: the message behind each delivery tag
 * published since the window opened.  Tags are consecutive per channel,
 * so tag t is idx[t - base].
 */
struct window {
	uint64_t base;
	size_t *idx;
	size_t len, cap;
	size_t lo;		/* every tag below base + lo is confirmed */
	size_t outstanding;	/* published and not yet confirmed */
	size_t ret_cursor;	/* returns come in publish order: look here */
};

/* Exchanges known to work (until reconnect) or to fail (this batch). */
struct xentry {
	char *name;
	char *type;		/* "" for a passive check */
	bool ok;
	uint64_t batch;		/* the batch a failure belongs to */
	char reason[256];
};

struct broker {
	struct broker_conf conf;	/* deep copy; password wiped */
	amqp_connection_state_t conn;	/* NULL when disconnected */
	char node[300];			/* host:port connected to */
	bool pub_open, check_open;	/* channels 1 and 2 usable */
	bool consuming;
	uint64_t next_tag;		/* of the next publish on channel 1 */
	uint64_t batch_seq;
	size_t broker_max_size;		/* learned from a 406; 0 unknown */
	struct xentry *xs;
	size_t n_xs, cap_xs;
	struct slot *slots;
	size_t cap_slots;
	struct window win;
	amqp_table_entry_t *entries;	/* headers of the message in hand */
	size_t cap_entries;
	bool want_return_header;	/* a basic.return's header is next */
	char return_reason[256];
	char close_reason[256];		/* the last close of channel 1 */
	char err[512];
};

/* One call of broker_publish_batch(). */
struct batch {
	struct broker *b;
	const struct broker_msg *msgs;
	size_t n;
	struct broker_result *res;
	int64_t deadline;		/* monotonic ms */
	size_t probe;			/* suspects per round */
	unsigned closes;		/* of channel 1, in this batch */
};

/* ---- errors and the connection's life ---------------------------------- */

static void
set_err(struct broker *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Error text is "host:port: what happened" when a node is known. */
static void
set_err(struct broker *b, const char *fmt, ...)
{
	char msg[400];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (b->node[0] != '\0')
		strfmt(b->err, sizeof(b->err), "%s: %s", b->node, msg);
	else
		strfmt(b->err, sizeof(b->err), "%s", msg);
}

static void
xcache_clear(struct broker *b)
{
	for (size_t i = 0; i < b->n_xs; i++) {
		free(b->xs[i].name);
		free(b->xs[i].type);
	}
	b->n_xs = 0;
}

/* Frees the connection without a word to the broker: it is broken, or
 * we cannot know what it holds.  A broken connection is never reused. */
static void
drop(struct broker *b)
{
	if (b->conn != NULL)
		amqp_destroy_connection(b->conn);
	b->conn = NULL;
	b->pub_open = b->check_open = b->consuming = false;
	b->broker_max_size = 0;
	xcache_clear(b);
}

static int
conn_lost(struct broker *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Records why the connection is unusable and drops it; returns -1. */
static int
conn_lost(struct broker *b, const char *fmt, ...)
{
	char msg[400];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	set_err(b, "%s", msg);
	drop(b);
	return -1;
}

/* The broker closed the whole connection: say goodbye and drop it. */
static int
conn_closed_by_broker(struct broker *b, const amqp_connection_close_t *m)
{
	amqp_connection_close_ok_t ok = { 0 };
	char text[256];

	strfmt(text, sizeof(text), "%.*s", (int)m->reply_text.len,
	    (const char *)m->reply_text.bytes);
	(void)amqp_send_method(b->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD,
	    &ok);
	return conn_lost(b, "connection closed by the broker: %s (%u)", text,
	    m->reply_code);
}

/* Answers the broker's channel.close, after which the channel may be
 * opened again. */
static int
channel_close_ok(struct broker *b, amqp_channel_t ch)
{
	amqp_channel_close_ok_t ok = { 0 };
	int st;

	st = amqp_send_method(b->conn, ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
	if (st != AMQP_STATUS_OK)
		return conn_lost(b, "channel.close-ok: %s",
		    amqp_error_string2(st));
	if (ch == CH_PUB)
		b->pub_open = false;
	else if (ch == CH_CHECK)
		b->check_open = false;
	return 0;
}

/*
 * Sorts out an RPC's reply: 0 done; 1 the broker refused and closed the
 * channel (its words in reason, close-ok sent); -1 the connection is gone
 * (dropped, error in b->err).
 */
static int WARN_UNUSED
rpc_outcome(struct broker *b, amqp_channel_t ch, amqp_rpc_reply_t r,
    const char *what, char *reason, size_t size)
{
	const amqp_channel_close_t *cc;

	switch (r.reply_type) {
	case AMQP_RESPONSE_NORMAL:
		return 0;
	case AMQP_RESPONSE_SERVER_EXCEPTION:
		if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD)
			return conn_closed_by_broker(b, r.reply.decoded);
		if (r.reply.id != AMQP_CHANNEL_CLOSE_METHOD)
			return conn_lost(b, "%s: unexpected reply 0x%08x",
			    what, (unsigned)r.reply.id);
		cc = r.reply.decoded;
		strfmt(reason, size, "%.*s", (int)cc->reply_text.len,
		    (const char *)cc->reply_text.bytes);
		return channel_close_ok(b, ch) == -1 ? -1 : 1;
	case AMQP_RESPONSE_LIBRARY_EXCEPTION:
		return conn_lost(b, "%s: %s", what,
		    amqp_error_string2(r.library_error));
	default:
		return conn_lost(b, "%s: no reply", what);
	}
}

static struct timeval
ms_to_tv(int64_t ms)
{
	struct timeval tv;

	if (ms < 0)
		ms = 0;
	tv.tv_sec = ms / 1000;
	tv.tv_usec = (ms % 1000) * 1000;
	return tv;
}

/* Bounds the next RPCs: rabbitmq-c closes the socket when one times
 * out, which is what a stuck broker deserves. */
static void
rpc_deadline(struct broker *b, int64_t deadline)
{
	int64_t left = deadline - now_mono_ms();
	struct timeval tv = ms_to_tv(left > 0 ? left : 1);

	(void)amqp_set_rpc_timeout(b->conn, &tv);
}

static int64_t
confirm_ms(const struct broker *b)
{
	return b->conf.confirm_timeout_ms > 0 ? b->conf.confirm_timeout_ms :
	    DEFAULT_CONFIRM_MS;
}

static int64_t
connect_ms(const struct broker *b)
{
	return b->conf.connect_timeout_ms > 0 ? b->conf.connect_timeout_ms :
	    DEFAULT_CONNECT_MS;
}

/* Opens channel ch; the publishing channel also gets confirm.select,
 * after which its delivery tags count from 1. */
static int WARN_UNUSED
open_channel(struct broker *b, amqp_channel_t ch, int64_t deadline)
{
	char reason[256];
	int rc;

	rpc_deadline(b, deadline);
	amqp_channel_open(b->conn, ch);
	rc = rpc_outcome(b, ch, amqp_get_rpc_reply(b->conn), "channel.open",
	    reason, sizeof(reason));
	if (rc == 0 && ch == CH_PUB) {
		amqp_confirm_select(b->conn, ch);
		rc = rpc_outcome(b, ch, amqp_get_rpc_reply(b->conn),
		    "confirm.select", reason, sizeof(reason));
	}
	if (rc == 1)
		return conn_lost(b, "opening channel %u: %s", ch, reason);
	if (rc == -1)
		return -1;
	if (ch == CH_PUB) {
		b->pub_open = true;
		b->next_tag = 1;
	} else if (ch == CH_CHECK) {
		b->check_open = true;
	}
	return 0;
}

static int WARN_UNUSED
ensure_channels(struct broker *b, int64_t deadline)
{
	if (!b->pub_open && open_channel(b, CH_PUB, deadline) == -1)
		return -1;
	if (!b->check_open && open_channel(b, CH_CHECK, deadline) == -1)
		return -1;
	return 0;
}

/* ---- connecting -------------------------------------------------------- */

/* Connects one address before deadline; returns the fd or -1 with the
 * reason in err. */
static int WARN_UNUSED
tcp_try(const struct addrinfo *ai, int64_t deadline, char *err, size_t size)
{
	struct pollfd pfd;
	socklen_t len = sizeof(int);
	int fd, rc, one = 1, soerr = 0, saved;

	fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK |
	    SOCK_CLOEXEC, ai->ai_protocol);
	if (fd == -1) {
		strfmt(err, size, "socket: %s", strerror(errno));
		return -1;
	}
	/* What rabbitmq-c's own open sets up: it expects a non-blocking
	 * socket (it polls with its own timeouts) and no Nagle delay. */
	(void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	(void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
	if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
		return fd;
	if (errno != EINPROGRESS)
		goto fail;
	pfd.fd = fd;
	pfd.events = POLLOUT;
	do {
		int64_t left = deadline - now_mono_ms();
		rc = poll(&pfd, 1, left > 0 ? (int)left : 0);
	} while (rc == -1 && errno == EINTR);
	if (rc == 0)
		errno = ETIMEDOUT;
	if (rc <= 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == -1)
		goto fail;
	if (soerr == 0)
		return fd;
	errno = soerr;
fail:
	saved = errno;
	close(fd);
	strfmt(err, size, "cannot connect: %s", strerror(saved));
	return -1;
}

/*
 * Our own TCP connect, so that the error says "Connection refused" or
 * "timed out" where rabbitmq-c would only say "a socket error occurred".
 */
static int WARN_UNUSED
tcp_connect(const char *host, int port, int64_t timeout_ms, char *err,
    size_t size)
{
	struct addrinfo hints, *res, *ai;
	char service[16];
	int64_t deadline = now_mono_ms() + timeout_ms;
	int fd = -1, rc;

	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	strfmt(service, sizeof(service), "%d", port);
	rc = getaddrinfo(host, service, &hints, &res);
	if (rc != 0) {
		strfmt(err, size, "cannot resolve: %s", gai_strerror(rc));
		return -1;
	}
	for (ai = res; ai != NULL && fd == -1; ai = ai->ai_next)
		fd = tcp_try(ai, deadline, err, size);
	freeaddrinfo(res);
	return fd;
}

/*
 * The system's trusted CAs on Debian (where OpenSSL's default file points).
 * rabbitmq-c 0.11 never loads OpenSSL's default locations, so without
 * rabbitmq.tls.ca_file no broker could pass verify_peer at all.
 */
#define SYSTEM_CA_FILE "/etc/ssl/certs/ca-certificates.crt"

/* rabbitmq-c says only "a SSL error occurred" for a file it cannot load:
 * open it first so that a missing or unreadable one says why. */
static int WARN_UNUSED
tls_file_check(struct broker *b, const char *key, const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);

	if (fd == -1) {
		set_err(b, "%s %s: %s", key, path, strerror(errno));
		return -1;
	}
	close(fd);
	return 0;
}

static int WARN_UNUSED
tls_setup(struct broker *b, amqp_socket_t *sock)
{
	const struct broker_conf *c = &b->conf;
	const char *ca = c->tls_ca_file, *key;
	const char *what = "rabbitmq.tls.ca_file";
	int st;

	if (ca == NULL && c->tls_verify_peer) {
		ca = SYSTEM_CA_FILE;
		what = "rabbitmq.tls.ca_file is unset and the system CAs";
	}
	if (ca != NULL) {
		if (tls_file_check(b, what, ca) == -1)
			return -1;
		if ((st = amqp_ssl_socket_set_cacert(sock, ca)) != 0) {
			set_err(b, "%s %s: no PEM certificate could be loaded "
			    "(%s)", what, ca, amqp_error_string2(st));
			return -1;
		}
	}
	if (c->tls_cert_file != NULL) {
		key = c->tls_key_file ? c->tls_key_file : c->tls_cert_file;
		if (tls_file_check(b, "rabbitmq.tls.cert_file",
		    c->tls_cert_file) == -1 ||
		    tls_file_check(b, "rabbitmq.tls.key_file", key) == -1)
			return -1;
		if ((st = amqp_ssl_socket_set_key(sock, c->tls_cert_file,
		    key)) != 0) {
			set_err(b, "rabbitmq.tls.cert_file %s, key_file %s: "
			    "cannot load them: not PEM, or the key does not "
			    "match the certificate (%s)", c->tls_cert_file, key,
			    amqp_error_string2(st));
			return -1;
		}
	}
	amqp_ssl_socket_set_verify_peer(sock, c->tls_verify_peer);
	amqp_ssl_socket_set_verify_hostname(sock, c->tls_verify_hostname);
	/* Failing here would leave TLS 1.0 and 1.1 allowed: refuse. */
	if ((st = amqp_ssl_socket_set_ssl_versions(sock, AMQP_TLSv1_2,
	    AMQP_TLSvLATEST)) != 0) {
		set_err(b, "cannot limit TLS to 1.2 and later: %s",
		    amqp_error_string2(st));
		return -1;
	}
	return 0;
}

/* What to do about a failed TLS open, for the error message. */
static const char *
tls_open_hint(int st, const char *host)
{
	struct in6_addr a;

	switch (st) {
	case AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED:
		/* rabbitmq-c 0.11 compares DNS names (SAN, else CN) only. */
		if (inet_pton(AF_INET, host, &a) == 1 ||
		    inet_pton(AF_INET6, host, &a) == 1)
			return "the certificate must list the node as a DNS "
			    "name: rabbitmq-c never matches IP addresses, so "
			    "name the node by a host name the certificate "
			    "lists";
		return "the broker's certificate does not name this host";
	case AMQP_STATUS_SSL_PEER_VERIFY_FAILED:
		return "the broker's certificate is not signed by a CA in "
		    "rabbitmq.tls.ca_file (unset: the system's CAs), or has "
		    "expired";
	case AMQP_STATUS_SSL_CONNECTION_FAILED:
		return "is the port an amqps (TLS) port?";
	default:
		return NULL;
	}
}

/* Gives b->conn an open socket to node. */
static int WARN_UNUSED
open_socket(struct broker *b, const struct broker_node *node)
{
	struct timeval tv = ms_to_tv(connect_ms(b));
	amqp_socket_t *sock;
	char why[200];
	int fd, st;

	if (!b->conf.tls) {
		fd = tcp_connect(node->host, node->port, connect_ms(b), why,
		    sizeof(why));
		if (fd == -1) {
			set_err(b, "%s", why);
			return -1;
		}
		sock = amqp_tcp_socket_new(b->conn);
		if (sock == NULL) {
			close(fd);
			set_err(b, "cannot create a socket object");
			return -1;
		}
		amqp_tcp_socket_set_sockfd(sock, fd);
		return 0;
	}
	sock = amqp_ssl_socket_new(b->conn);
	if (sock == NULL) {
		set_err(b, "cannot create a TLS socket");
		return -1;
	}
	if (tls_setup(b, sock) == -1)
		return -1;
	st = amqp_socket_open_noblock(sock, node->host, node->port, &tv);
	if (st != AMQP_STATUS_OK) {
		const char *hint = tls_open_hint(st, node->host);

		set_err(b, "cannot connect (TLS): %s%s%s",
		    amqp_error_string2(st), hint ? ": " : "", hint ? hint : "");
		return -1;
	}
	return 0;
}

static int WARN_UNUSED
login(struct broker *b)
{
	const struct broker_conf *c = &b->conf;
	amqp_table_entry_t name = {
		.key = amqp_cstring_bytes("connection_name"),
		.value = { .kind = AMQP_FIELD_KIND_UTF8,
		    .value.bytes = amqp_cstring_bytes("outboxd") },
	};
	amqp_table_t props = { 1, &name };
	struct timeval tv = ms_to_tv(connect_ms(b));
	amqp_rpc_reply_t r;
	const amqp_connection_close_t *m;

	(void)amqp_set_handshake_timeout(b->conn, &tv);
	r = amqp_login_with_properties(b->conn, c->vhost, 0,
	    c->frame_max > 0 ? c->frame_max : AMQP_DEFAULT_FRAME_SIZE,
	    c->heartbeat_s, &props, AMQP_SASL_METHOD_PLAIN, c->user,
	    c->password);
	if (r.reply_type == AMQP_RESPONSE_NORMAL)
		return 0;
	if (r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
	    r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
		m = r.reply.decoded;
		set_err(b, "login refused: %.*s (%u)", (int)m->reply_text.len,
		    (const char *)m->reply_text.bytes, m->reply_code);
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_CONNECTION_CLOSED) {
		set_err(b, "login failed: the broker closed the connection "
		    "(wrong user, password or vhost?)");
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_SSL_ERROR && c->tls) {
		/* With TLS 1.3 a refused client certificate only shows
		 * once the first AMQP bytes are read. */
		set_err(b, "login failed: %s (did the broker refuse the "
		    "client certificate? see rabbitmq.tls.cert_file)",
		    amqp_error_string2(r.library_error));
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_SOCKET_ERROR && !c->tls) {
		/* A TLS listener drops a plain AMQP header this way. */
		set_err(b, "login failed: %s (an amqps port? then set "
		    "rabbitmq.tls.enabled)",
		    amqp_error_string2(r.library_error));
	} else {
		set_err(b, "login failed: %s", r.reply_type ==
		    AMQP_RESPONSE_LIBRARY_EXCEPTION ?
		    amqp_error_string2(r.library_error) : "unexpected reply");
	}
	return -1;
}

static int WARN_UNUSED
connect_node(struct broker *b, const struct broker_node *node)
{
	strfmt(b->node, sizeof(b->node), "%s:%d", node->host, node->port);
	b->conn = amqp_new_connection();
	if (b->conn == NULL) {
		set_err(b, "out of memory");
		return -1;
	}
	if (open_socket(b, node) == -1 || login(b) == -1) {
		drop(b);
		return -1;
	}
	/* ensure_channels() drops the connection itself on failure. */
	return ensure_channels(b, now_mono_ms() + connect_ms(b));
}

int
broker_connect(struct broker *b)
{
	char qerr[600];

	broker_disconnect(b);
	b->node[0] = '\0';
	if (b->conf.n_nodes == 0) {
		set_err(b, "no rabbitmq node configured");
		log_error("broker connect failed", "error=%s",
		    log_quote(qerr, sizeof(qerr), b->err));
		return -1;
	}
	for (size_t i = 0; i < b->conf.n_nodes; i++) {
		if (connect_node(b, &b->conf.nodes[i]) == 0) {
			log_info("broker connected", "node=%s tls=%s "
			    "frame_max=%d heartbeat_s=%d", b->node,
			    b->conf.tls ? "on" : "off",
			    amqp_get_frame_max(b->conn),
			    amqp_get_heartbeat(b->conn));
			return 0;
		}
		log_warn("broker connect failed", "node=%s error=%s", b->node,
		    log_quote(qerr, sizeof(qerr), b->err));
	}
	return -1;
}

bool
broker_connected(const struct broker *b)
{
	return b != NULL && b->conn != NULL;
}

void
broker_disconnect(struct broker *b)
{
	struct timeval tv = ms_to_tv(CLOSE_TIMEOUT_MS);

	if (b == NULL || b->conn == NULL)
		return;
	/* A polite close lets the broker log a clean goodbye; if the
	 * connection is already broken this fails fast, and either way
	 * everything is freed below. */
	(void)amqp_set_rpc_timeout(b->conn, &tv);
	(void)amqp_connection_close(b->conn, AMQP_REPLY_SUCCESS);
	drop(b);
}

const char *
broker_error(const struct broker *b)
{
	return b->err[0] != '\0' ? b->err : "no error";
}

/* ---- the life of a struct broker --------------------------------------- */

static char *
dup_or_null(const char *s)
{
	return s != NULL ? xstrdup(s) : NULL;
}

struct broker *
broker_new(const struct broker_conf *conf)
{
	struct broker *b = xcalloc(1, sizeof(*b));
	struct broker_conf *c = &b->conf;

	*c = *conf;
	if (c->n_nodes > BROKER_MAX_NODES)
		c->n_nodes = BROKER_MAX_NODES;
	for (size_t i = 0; i < c->n_nodes; i++)
		c->nodes[i].host = xstrdup(conf->nodes[i].host);
	c->vhost = xstrdup(conf->vhost ? conf->vhost : "/");
	c->user = xstrdup(conf->user);
	c->password = xstrdup(conf->password);
	c->tls_ca_file = dup_or_null(conf->tls_ca_file);
	c->tls_cert_file = dup_or_null(conf->tls_cert_file);
	c->tls_key_file = dup_or_null(conf->tls_key_file);
	return b;
}

void
broker_free(struct broker *b)
{
	if (b == NULL)
		return;
	broker_disconnect(b);
	for (size_t i = 0; i < b->conf.n_nodes; i++)
		free(b->conf.nodes[i].host);
	free(b->conf.vhost);
	free(b->conf.user);
	secret_free(b->conf.password);
	free(b->conf.tls_ca_file);
	free(b->conf.tls_cert_file);
	free(b->conf.tls_key_file);
	free(b->xs);
	free(b->slots);
	free(b->win.idx);
	free(b->entries);
	free(b);
}

/* ---- the exchange cache ------------------------------------------------ */

static struct xentry *
xcache_find(struct broker *b, const char *name, const char *type)
{
	for (size_t i = 0; i < b->n_xs; i++) {
		if (strcmp(b->xs[i].name, name) == 0 &&
		    strcmp(b->xs[i].type, type) == 0)
			return &b->xs[i];
	}
	return NULL;
}

static void
xcache_put(struct broker *b, const char *name, const char *type, bool ok,
    const char *reason)
{
	struct xentry *x = xcache_find(b, name, type);

	/* A failure from an earlier batch is worth nothing: its slot is
	 * reused, so that bogus names cannot grow the cache. */
	for (size_t i = 0; x == NULL && i < b->n_xs; i++) {
		if (!b->xs[i].ok && b->xs[i].batch != b->batch_seq) {
			x = &b->xs[i];
			free(x->name);
			free(x->type);
			x->name = xstrdup(name);
			x->type = xstrdup(type);
		}
	}
	if (x == NULL) {
		if (b->n_xs == b->cap_xs) {
			b->cap_xs = b->cap_xs ? b->cap_xs * 2 : 16;
			b->xs = xrealloc(b->xs, b->cap_xs * sizeof(*b->xs));
		}
		x = &b->xs[b->n_xs++];
		x->name = xstrdup(name);
		x->type = xstrdup(type);
	}
	x->ok = ok;
	x->batch = b->batch_seq;
	strfmt(x->reason, sizeof(x->reason), "%s", ok ? "" : reason);
}

/* The exchange failed under our feet (deleted after it was checked):
 * whatever we knew about it is stale. */
static void
xcache_forget(struct broker *b, const char *name)
{
	for (size_t i = 0; i < b->n_xs;) {
		if (strcmp(b->xs[i].name, name) != 0) {
			i++;
			continue;
		}
		free(b->xs[i].name);
		free(b->xs[i].type);
		b->xs[i] = b->xs[--b->n_xs];
	}
}

/*
 * Whether an exchange can take messages: 0 yes, 1 no (the broker's words
 * in reason), -1 connection lost.  With a type it is declared (created
 * when missing, 406 when it exists with another type), without one it
 * must exist.  Successes are cached until reconnect, failures for the
 * batch.
 */
static int WARN_UNUSED
exchange_usable(struct broker *b, const char *name, const char *type,
    int64_t deadline, char *reason, size_t size)
{
	const struct xentry *x;
	bool passive = (*type == '\0');
	int rc;

	if (*name == '\0')
		return 0;	/* the default exchange always exists */
	x = xcache_find(b, name, type);
	if (x != NULL && x->ok)
		return 0;
	if (x != NULL && x->batch == b->batch_seq) {
		strfmt(reason, size, "%s", x->reason);
		return 1;
	}
	if (ensure_channels(b, deadline) == -1)
		return -1;
	rpc_deadline(b, deadline);
	amqp_exchange_declare(b->conn, CH_CHECK, amqp_cstring_bytes(name),
	    passive ? amqp_empty_bytes : amqp_cstring_bytes(type), passive,
	    1, 0, 0, amqp_empty_table);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "exchange.declare", reason, size);
	if (rc == -1)
		return -1;
	xcache_put(b, name, type, rc == 0, reason);
	return rc;
}

/* ---- building a message ------------------------------------------------ */

static const char *const own_headers[] = {
	"business_module", "business_key", "attempt",
};

static bool
own_header(const char *key)
{
	for (size_t i = 0; i < ARRAY_LEN(own_headers); i++)
		if (strcmp(key, own_headers[i]) == 0)
			return true;
	return false;
}

static amqp_table_entry_t
str_entry(const char *key, const char *value)
{
	amqp_table_entry_t e;

	e.key = amqp_cstring_bytes(key);
	e.value.kind = AMQP_FIELD_KIND_UTF8;
	e.value.value.bytes = amqp_cstring_bytes(value);
	return e;
}

/* Properties for m.  They point into m, id and b->entries, which are
 * reused for every message: no allocation per message. */
static void
message_props(struct broker *b, const struct broker_msg *m,
    amqp_basic_properties_t *p, char *id, size_t idsize)
{
	amqp_table_entry_t *e;
	size_t n = 0;

	if (b->cap_entries < m->n_headers + ARRAY_LEN(own_headers)) {
		b->cap_entries = m->n_headers + ARRAY_LEN(own_headers) + 8;
		b->entries = xrealloc(b->entries,
		    b->cap_entries * sizeof(*b->entries));
	}
	e = b->entries;
	if (m->business_module != NULL)
		e[n++] = str_entry("business_module", m->business_module);
	if (m->business_key != NULL)
		e[n++] = str_entry("business_key", m->business_key);
	e[n].key = amqp_cstring_bytes("attempt");
	e[n].value.kind = AMQP_FIELD_KIND_I32;
	e[n++].value.value.i32 = m->attempt;
	for (size_t i = 0; i < m->n_headers; i++) {
		const char *k = m->header_keys[i], *v = m->header_values[i];
		/* Ours win: a consumer must be able to trust them. */
		if (k != NULL && v != NULL && !own_header(k))
			e[n++] = str_entry(k, v);
	}
	memset(p, 0, sizeof(*p));
	p->_flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_HEADERS_FLAG |
	    AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG;
	p->content_type = amqp_cstring_bytes(m->content_type ?
	    m->content_type : DEFAULT_CONTENT_TYPE);
	p->headers.num_entries = (int)n;
	p->headers.entries = e;
	p->delivery_mode = AMQP_DELIVERY_PERSISTENT;
	strfmt(id, idsize, "%" PRId64, m->id);
	p->message_id = amqp_cstring_bytes(id);
	if (m->timestamp_s > 0) {
		p->_flags |= AMQP_BASIC_TIMESTAMP_FLAG;
		p->timestamp = (uint64_t)m->timestamp_s;
	}
}

/* Encoded size of the content header, an upper bound. */
static size_t
props_size(const struct broker_msg *m)
{
	size_t size = 128;	/* frame, fixed fields, message_id, attempt */

	if (m->content_type != NULL)
		size += strlen(m->content_type);
	if (m->business_module != NULL)
		size += 32 + strlen(m->business_module);
	if (m->business_key != NULL)
		size += 32 + strlen(m->business_key);
	for (size_t i = 0; i < m->n_headers; i++) {
		if (m->header_keys[i] != NULL && m->header_values[i] != NULL)
			size += 6 + strlen(m->header_keys[i]) +
			    strlen(m->header_values[i]);
	}
	return size;
}

static bool
too_long(const char *s)
{
	return s != NULL && strlen(s) > SHORTSTR_MAX;
}

/*
 * Why m can never be published as it is; false when it can.  A content
 * header must fit one frame, and rabbitmq-c fails a header that does not
 * only after the method frame went out, which breaks the connection:
 * such a row would take every batch down with it.
 */
static bool
msg_invalid(const struct broker *b, const struct broker_msg *m,
    char *reason, size_t size)
{
	size_t frame_max = (size_t)amqp_get_frame_max(b->conn);
	bool long_name = too_long(m->exchange) || too_long(m->routing_key) ||
	    too_long(m->content_type) || too_long(m->exchange_type);

	for (size_t i = 0; i < m->n_headers; i++)
		long_name = long_name || too_long(m->header_keys[i]);
	if (b->conf.max_payload > 0 && m->body_len > b->conf.max_payload)
		strfmt(reason, size, "payload of %zu bytes exceeds "
		    "rabbitmq.max_payload (%zu)", m->body_len,
		    b->conf.max_payload);
	else if (long_name)
		strfmt(reason, size, "exchange, exchange type, routing key, "
		    "content type or header name longer than %d bytes",
		    SHORTSTR_MAX);
	else if (props_size(m) > frame_max)
		strfmt(reason, size, "headers of about %zu bytes do not fit "
		    "one frame (frame_max %zu)", props_size(m), frame_max);
	else
		return false;
	return true;
}

/* ---- the batch --------------------------------------------------------- */

static void
finish(struct batch *bt, size_t i, enum broker_outcome outcome,
    bool permanent, const char *reason)
{
	struct broker_result *r = &bt->res[i];

	bt->b->slots[i].state = SLOT_DONE;
	r->outcome = outcome;
	r->permanent = permanent;
	if (reason != r->reason)
		strfmt(r->reason, sizeof(r->reason), "%s", reason);
	if (outcome != BROKER_ACKED) {
		char q[300];
		log_debug("message not taken", "id=%" PRId64 " reason=%s",
		    bt->msgs[i].id, log_quote(q, sizeof(q), reason));
	}
}

static size_t
batch_left(const struct batch *bt)
{
	size_t left = 0;

	for (size_t i = 0; i < bt->n; i++)
		left += bt->b->slots[i].state != SLOT_DONE;
	return left;
}

static bool
batch_has_suspect(const struct batch *bt)
{
	for (size_t i = 0; i < bt->n; i++) {
		const struct slot *s = &bt->b->slots[i];
		if (s->state == SLOT_PENDING && s->suspect)
			return true;
	}
	return false;
}

/* Settles what can be settled without sending: limits, exchanges. */
static int WARN_UNUSED
batch_prepare(struct batch *bt)
{
	struct broker *b = bt->b;
	char reason[256];

	if (ensure_channels(b, bt->deadline) == -1)
		return -1;
	for (size_t i = 0; i < bt->n; i++) {
		const struct broker_msg *m = &bt->msgs[i];
		int rc;

		if (b->slots[i].state != SLOT_PENDING)
			continue;
		if (msg_invalid(b, m, reason, sizeof(reason))) {
			finish(bt, i, BROKER_REJECTED, true, reason);
			continue;
		}
		if (b->broker_max_size > 0 &&
		    m->body_len > b->broker_max_size) {
			/* Sending it would only close the channel again. */
			strfmt(reason, sizeof(reason), "payload of %zu bytes "
			    "exceeds the broker's max_message_size (%zu)",
			    m->body_len, b->broker_max_size);
			/* The row can never fit as it is: permanent. */
			finish(bt, i, BROKER_REJECTED, true, reason);
			continue;
		}
		rc = exchange_usable(b, m->exchange ? m->exchange : "",
		    m->exchange_type ? m->exchange_type : "", bt->deadline,
		    reason, sizeof(reason));
		if (rc == -1)
			return -1;
		if (rc == 1)
			finish(bt, i, BROKER_REJECTED, false, reason);
	}
	return 0;
}

static void
window_reset(struct window *w, uint64_t base)
{
	w->base = base;
	w->len = w->lo = w->outstanding = w->ret_cursor = 0;
}

static void
window_push(struct window *w, size_t i)
{
	if (w->len == w->cap) {
		w->cap = w->cap ? w->cap * 2 : 256;
		w->idx = xrealloc(w->idx, w->cap * sizeof(*w->idx));
	}
	w->idx[w->len++] = i;
	w->outstanding++;
}

static int WARN_UNUSED
publish_one(struct batch *bt, size_t i)
{
	struct broker *b = bt->b;
	const struct broker_msg *m = &bt->msgs[i];
	amqp_basic_properties_t props;
	amqp_bytes_t body = { m->body_len, (void *)m->body };
	char id[24];
	int st;

	message_props(b, m, &props, id, sizeof(id));
	st = amqp_basic_publish(b->conn, CH_PUB,
	    amqp_cstring_bytes(m->exchange ? m->exchange : ""),
	    amqp_cstring_bytes(m->routing_key ? m->routing_key : ""),
	    1, 0, &props, body);
	if (st != AMQP_STATUS_OK)
		return conn_lost(b, "publishing id %" PRId64 ": %s", m->id,
		    amqp_error_string2(st));
	b->next_tag++;
	b->slots[i].state = SLOT_SENT;
	b->slots[i].returned = false;
	bt->res[i].outcome = BROKER_UNKNOWN;
	bt->res[i].reason[0] = '\0';
	window_push(&b->win, i);
	return 0;
}

static void
confirm_slot(struct batch *bt, size_t i, bool ack)
{
	struct slot *s = &bt->b->slots[i];

	if (s->state != SLOT_SENT)
		return;
	bt->b->win.outstanding--;
	if (s->returned)	/* the reason was set by the return */
		finish(bt, i, BROKER_RETURNED, false, bt->res[i].reason);
	else if (ack)
		finish(bt, i, BROKER_ACKED, false, "");
	else
		finish(bt, i, BROKER_NACKED, false, "basic.nack: the broker "
		    "could not take the message");
}

/* basic.ack / basic.nack; multiple covers every tag up to this one. */
static void
window_confirm(struct batch *bt, uint64_t tag, bool multiple, bool ack)
{
	struct window *w = &bt->b->win;
	size_t last;

	if (w->len == 0)
		return;
	if (multiple && tag == 0)	/* 0 with multiple: everything */
		tag = w->base + w->len - 1;
	if (tag < w->base || tag - w->base >= w->len) {
		log_debug("confirm for an unknown tag", "tag=%" PRIu64, tag);
		return;
	}
	last = (size_t)(tag - w->base);
	for (size_t k = multiple ? w->lo : last; k <= last; k++)
		confirm_slot(bt, w->idx[k], ack);
	while (w->lo < w->len && bt->b->slots[w->idx[w->lo]].state ==
	    SLOT_DONE)
		w->lo++;
}

static bool
parse_id(amqp_bytes_t s, int64_t *id)
{
	char buf[24], *end;

	if (s.len == 0 || s.len >= sizeof(buf))
		return false;
	memcpy(buf, s.bytes, s.len);
	buf[s.len] = '\0';
	errno = 0;
	*id = strtoll(buf, &end, 10);
	return errno == 0 && *end == '\0';
}

/* The in-flight message with this outbox id, or (size_t)-1. */
static size_t
window_find_id(struct batch *bt, int64_t id)
{
	struct window *w = &bt->b->win;

	for (size_t n = 0; n < w->len; n++) {
		size_t k = (w->ret_cursor + n) % w->len, i = w->idx[k];
		const struct slot *s = &bt->b->slots[i];

		if (s->state == SLOT_SENT && !s->returned &&
		    bt->msgs[i].id == id) {
			w->ret_cursor = k + 1;
			return i;
		}
	}
	return (size_t)-1;
}

static void
return_begin(struct broker *b, const amqp_basic_return_t *m)
{
	b->want_return_header = true;
	strfmt(b->return_reason, sizeof(b->return_reason),
	    "%.*s (%u): exchange '%.*s' routing key '%.*s'",
	    (int)m->reply_text.len, (const char *)m->reply_text.bytes,
	    m->reply_code, (int)m->exchange.len,
	    (const char *)m->exchange.bytes, (int)m->routing_key.len,
	    (const char *)m->routing_key.bytes);
}

/*
 * The content header after a basic.return names the message by its
 * message_id; the return comes before that message's ack, which must
 * then not count as success.  The body frames that follow are ignored:
 * nothing else carries content on the publishing channel.
 */
static void
return_header(struct batch *bt, const amqp_frame_t *f)
{
	const amqp_basic_properties_t *p = f->payload.properties.decoded;
	struct broker *b = bt->b;
	int64_t id;
	size_t i;

	if (!b->want_return_header)
		return;
	b->want_return_header = false;
	if (!(p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG) ||
	    !parse_id(p->message_id, &id) ||
	    (i = window_find_id(bt, id)) == (size_t)-1) {
		log_warn("basic.return for an unknown message", "reason=%s",
		    log_quote((char[300]){ 0 }, 300, b->return_reason));
		return;
	}
	b->slots[i].returned = true;
	bt->res[i].outcome = BROKER_RETURNED;
	strfmt(bt->res[i].reason, sizeof(bt->res[i].reason), "%s",
	    b->return_reason);
}

static int WARN_UNUSED
pub_channel_closed(struct batch *bt, const amqp_channel_close_t *m)
{
	struct broker *b = bt->b;
	char q[300];

	strfmt(b->close_reason, sizeof(b->close_reason), "%.*s",
	    (int)m->reply_text.len, (const char *)m->reply_text.bytes);
	/* Isolating a culprit takes a few closes: one warning is enough. */
	log_event(bt->closes++ == 0 ? LOG_WARN : LOG_DEBUG,
	    "publish channel closed by the broker", "node=%s code=%u "
	    "reason=%s unconfirmed=%zu", b->node, m->reply_code,
	    log_quote(q, sizeof(q), b->close_reason), b->win.outstanding);
	b->want_return_header = false;
	return channel_close_ok(b, CH_PUB);
}

static int WARN_UNUSED
pub_method(struct batch *bt, const amqp_method_t *m)
{
	const amqp_basic_ack_t *ack;
	const amqp_basic_nack_t *nack;

	switch (m->id) {
	case AMQP_BASIC_ACK_METHOD:
		ack = m->decoded;
		window_confirm(bt, ack->delivery_tag, ack->multiple, true);
		return 0;
	case AMQP_BASIC_NACK_METHOD:
		nack = m->decoded;
		window_confirm(bt, nack->delivery_tag, nack->multiple, false);
		return 0;
	case AMQP_BASIC_RETURN_METHOD:
		return_begin(bt->b, m->decoded);
		return 0;
	case AMQP_CHANNEL_CLOSE_METHOD:
		return pub_channel_closed(bt, m->decoded);
	default:
		log_debug("unexpected method on the publish channel",
		    "method=0x%08x", (unsigned)m->id);
		return 0;
	}
}

/* Channel 0: the connection itself. */
static int WARN_UNUSED
conn_method(struct broker *b, const amqp_method_t *m)
{
	const amqp_connection_blocked_t *blocked;

	switch (m->id) {
	case AMQP_CONNECTION_CLOSE_METHOD:
		return conn_closed_by_broker(b, m->decoded);
	case AMQP_CONNECTION_BLOCKED_METHOD:
		blocked = m->decoded;
		log_warn("broker blocks publishing", "node=%s reason=%.*s",
		    b->node, (int)blocked->reason.len,
		    (const char *)blocked->reason.bytes);
		return 0;
	case AMQP_CONNECTION_UNBLOCKED_METHOD:
		log_info("broker unblocks publishing", "node=%s", b->node);
		return 0;
	default:
		return 0;
	}
}

static int WARN_UNUSED
handle_frame(struct batch *bt, const amqp_frame_t *f)
{
	struct broker *b = bt->b;
	bool method = f->frame_type == AMQP_FRAME_METHOD;

	if (method && f->channel == 0)
		return conn_method(b, &f->payload.method);
	if (method && f->channel == CH_CHECK &&
	    f->payload.method.id == AMQP_CHANNEL_CLOSE_METHOD)
		return channel_close_ok(b, CH_CHECK);
	if (f->channel != CH_PUB)
		return 0;
	if (method)
		return pub_method(bt, &f->payload.method);
	if (f->frame_type == AMQP_FRAME_HEADER)
		return_header(bt, f);
	return 0;
}

/*
 * Reads and handles one frame.  block: wait for it until the deadline
 * (returns 0 on a quiet wait too, the caller loops); otherwise take only
 * what is there and return 1 when nothing is.  -1: connection gone.
 */
static int WARN_UNUSED
pump(struct batch *bt, bool block)
{
	struct broker *b = bt->b;
	struct timeval tv = { 0, 0 };
	int64_t left = bt->deadline - now_mono_ms();
	amqp_frame_t f;
	int st, rc;

	if (left <= 0)
		return conn_lost(b, "%zu confirms missing after %" PRId64
		    " ms", b->win.outstanding, confirm_ms(b));
	/* Frames already inside the library (read ahead, or stashed by an
	 * RPC) never wake poll(): take them without waiting. */
	if (block && !amqp_frames_enqueued(b->conn) &&
	    !amqp_data_in_buffer(b->conn))
		tv = ms_to_tv(left);
	st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv);
	if (st == AMQP_STATUS_TIMEOUT)
		return block ? 0 : 1;
	if (st != AMQP_STATUS_OK)
		return conn_lost(b, "reading confirms: %s",
		    amqp_error_string2(st));
	rc = handle_frame(bt, &f);
	if (b->conn != NULL)
		amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
	return rc;
}

/* Handles every frame already available, without blocking: acks pile up
 * while we publish, and the broker may have closed the channel. */
static int WARN_UNUSED
pump_available(struct batch *bt)
{
	int rc;

	while ((rc = pump(bt, false)) == 0 && bt->b->pub_open)
		;
	return rc == -1 ? -1 : 0;
}

static size_t
size_after(const char *text, const char *key)
{
	const char *p = strstr(text, key);

	return p != NULL ? (size_t)strtoull(p + strlen(key), NULL, 10) : 0;
}

static bool
names_exchange(const char *text, const char *exchange)
{
	char needle[SHORTSTR_MAX + 16];

	if (exchange == NULL || *exchange == '\0')
		return false;
	strfmt(needle, sizeof(needle), "exchange '%s'", exchange);
	return strstr(text, needle) != NULL;
}

/*
 * The broker closed channel 1: none of the unconfirmed messages on it
 * will be confirmed.  Those its words point at (an exchange named, a
 * message size over the limit, or the only one left) are rejected; the
 * rest go back to pending.  If none could be pointed at, they become
 * suspects; returns how many.  Messages the broker took just before the
 * close are sent again: at-least-once, a copy at most per close.
 */
static size_t
window_after_close(struct batch *bt)
{
	struct broker *b = bt->b;
	struct window *w = &b->win;
	const char *text = b->close_reason;
	size_t max_size = size_after(text, "larger than configured max size ");
	bool alone = (w->outstanding == 1), blamed = false;
	size_t suspects = 0;

	if (max_size > 0)
		b->broker_max_size = max_size;
	for (size_t k = 0; k < w->len; k++) {
		const struct broker_msg *m = &bt->msgs[w->idx[k]];

		if (b->slots[w->idx[k]].state != SLOT_SENT)
			continue;
		if (alone || (max_size > 0 && m->body_len > max_size) ||
		    names_exchange(text, m->exchange)) {
			if (names_exchange(text, m->exchange))
				xcache_forget(b, m->exchange);
			/* Too big for the broker is permanent; a missing or
			 * mistyped exchange may be fixed by an operator. */
			finish(bt, w->idx[k], BROKER_REJECTED, max_size > 0 &&
			    m->body_len > max_size, text);
			blamed = true;
		}
	}
	for (size_t k = 0; k < w->len; k++) {
		struct slot *s = &b->slots[w->idx[k]];

		if (s->state != SLOT_SENT)
			continue;
		s->state = SLOT_PENDING;
		s->suspect = s->suspect || !blamed;
		suspects += !blamed;
	}
	window_reset(w, b->next_tag);
	return suspects;
}

/*
 * One confirm window: publishes the pending messages (while isolating,
 * only the first bt->probe suspects), reading acks as it goes, then
 * waits for every confirm or for the channel close that ends the window.
 */
static int WARN_UNUSED
batch_round(struct batch *bt)
{
	struct broker *b = bt->b;
	bool isolating = batch_has_suspect(bt), closed;
	size_t sent = 0, suspects;

	window_reset(&b->win, b->next_tag);
	b->want_return_header = false;
	for (size_t i = 0; i < bt->n && b->pub_open; i++) {
		const struct slot *s = &b->slots[i];

		if (s->state != SLOT_PENDING || (isolating && !s->suspect))
			continue;
		if (isolating && sent == bt->probe)
			break;
		if (publish_one(bt, i) == -1)
			return -1;
		if (++sent % DRAIN_EVERY == 0 && pump_available(bt) == -1)
			return -1;
	}
	while (b->pub_open && b->win.outstanding > 0) {
		if (pump(bt, true) == -1)
			return -1;
	}
	closed = !b->pub_open;
	suspects = closed ? window_after_close(bt) : 0;
	/*
	 * Isolating is a binary search, not a crawl (a round trip per
	 * suspect is too slow for thousands): an unexplained close puts the
	 * culprit among its suspects, so probe with the first half; a half
	 * that goes through puts it in the other half.  Once a culprit is
	 * found the rest are probably innocent: all of them together.
	 */
	if (suspects > 0)
		bt->probe = (suspects + 1) / 2;
	else if (closed || bt->probe <= 1)
		bt->probe = SIZE_MAX;
	else if (isolating)
		bt->probe = (bt->probe + 1) / 2;
	log_debug("confirm window done", "sent=%zu closed=%d suspects=%zu",
	    sent, closed, suspects);
	return 0;
}

static void
batch_start(struct batch *bt, struct broker *b,
    const struct broker_msg *msgs, size_t n, struct broker_result *res)
{
	bt->b = b;
	bt->msgs = msgs;
	bt->n = n;
	bt->res = res;
	bt->deadline = now_mono_ms() + confirm_ms(b);
	bt->probe = SIZE_MAX;
	bt->closes = 0;
	if (b->cap_slots < n) {
		b->cap_slots = n + n / 2 + 16;
		b->slots = xrealloc(b->slots, b->cap_slots * sizeof(*b->slots));
	}
	memset(b->slots, 0, n * sizeof(*b->slots));
	for (size_t i = 0; i < n; i++) {
		res[i].outcome = BROKER_UNKNOWN;
		res[i].permanent = false;
		res[i].reason[0] = '\0';
	}
	b->batch_seq++;
}

/* Whatever is not settled when the connection goes is unknown. */
static void
batch_abandon(struct batch *bt)
{
	size_t left = 0;
	char q[600];

	for (size_t i = 0; i < bt->n; i++) {
		if (bt->b->slots[i].state == SLOT_DONE)
			continue;
		finish(bt, i, BROKER_UNKNOWN, false, bt->b->err);
		left++;
	}
	drop(bt->b);
	log_error("broker connection lost", "unsettled=%zu error=%s", left,
	    log_quote(q, sizeof(q), bt->b->err));
}

int
broker_publish_batch(struct broker *b, const struct broker_msg *msgs,
    size_t n, struct broker_result *results)
{
	struct batch bt;
	/* A round settles a message, or halves the group of suspects that
	 * holds an unexplained culprit: about two rounds per bad message.
	 * The bound only stops a broker that closes the channel for
	 * reasons of its own. */
	size_t max_rounds = 3 * n + 8;

	batch_start(&bt, b, msgs, n, results);
	if (b->conn == NULL || b->consuming) {
		/* The caller's slip, not an event: nothing to log. */
		set_err(b, "%s", b->conn == NULL ? "not connected" :
		    "a consuming connection cannot publish");
		return -1;
	}
	for (size_t round = 0; batch_left(&bt) > 0; round++) {
		if (round == max_rounds) {
			for (size_t i = 0; i < n; i++) {
				if (b->slots[i].state != SLOT_DONE)
					finish(&bt, i, BROKER_REJECTED, false,
					    b->close_reason);
			}
			break;
		}
		if (batch_prepare(&bt) == -1 || batch_round(&bt) == -1)
			goto fail;
	}
	/* A batch leaves the publishing channel ready for the next, even
	 * when its last confirm came just before its deadline. */
	if (ensure_channels(b, now_mono_ms() + connect_ms(b)) == -1)
		goto fail;
	amqp_maybe_release_buffers(b->conn);
	return 0;
fail:
	batch_abandon(&bt);
	return -1;
}

/* ---- idle time --------------------------------------------------------- */

int
broker_tick(struct broker *b)
{
	struct timeval tv = { 0, 0 };
	amqp_frame_t f;
	int st;

	if (b->conn == NULL) {
		set_err(b, "not connected");
		return -1;
	}
	/* Outside a batch only the connection and the check channel can
	 * have something to say; reading also sends due heartbeats. */
	while ((st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv)) ==
	    AMQP_STATUS_OK) {
		int rc = 0;

		if (f.frame_type == AMQP_FRAME_METHOD && f.channel == 0)
			rc = conn_method(b, &f.payload.method);
		else if (f.frame_type == AMQP_FRAME_METHOD &&
		    f.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD)
			rc = channel_close_ok(b, f.channel);
		if (rc == -1)
			goto lost;
		amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
	}
	if (st == AMQP_STATUS_TIMEOUT)
		return 0;
	(void)conn_lost(b, "%s", amqp_error_string2(st));
lost:
	log_error("broker connection lost", "error=%s",
	    log_quote((char[600]){ 0 }, 600, b->err));
	return -1;
}

/* ---- declares and counts (CLI, tests) ---------------------------------- */

static int WARN_UNUSED
admin_begin(struct broker *b)
{
	if (b->conn == NULL) {
		set_err(b, "not connected");
		return -1;
	}
	return ensure_channels(b, now_mono_ms() + confirm_ms(b));
}

/* rc from rpc_outcome(); logs the failure once and returns 0 or -1. */
static int
admin_end(struct broker *b, int rc, const char *what, const char *name,
    const char *reason)
{
	char q[600];

	if (rc == 0)
		return 0;
	if (rc == 1)
		set_err(b, "%s %s: %s", what, name, reason);
	log_warn("broker request failed", "error=%s",
	    log_quote(q, sizeof(q), b->err));
	return -1;
}

int
broker_declare_queue(struct broker *b, const char *queue,
    const char *exchange, const char *routing_key)
{
	char reason[256] = "";
	int rc;

	if (admin_begin(b) == -1)
		return admin_end(b, -1, "queue.declare", queue, reason);
	amqp_queue_declare(b->conn, CH_CHECK, amqp_cstring_bytes(queue), 0, 1,
	    0, 0, amqp_empty_table);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "queue.declare", reason, sizeof(reason));
	if (rc == 0 && exchange != NULL && *exchange != '\0') {
		amqp_queue_bind(b->conn, CH_CHECK, amqp_cstring_bytes(queue),
		    amqp_cstring_bytes(exchange),
		    amqp_cstring_bytes(routing_key ? routing_key : ""),
		    amqp_empty_table);
		rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
		    "queue.bind", reason, sizeof(reason));
	}
	return admin_end(b, rc, "queue.declare", queue, reason);
}

int
broker_queue_count(struct broker *b, const char *queue, uint32_t *count)
{
	const amqp_queue_declare_ok_t *ok;
	char reason[256] = "";
	int rc;

	if (admin_begin(b) == -1)
		return admin_end(b, -1, "queue.declare", queue, reason);
	ok = amqp_queue_declare(b->conn, CH_CHECK, amqp_cstring_bytes(queue),
	    1, 0, 0, 0, amqp_empty_table);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "queue.declare", reason, sizeof(reason));
	if (rc == 0)
		*count = ok->message_count;
	return admin_end(b, rc, "queue.declare", queue, reason);
}

int
broker_delete_queue(struct broker *b, const char *queue)
{
	char reason[256] = "";
	int rc;

	if (admin_begin(b) == -1)
		return admin_end(b, -1, "queue.delete", queue, reason);
	amqp_queue_delete(b->conn, CH_CHECK, amqp_cstring_bytes(queue), 0, 0);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "queue.delete", reason, sizeof(reason));
	return admin_end(b, rc, "queue.delete", queue, reason);
}

int
broker_declare_exchange(struct broker *b, const char *exchange,
    const char *type)
{
	char reason[256] = "";
	int rc;

	if (admin_begin(b) == -1)
		return admin_end(b, -1, "exchange.declare", exchange, reason);
	amqp_exchange_declare(b->conn, CH_CHECK, amqp_cstring_bytes(exchange),
	    amqp_cstring_bytes(type), 0, 1, 0, 0, amqp_empty_table);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "exchange.declare", reason, sizeof(reason));
	return admin_end(b, rc, "exchange.declare", exchange, reason);
}

int
broker_delete_exchange(struct broker *b, const char *exchange)
{
	char reason[256] = "";
	int rc;

	if (admin_begin(b) == -1)
		return admin_end(b, -1, "exchange.delete", exchange, reason);
	xcache_forget(b, exchange);
	amqp_exchange_delete(b->conn, CH_CHECK, amqp_cstring_bytes(exchange),
	    0);
	rc = rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "exchange.delete", reason, sizeof(reason));
	return admin_end(b, rc, "exchange.delete", exchange, reason);
}

/* ---- consuming (CLI, tests) -------------------------------------------- */

int
broker_consume(struct broker *b, const char *queue)
{
	char reason[256] = "";
	int rc;

	if (b->consuming) {
		set_err(b, "already consuming");
		return -1;
	}
	if (admin_begin(b) == -1)
		return admin_end(b, -1, "basic.consume", queue, reason);
	rpc_deadline(b, now_mono_ms() + confirm_ms(b));
	amqp_channel_open(b->conn, CH_CONSUME);
	rc = rpc_outcome(b, CH_CONSUME, amqp_get_rpc_reply(b->conn),
	    "channel.open", reason, sizeof(reason));
	if (rc == 0) {
		amqp_basic_consume(b->conn, CH_CONSUME,
		    amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 1, 0,
		    amqp_empty_table);
		rc = rpc_outcome(b, CH_CONSUME, amqp_get_rpc_reply(b->conn),
		    "basic.consume", reason, sizeof(reason));
	}
	if (rc == 0)
		b->consuming = true;
	return admin_end(b, rc, "basic.consume", queue, reason);
}

static char *
bytes_dup(amqp_bytes_t s)
{
	char *p = xmalloc(s.len + 1);

	if (s.len > 0)
		memcpy(p, s.bytes, s.len);
	p[s.len] = '\0';
	return p;
}

static void
copy_header(struct broker_header *h, const amqp_table_entry_t *e)
{
	const amqp_field_value_t *v = &e->value;
	char num[32];

	h->key = bytes_dup(e->key);
	h->integer = true;
	switch (v->kind) {
	case AMQP_FIELD_KIND_UTF8:
	case AMQP_FIELD_KIND_BYTES:
		h->integer = false;
		h->value = bytes_dup(v->value.bytes);
		return;
	case AMQP_FIELD_KIND_I8:
		strfmt(num, sizeof(num), "%d", v->value.i8);
		break;
	case AMQP_FIELD_KIND_U8:
		strfmt(num, sizeof(num), "%u", v->value.u8);
		break;
	case AMQP_FIELD_KIND_I16:
		strfmt(num, sizeof(num), "%d", v->value.i16);
		break;
	case AMQP_FIELD_KIND_U16:
		strfmt(num, sizeof(num), "%u", v->value.u16);
		break;
	case AMQP_FIELD_KIND_I32:
		strfmt(num, sizeof(num), "%" PRId32, v->value.i32);
		break;
	case AMQP_FIELD_KIND_U32:
		strfmt(num, sizeof(num), "%" PRIu32, v->value.u32);
		break;
	case AMQP_FIELD_KIND_I64:
		strfmt(num, sizeof(num), "%" PRId64, v->value.i64);
		break;
	case AMQP_FIELD_KIND_U64:
	case AMQP_FIELD_KIND_TIMESTAMP:
		strfmt(num, sizeof(num), "%" PRIu64, v->value.u64);
		break;
	default:
		h->integer = false;
		strfmt(num, sizeof(num), "(field kind '%c')", v->kind);
		break;
	}
	h->value = xstrdup(num);
}

static struct broker_delivery *
delivery_copy(const amqp_envelope_t *env)
{
	const amqp_basic_properties_t *p = &env->message.properties;
	struct broker_delivery *d = xcalloc(1, sizeof(*d));

	d->body = bytes_dup(env->message.body);
	d->body_len = env->message.body.len;
	d->exchange = bytes_dup(env->exchange);
	d->routing_key = bytes_dup(env->routing_key);
	if (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG)
		d->message_id = bytes_dup(p->message_id);
	if (p->_flags & AMQP_BASIC_CONTENT_TYPE_FLAG)
		d->content_type = bytes_dup(p->content_type);
	if (p->_flags & AMQP_BASIC_DELIVERY_MODE_FLAG)
		d->delivery_mode = p->delivery_mode;
	if (p->_flags & AMQP_BASIC_TIMESTAMP_FLAG)
		d->timestamp_s = (int64_t)p->timestamp;
	if ((p->_flags & AMQP_BASIC_HEADERS_FLAG) &&
	    p->headers.num_entries > 0) {
		d->n_headers = (size_t)p->headers.num_entries;
		d->headers = xcalloc(d->n_headers, sizeof(*d->headers));
		for (size_t i = 0; i < d->n_headers; i++)
			copy_header(&d->headers[i], &p->headers.entries[i]);
	}
	return d;
}

/* A frame other than a delivery arrived while consuming. */
static int WARN_UNUSED
consumer_frame(struct broker *b)
{
	struct timeval tv = { 0, 0 };
	const amqp_channel_close_t *cc;
	amqp_frame_t f;
	int st;

	st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv);
	if (st == AMQP_STATUS_TIMEOUT)
		return 0;
	if (st != AMQP_STATUS_OK)
		return conn_lost(b, "consuming: %s", amqp_error_string2(st));
	if (f.frame_type != AMQP_FRAME_METHOD)
		return 0;
	if (f.channel == 0)
		return conn_method(b, &f.payload.method);
	if (f.payload.method.id != AMQP_CHANNEL_CLOSE_METHOD)
		return 0;
	cc = f.payload.method.decoded;
	set_err(b, "channel %u closed by the broker: %.*s", f.channel,
	    (int)cc->reply_text.len, (const char *)cc->reply_text.bytes);
	if (f.channel == CH_CONSUME)
		b->consuming = false;
	(void)channel_close_ok(b, f.channel);
	return -1;
}

int
broker_get(struct broker *b, int64_t timeout_ms,
    struct broker_delivery **out)
{
	int64_t deadline = now_mono_ms() + timeout_ms;
	amqp_envelope_t env;
	amqp_rpc_reply_t r;

	*out = NULL;
	if (b->conn == NULL || !b->consuming) {
		set_err(b, "%s", b->conn == NULL ? "not connected" :
		    "not consuming");
		return -1;
	}
	for (;;) {
		struct timeval tv = ms_to_tv(deadline - now_mono_ms());

		amqp_maybe_release_buffers(b->conn);
		r = amqp_consume_message(b->conn, &env, &tv, 0);
		if (r.reply_type == AMQP_RESPONSE_NORMAL) {
			*out = delivery_copy(&env);
			amqp_destroy_envelope(&env);
			return 0;
		}
		if (r.reply_type != AMQP_RESPONSE_LIBRARY_EXCEPTION)
			break;
		if (r.library_error == AMQP_STATUS_TIMEOUT)
			return 0;
		if (r.library_error != AMQP_STATUS_UNEXPECTED_STATE)
			break;
		if (consumer_frame(b) == -1)
			goto fail;
	}
	(void)conn_lost(b, "consuming: %s", r.reply_type ==
	    AMQP_RESPONSE_LIBRARY_EXCEPTION ?
	    amqp_error_string2(r.library_error) : "unexpected reply");
fail:
	log_warn("broker consume failed", "error=%s",
	    log_quote((char[600]){ 0 }, 600, b->err));
	return -1;
}

const struct broker_header *
broker_delivery_header(const struct broker_delivery *d, const char *key)
{
	for (size_t i = 0; i < d->n_headers; i++)
		if (strcmp(d->headers[i].key, key) == 0)
			return &d->headers[i];
	return NULL;
}

void
broker_delivery_free(struct broker_delivery *d)
{
	if (d == NULL)
		return;
	for (size_t i = 0; i < d->n_headers; i++) {
		free(d->headers[i].key);
		free(d->headers[i].value);
	}
	free(d->headers);
	free(d->body);
	free(d->exchange);
	free(d->routing_key);
	free(d->message_id);
	free(d->content_type);
	free(d);
}
