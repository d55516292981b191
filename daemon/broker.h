/*
 * Broker: the RabbitMQ side (rabbitmq-c).  Publishes a batch of messages
 * with publisher confirms and says, per message, whether the broker took
 * it (basic.ack without basic.return) or why not.
 */
#ifndef OUTBOXD_BROKER_H
#define OUTBOXD_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

#define BROKER_MAX_NODES 8

struct broker_node {
	char *host;
	int port;
};

struct broker_conf {
	struct broker_node nodes[BROKER_MAX_NODES]; /* tried in turn */
	size_t n_nodes;
	char *vhost;
	char *user;
	char *password;		/* secret: never logged */
	int heartbeat_s;	/* 0 = off */
	int64_t connect_timeout_ms;
	int64_t confirm_timeout_ms; /* a whole batch's confirms */
	size_t max_payload;	/* larger bodies fail permanently, unsent */
	int frame_max;
	/* TLS (amqps); all NULL/false = plain TCP. */
	bool tls;
	char *tls_ca_file;
	char *tls_cert_file;
	char *tls_key_file;
	bool tls_verify_peer;
	bool tls_verify_hostname;
};

/* One message to publish; all pointers are borrowed for the call. */
struct broker_msg {
	int64_t id;		/* outbox id: becomes message_id */
	const char *exchange;	/* "" = default exchange */
	const char *exchange_type; /* for the error text only; may be NULL */
	const char *routing_key;
	const void *body;
	size_t body_len;
	const char *content_type; /* NULL = application/octet-stream */
	int64_t timestamp_s;	/* create_time, seconds since the epoch */
	const char *business_module; /* NULL = header left out */
	const char *business_key;
	int attempt;		/* 1 for the first try */
	/* Extra string headers from the row's headers column. */
	const char *const *header_keys;
	const char *const *header_values;
	size_t n_headers;
};

enum broker_outcome {
	BROKER_ACKED,		/* confirmed by basic.ack, not returned */
	BROKER_NACKED,		/* basic.nack: broker could not take it */
	BROKER_RETURNED,	/* basic.return: unroutable (mandatory) */
	BROKER_REJECTED,	/* channel closed for it: 404, 406, too big */
	BROKER_UNKNOWN,		/* connection lost or timed out before a
				 * confirm: it may or may not have arrived */
};

struct broker_result {
	enum broker_outcome outcome;
	bool permanent;		/* retrying can never help (e.g. too big) */
	char reason[256];	/* the broker's words, for last_error */
};

struct broker;

struct broker *broker_new(const struct broker_conf *);
void broker_free(struct broker *);

/* Connects to the first node that answers, opens the channel and turns
 * on confirms.  Error text in broker_error(). */
int broker_connect(struct broker *) WARN_UNUSED;
bool broker_connected(const struct broker *);
/* Drops the connection (kept struct; broker_connect again later). */
void broker_disconnect(struct broker *);
const char *broker_error(const struct broker *);

/*
 * Publishes msgs[0..n) and waits up to confirm_timeout_ms for every
 * confirm, filling results[i] for msgs[i].  Returns 0 when the connection
 * is still healthy (each result says what happened to its message), -1
 * when it was lost: the messages not yet confirmed are BROKER_UNKNOWN and
 * the caller must reconnect.  A message rejected by a channel close never
 * takes the others with it: the channel is reopened and the rest resent.
 */
int broker_publish_batch(struct broker *, const struct broker_msg *msgs,
    size_t n, struct broker_result *results) WARN_UNUSED;

/* Test and CLI helpers: declare a durable queue bound to exchange with
 * routing_key ("" exchange = no binding), and count its messages. */
int broker_declare_queue(struct broker *, const char *queue,
    const char *exchange, const char *routing_key) WARN_UNUSED;

#endif
