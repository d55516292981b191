-- outboxd migration 009: a NULL max_retry_times, init_backoff or
-- backoff_factor given to outbox_enqueue means the default, as a NULL
-- exchange, queue_name, exchange_type, content_type or delay already did.
-- A driver or wrapper that binds every parameter, NULL for "not given",
-- met the columns' NOT NULL: the insert failed, and the business
-- transaction with it.  002 now does the same, for a recipe that runs it
-- again; this file is for databases that had 002 before it did.  The
-- text form calls this one, so it needs no change.  CREATE OR REPLACE
-- drops a function's settings: the search_path pin of 008 is given
-- again, to the tables' own schema.

DO $$
DECLARE
    home text;
BEGIN
    SELECT n.nspname INTO STRICT home
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = 't_transactional_message'::regclass;
    EXECUTE format($def$
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
SET search_path = %I, pg_temp
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
$fn$
$def$, home);
END
$$;
