-- outboxd migration 007: an index for the leader's purge of sent rows
-- (relay.retention, `outboxd purge`).  Without it, a purge pass that
-- finds nothing old enough, as most do, read every SUCCESS row: once a
-- minute, a full scan of the week of sent rows the default retention
-- keeps (520 ms for 4,000,000 rows held in memory; over this index,
-- 3 ms).  New SUCCESS rows enter it at its right edge: marking batches
-- sent was no slower in the benchmark (docs/PERFORMANCE.md).  It takes
-- about 22 bytes per sent row.
--
-- Built CONCURRENTLY: a plain CREATE INDEX would hold up the producers'
-- inserts for as long as it takes (1.0-1.4 s for 4,000,000 sent rows in
-- memory; longer from disk).  A concurrent build waits instead for the
-- transactions open when it starts, which a relay keeps short.  It cannot
-- run in a transaction: `outboxd migrate` runs this file on its own, and
-- psql -f does too (not with -1).  A build that fails or is cancelled
-- leaves an invalid index of this name; `outboxd migrate` drops it and
-- builds it again.
-- outboxd: online index t_transactional_message_sent_idx

CREATE INDEX CONCURRENTLY IF NOT EXISTS t_transactional_message_sent_idx
    ON t_transactional_message (edit_time)
    WHERE message_status = 1;
