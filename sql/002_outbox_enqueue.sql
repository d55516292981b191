-- outboxd migration 002: one-call enqueue for producers in any language.
--   SELECT outbox_enqueue('orders', 'order.created', '{"id": 42}');
-- writes the message and its content rows and returns the message id.
-- Call it inside the business transaction: the message exists if and
-- only if that transaction commits.

CREATE OR REPLACE FUNCTION outbox_enqueue(
    exchange         text,
    routing_key      text,
    content          bytea,
    queue_name       text             DEFAULT '',
    exchange_type    text             DEFAULT '',
    business_module  text             DEFAULT NULL,
    business_key     text             DEFAULT NULL,
    content_type     text             DEFAULT 'application/json',
    headers          jsonb            DEFAULT NULL,
    max_retry_times  integer          DEFAULT 5,
    init_backoff     interval         DEFAULT interval '10 seconds',
    backoff_factor   double precision DEFAULT 2,
    delay            interval         DEFAULT interval '0'
) RETURNS bigint
LANGUAGE sql VOLATILE
AS $fn$
    WITH m AS (
        INSERT INTO t_transactional_message
            (exchange_name, routing_key, queue_name, exchange_type,
             business_module, business_key, content_type, headers,
             max_retry_times, init_backoff, backoff_factor,
             next_schedule_time)
        VALUES (coalesce($1, ''), $2, coalesce($4, ''), coalesce($5, ''),
                $6, $7, coalesce($8, 'application/json'), $9,
                $10, $11, $12, now() + coalesce($13, interval '0'))
        RETURNING id
    ), c AS (
        INSERT INTO t_transactional_message_content (message_id, content)
        SELECT id, $3 FROM m
    )
    SELECT id FROM m
$fn$;

-- The same for text payloads (JSON, XML, ...), stored as UTF-8 bytes.  An
-- untyped literal resolves to this one.
CREATE OR REPLACE FUNCTION outbox_enqueue(
    exchange         text,
    routing_key      text,
    content          text,
    queue_name       text             DEFAULT '',
    exchange_type    text             DEFAULT '',
    business_module  text             DEFAULT NULL,
    business_key     text             DEFAULT NULL,
    content_type     text             DEFAULT 'application/json',
    headers          jsonb            DEFAULT NULL,
    max_retry_times  integer          DEFAULT 5,
    init_backoff     interval         DEFAULT interval '10 seconds',
    backoff_factor   double precision DEFAULT 2,
    delay            interval         DEFAULT interval '0'
) RETURNS bigint
LANGUAGE sql VOLATILE
AS $fn$
    SELECT outbox_enqueue($1, $2, convert_to($3, 'UTF8'), $4, $5, $6, $7,
                          $8, $9, $10, $11, $12, $13)
$fn$;
