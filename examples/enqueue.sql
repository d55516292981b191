-- Producer example for psql: a business change and its outbox message in
-- ONE transaction, so the message exists if and only if the order does.
--   psql -v ON_ERROR_STOP=1 -v item=book -f examples/enqueue.sql
-- Connection from the usual PG* variables (PGHOST, PGDATABASE, ...).
-- Prints "order_id=N message_id=M".

\set ON_ERROR_STOP on
\if :{?item}
\else
\set item 'book'
\endif

-- The business table of this example (a real application has its own).
CREATE TABLE IF NOT EXISTS orders (
    id   serial PRIMARY KEY,
    item text NOT NULL
);

BEGIN;

INSERT INTO orders (item) VALUES (:'item') RETURNING id AS order_id \gset

-- One call writes t_transactional_message and its content row.  Named
-- arguments (=>) set only what differs from the defaults; business_key
-- lets consumers and `outboxd dead` find the order again.
SELECT outbox_enqueue(
           'orders',                    -- exchange ('' = default exchange)
           'order.created',             -- routing key
           json_build_object('order_id', :order_id,
                             'item', :'item')::text,
           exchange_type   => 'topic',  -- outboxd declares it durable
           business_module => 'orders',
           business_key    => :'order_id'
       ) AS message_id \gset

-- Nothing is visible to outboxd until here; a ROLLBACK (or a failure
-- above) would discard the order and the message together.
COMMIT;

\echo order_id=:order_id message_id=:message_id
