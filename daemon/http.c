/*
 * The metrics and health endpoint, on libmicrohttpd's own thread.  We bind
 * the socket ourselves so a failure reads "Address already in use", not
 * libmicrohttpd's bare NULL.
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "metrics.h"

/* A scraper needs one connection; a few more allow curl by hand.  Idle
 * clients lose their slot after the timeout, but one that trickles a
 * byte now and then keeps it: so one address may hold only a few, and
 * the health check and the scraper, from their own addresses, still get
 * in (with 16 slots for everyone, one client could take them all). */
#define HTTP_MAX_CONNECTIONS 64u
#define HTTP_MAX_PER_ADDRESS 4u
#define HTTP_TIMEOUT_S 10u

struct http {
	struct MHD_Daemon *daemon;	/* NULL when disabled */
	int port;
	atomic_bool serving;	/* start-up done; read by MHD's thread */
};

static void
set_err(char *err, size_t errlen, const char *spec, const char *why)
{
	if (err != NULL && errlen > 0)
		strfmt(err, errlen, "http.listen %s: %s", spec, why);
}

/*
 * "1.2.3.4:port" or "[v6]:port" into a socket address.  Names are not
 * resolved: the endpoint binds exactly what the operator wrote.
 */
static int
listen_parse(const char *spec, struct sockaddr_storage *ss,
    socklen_t *sslen, char *err, size_t errlen)
{
	char host[INET6_ADDRSTRLEN];
	const char *start = spec, *end, *p;
	bool v6 = spec[0] == '[';
	unsigned long port = 0;
	size_t hlen;

	if (v6) {
		start = spec + 1;
		end = strchr(spec, ']');
		if (end == NULL || end[1] != ':') {
			set_err(err, errlen, spec,
			    "expected [IPv6 address]:port, e.g. [::1]:9187");
			return -1;
		}
		p = end + 2;
	} else {
		end = strrchr(spec, ':');
		if (end == NULL) {
			set_err(err, errlen, spec,
			    "expected address:port, e.g. 127.0.0.1:9187");
			return -1;
		}
		p = end + 1;
	}
	hlen = (size_t)(end - start);
	if (hlen == 0) {
		set_err(err, errlen, spec,
		    "missing address (0.0.0.0 listens on every IPv4 one)");
		return -1;
	}
	/* Digits only, at most five of them: no sign, space or overflow. */
	if (*p == '\0' || strspn(p, "0123456789") != strlen(p) ||
	    strlen(p) > 5 || (port = strtoul(p, NULL, 10)) > 65535) {
		set_err(err, errlen, spec,
		    "port must be a number from 0 to 65535");
		return -1;
	}
	if (hlen >= sizeof(host))
		goto bad_host;
	memcpy(host, start, hlen);
	host[hlen] = '\0';

	memset(ss, 0, sizeof(*ss));
	if (v6) {
		struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)ss;

		sin6->sin6_family = AF_INET6;
		sin6->sin6_port = htons((uint16_t)port);
		if (inet_pton(AF_INET6, host, &sin6->sin6_addr) != 1)
			goto bad_host;
		*sslen = sizeof(*sin6);
	} else {
		struct sockaddr_in *sin = (struct sockaddr_in *)ss;

		sin->sin_family = AF_INET;
		sin->sin_port = htons((uint16_t)port);
		if (inet_pton(AF_INET, host, &sin->sin_addr) != 1)
			goto bad_host;
		*sslen = sizeof(*sin);
	}
	return 0;

bad_host:
	set_err(err, errlen, spec, v6 ? "not an IPv6 address" :
	    "not an IPv4 address (IPv6 goes in brackets, [::1]:9187; "
	    "names are not resolved)");
	return -1;
}

int
http_listen_check(const char *spec, char *err, size_t errlen)
{
	struct sockaddr_storage ss;
	socklen_t sslen;

	if (spec == NULL || *spec == '\0')
		return 0;
	return listen_parse(spec, &ss, &sslen, err, errlen);
}

/*
 * libmicrohttpd's own messages, as our log lines.  At start-up they
 * explain a failure; once serving they are about clients (a scanner that
 * hung up mid-request, the connection limit), so they go to debug rather
 * than let any client fill the journal.
 */
static void mhd_log(void *, const char *, va_list)
    __attribute__((format(printf, 2, 0)));

static void
mhd_log(void *cls, const char *fmt, va_list ap)
{
	const struct http *h = cls;
	char msg[512], quoted[600];
	size_t n;

	vsnprintf(msg, sizeof(msg), fmt, ap);
	n = strlen(msg);
	while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == ' '))
		msg[--n] = '\0';
	log_event(atomic_load(&h->serving) ? LOG_DEBUG : LOG_WARN,
	    "http server", "error=%s",
	    log_quote(quoted, sizeof(quoted), msg));
}

/* Queues a response and drops our reference (MHD keeps its own). */
static enum MHD_Result
reply(struct MHD_Connection *conn, unsigned int status,
    struct MHD_Response *resp, const char *type)
{
	enum MHD_Result rc;

	if (resp == NULL)
		return MHD_NO;
	if (MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
	    type) != MHD_YES ||
	    (status == MHD_HTTP_METHOD_NOT_ALLOWED &&
	    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW,
	    "GET, HEAD") != MHD_YES)) {
		MHD_destroy_response(resp);
		return MHD_NO;
	}
	rc = MHD_queue_response(conn, status, resp);
	MHD_destroy_response(resp);
	return rc;
}

static enum MHD_Result
reply_text(struct MHD_Connection *conn, unsigned int status,
    const char *text)
{
	/* MUST_COPY: the API takes a non-const pointer, and these bodies
	 * are a few bytes. */
	return reply(conn, status, MHD_create_response_from_buffer(
	    strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY),
	    "text/plain; charset=utf-8");
}

static enum MHD_Result
reply_metrics(struct MHD_Connection *conn)
{
	struct MHD_Response *resp;
	size_t size = 8192, len;
	char *buf = xmalloc(size);

	/* Values can gain digits between two renders: loop, with room. */
	while ((len = metrics_render(buf, size)) >= size) {
		size = len + 1024;
		buf = xrealloc(buf, size);
	}
	resp = MHD_create_response_from_buffer(len, buf,
	    MHD_RESPMEM_MUST_FREE);
	if (resp == NULL) {
		free(buf);
		return MHD_NO;
	}
	return reply(conn, MHD_HTTP_OK, resp,
	    "text/plain; version=0.0.4; charset=utf-8");
}

static enum MHD_Result
reply_health(struct MHD_Connection *conn)
{
	char reason[128], body[160];

	if (metrics_health(reason, sizeof(reason)))
		return reply_text(conn, MHD_HTTP_OK, "ok\n");
	strfmt(body, sizeof(body), "unhealthy: %s\n", reason);
	return reply_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, body);
}

/*
 * Every request is answered on the first call, before any body is read:
 * none of our routes takes one, and MHD discards what a client sends.
 */
static enum MHD_Result
handle(void *cls, struct MHD_Connection *conn, const char *url,
    const char *method, const char *version, const char *upload_data,
    size_t *upload_data_size, void **req_cls)
{
	bool metrics, health;

	(void)cls;
	(void)version;
	(void)upload_data;
	(void)upload_data_size;
	(void)req_cls;
	metrics = strcmp(url, "/metrics") == 0;
	health = strcmp(url, "/healthz") == 0;
	if (!metrics && !health)
		return reply_text(conn, MHD_HTTP_NOT_FOUND, "not found\n");
	/* HEAD is GET without the body (RFC 9110 requires both); MHD
	 * leaves the body out itself. */
	if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
	    strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
		return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
		    "method not allowed\n");
	return metrics ? reply_metrics(conn) : reply_health(conn);
}

/*
 * A bound, listening, non-blocking socket for ss, its port in *port; -1
 * with errno kept for the caller's message.
 */
static int
listen_socket(struct sockaddr_storage *ss, socklen_t sslen, int *port)
{
	int fd, on = 1, saved;

	fd = socket(ss->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK,
	    0);
	if (fd == -1)
		return -1;
	/* Restarting must not wait for old connections in TIME_WAIT. */
	if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == -1)
		goto fail;
	/* "[::]" means IPv6 only: 0.0.0.0 is how to ask for IPv4. */
	if (ss->ss_family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6,
	    IPV6_V6ONLY, &on, sizeof(on)) == -1)
		goto fail;
	if (bind(fd, (struct sockaddr *)ss, sslen) == -1 ||
	    listen(fd, (int)HTTP_MAX_CONNECTIONS) == -1)
		goto fail;
	/* Port 0 asked the kernel to choose: find out what it chose. */
	sslen = sizeof(*ss);
	if (getsockname(fd, (struct sockaddr *)ss, &sslen) == -1)
		goto fail;
	*port = ntohs(ss->ss_family == AF_INET6 ?
	    ((struct sockaddr_in6 *)ss)->sin6_port :
	    ((struct sockaddr_in *)ss)->sin_port);
	return fd;

fail:
	saved = errno;
	close(fd);
	errno = saved;
	return -1;
}

struct http *
http_start(const struct http_conf *conf, char *err, size_t errlen)
{
	struct sockaddr_storage ss;
	socklen_t sslen;
	struct http *h = xcalloc(1, sizeof(*h));
	const char *spec = conf != NULL && conf->listen != NULL ?
	    conf->listen : "";
	int fd = -1;

	atomic_init(&h->serving, false);
	if (*spec == '\0')
		return h;
	if (listen_parse(spec, &ss, &sslen, err, errlen) == -1)
		goto fail;
	if ((fd = listen_socket(&ss, sslen, &h->port)) == -1) {
		set_err(err, errlen, spec, strerror(errno));
		goto fail;
	}
	h->daemon = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD |
	    MHD_USE_ERROR_LOG, 0, NULL, NULL, handle, NULL,
	    MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h,
	    MHD_OPTION_LISTEN_SOCKET, fd,
	    MHD_OPTION_CONNECTION_LIMIT, HTTP_MAX_CONNECTIONS,
	    MHD_OPTION_PER_IP_CONNECTION_LIMIT, HTTP_MAX_PER_ADDRESS,
	    MHD_OPTION_CONNECTION_TIMEOUT, HTTP_TIMEOUT_S,
	    MHD_OPTION_END);
	if (h->daemon == NULL) {
		set_err(err, errlen, spec,
		    "libmicrohttpd could not start (see its log line)");
		/* 0.9.75 leaves a socket it was given open when it fails
		 * early (checked), but may close it on later paths: close
		 * it only if it is still open. */
		if (fcntl(fd, F_GETFD) == -1)
			fd = -1;
		goto fail;
	}
	/* From here MHD owns fd: MHD_stop_daemon closes it. */
	atomic_store(&h->serving, true);
	log_info("http listening", "listen=%s port=%d", spec, h->port);
	return h;

fail:
	if (fd != -1)
		close(fd);
	free(h);
	return NULL;
}

void
http_stop(struct http *h)
{
	if (h == NULL)
		return;
	if (h->daemon != NULL)
		MHD_stop_daemon(h->daemon);
	free(h);
}

int
http_port(const struct http *h)
{
	return h != NULL ? h->port : 0;
}
