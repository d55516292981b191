/* HTTP endpoint for /metrics (Prometheus text) and /healthz. */
#ifndef OUTBOXD_HTTP_H
#define OUTBOXD_HTTP_H

struct http_conf {
	char *listen;		/* "127.0.0.1:9187"; "" = disabled */
};

#endif
