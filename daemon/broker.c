/*
 * Broker: the RabbitMQ side (rabbitmq-c 0.11).  This part owns the
 * connection: connecting (TCP or TLS, node after node), channels, the
 * errors that end a connection, and idle-time reads.  Publishing is in
 * broker_publish.c, declares and consuming in broker_admin.c.
 */
#include "broker_internal.h"

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
#include <unistd.h>

#include "log.h"
#include "secret.h"

#define DEFAULT_CONNECT_MS 10000
#define DEFAULT_CONFIRM_MS 30000
#define CLOSE_TIMEOUT_MS 1000	/* for a polite connection.close */

/* ---- errors and the connection's life ---------------------------------- */

/* Error text is "host:port: what happened" when a node is known. */
void
bk_set_err(struct broker *b, const char *fmt, ...)
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

void
bk_xcache_clear(struct broker *b)
{
	for (size_t i = 0; i < b->n_xs; i++) {
		free(b->xs[i].name);
		free(b->xs[i].type);
	}
	b->n_xs = 0;
}

/* Frees the connection without a word to the broker: it is broken, or
 * we cannot know what it holds.  A broken connection is never reused. */
void
bk_drop(struct broker *b)
{
	if (b->conn != NULL)
		amqp_destroy_connection(b->conn);
	b->conn = NULL;
	b->pub_open = b->check_open = b->consuming = false;
	b->pub_stale = false;
	b->awaiting = false;
	b->broker_max_size = 0;
	b->blocked_since_ms = 0;
	/* Nothing is in flight on a new connection, whatever the old one
	 * had (its count shows in the next "broker blocks" line). */
	b->win.len = b->win.lo = b->win.outstanding = 0;
	bk_xcache_clear(b);
}

/* Records why the connection is unusable and drops it; returns -1. */
int
bk_conn_lost(struct broker *b, const char *fmt, ...)
{
	char msg[400];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	bk_set_err(b, "%s", msg);
	bk_drop(b);
	return -1;
}

/* The broker closed the whole connection: say goodbye and drop it. */
int
bk_conn_closed_by_broker(struct broker *b, const amqp_connection_close_t *m)
{
	amqp_connection_close_ok_t ok = { 0 };
	char text[256];

	strfmt(text, sizeof(text), "%.*s", (int)m->reply_text.len,
	    (const char *)m->reply_text.bytes);
	(void)amqp_send_method(b->conn, 0, AMQP_CONNECTION_CLOSE_OK_METHOD,
	    &ok);
	return bk_conn_lost(b, "connection closed by the broker: %s (%u)", text,
	    m->reply_code);
}

static void bound_stuck_sends(struct broker *, bool on);

/*
 * Answers the broker's channel.close, after which the channel may be
 * opened again.  rabbitmq-c waits for room in the socket without a time
 * limit, and TCP_USER_TIMEOUT is off while the broker blocks us: a
 * blocked broker reads nothing, so with the send buffer full of a large
 * batch when its block and a close came, the answer waited for the end
 * of the alarm (hours), and the relay with it, past its deadline and a
 * stop.  The user timeout is on for this send: a send that finds room
 * is done before it matters, one that waits ends at the kernel's next
 * window probe past the confirm timeout.
 */
int
bk_channel_close_ok(struct broker *b, amqp_channel_t ch)
{
	amqp_channel_close_ok_t ok = { 0 };
	bool blocked = b->blocked_since_ms != 0;
	int st;

	if (blocked)
		bound_stuck_sends(b, true);
	st = amqp_send_method(b->conn, ch, AMQP_CHANNEL_CLOSE_OK_METHOD, &ok);
	if (blocked && st == AMQP_STATUS_OK)
		bound_stuck_sends(b, false);
	if (st != AMQP_STATUS_OK)
		return bk_conn_lost(b, "channel.close-ok: %s",
		    amqp_error_string2(st));
	if (ch == CH_PUB)
		b->pub_open = false;
	else if (ch == CH_CHECK)
		b->check_open = false;
	return 0;
}

/*
 * rabbitmq-c waits without a timeout for room in the socket's buffer,
 * so a broker that stops reading (frozen, cut off) could hang a send for
 * good.  With TCP_USER_TIMEOUT the kernel ends the connection instead
 * when what we sent stays unacknowledged, or the broker's window shut,
 * for as long as a batch may wait for its confirms.  Off while the
 * broker blocks us: that connection must live until the alarm clears.
 * Best effort, like the cork.
 */
static void
bound_stuck_sends(struct broker *b, bool on)
{
	int fd = b->conn != NULL ? amqp_get_sockfd(b->conn) : -1;
	unsigned ms = on ? (unsigned)bk_confirm_ms(b) : 0;

	if (fd >= 0)
		(void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms,
		    sizeof(ms));
}

/*
 * A broker host that dies or drops off the network sends nothing, not
 * even a reset.  A relay in the middle of a batch notices at the
 * confirm timeout, but an idle relay, or one the broker blocks under an
 * alarm (TCP_USER_TIMEOUT off, heartbeats off by default), would wait
 * on that connection for the kernel's keepalive default: two hours and
 * more.  These probes, the same as the PostgreSQL sessions', find the
 * dead peer: blocked, after 3 unanswered probes, within 25 s; otherwise
 * once nothing was heard for TCP_USER_TIMEOUT (the confirm timeout), or
 * 15 s if that is shorter.  A live broker's kernel answers them, so a
 * blocked connection lives on.  (While a batch too big for the broker's
 * socket buffer waits in its shut window, the kernel's window probes
 * take over: about 15 minutes with tcp_retries2 = 15.)
 */
#define KEEPALIVE_IDLE_S 10
#define KEEPALIVE_INTERVAL_S 5
#define KEEPALIVE_PROBES 3

static void
probe_idle_connection(struct broker *b)
{
	int fd = b->conn != NULL ? amqp_get_sockfd(b->conn) : -1;
	int on = 1, idle = KEEPALIVE_IDLE_S, interval = KEEPALIVE_INTERVAL_S,
	    probes = KEEPALIVE_PROBES;

	if (fd < 0)
		return;
	(void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
	(void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
	(void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval,
	    sizeof(interval));
	(void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes,
	    sizeof(probes));
}

/* Channel 0: the connection itself. */
int WARN_UNUSED
bk_conn_method(struct broker *b, const amqp_method_t *m)
{
	const amqp_connection_blocked_t *blocked;

	switch (m->id) {
	case AMQP_CONNECTION_CLOSE_METHOD:
		return bk_conn_closed_by_broker(b, m->decoded);
	case AMQP_CONNECTION_BLOCKED_METHOD:
		blocked = m->decoded;
		strfmt(b->blocked_reason, sizeof(b->blocked_reason), "%.*s",
		    (int)blocked->reason.len,
		    (const char *)blocked->reason.bytes);
		if (b->blocked_since_ms == 0)
			b->blocked_since_ms = now_mono_ms();
		b->blocks++;
		bound_stuck_sends(b, false);
		log_warn("broker blocks publishing", "node=%s reason=%s "
		    "unconfirmed=%zu", b->node, log_quote((char[300]){ 0 },
		    300, b->blocked_reason), b->win.outstanding);
		return 0;
	case AMQP_CONNECTION_UNBLOCKED_METHOD:
		log_info("broker unblocks publishing", "node=%s "
		    "blocked_for_ms=%" PRId64, b->node, b->blocked_since_ms ?
		    now_mono_ms() - b->blocked_since_ms : 0);
		b->blocked_since_ms = 0;
		bound_stuck_sends(b, true);
		return 0;
	default:
		return 0;
	}
}

/*
 * Sorts out an RPC's reply: 0 done; 1 the broker refused and closed the
 * channel (its words in reason, close-ok sent); -1 the connection is gone
 * (dropped, error in b->err).
 */
int WARN_UNUSED
bk_rpc_outcome(struct broker *b, amqp_channel_t ch, amqp_rpc_reply_t r,
    const char *what, char *reason, size_t size)
{
	const amqp_channel_close_t *cc;
	const amqp_connection_close_t *conn_close;

	*reason = '\0';
	switch (r.reply_type) {
	case AMQP_RESPONSE_NORMAL:
		return 0;
	case AMQP_RESPONSE_SERVER_EXCEPTION:
		if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
			/* The broker's answer to this command, fatal to the
			 * whole connection (503 for an exchange type it does
			 * not know): the reason goes to the caller too.  Not
			 * for a close that only happened to arrive now (320
			 * CONNECTION_FORCED at a node's shutdown, 541). */
			conn_close = r.reply.decoded;
			if (conn_close->reply_code == AMQP_COMMAND_INVALID ||
			    conn_close->reply_code == AMQP_NOT_IMPLEMENTED)
				strfmt(reason, size, "%.*s (%u)",
				    (int)conn_close->reply_text.len,
				    (const char *)conn_close->reply_text.bytes,
				    conn_close->reply_code);
			return bk_conn_closed_by_broker(b, conn_close);
		}
		if (r.reply.id != AMQP_CHANNEL_CLOSE_METHOD)
			return bk_conn_lost(b, "%s: unexpected reply 0x%08x",
			    what, (unsigned)r.reply.id);
		cc = r.reply.decoded;
		strfmt(reason, size, "%.*s", (int)cc->reply_text.len,
		    (const char *)cc->reply_text.bytes);
		return bk_channel_close_ok(b, ch) == -1 ? -1 : 1;
	case AMQP_RESPONSE_LIBRARY_EXCEPTION:
		return bk_conn_lost(b, "%s: %s", what,
		    amqp_error_string2(r.library_error));
	default:
		return bk_conn_lost(b, "%s: no reply", what);
	}
}

struct timeval
bk_ms_to_tv(int64_t ms)
{
	struct timeval tv;

	if (ms < 0)
		ms = 0;
	tv.tv_sec = ms / 1000;
	tv.tv_usec = (ms % 1000) * 1000;
	return tv;
}

/* Time left until deadline: at least 1 ms, so that a step begun just
 * before the deadline fails on its own terms. */
static int64_t
left_ms(int64_t deadline)
{
	int64_t left = deadline - now_mono_ms();

	return left > 1 ? left : 1;
}

/* Bounds the next RPCs: rabbitmq-c closes the socket when one times
 * out, which is what a stuck broker deserves. */
void
bk_rpc_deadline(struct broker *b, int64_t deadline)
{
	struct timeval tv = bk_ms_to_tv(left_ms(deadline));

	(void)amqp_set_rpc_timeout(b->conn, &tv);
}

int64_t
bk_confirm_ms(const struct broker *b)
{
	return b->conf.confirm_timeout_ms > 0 ? b->conf.confirm_timeout_ms :
	    DEFAULT_CONFIRM_MS;
}

int64_t
broker_confirm_timeout_ms(const struct broker *b)
{
	return bk_confirm_ms(b);
}

int64_t
bk_connect_ms(const struct broker *b)
{
	return b->conf.connect_timeout_ms > 0 ? b->conf.connect_timeout_ms :
	    DEFAULT_CONNECT_MS;
}

/* TCP_CORK on or off; off sends what the kernel holds at once.  Best
 * effort: a socket that refuses it only sends smaller segments. */
void
bk_cork(struct broker *b, bool on)
{
	int fd = b->conn != NULL ? amqp_get_sockfd(b->conn) : -1;
	int v = on;

	if (fd >= 0)
		(void)setsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, sizeof(v));
}

/* Opens channel ch; the publishing channel also gets confirm.select,
 * after which its delivery tags count from 1. */
static int WARN_UNUSED
open_channel(struct broker *b, amqp_channel_t ch, int64_t deadline)
{
	char reason[256];
	int rc;

	bk_rpc_deadline(b, deadline);
	amqp_channel_open(b->conn, ch);
	rc = bk_rpc_outcome(b, ch, amqp_get_rpc_reply(b->conn), "channel.open",
	    reason, sizeof(reason));
	if (rc == 0 && ch == CH_PUB) {
		amqp_confirm_select(b->conn, ch);
		rc = bk_rpc_outcome(b, ch, amqp_get_rpc_reply(b->conn),
		    "confirm.select", reason, sizeof(reason));
	}
	if (rc == 1)
		return bk_conn_lost(b, "opening channel %u: %s", ch, reason);
	if (rc == -1)
		return -1;
	if (ch == CH_PUB) {
		b->pub_open = true;
		b->pub_stale = false;
		b->next_tag = 1;
	} else if (ch == CH_CHECK) {
		b->check_open = true;
	}
	return 0;
}

/*
 * Closes channel 1 ourselves and reads until the broker's close-ok,
 * dropping what still comes for the messages published on it before:
 * the broker sends all of that ahead of the close-ok.  Other channels'
 * frames are handled as everywhere; a close from the broker crossing
 * ours is answered, and its close-ok still follows.
 */
static int WARN_UNUSED
close_stale_channel(struct broker *b, int64_t deadline)
{
	amqp_channel_close_t close = { .reply_code = AMQP_REPLY_SUCCESS,
		.reply_text = amqp_cstring_bytes("stale confirms") };
	int st = amqp_send_method(b->conn, CH_PUB, AMQP_CHANNEL_CLOSE_METHOD,
	    &close);

	if (st != AMQP_STATUS_OK)
		return bk_conn_lost(b, "channel.close: %s",
		    amqp_error_string2(st));
	for (;;) {
		struct timeval tv = bk_ms_to_tv(left_ms(deadline));
		amqp_frame_t f;
		bool method, done = false;
		int rc = 0;

		st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv);
		if (st == AMQP_STATUS_TIMEOUT && now_mono_ms() >= deadline)
			return bk_conn_lost(b, "no channel.close-ok for the "
			    "publishing channel in time");
		if (st == AMQP_STATUS_TIMEOUT)
			continue;
		if (st != AMQP_STATUS_OK)
			return bk_conn_lost(b, "closing the publishing channel: "
			    "%s", amqp_error_string2(st));
		method = f.frame_type == AMQP_FRAME_METHOD;
		if (method && f.channel == 0)
			rc = bk_conn_method(b, &f.payload.method);
		else if (method && f.payload.method.id ==
		    AMQP_CHANNEL_CLOSE_METHOD)
			rc = bk_channel_close_ok(b, f.channel);
		else if (method && f.channel == CH_PUB)
			done = f.payload.method.id ==
			    AMQP_CHANNEL_CLOSE_OK_METHOD;
		if (rc == -1)
			return -1;	/* nothing left to release */
		amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
		if (done)
			break;
	}
	b->pub_open = false;
	b->pub_stale = false;
	return 0;
}

int WARN_UNUSED
bk_ensure_channels(struct broker *b, int64_t deadline)
{
	/* Not while blocked: the close would queue behind the publishes
	 * the broker has stopped reading. */
	if (b->pub_stale && b->pub_open && b->blocked_since_ms == 0 &&
	    close_stale_channel(b, deadline) == -1)
		return -1;
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
	int64_t deadline = now_mono_ms() + timeout_ms, left;
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
	/* Each address gets an equal share of what is left, so that one
	 * that drops SYNs (a firewalled IPv6, a dead member of a
	 * round-robin name) cannot use up the whole timeout: the later
	 * addresses got no time at all and the node was never reached. */
	for (ai = res, left = 0; ai != NULL; ai = ai->ai_next)
		left++;
	for (ai = res; ai != NULL && fd == -1; ai = ai->ai_next, left--) {
		int64_t now = now_mono_ms();
		int64_t share = deadline > now ? (deadline - now) / left : 0;

		fd = tcp_try(ai, now + share, err, size);
	}
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
		bk_set_err(b, "%s %s: %s", key, path, strerror(errno));
		return -1;
	}
	close(fd);
	return 0;
}

/*
 * OpenSSL asks for an encrypted key's passphrase on the terminal, with no
 * timeout: in the foreground the connect hung there, and under systemd
 * it failed as "not PEM".  Both PEM forms say so in clear text.
 */
static bool
pem_key_encrypted(const char *path)
{
	char buf[16384];
	FILE *f = fopen(path, "re");
	size_t n;
	bool encrypted;

	if (f == NULL)
		return false;	/* tls_file_check said why */
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	encrypted = strstr(buf, "-----BEGIN ENCRYPTED PRIVATE KEY-----") !=
	    NULL || strstr(buf, "Proc-Type: 4,ENCRYPTED") != NULL;
	explicit_bzero(buf, sizeof(buf));	/* key material */
	return encrypted;
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
			bk_set_err(b, "%s %s: no PEM certificate could be loaded "
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
		if (pem_key_encrypted(key)) {
			bk_set_err(b, "rabbitmq.tls.key_file %s: the key is "
			    "encrypted, and outboxd cannot ask for its "
			    "passphrase: keep it unencrypted, mode 0600 "
			    "(openssl pkey -in KEY -out PLAIN)", key);
			return -1;
		}
		if ((st = amqp_ssl_socket_set_key(sock, c->tls_cert_file,
		    key)) != 0) {
			bk_set_err(b, "rabbitmq.tls.cert_file %s, key_file %s: "
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
		bk_set_err(b, "cannot limit TLS to 1.2 and later: %s",
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
open_socket(struct broker *b, const struct broker_node *node,
    int64_t deadline)
{
	struct timeval tv = bk_ms_to_tv(left_ms(deadline));
	amqp_socket_t *sock;
	char why[200];
	int fd, st;

	if (!b->conf.tls) {
		fd = tcp_connect(node->host, node->port, left_ms(deadline), why,
		    sizeof(why));
		if (fd == -1) {
			bk_set_err(b, "%s", why);
			return -1;
		}
		sock = amqp_tcp_socket_new(b->conn);
		if (sock == NULL) {
			close(fd);
			bk_set_err(b, "cannot create a socket object");
			return -1;
		}
		amqp_tcp_socket_set_sockfd(sock, fd);
		return 0;
	}
	sock = amqp_ssl_socket_new(b->conn);
	if (sock == NULL) {
		bk_set_err(b, "cannot create a TLS socket");
		return -1;
	}
	if (tls_setup(b, sock) == -1)
		return -1;
	st = amqp_socket_open_noblock(sock, node->host, node->port, &tv);
	if (st != AMQP_STATUS_OK) {
		const char *hint = tls_open_hint(st, node->host);

		bk_set_err(b, "cannot connect (TLS): %s%s%s",
		    amqp_error_string2(st), hint ? ": " : "", hint ? hint : "");
		return -1;
	}
	return 0;
}

static int WARN_UNUSED
login(struct broker *b, int64_t deadline)
{
	const struct broker_conf *c = &b->conf;
	/* rabbitmq-c 0.11 does not ask for connection.blocked itself;
	 * without it the broker blocks us under an alarm without a word,
	 * and the batch looks like a dead connection (its own capabilities
	 * are merged into ours). */
	amqp_table_entry_t caps_entry = {
		.key = amqp_cstring_bytes("connection.blocked"),
		.value = { .kind = AMQP_FIELD_KIND_BOOLEAN,
		    .value.boolean = 1 },
	};
	amqp_table_entry_t entries[] = {
		{ .key = amqp_cstring_bytes("connection_name"),
		  .value = { .kind = AMQP_FIELD_KIND_UTF8,
		      .value.bytes = amqp_cstring_bytes("outboxd") } },
		{ .key = amqp_cstring_bytes("capabilities"),
		  .value = { .kind = AMQP_FIELD_KIND_TABLE,
		      .value.table = { 1, &caps_entry } } },
	};
	amqp_table_t props = { (int)ARRAY_LEN(entries), entries };
	struct timeval tv = bk_ms_to_tv(left_ms(deadline));
	amqp_rpc_reply_t r;
	const amqp_connection_close_t *m;

	secret_reread(&b->conf.password, c->password_file,
	    "rabbitmq.password_file");
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
		bk_set_err(b, "login refused: %.*s (%u)", (int)m->reply_text.len,
		    (const char *)m->reply_text.bytes, m->reply_code);
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_CONNECTION_CLOSED) {
		/* Wrong credentials or vhost get a close with a reason
		 * (login refused, above: rabbitmq-c asks for that); a bare
		 * close is a connection limit, or a proxy with no broker. */
		bk_set_err(b, "login failed: the broker closed the connection "
		    "without a reason (its connection limit? a proxy with no "
		    "broker behind it?)");
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_SSL_ERROR && c->tls) {
		/* With TLS 1.3 a refused client certificate only shows
		 * once the first AMQP bytes are read. */
		bk_set_err(b, "login failed: %s (did the broker refuse the "
		    "client certificate? see rabbitmq.tls.cert_file)",
		    amqp_error_string2(r.library_error));
	} else if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
	    r.library_error == AMQP_STATUS_SOCKET_ERROR && !c->tls) {
		/* A TLS listener drops a plain AMQP header this way. */
		bk_set_err(b, "login failed: %s (an amqps port? then set "
		    "rabbitmq.tls.enabled)",
		    amqp_error_string2(r.library_error));
	} else {
		bk_set_err(b, "login failed: %s", r.reply_type ==
		    AMQP_RESPONSE_LIBRARY_EXCEPTION ?
		    amqp_error_string2(r.library_error) : "unexpected reply");
	}
	return -1;
}

/*
 * Under a memory or disk alarm the broker says that it blocks a
 * connection only once the connection publishes, and it holds what it
 * was sent until the alarm clears.  The first batch on a new connection
 * during an alarm was held that way, left unconfirmed, and sent again
 * after the alarm: every row of it twice.  So a new connection first
 * publishes one empty message to a queue that cannot exist ("amq." names
 * are the broker's, and the default exchange drops what it cannot
 * route, without a return as the message is not mandatory), and waits
 * for the broker's answer: the ack, or connection.blocked, which makes
 * the relay wait for the unblock before it claims anything.
 *
 * Two probes, the second sent once the first is answered: the broker's
 * reader sends connection.blocked and its channel the probe's ack, and
 * either may come first.  An ack first ended the wait, the block came
 * after, and the first batch was held (seen once in the tests as `batch
 * left unconfirmed`).  A blocked broker reads nothing more, so the
 * second probe is answered only when no block is on its way.  Returns 0
 * or -1 (connection lost).
 */
#define ALARM_PROBE_KEY "amq.outboxd.alarm-probe"
#define ALARM_PROBES 2

static int WARN_UNUSED
publish_alarm_probe(struct broker *b)
{
	amqp_basic_properties_t props = { ._flags = 0 };
	int st = amqp_basic_publish(b->conn, CH_PUB, amqp_empty_bytes,
	    amqp_cstring_bytes(ALARM_PROBE_KEY), 0, 0, &props,
	    amqp_empty_bytes);

	if (st != AMQP_STATUS_OK)
		return bk_conn_lost(b, "publishing: %s", amqp_error_string2(st));
	b->next_tag++;	/* the batches' windows start after it */
	return 0;
}

static int WARN_UNUSED
ask_for_alarms(struct broker *b, int64_t deadline)
{
	int answered = 0, st;

	if (publish_alarm_probe(b) == -1)
		return -1;
	while (b->blocked_since_ms == 0) {
		struct timeval tv = bk_ms_to_tv(deadline - now_mono_ms());
		amqp_frame_t f;
		const amqp_method_t *m = &f.payload.method;
		bool answer = false;
		int rc = 0;

		st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv);
		if (st == AMQP_STATUS_TIMEOUT)
			return bk_conn_lost(b, "no answer to a publish within "
			    "rabbitmq.connect_timeout");
		if (st != AMQP_STATUS_OK)
			return bk_conn_lost(b, "%s", amqp_error_string2(st));
		if (f.frame_type != AMQP_FRAME_METHOD) {
			amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
			continue;
		}
		if (f.channel == 0) {
			rc = bk_conn_method(b, m);
		} else if (m->id == AMQP_CHANNEL_CLOSE_METHOD) {
			unsigned code = ((const amqp_channel_close_t *)
			    m->decoded)->reply_code;

			rc = bk_channel_close_ok(b, f.channel);
			if (rc == 0 && f.channel == CH_PUB) {
				/* A user that may not write to the default
				 * exchange: the broker read the publish,
				 * which answers as well as an ack. */
				log_debug("alarm probe refused: the broker "
				    "reads us", "node=%s code=%u", b->node,
				    code);
				rc = bk_ensure_channels(b, deadline);
				answer = true;
			}
		} else if (f.channel == CH_PUB) {
			answer = m->id == AMQP_BASIC_ACK_METHOD ||
			    m->id == AMQP_BASIC_NACK_METHOD;
		}
		/* A connection.close took the connection with it: nothing
		 * is left to release (rabbitmq-c would dereference NULL). */
		if (rc == -1)
			return -1;
		amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
		if (answer && ++answered == ALARM_PROBES)
			break;
		if (answer && publish_alarm_probe(b) == -1)
			return -1;
	}
	return 0;
}

static int WARN_UNUSED
connect_node(struct broker *b, const struct broker_node *node)
{
	/* rabbitmq.connect_timeout bounds the whole attempt (socket, TLS,
	 * login, channels), not each step: a node that answers slowly must
	 * not hold the relay, and the watchdog, for several timeouts. */
	int64_t deadline = now_mono_ms() + bk_connect_ms(b);

	strfmt(b->node, sizeof(b->node), "%s:%d", node->host, node->port);
	b->conn = amqp_new_connection();
	if (b->conn == NULL) {
		bk_set_err(b, "out of memory");
		return -1;
	}
	if (open_socket(b, node, deadline) == -1 || login(b, deadline) == -1) {
		bk_drop(b);
		return -1;
	}
	bound_stuck_sends(b, true);
	probe_idle_connection(b);
	/* Both drop the connection themselves on failure. */
	if (bk_ensure_channels(b, deadline) == -1)
		return -1;
	return ask_for_alarms(b, deadline);
}

int
broker_connect(struct broker *b)
{
	char qerr[600];

	broker_disconnect(b);
	b->node[0] = '\0';
	if (b->conf.n_nodes == 0) {
		bk_set_err(b, "no rabbitmq node configured");
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
			log_limit_reset(&b->connect_log);
			return 0;
		}
		log_event_limited(&b->connect_log, LOG_WARN,
		    "broker connect failed", "node=%s error=%s", b->node,
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
	struct timeval tv = bk_ms_to_tv(CLOSE_TIMEOUT_MS);

	if (b == NULL || b->conn == NULL)
		return;
	/* A polite close lets the broker log a clean goodbye; if the
	 * connection is already broken this fails fast, and either way
	 * everything is freed below.  Not while the broker blocks us: it
	 * reads nothing, so the close waited out CLOSE_TIMEOUT_MS for a
	 * close-ok that could not come (each relay, at every stop under
	 * an alarm), or for good on a full send buffer. */
	if (b->blocked_since_ms == 0) {
		(void)amqp_set_rpc_timeout(b->conn, &tv);
		(void)amqp_connection_close(b->conn, AMQP_REPLY_SUCCESS);
	}
	bk_drop(b);
}

int64_t
broker_blocked_ms(const struct broker *b)
{
	if (b == NULL || b->conn == NULL || b->blocked_since_ms == 0)
		return 0;
	return now_mono_ms() - b->blocked_since_ms + 1;
}

int
broker_socket(const struct broker *b)
{
	return b != NULL && b->conn != NULL ? amqp_get_sockfd(b->conn) : -1;
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
	c->password_file = dup_or_null(conf->password_file);
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
	free(b->conf.password_file);
	free(b->conf.tls_ca_file);
	free(b->conf.tls_cert_file);
	free(b->conf.tls_key_file);
	free(b->xs);
	free(b->slots);
	free(b->win.idx);
	free(b->entries);
	free(b);
}

/* ---- idle time --------------------------------------------------------- */

int
broker_tick(struct broker *b)
{
	struct timeval tv = { 0, 0 };
	amqp_frame_t f;
	int st;

	if (b->conn == NULL) {
		bk_set_err(b, "not connected");
		return -1;
	}
	/* A sent batch's confirms are broker_await_batch()'s to read. */
	if (b->awaiting)
		return 0;
	/* Outside a batch only the connection and the check channel can
	 * have something to say; reading also sends due heartbeats. */
	while ((st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv)) ==
	    AMQP_STATUS_OK) {
		int rc = 0;

		if (f.frame_type == AMQP_FRAME_METHOD && f.channel == 0)
			rc = bk_conn_method(b, &f.payload.method);
		else if (f.frame_type == AMQP_FRAME_METHOD &&
		    f.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD)
			rc = bk_channel_close_ok(b, f.channel);
		if (rc == -1)
			goto lost;
		amqp_maybe_release_buffers_on_channel(b->conn, f.channel);
	}
	if (st == AMQP_STATUS_TIMEOUT)
		return 0;
	(void)bk_conn_lost(b, "%s", amqp_error_string2(st));
lost:
	log_error("broker connection lost", "error=%s",
	    log_quote((char[600]){ 0 }, 600, b->err));
	return -1;
}
