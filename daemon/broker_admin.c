/*
 * Broker, administration: declares, counts and consuming, for the CLI
 * and the tests.  They run on their own channels, so a refusal (404,
 * 406) never disturbs publishing.
 */
#include "broker_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

/* ---- declares and counts (CLI, tests) ---------------------------------- */

static int WARN_UNUSED
admin_begin(struct broker *b)
{
	if (b->conn == NULL) {
		bk_set_err(b, "not connected");
		return -1;
	}
	if (bk_ensure_channels(b, now_mono_ms() + bk_confirm_ms(b)) == -1)
		return -1;
	/* rabbitmq-c's RPC timeout is the connection's: without this the
	 * request got what the last caller left of its own deadline (1 ms
	 * after a batch that ended late), and a slower broker cost the
	 * connection. */
	bk_rpc_deadline(b, now_mono_ms() + bk_confirm_ms(b));
	return 0;
}

/* rc from bk_rpc_outcome(); logs the failure once and returns 0 or -1. */
static int
admin_end(struct broker *b, int rc, const char *what, const char *name,
    const char *reason)
{
	char q[600];

	if (rc == 0)
		return 0;
	if (rc == 1)
		bk_set_err(b, "%s %s: %s", what, name, reason);
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
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
	    "queue.declare", reason, sizeof(reason));
	if (rc == 0 && exchange != NULL && *exchange != '\0') {
		amqp_queue_bind(b->conn, CH_CHECK, amqp_cstring_bytes(queue),
		    amqp_cstring_bytes(exchange),
		    amqp_cstring_bytes(routing_key ? routing_key : ""),
		    amqp_empty_table);
		rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
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
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
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
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
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
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
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
	bk_xcache_forget(b, exchange);
	amqp_exchange_delete(b->conn, CH_CHECK, amqp_cstring_bytes(exchange),
	    0);
	rc = bk_rpc_outcome(b, CH_CHECK, amqp_get_rpc_reply(b->conn),
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
		bk_set_err(b, "already consuming");
		return -1;
	}
	if (admin_begin(b) == -1)
		return admin_end(b, -1, "basic.consume", queue, reason);
	bk_rpc_deadline(b, now_mono_ms() + bk_confirm_ms(b));
	amqp_channel_open(b->conn, CH_CONSUME);
	rc = bk_rpc_outcome(b, CH_CONSUME, amqp_get_rpc_reply(b->conn),
	    "channel.open", reason, sizeof(reason));
	if (rc == 0) {
		amqp_basic_consume(b->conn, CH_CONSUME,
		    amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 1, 0,
		    amqp_empty_table);
		rc = bk_rpc_outcome(b, CH_CONSUME, amqp_get_rpc_reply(b->conn),
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
		return bk_conn_lost(b, "consuming: %s", amqp_error_string2(st));
	if (f.frame_type != AMQP_FRAME_METHOD)
		return 0;
	if (f.channel == 0)
		return bk_conn_method(b, &f.payload.method);
	if (f.payload.method.id != AMQP_CHANNEL_CLOSE_METHOD)
		return 0;
	cc = f.payload.method.decoded;
	bk_set_err(b, "channel %u closed by the broker: %.*s", f.channel,
	    (int)cc->reply_text.len, (const char *)cc->reply_text.bytes);
	if (f.channel == CH_CONSUME)
		b->consuming = false;
	(void)bk_channel_close_ok(b, f.channel);
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
		bk_set_err(b, "%s", b->conn == NULL ? "not connected" :
		    "not consuming");
		return -1;
	}
	for (;;) {
		struct timeval tv = bk_ms_to_tv(deadline - now_mono_ms());

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
	(void)bk_conn_lost(b, "consuming: %s", r.reply_type ==
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
