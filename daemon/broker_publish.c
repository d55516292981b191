/*
 * Broker, publishing: a batch of outbox messages goes out on channel 1
 * with publisher confirms, and each message's outcome is read back.
 * rabbitmq-c 0.11 has no confirm helper: the confirm frames are read
 * here.
 */
#include "broker_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

#define DRAIN_EVERY 64		/* publishes between reads of the acks */
/* ... or fewer, when they are large: a connection.blocked is read before
 * much more is written into a connection the broker no longer reads. */
#define DRAIN_BYTES (64 * 1024)
#define SHORTSTR_MAX 255	/* AMQP short strings: names, keys */
#define DEFAULT_CONTENT_TYPE "application/octet-stream"
/* Exchanges remembered per connection, beyond those the last batch used.
 * A producer with an exchange per tenant must not grow the cache, and
 * the linear search in it, without end. */
#define XCACHE_MAX 256

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

/*
 * Between batches, above XCACHE_MAX: what the last batch did not use
 * goes.  What it used stays, however much that is (at most a batch's
 * worth): the next batch probably sends there again, and forgetting it
 * would cost a round trip per exchange.
 */
static void
xcache_trim(struct broker *b)
{
	size_t kept = 0;

	if (b->n_xs <= XCACHE_MAX)
		return;
	for (size_t i = 0; i < b->n_xs; i++) {
		if (b->xs[i].batch + 1 >= b->batch_seq) {
			b->xs[kept++] = b->xs[i];
		} else {
			free(b->xs[i].name);
			free(b->xs[i].type);
		}
	}
	b->n_xs = kept;
}

/* The exchange failed under our feet (deleted after it was checked):
 * whatever we knew about it is stale. */
void
bk_xcache_forget(struct broker *b, const char *name)
{
	size_t kept = 0;

	for (size_t i = 0; i < b->n_xs; i++) {
		if (strcmp(b->xs[i].name, name) == 0) {
			free(b->xs[i].name);
			free(b->xs[i].type);
		} else {
			b->xs[kept++] = b->xs[i];
		}
	}
	b->n_xs = kept;
}

/*
 * Whether an exchange can take messages: 0 yes, 1 no (the broker's words
 * in reason), -1 connection lost.  With a type it is declared (created
 * when missing, 406 when it exists with another type; one of that type
 * with other flags is used as it is), without one it must exist.  Successes are cached until reconnect, failures for the
 * batch.
 */
static int WARN_UNUSED
exchange_usable(struct broker *b, const char *name, const char *type,
    int64_t deadline, char *reason, size_t size)
{
	struct xentry *x;
	bool passive = (*type == '\0');
	int rc;

	*reason = '\0';
	if (*name == '\0')
		return 0;	/* the default exchange always exists */
	x = xcache_find(b, name, type);
	if (x != NULL && x->ok) {
		x->batch = b->batch_seq;	/* in use: kept by the trim */
		return 0;
	}
	if (x != NULL && x->batch == b->batch_seq) {
		strfmt(reason, size, "%s", x->reason);
		return 1;
	}
	if (bk_ensure_channels(b, deadline) == -1)
		return -1;
	bk_rpc_deadline(b, deadline);
	b->exchange_checks++;
	amqp_exchange_declare(b->conn, CH_CHECK, amqp_cstring_bytes(name),
	    passive ? amqp_empty_bytes : amqp_cstring_bytes(type), passive,
	    1, 0, 0, amqp_empty_table);
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "exchange.declare", reason, size);
	if (rc == 1 && !passive && strstr(reason, "inequivalent arg") != NULL &&
	    strstr(reason, "inequivalent arg 'type'") == NULL &&
	    strstr(reason, "inequivalent arg 'internal'") == NULL) {
		/* It exists with the row's type (the broker compares the
		 * type first) but other flags than ours: not durable (pika's
		 * default), auto-delete, an alternate exchange.  A publish
		 * works: every such row was rejected until it was dead.  Not
		 * an internal one: a publish there closes the channel. */
		if (bk_ensure_channels(b, deadline) == -1)
			return -1;
		bk_rpc_deadline(b, deadline);
		b->exchange_checks++;
		amqp_exchange_declare(b->conn, CH_CHECK,
		    amqp_cstring_bytes(name), amqp_empty_bytes, 1, 0, 0, 0,
		    amqp_empty_table);
		rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
		    "exchange.declare", reason, size);
		if (rc == -1)
			return -1;
	}
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
 * such a row would take every batch down with it.  *oversized says
 * whether the payload is what is wrong.
 */
static bool
msg_invalid(const struct broker *b, const struct broker_msg *m,
    char *reason, size_t size, bool *oversized)
{
	size_t frame_max = (size_t)amqp_get_frame_max(b->conn);
	bool long_name = too_long(m->exchange) || too_long(m->routing_key) ||
	    too_long(m->content_type) || too_long(m->exchange_type);

	for (size_t i = 0; i < m->n_headers; i++)
		long_name = long_name || too_long(m->header_keys[i]);
	*oversized = b->conf.max_payload > 0 &&
	    m->body_len > b->conf.max_payload;
	if (*oversized)
		strfmt(reason, size, BROKER_PAYLOAD_TOO_LARGE, m->body_len,
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
	bool oversized;

	if (bk_ensure_channels(b, bt->deadline) == -1)
		return -1;
	for (size_t i = 0; i < bt->n; i++) {
		const struct broker_msg *m = &bt->msgs[i];
		int rc;

		if (b->slots[i].state != SLOT_PENDING)
			continue;
		if (msg_invalid(b, m, reason, sizeof(reason), &oversized)) {
			finish(bt, i, BROKER_REJECTED, true, reason);
			bt->res[i].oversized = oversized;
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
			bt->res[i].oversized = true;
			continue;
		}
		rc = exchange_usable(b, m->exchange ? m->exchange : "",
		    m->exchange_type ? m->exchange_type : "", bt->deadline,
		    reason, sizeof(reason));
		if (rc == -1 && *reason != '\0') {
			/* The broker closed the whole connection over this
			 * row's exchange (an exchange type it does not know:
			 * 503): the row takes the blame, or every batch would
			 * reconnect and meet it again. */
			finish(bt, i, BROKER_REJECTED, false, reason);
			return -1;
		}
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
	/* Before the call: a publish that fails may have been cut by the
	 * broker closing for this very message, which must be blamed. */
	bt->res[i].sent = true;
	st = amqp_basic_publish(b->conn, CH_PUB,
	    amqp_cstring_bytes(m->exchange ? m->exchange : ""),
	    amqp_cstring_bytes(m->routing_key ? m->routing_key : ""),
	    1, 0, &props, body);
	if (st != AMQP_STATUS_OK)
		return bk_conn_lost(b, "publishing id %" PRId64 ": %s", m->id,
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
	    !int64_parse(p->message_id.bytes, p->message_id.len, &id) ||
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
	return bk_channel_close_ok(b, CH_PUB);
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

static int WARN_UNUSED
handle_frame(struct batch *bt, const amqp_frame_t *f)
{
	struct broker *b = bt->b;
	bool method = f->frame_type == AMQP_FRAME_METHOD;

	if (method && f->channel == 0)
		return bk_conn_method(b, &f->payload.method);
	if (method && f->channel == CH_CHECK &&
	    f->payload.method.id == AMQP_CHANNEL_CLOSE_METHOD)
		return bk_channel_close_ok(b, CH_CHECK);
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
 * PUMP_BLOCKED: the deadline passed while the broker blocks publishing,
 * which is no sign of a dead connection.  PUMP_OUT_OF_TIME: it passed in
 * a round after a channel close, which had only what was left of the
 * batch's time: no sign either.
 */
#define PUMP_BLOCKED 2
#define PUMP_OUT_OF_TIME 3

static int WARN_UNUSED
pump(struct batch *bt, bool block)
{
	struct broker *b = bt->b;
	struct timeval tv = { 0, 0 };
	int64_t left = bt->deadline - now_mono_ms();
	amqp_frame_t f;
	int st, rc;

	/* Frames already inside the library (read ahead, or stashed by an
	 * RPC) never wake poll(): take them without waiting.  Past the
	 * deadline, what has arrived still counts: a pipelined relay can
	 * come back late (its next claim and last marks took a slow
	 * database that long) to every ack waiting in the socket. */
	if (block && left > 0 && !amqp_frames_enqueued(b->conn) &&
	    !amqp_data_in_buffer(b->conn))
		tv = bk_ms_to_tv(left);
	st = amqp_simple_wait_frame_noblock(b->conn, &f, &tv);
	/* Without waiting, nothing there is only that: the callers that
	 * read what is available weigh the deadline themselves. */
	if (st == AMQP_STATUS_TIMEOUT && left <= 0 && block) {
		/* Unblocked a moment before the deadline, the broker is
		 * still working off what the alarm held: its confirms are
		 * late, not lost, and the connection is as good as it was
		 * blocked.  It was dropped, with "confirms missing". */
		if (b->blocked_since_ms != 0 || b->blocks != bt->blocks_before)
			return PUMP_BLOCKED;
		if (bt->round > 0)
			return PUMP_OUT_OF_TIME;
		return bk_conn_lost(b, "%zu confirms missing after %" PRId64
		    " ms", b->win.outstanding, bk_confirm_ms(b));
	}
	if (st == AMQP_STATUS_TIMEOUT)
		return block ? 0 : 1;
	if (st != AMQP_STATUS_OK)
		return bk_conn_lost(b, "reading confirms: %s",
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

/*
 * Before more is written: waits until the socket has room, reading what
 * the broker says meanwhile.  rabbitmq-c itself would wait for room
 * without a timeout, and a broker that blocks us (an alarm) stops
 * reading: the connection.blocked that says so is read here, and then
 * no more is sent.  Returns 0 (room, blocked, or the channel closed) or
 * -1 when the connection is lost, or the broker took nothing until the
 * deadline without a word.
 */
static int WARN_UNUSED
wait_for_room(struct batch *bt)
{
	struct broker *b = bt->b;

	for (;;) {
		struct pollfd pfd = { .fd = amqp_get_sockfd(b->conn),
			.events = POLLOUT | POLLIN };
		int64_t left;

		if (pump_available(bt) == -1)
			return -1;
		if (b->blocked_since_ms != 0 || !b->pub_open)
			return 0;
		left = bt->deadline - now_mono_ms();
		if (left <= 0)
			return bk_conn_lost(b, "the broker took nothing for %"
			    PRId64 " ms", bk_confirm_ms(b));
		if (poll(&pfd, 1, (int)left) == -1 && errno != EINTR)
			return bk_conn_lost(b, "poll: %s", strerror(errno));
		if (pfd.revents & (POLLOUT | POLLERR | POLLHUP))
			return 0;	/* a send reports an error itself */
	}
}

static size_t
size_after(const char *text, const char *key)
{
	const char *p = strstr(text, key);

	return p != NULL ? (size_t)strtoull(p + strlen(key), NULL, 10) : 0;
}

/* RabbitMQ's words when topic authorisation refuses one routing key of
 * an exchange: "ACCESS_REFUSED - access to topic 'KEY' in exchange 'X'
 * in vhost '/' refused for user 'U'". */
#define TOPIC_REFUSED "access to topic '"

/* Whether the broker's words name the exchange.  It calls the default
 * exchange amq.default (a 403 for a user that may not write to it):
 * unnamed, each such row was hunted down as an unexplained close, up to
 * the round limit, which then failed the innocent rows too.  A topic
 * refusal names the exchange too, but only the message with that
 * routing key is refused: see names_message. */
static bool
names_exchange(const char *text, const char *exchange)
{
	char needle[SHORTSTR_MAX + 16];

	if (strstr(text, TOPIC_REFUSED) != NULL)
		return false;
	if (exchange == NULL || *exchange == '\0')
		exchange = "amq.default";
	strfmt(needle, sizeof(needle), "exchange '%s'", exchange);
	return strstr(text, needle) != NULL;
}

/* Whether the broker's words point at m: its exchange, or, for a topic
 * refusal, its exchange and routing key both.  Blamed on the exchange,
 * one forbidden key failed every message to it in flight, each with
 * that key's words, and spent their retries.  A text the broker cut
 * short (255 bytes) names no message: the close is then unexplained,
 * and the suspects' rounds find the row. */
static bool
names_message(const char *text, const struct broker_msg *m)
{
	char needle[2 * SHORTSTR_MAX + 64];

	if (strstr(text, TOPIC_REFUSED) == NULL)
		return names_exchange(text, m->exchange);
	strfmt(needle, sizeof(needle), TOPIC_REFUSED "%s' in exchange '%s'",
	    m->routing_key != NULL ? m->routing_key : "", m->exchange);
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
		bool big = max_size > 0 && m->body_len > max_size;

		if (b->slots[w->idx[k]].state != SLOT_SENT)
			continue;
		if (alone || big || names_message(text, m)) {
			if (names_exchange(text, m->exchange))
				bk_xcache_forget(b, m->exchange);
			/* Too big for the broker is permanent; a missing or
			 * mistyped exchange may be fixed by an operator. */
			finish(bt, w->idx[k], BROKER_REJECTED, big, text);
			bt->res[w->idx[k]].oversized = big;
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
 * A confirm window opens: publishes the pending messages (while
 * isolating, only the first bt->probe suspects), reading acks as it
 * goes.  Once the broker blocks publishing, sends stop.  Returns 0 or -1
 * (connection lost).
 */
static int WARN_UNUSED
batch_send(struct batch *bt)
{
	struct broker *b = bt->b;
	size_t unread = 0;

	bt->isolating = batch_has_suspect(bt);
	bt->sent = 0;
	window_reset(&b->win, b->next_tag);
	b->want_return_header = false;
	/* Corked, the kernel sends the batch in full segments instead of
	 * pushing each message: rabbitmq-c writes every frame with its own
	 * send(), and the socket has TCP_NODELAY.  That saves about a fifth
	 * of outboxd's kernel time (docs/PERFORMANCE-LOG.md, "Corking the
	 * batch").  Uncorked before the wait, or the tail of the batch
	 * would sit in the kernel for up to 200 ms. */
	bk_cork(b, true);
	for (size_t i = 0; i < bt->n && b->pub_open &&
	    b->blocked_since_ms == 0; i++) {
		const struct slot *s = &b->slots[i];

		if (s->state != SLOT_PENDING || (bt->isolating && !s->suspect))
			continue;
		if (bt->isolating && bt->sent == bt->probe)
			break;
		if (publish_one(bt, i) == -1)
			return -1;
		unread += bt->msgs[i].body_len;
		if (++bt->sent % DRAIN_EVERY == 0 || unread >= DRAIN_BYTES) {
			unread = 0;
			if (wait_for_room(bt) == -1)
				return -1;
		}
	}
	bk_cork(b, false);
	return 0;
}

/* Whether a frame, or part of one, waits to be read. */
static bool
frame_waiting(struct broker *b)
{
	struct pollfd pfd = { .fd = amqp_get_sockfd(b->conn),
		.events = POLLIN };

	return amqp_frames_enqueued(b->conn) || amqp_data_in_buffer(b->conn) ||
	    poll(&pfd, 1, 0) == 1;
}

/*
 * The confirm window closes: waits for every confirm or for the channel
 * close that ends the window (blocked with messages still to send: for
 * the unblock too).  Returns 0, -1 (connection lost), 1: the deadline
 * passed while blocked, or 2: a later round ran out of the batch's time.
 */
static int WARN_UNUSED
batch_settle(struct batch *bt)
{
	struct broker *b = bt->b;
	size_t suspects;
	bool closed;

	while (b->pub_open && (b->win.outstanding > 0 ||
	    (b->blocked_since_ms != 0 && batch_left(bt) > 0))) {
		int rc = pump(bt, true);

		if (rc == -1)
			return -1;
		if (rc == PUMP_BLOCKED)
			return 1;
		if (rc == PUMP_OUT_OF_TIME)
			return 2;
	}
	closed = !b->pub_open;
	/* What came right behind the close is read before anything else
	 * is decided: a connection.blocked there (RabbitMQ's channel and
	 * reader send the two apart, in either order) means the channel
	 * must not be opened again until the unblock.  Unread, the next
	 * round opened it, the blocked broker never answered, and the
	 * connection was dropped under the alarm. */
	while (closed && b->conn != NULL && frame_waiting(b)) {
		int rc = pump(bt, false);

		if (rc == -1)
			return -1;
		if (rc != 0)
			break;
	}
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
	else if (bt->isolating)
		bt->probe = (bt->probe + 1) / 2;
	log_debug("confirm window done", "sent=%zu closed=%d suspects=%zu",
	    bt->sent, closed, suspects);
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
	bt->deadline = now_mono_ms() + bk_confirm_ms(b);
	bt->probe = SIZE_MAX;
	bt->closes = 0;
	bt->round = 0;
	bt->blocks_before = b->blocks;
	/* Even for an empty batch: memset() must not get NULL. */
	if (b->slots == NULL || b->cap_slots < n) {
		b->cap_slots = n + n / 2 + 16;
		b->slots = xrealloc(b->slots, b->cap_slots * sizeof(*b->slots));
	}
	memset(b->slots, 0, n * sizeof(*b->slots));
	for (size_t i = 0; i < n; i++) {
		res[i].outcome = BROKER_UNKNOWN;
		res[i].permanent = false;
		res[i].oversized = false;
		res[i].sent = false;
		res[i].reason[0] = '\0';
	}
	b->batch_seq++;
	xcache_trim(b);
}

/* Every message not settled yet is unknown, for why; returns how many. */
static size_t
finish_unsettled(struct batch *bt, const char *why)
{
	size_t left = 0;

	for (size_t i = 0; i < bt->n; i++) {
		if (bt->b->slots[i].state == SLOT_DONE)
			continue;
		finish(bt, i, BROKER_UNKNOWN, false, why);
		left++;
	}
	return left;
}

/*
 * The deadline passed while the broker blocks publishing.  Whatever is
 * not settled is unknown, and goes out again later: the broker still
 * holds what was sent, and will deliver it when it unblocks, so those
 * messages arrive twice.  Dropping the connection would not help: the
 * broker reads it only once it unblocks, and then delivers its messages
 * all the same (and every new connection would block one more batch).
 */
static void
batch_blocked(struct batch *bt)
{
	struct broker *b = bt->b;
	size_t left, unconfirmed = b->win.outstanding;
	char why[300], q[300];

	strfmt(why, sizeof(why), "the broker %s publishing: %s",
	    b->blocked_since_ms != 0 ? "blocks" : "blocked", b->blocked_reason);
	left = finish_unsettled(bt, why);
	/* Their late confirms fall below the next window, but a late
	 * basic.return would name a message by an id that the next batch
	 * may send again, and a late channel close would end the next
	 * batch's window: the next batch first closes the channel. */
	window_reset(&b->win, b->next_tag);
	b->want_return_header = false;
	b->pub_stale = b->pub_stale || unconfirmed > 0;
	log_warn("batch left unconfirmed", "node=%s unsettled=%zu "
	    "unconfirmed=%zu reason=%s", b->node, left, unconfirmed,
	    log_quote(q, sizeof(q), b->blocked_reason));
}

/*
 * The broker closed the channel again and again, or blocked publishing
 * until late, and the batch's time is up.  What is still pending was
 * not confirmed on a channel that is gone (nothing more can come for
 * it): it goes out with a later batch.  With no close in this batch the
 * close text is an older batch's, maybe hours old: the block is why.
 */
static void
batch_out_of_time(struct batch *bt)
{
	struct broker *b = bt->b;
	const char *reason = bt->closes > 0 ? b->close_reason :
	    b->blocked_reason;
	size_t left;
	char why[300], q[300];

	if (bt->closes > 0)
		strfmt(why, sizeof(why), "the broker closed the publishing "
		    "channel %u times within rabbitmq.confirm_timeout; last: "
		    "%s", bt->closes, reason);
	else
		strfmt(why, sizeof(why), "not all sent within "
		    "rabbitmq.confirm_timeout: the broker blocked publishing "
		    "meanwhile: %s", reason);
	left = finish_unsettled(bt, why);
	log_warn("batch out of time", "node=%s unsettled=%zu closes=%u "
	    "reason=%s", b->node, left, bt->closes,
	    log_quote(q, sizeof(q), reason));
}

/* Whatever is not settled when the connection goes is unknown. */
static void
batch_abandon(struct batch *bt)
{
	size_t left = finish_unsettled(bt, bt->b->err);
	char q[600];

	bk_drop(bt->b);
	log_error("broker connection lost", "unsettled=%zu error=%s", left,
	    log_quote(q, sizeof(q), bt->b->err));
}

int
broker_send_batch(struct broker *b, const struct broker_msg *msgs,
    size_t n, struct broker_result *results)
{
	struct batch *bt = &b->batch;

	batch_start(bt, b, msgs, n, results);
	b->awaiting = false;
	if (b->conn == NULL || b->consuming) {
		/* The caller's slip, not an event: nothing to log. */
		bk_set_err(b, "%s", b->conn == NULL ? "not connected" :
		    "a consuming connection cannot publish");
		return -1;
	}
	if (batch_prepare(bt) == -1 || batch_send(bt) == -1) {
		batch_abandon(bt);
		return -1;
	}
	b->awaiting = true;
	return 0;
}

int
broker_await_batch(struct broker *b)
{
	struct batch *bt = &b->batch;
	/* A round settles a message, or halves the group of suspects that
	 * holds an unexplained culprit: about two rounds per bad message.
	 * The bound only stops a broker that closes the channel for
	 * reasons of its own. */
	size_t max_rounds = 3 * bt->n + 8;
	/* Rounds after the first share one confirm timeout from now, not
	 * one each: the relay gives a batch's transaction only so long.
	 * From now, not from the send: a pipelined relay may come back to
	 * round 0 past its deadline (a slow database), and the rest of the
	 * batch, sent again after a channel close, would find no time left
	 * (its connection dropped for confirms that could not have come). */
	int64_t batch_end = now_mono_ms() + bk_confirm_ms(b);
	int rc;

	if (!b->awaiting) {
		bk_set_err(b, "no batch was sent");
		return -1;
	}
	b->awaiting = false;
	/* The first round was sent by broker_send_batch(). */
	for (size_t round = 0; round == 0 || batch_left(bt) > 0; round++) {
		bt->round = round;
		if (round == max_rounds) {
			for (size_t i = 0; i < bt->n; i++) {
				if (b->slots[i].state != SLOT_DONE)
					finish(bt, i, BROKER_REJECTED, false,
					    b->close_reason);
			}
			break;
		}
		/* A blocked broker reads nothing, not even the channel.open
		 * that a closed channel needs: the rest waits for the
		 * unblock, as it would at the deadline. */
		if (round > 0 && b->blocked_since_ms != 0 &&
		    (!b->pub_open || !b->check_open)) {
			batch_blocked(bt);
			return 0;
		}
		/* Not a round that could not even open the channel and hear
		 * back: what is left goes out with a later batch. */
		if (round > 0 &&
		    batch_end - now_mono_ms() < bk_confirm_ms(b) / 4) {
			batch_out_of_time(bt);
			break;
		}
		if (round > 0)
			bt->deadline = batch_end;
		if (round > 0 && (batch_prepare(bt) == -1 ||
		    batch_send(bt) == -1))
			goto fail;
		if ((rc = batch_settle(bt)) == -1)
			goto fail;
		if (rc == 1) {
			batch_blocked(bt);
			return 0;
		}
		if (rc == 2) {
			/* Their confirms may still come: the channel is
			 * closed and opened afresh below, dropping them. */
			b->pub_stale = true;
			batch_out_of_time(bt);
			break;
		}
	}
	/* A batch leaves the publishing channel ready for the next, even
	 * when its last confirm came just before its deadline; under a
	 * block, the next batch (after the unblock) reopens it. */
	if (b->blocked_since_ms == 0 &&
	    bk_ensure_channels(b, now_mono_ms() + bk_connect_ms(b)) == -1)
		goto fail;
	amqp_maybe_release_buffers(b->conn);
	return 0;
fail:
	batch_abandon(bt);
	return -1;
}

int
broker_publish_batch(struct broker *b, const struct broker_msg *msgs,
    size_t n, struct broker_result *results)
{
	if (broker_send_batch(b, msgs, n, results) == -1)
		return -1;
	return broker_await_batch(b);
}
