#!/usr/bin/python3
"""Producer example (psycopg2): an order and its outbox message in ONE
transaction, so the message exists if and only if the order commits.

    examples/python/enqueue.py [--item NAME] [--fail] [DSN]

The connection comes from DSN (a libpq string or postgresql:// URI) or,
when it is left out, from the PG* environment variables (PGHOST, PGPORT,
PGUSER, PGDATABASE, PGPASSWORD).  --fail raises after the enqueue to show
that a rolled-back business transaction leaves no outbox row either.
Needs Debian's python3-psycopg2 (or `pip install psycopg2`).
"""
import argparse
import json
import sys

import psycopg2


def place_order(conn, item, fail=False):
    """Inserts an order and enqueues order.created; returns both ids."""
    # `with conn` is one transaction: COMMIT when the block ends normally,
    # ROLLBACK when it raises.  Both INSERTs share it.
    with conn, conn.cursor() as cur:
        cur.execute("""
            CREATE TABLE IF NOT EXISTS orders (
                id   serial PRIMARY KEY,
                item text NOT NULL
            )""")
        cur.execute("INSERT INTO orders (item) VALUES (%s) RETURNING id",
                    (item,))
        order_id = cur.fetchone()[0]
        payload = json.dumps({"order_id": order_id, "item": item})
        # ::text picks the text overload (payload stored as UTF-8 bytes);
        # pass bytes and ::bytea for binary payloads.
        cur.execute("""
            SELECT outbox_enqueue(%s, %s, %s::text,
                                  exchange_type   => 'topic',
                                  business_module => 'orders',
                                  business_key    => %s)""",
                    ("orders", "order.created", payload, str(order_id)))
        message_id = cur.fetchone()[0]
        if fail:
            # Anything that goes wrong before COMMIT undoes both rows.
            raise RuntimeError("simulated failure after enqueue")
    return order_id, message_id


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dsn", nargs="?", default="",
                    help="libpq connection string (default: PG* variables)")
    ap.add_argument("--item", default="book")
    ap.add_argument("--fail", action="store_true",
                    help="fail after the enqueue: nothing is committed")
    args = ap.parse_args()

    conn = psycopg2.connect(args.dsn)
    try:
        order_id, message_id = place_order(conn, args.item, args.fail)
    except RuntimeError as e:
        print("rolled back: %s" % e, file=sys.stderr)
        return 1
    finally:
        conn.close()
    print("order_id=%d message_id=%d" % (order_id, message_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
