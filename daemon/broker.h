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

/* The reason for a body over max_payload (size, max_payload); the relay
 * gives it too, for a content its claim left in the database. */
#define BROKER_PAYLOAD_TOO_LARGE \
	"payload of %zu bytes exceeds rabbitmq.max_payload (%zu)"

struct broker_conf {
	struct broker_node nodes[BROKER_MAX_NODES]; /* tried in turn */
	size_t n_nodes;
	char *vhost;
	char *user;
	char *password;		/* secret: never logged */
	/* rabbitmq.password_file, read again before each connection
	 * (secret.h); NULL: the password above is fixed. */
	char *password_file;
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
	const char *exchange;	/* "" = default exchange; never NULL */
	/* Non-empty: the exchange is declared durable with this type
	 * (created when missing; a different existing type rejects the
	 * message).  NULL or "": it must exist (passive check). */
	const char *exchange_type;
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
	bool oversized;		/* permanent: the payload is too large */
	/* outboxd began to send it in this batch: an unknown outcome is
	 * a possible duplicate.  Never begun, it is simply still due. */
	bool sent;
	char reason[256];	/* the broker's words, for last_error */
};

struct broker;

/* Copies conf (the password is wiped on free); does not connect. */
struct broker *broker_new(const struct broker_conf *);
void broker_free(struct broker *);

/* Connects to the first node that answers (dropping any connection it
 * had), opens the channel and turns on confirms.  Error text, naming the
 * node, in broker_error(). */
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
 * the caller must reconnect.  When the broker blocks publishing, the rest
 * of the batch is not sent; what is unconfirmed at the deadline is
 * BROKER_UNKNOWN, and 0 is returned with the connection kept (see
 * broker_blocked_ms).  A message rejected by a channel close never
 * takes the others with it: the channel is reopened and the rest resent
 * (a message the broker took just before the close but never confirmed
 * is sent again: at-least-once).  Those resends share one more confirm
 * timeout; what is pending when it runs out is BROKER_UNKNOWN, with the
 * connection kept.  Not connected: -1, nothing sent.
 */
int broker_publish_batch(struct broker *, const struct broker_msg *msgs,
    size_t n, struct broker_result *results) WARN_UNUSED;

/*
 * broker_publish_batch() in two halves, so that the caller can work
 * while the broker does (a relay claims its next batch, or marks its
 * last, meanwhile).  broker_send_batch() sends the batch and returns
 * without waiting; -1 means the connection was lost (or was not there)
 * and every result is already final.  After a 0, call
 * broker_await_batch() before anything else on this broker (msgs and
 * results must stay valid until then): it returns what
 * broker_publish_batch() would.  Confirms arriving in between wait in
 * the socket, and the confirm deadline runs from the send.
 */
int broker_send_batch(struct broker *, const struct broker_msg *msgs,
    size_t n, struct broker_result *results) WARN_UNUSED;
int broker_await_batch(struct broker *) WARN_UNUSED;

/*
 * How long the broker has blocked publishing on this connection (a
 * memory or disk alarm; connection.blocked), 0 when it does not (the
 * log has the broker's words).  The broker says so only once the
 * connection publishes.  A blocked connection is kept: closing it
 * would not take back what it sent, which the broker still delivers
 * when the alarm clears.  Wait for broker_tick() to read the unblock.
 */
int64_t broker_blocked_ms(const struct broker *);
/* The confirm timeout in force (rabbitmq.confirm_timeout). */
int64_t broker_confirm_timeout_ms(const struct broker *);
/* The connection's socket, to poll() for the broker's next words; -1
 * when not connected. */
int broker_socket(const struct broker *);

/*
 * Services heartbeats and reads what the broker sent while no batch was
 * running (e.g. a connection.close), without blocking.  Call it while
 * idle: rabbitmq-c 0.11 only handles heartbeats inside its own calls.
 * Returns -1 when the connection is gone (error in broker_error()).
 */
int broker_tick(struct broker *) WARN_UNUSED;

/*
 * Test and CLI helpers; they run on their own channel, so a refusal
 * (404, 406) never disturbs publishing.  Each returns -1 with the
 * broker's words in broker_error().
 */
/* Declares a durable classic queue, bound to exchange with routing_key
 * when exchange is not "". */
int broker_declare_queue(struct broker *, const char *queue,
    const char *exchange, const char *routing_key) WARN_UNUSED;
/* Messages ready in queue (a passive declare: it may lag behind the
 * last confirm for a moment, so poll it). */
int broker_queue_count(struct broker *, const char *queue,
    uint32_t *count) WARN_UNUSED;
int broker_delete_queue(struct broker *, const char *queue) WARN_UNUSED;
/* Declares a durable exchange of type ("direct", "topic", ...). */
int broker_declare_exchange(struct broker *, const char *exchange,
    const char *type) WARN_UNUSED;
int broker_delete_exchange(struct broker *, const char *exchange)
    WARN_UNUSED;

/* A received message; every pointer is an owned, NUL-terminated copy. */
struct broker_header {
	char *key;
	char *value;		/* strings as sent; integers in decimal */
	bool integer;		/* the field was an AMQP integer */
};

struct broker_delivery {
	char *body;		/* body_len bytes, plus a NUL */
	size_t body_len;
	char *exchange;
	char *routing_key;
	char *message_id;	/* NULL when absent */
	char *content_type;	/* NULL when absent */
	int delivery_mode;	/* 2 = persistent; 0 when absent */
	int64_t timestamp_s;	/* 0 when absent */
	struct broker_header *headers;
	size_t n_headers;
};

/*
 * Consuming, for tests and the CLI.  broker_consume() turns a connected
 * broker into a consumer of queue (auto-ack); keep a separate struct
 * broker for it, as a consuming broker refuses to publish.
 * broker_get() waits up to timeout_ms for the next delivery: 0 with *out
 * set, 0 with *out NULL when none came, -1 on error.
 */
int broker_consume(struct broker *, const char *queue) WARN_UNUSED;
int broker_get(struct broker *, int64_t timeout_ms,
    struct broker_delivery **out) WARN_UNUSED;
/* The header named key, or NULL. */
const struct broker_header *broker_delivery_header(
    const struct broker_delivery *, const char *key);
void broker_delivery_free(struct broker_delivery *);

#endif
