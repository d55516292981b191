-- outboxd migration 005: narrow the per-key index of 004 to rows that have
-- a key.  Over every unsent row, the planner sometimes chose it for the
-- claim itself and sorted the whole backlog per batch (docs/PERFORMANCE.md);
-- the ordering check only ever looks up rows with a key, and
-- "business_key = ..." proves "business_key IS NOT NULL", so it still fits.
-- Only when the index is not the narrow one yet: the psql recipe runs every
-- file again at each upgrade, and a rebuild holds producers' inserts back.

DO $$
BEGIN
    -- Looked up as DROP INDEX finds it, through search_path: a first
    -- schema on the path without the tables ("$user") made the index
    -- look missing, and it was rebuilt at every run.
    IF NOT EXISTS (SELECT 1 FROM pg_index
        WHERE indexrelid = to_regclass('t_transactional_message_unsent_key_idx')
          AND pg_get_indexdef(indexrelid) LIKE '%business_key IS NOT NULL%') THEN
        DROP INDEX IF EXISTS t_transactional_message_unsent_key_idx;
        CREATE INDEX t_transactional_message_unsent_key_idx
            ON t_transactional_message (business_key, id)
            WHERE message_status IN (0, 2) AND NOT deleted
              AND business_key IS NOT NULL;
    END IF;
END
$$;
