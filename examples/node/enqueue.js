#!/usr/bin/env node
// Producer example (node-postgres): an order and its outbox message in ONE
// transaction, so the message exists if and only if the order commits.
//
//   node examples/node/enqueue.js [--item NAME] [--fail] [DSN]
//
// The connection comes from DSN (a postgresql:// URI) or, when it is left
// out, from the PG* environment variables.  --fail throws after the
// enqueue to show that the rollback takes the outbox row with it.
// The driver: Debian 12's node-pg (apt-get install node-pg; Debian's nodejs
// has no npm), or `npm ci` in this directory (package-lock.json).
'use strict';

const { Client } = require('pg');

async function placeOrder(client, item, fail) {
  await client.query(`CREATE TABLE IF NOT EXISTS orders (
                        id   serial PRIMARY KEY,
                        item text NOT NULL)`);
  // One client, one connection: BEGIN ... COMMIT covers both INSERTs.
  // (With a Pool, check out a client first; pool.query() may use a
  // different connection for every statement.)
  await client.query('BEGIN');
  try {
    const order = await client.query(
      'INSERT INTO orders (item) VALUES ($1) RETURNING id', [item]);
    const orderId = order.rows[0].id;
    const payload = JSON.stringify({ order_id: orderId, item: item });
    // $3::text picks the text overload; pass a Buffer and $3::bytea for
    // binary payloads.  bigint comes back as a string: keep it that way.
    const msg = await client.query(
      `SELECT outbox_enqueue($1, $2, $3::text,
                             exchange_type   => 'topic',
                             business_module => 'orders',
                             business_key    => $4) AS id`,
      ['orders', 'order.created', payload, String(orderId)]);
    if (fail) {
      throw new Error('simulated failure after enqueue');
    }
    await client.query('COMMIT');
    return { orderId: orderId, messageId: msg.rows[0].id };
  } catch (err) {
    await client.query('ROLLBACK');
    throw err;
  }
}

async function main(argv) {
  let item = 'book';
  let fail = false;
  let dsn;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--item' && i + 1 < argv.length) item = argv[++i];
    else if (argv[i] === '--fail') fail = true;
    else dsn = argv[i];
  }
  // Without a connectionString, pg reads PGHOST, PGPORT, PGUSER, ...
  const client = new Client(dsn ? { connectionString: dsn } : {});
  await client.connect();
  try {
    const r = await placeOrder(client, item, fail);
    console.log(`order_id=${r.orderId} message_id=${r.messageId}`);
    return 0;
  } catch (err) {
    console.error(`rolled back: ${err.message}`);
    return 1;
  } finally {
    await client.end();
  }
}

main(process.argv.slice(2)).then(
  (code) => { process.exitCode = code; },
  (err) => { console.error(err.message); process.exitCode = 1; });
