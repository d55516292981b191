-- outboxd migration 008: outbox_enqueue writes to the outbox tables of its
-- own schema, whatever the caller's search_path.  It named them
-- unqualified, so they were looked up on the producer's path: a producer
-- whose path lacked the outbox schema failed ("relation does not exist"),
-- and one whose path found another t_transactional_message first (the
-- application's own from before outboxd, say) wrote there, and nothing was
-- ever relayed.  pg_temp last: no temporary table can stand in either.
-- 002 now pins it too, for a recipe that runs 002 again; this file is for
-- databases that had 002 before it did.

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
