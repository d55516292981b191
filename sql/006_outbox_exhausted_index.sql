-- outboxd migration 006: an index for the leader's sweep of rows out of
-- retries.  The sweep runs every poll_interval and looked at every unsent
-- row to find the few (usually none) whose retries are used up: 100 ms
-- per sweep with 1,000,000 rows waiting, on the relay's own session.  Over
-- this index, which holds only such rows, it costs nothing whatever the
-- backlog (docs/PERFORMANCE.md).  Rows enter it only when their last
-- retry fails, so writes stay as cheap as before.
--
-- Built CONCURRENTLY, so producers' inserts go on while it builds (see
-- 007).  `outboxd migrate` runs it outside a transaction, as psql -f does.
-- outboxd: online index t_transactional_message_exhausted_idx

CREATE INDEX CONCURRENTLY IF NOT EXISTS t_transactional_message_exhausted_idx
    ON t_transactional_message (id)
    WHERE message_status IN (0, 2) AND NOT deleted
      AND current_retry_times >= max_retry_times;
