-- outboxd migration 004: per-key ordering (relay.ordering: business_key).
-- The claim skips a row while an older unsent row has the same key; this
-- index over unsent rows answers that question without touching sent ones.

-- Only when missing: IF NOT EXISTS locks the table before it looks (001).
DO $$
BEGIN
    IF to_regclass('t_transactional_message_unsent_key_idx') IS NULL THEN
        CREATE INDEX t_transactional_message_unsent_key_idx
            ON t_transactional_message (business_key, id)
            WHERE message_status IN (0, 2) AND NOT deleted;
    END IF;
END
$$;
