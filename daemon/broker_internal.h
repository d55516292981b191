/*
 * The broker module's insides, shared by its three parts: broker.c (the
 * connection), broker_publish.c (batches with confirms) and
 * broker_admin.c (declares and consuming, for the CLI and tests).
 * Nothing outside the broker module includes this.
 */
#ifndef OUTBOXD_BROKER_INTERNAL_H
#define OUTBOXD_BROKER_INTERNAL_H

#include <amqp.h>
#include <amqp_framing.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/time.h>

#include "broker.h"
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

/* The batch between broker_send_batch() and the end of
 * broker_await_batch(). */
struct batch {
	struct broker *b;
	const struct broker_msg *msgs;
	size_t n;
	struct broker_result *res;
	int64_t deadline;		/* monotonic ms */
	size_t probe;			/* suspects per round */
	size_t sent;			/* in this round */
	bool isolating;			/* this round probes suspects */
	unsigned closes;		/* of channel 1, in this batch */
	size_t round;			/* 0: the send's; more after closes */
	unsigned blocks_before;		/* broker.blocks when it was sent */
};

/* Exchanges known to work (until reconnect) or to fail (this batch). */
struct xentry {
	char *name;
	char *type;		/* "" for a passive check */
	bool ok;
	uint64_t batch;		/* a failure's batch; a success's last use */
	char reason[256];
};

struct broker {
	struct broker_conf conf;	/* deep copy; password wiped */
	amqp_connection_state_t conn;	/* NULL when disconnected */
	char node[300];			/* host:port connected to */
	bool pub_open, check_open;	/* channels 1 and 2 usable */
	/* Channel 1 still has messages of a batch given up under an alarm
	 * in flight: their late returns, acks or close would be taken for
	 * the next batch's.  It is closed and opened afresh first. */
	bool pub_stale;
	bool consuming;
	uint64_t next_tag;		/* of the next publish on channel 1 */
	uint64_t batch_seq;
	size_t broker_max_size;		/* learned from a 406; 0 unknown */
	struct xentry *xs;
	size_t n_xs, cap_xs;
	uint64_t exchange_checks;	/* exchange.declare round trips */
	struct slot *slots;
	size_t cap_slots;
	struct window win;
	struct batch batch;
	bool awaiting;			/* sent; broker_await_batch() next */
	amqp_table_entry_t *entries;	/* headers of the message in hand */
	size_t cap_entries;
	bool want_return_header;	/* a basic.return's header is next */
	char return_reason[256];
	char close_reason[256];		/* the last close of channel 1 */
	/* Set while the broker blocks publishing on this connection (a
	 * memory or disk alarm): since when (monotonic ms, 0 = not) and
	 * the broker's words. */
	int64_t blocked_since_ms;
	char blocked_reason[128];
	unsigned blocks;		/* connection.blocked frames read */
	/* "broker connect failed" repeats at every try while nodes refuse. */
	struct log_limit connect_log;
	char err[512];
};

/* Error text is "host:port: what happened" when a node is known. */
void bk_set_err(struct broker *, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Records why the connection is unusable and drops it; returns -1. */
int bk_conn_lost(struct broker *, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Frees a broken connection without a word to the broker. */
void bk_drop(struct broker *);
/* The broker closed the whole connection: close-ok, drop; -1. */
int bk_conn_closed_by_broker(struct broker *,
    const amqp_connection_close_t *);
/* Answers the broker's channel.close on ch; -1 if the connection went. */
int bk_channel_close_ok(struct broker *, amqp_channel_t ch);
/* A method on channel 0 (close, blocked, unblocked); -1: lost. */
int bk_conn_method(struct broker *, const amqp_method_t *) WARN_UNUSED;
/* An RPC's reply: 0 done; 1 refused, channel closed (reason set); -1
 * the connection is gone (reason set when the broker closed it because
 * of this command: 503 COMMAND_INVALID, 540 NOT_IMPLEMENTED; empty
 * otherwise). */
int bk_rpc_outcome(struct broker *, amqp_channel_t ch, amqp_rpc_reply_t r,
    const char *what, char *reason, size_t size) WARN_UNUSED;
struct timeval bk_ms_to_tv(int64_t ms);
/* Bounds the next RPCs by deadline (monotonic ms). */
void bk_rpc_deadline(struct broker *, int64_t deadline);
int64_t bk_confirm_ms(const struct broker *);
int64_t bk_connect_ms(const struct broker *);
void bk_cork(struct broker *, bool on);
/* Opens the publishing and the check channel where they are closed. */
int bk_ensure_channels(struct broker *, int64_t deadline) WARN_UNUSED;
/* The exchange cache: forget all (reconnect) or one name (deleted). */
void bk_xcache_clear(struct broker *);
void bk_xcache_forget(struct broker *, const char *name);

#endif
