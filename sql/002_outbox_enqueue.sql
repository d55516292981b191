-- outboxd migration 002: one-call enqueue for producers in any language.
--   SELECT outbox_enqueue('orders', 'order.created', '{"id": 42}');
-- writes the message and its content rows and returns the message id.
-- Call it inside the business transaction: the message exists if and
-- only if that transaction commits.  A NULL argument means its default
-- (009 says why for the last ones).

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
                coalesce($10, 5), coalesce($11, interval '10 seconds'),
                coalesce($12, 2), now() + coalesce($13, interval '0'))
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

-- Pinned to the outbox tables' own schema, as 008 does (it says why), in
-- this file too: run again by the psql recipe at an upgrade, the CREATE OR
-- REPLACE above drops the setting, and producers' calls looked the tables
-- up on their own search_path again until 008's turn came, or for good if
-- a migration between stopped the recipe.
DO $$
DECLARE
    home text;
    sig text;
BEGIN
    SELECT n.nspname INTO STRICT home
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = 't_transactional_message'::regclass;
    FOREACH sig IN ARRAY ARRAY['bytea', 'text'] LOOP
        EXECUTE format('ALTER FUNCTION outbox_enqueue(text, text, %s, text, '
            'text, text, text, text, jsonb, integer, interval, '
            'double precision, interval) SET search_path = %I, pg_temp',
            sig, home);
    END LOOP;
END
$$;
