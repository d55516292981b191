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

DROP TRIGGER IF EXISTS t_transactional_message_notify
    ON t_transactional_message;
CREATE TRIGGER t_transactional_message_notify
    AFTER INSERT ON t_transactional_message
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
