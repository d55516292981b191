-- The least the PostgreSQL roles around outboxd need, as two group roles
-- that cannot log in: outbox_relay for outboxd, outbox_producer for the
-- applications that write the outbox.  Run it after `outboxd migrate`, as
-- the owner of the outbox tables with CREATEROLE (or as a superuser):
--
--   psql -v ON_ERROR_STOP=1 -f examples/roles.sql
--
-- then give each login role its group, for example:
--
--   CREATE ROLE outboxd LOGIN PASSWORD '...' IN ROLE outbox_relay;
--   GRANT outbox_producer TO app;
--
-- It can be run again.  The tables are in schema public, as sql/ makes
-- them.  `outboxd migrate` needs the tables' owner, not these roles.
-- tests/integration/check_daemon.c runs outboxd as a member of
-- outbox_relay, so a statement that needs more fails the tests.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay')
    THEN
        CREATE ROLE outbox_relay NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_producer')
    THEN
        CREATE ROLE outbox_producer NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_relay, outbox_producer;

-- outboxd: reads due rows with their content, locks them (SELECT ... FOR
-- UPDATE and LOCK TABLE ... ROW EXCLUSIVE need UPDATE) and marks them.
-- DELETE is for relay.retention and `outboxd purge` only; without it, set
-- relay.retention: 0 (the content rows go with their message by the
-- foreign key's ON DELETE CASCADE, which needs no grant).  LISTEN,
-- NOTIFY and advisory locks need none either.  The same grants serve the
-- commands status, dead and replay.
GRANT SELECT, UPDATE, DELETE ON t_transactional_message TO outbox_relay;
GRANT SELECT ON t_transactional_message_content TO outbox_relay;

-- Producers: what outbox_enqueue() does, with the caller's rights
-- (docs/PRODUCERS.md).  EXECUTE on functions is granted to everyone by
-- default, and the identity columns need no sequence grant.
GRANT INSERT ON t_transactional_message, t_transactional_message_content
    TO outbox_producer;
GRANT SELECT (id) ON t_transactional_message TO outbox_producer;
