/* HTTP endpoint for /metrics (Prometheus text) and /healthz. */
#ifndef OUTBOXD_HTTP_H
#define OUTBOXD_HTTP_H

#include <stddef.h>

#include "util.h"

struct http_conf {
	char *listen;		/* "127.0.0.1:9187"; "" = disabled */
};

struct http;

/*
 * Checks a listen value without binding: "IPv4:port" or "[IPv6]:port",
 * numeric addresses only, port 0-65535 (0 = any free port).  "" and NULL
 * are valid (disabled).  On error writes "http.listen <value>: <why>".
 */
int http_listen_check(const char *listen, char *err, size_t errlen)
    WARN_UNUSED;

/*
 * Binds the configured address and starts serving on a thread of its
 * own: GET /metrics, GET /healthz (HEAD too).  When listen is empty the
 * endpoint is disabled and a handle that serves nothing is returned, so
 * callers need no special case.  NULL with a message on failure, e.g.
 * "http.listen 127.0.0.1:9187: Address already in use".
 */
struct http *http_start(const struct http_conf *, char *err, size_t errlen)
    WARN_UNUSED;
/* Stops serving, closes the socket and frees; NULL is a no-op. */
void http_stop(struct http *);
/* The bound port (useful after port 0); 0 when disabled or NULL. */
int http_port(const struct http *);

#endif
