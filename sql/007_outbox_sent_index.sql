-- outboxd migration 007: an index for the leader's purge of sent rows
-- (relay.retention, `outboxd purge`).  Without it, a purge pass that
-- finds nothing old enough, as most do, read every SUCCESS row: once a
-- minute, a full scan of the week of sent rows the default retention
-- keeps (520 ms for 4,000,000 rows held in memory; over this index,
-- 3 ms).  New SUCCESS rows enter it at its right edge: marking batches
-- sent was no slower in the benchmark (docs/PERFORMANCE.md).  It takes
-- about 22 bytes per sent row.
--
-- Building it holds up inserts into the table for as long as it takes
-- (1.0-1.4 s for 4,000,000 sent rows in memory; longer from disk).  On a
-- big outbox, create it first without that lock; this file then finds it
-- and does nothing:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS
--       t_transactional_message_sent_idx ON t_transactional_message
--       (edit_time) WHERE message_status = 1;

CREATE INDEX IF NOT EXISTS t_transactional_message_sent_idx
    ON t_transactional_message (edit_time)
    WHERE message_status = 1;
