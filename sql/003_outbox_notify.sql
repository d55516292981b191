-- outboxd migration 003: wake the relay when rows are inserted.  One
-- statement-level trigger; PostgreSQL delivers the NOTIFY at commit and
-- folds duplicates within a transaction, so a bulk insert costs one.

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    PERFORM pg_notify('outboxd', '');
    RETURN NULL;
END
$fn$;

-- Only when missing: DROP TRIGGER takes an ACCESS EXCLUSIVE lock, which
-- queued behind any open transaction and held every insert and read
-- back when the psql recipe ran this file again at an upgrade.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
        WHERE tgrelid = to_regclass('t_transactional_message')
          AND tgname = 't_transactional_message_notify') THEN
        CREATE TRIGGER t_transactional_message_notify
            AFTER INSERT ON t_transactional_message
            FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
    END IF;
END
$$;
