-- outboxd migration 004: per-key ordering (relay.ordering: business_key).
-- The claim skips a row while an older unsent row has the same key; this
-- index over unsent rows answers that question without touching sent ones.

CREATE INDEX IF NOT EXISTS t_transactional_message_unsent_key_idx
    ON t_transactional_message (business_key, id)
    WHERE message_status IN (0, 2) AND NOT deleted;
