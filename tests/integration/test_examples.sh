#!/usr/bin/env bash
# Runs the producer examples (examples/enqueue.sql, python, node) against
# the private PostgreSQL of tests/run-integration.sh and checks the order
# and outbox rows they write, and that a rolled-back order leaves none;
# then applies sql/ with psql -f into a scratch database.
# Needs PG* from the servers' env.sh and the schema applied.  A missing
# runtime (python3-psycopg2, node, the pg module) is a failure, not a skip.
set -uo pipefail

cd "${OUTBOXD_SRCDIR:-$(dirname "$0")/../..}" || exit 1
: "${PGHOST:?source the servers env.sh first}" "${PGDATABASE:?}"
: "${OUTBOXD_PG_CONNINFO:?source the servers env.sh first}"

# Debian's python3-psycopg2 lives in /usr/bin/python3's path, not in a
# pyenv or venv interpreter that may come first in PATH.
PYTHON=${PYTHON:-/usr/bin/python3}
NODE=${NODE:-node}
# Keep NOTICEs (e.g. "orders already exists, skipping") out of the output.
export PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning"

. tests/lib/checks.sh
tmp=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-examples.XXXXXX")
checks_at_exit+=('rm -rf "$tmp"')

sql() { psql -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }

# check_message MESSAGE_ID ORDER_ID ITEM: the order exists and the outbox
# row carries what every example writes.  Prints what differs, if any.
check_message() {
	local mid=$1 oid=$2 item=$3 got
	got=$(sql "SELECT count(*) FROM orders
		WHERE id = $oid AND item = '$item'") || return 1
	[ "$got" = 1 ] || { echo "order $oid ($item) not found"; return 1; }
	got=$(sql "SELECT concat_ws('|', m.exchange_name, m.exchange_type,
			m.routing_key, m.business_module, m.business_key,
			m.message_status, m.current_retry_times,
			m.max_retry_times, m.deleted, m.content_type,
			m.next_schedule_time <= now(),
			convert_from(c.content, 'UTF8')::jsonb =
			    jsonb_build_object('order_id', $oid, 'item', '$item'))
		FROM t_transactional_message m
		JOIN t_transactional_message_content c ON c.message_id = m.id
		WHERE m.id = $mid") || return 1
	local want="orders|topic|order.created|orders|$oid|0|0|5|f"
	want="$want|application/json|t|t"
	[ "$got" = "$want" ] ||
		{ echo "message $mid: got '$got', want '$want'"; return 1; }
}

# run_example NAME CMD...: runs an example that prints
# "order_id=N message_id=M" and checks both rows.
run_example() {
	local name=$1 item=$2 out
	shift 2
	if ! out=$("$@" 2>&1); then
		fail "$name" "exit status $?: $out"
		return 1
	fi
	if ! [[ "$out" =~ order_id=([0-9]+)\ message_id=([0-9]+) ]]; then
		fail "$name" "unexpected output: $out"
		return 1
	fi
	if ! out=$(check_message "${BASH_REMATCH[2]}" "${BASH_REMATCH[1]}" \
	    "$item"); then
		fail "$name" "$out"
		return 1
	fi
	return 0
}

# run_rollback NAME ITEM CMD...: the example's --fail mode must exit
# non-zero and leave neither the order nor any outbox row behind.
run_rollback() {
	local name=$1 item=$2 before after orders out
	shift 2
	before=$(sql "SELECT count(*) FROM t_transactional_message") || return 1
	if out=$("$@" 2>&1); then
		fail "$name" "--fail exited 0: $out"
		return 1
	fi
	after=$(sql "SELECT count(*) FROM t_transactional_message")
	orders=$(sql "SELECT count(*) FROM orders WHERE item = '$item'")
	if [ "$before" != "$after" ] || [ "$orders" != 0 ]; then
		fail "$name" "rollback left rows: outbox $before -> $after," \
		    "orders '$item': $orders"
		return 1
	fi
	return 0
}

# A fresh business table, so the examples' CREATE TABLE runs too.
sql "DROP TABLE IF EXISTS orders" >/dev/null || exit 1

# --- 1. psql ---------------------------------------------------------------
if run_example "sql example" sql-item \
    psql -X -q -At -v ON_ERROR_STOP=1 -v item=sql-item \
    -f examples/enqueue.sql; then
	pass "sql example: order and outbox row in one transaction"
fi

# --- 2. Python (psycopg2) --------------------------------------------------
if ! "$PYTHON" -c 'import psycopg2' 2>/dev/null; then
	fail "python example" "$PYTHON cannot import psycopg2" \
	    "(install Debian's python3-psycopg2)"
elif run_example "python example" py-item \
    "$PYTHON" examples/python/enqueue.py --item py-item \
    "$OUTBOXD_PG_CONNINFO" &&
    run_rollback "python example rollback" py-fail \
    "$PYTHON" examples/python/enqueue.py --item py-fail --fail; then
	pass "python example: commit writes both rows, rollback neither"
fi

# --- 3. Node.js (node-postgres) --------------------------------------------
# The pg module: Debian's node-pg or examples/node/node_modules if either
# is there, else `npm ci` from package-lock.json into a scratch directory.
node_ok=
if ! command -v "$NODE" >/dev/null; then
	fail "node example" "no node binary (install Debian's nodejs)"
elif (cd examples/node && "$NODE" -e "require('pg')") 2>/dev/null; then
	node_ok=1
elif (cd examples/node && NODE_PATH=/usr/share/nodejs "$NODE" -e \
    "require('pg')") 2>/dev/null; then
	# Debian's node-pg, for a node that does not look there itself.
	export NODE_PATH=/usr/share/nodejs
	node_ok=1
elif ! command -v npm >/dev/null; then
	fail "node example" "module pg not found and no npm to install it" \
	    "(install Debian's node-pg, or npm and run npm ci in examples/node)"
else
	cp examples/node/package.json examples/node/package-lock.json "$tmp/"
	if (cd "$tmp" && npm ci --prefer-offline --no-audit --no-fund \
	    --loglevel=error) >"$tmp/npm.log" 2>&1; then
		export NODE_PATH="$tmp/node_modules"
		node_ok=1
	else
		fail "node example" "npm ci failed: $(tail -5 "$tmp/npm.log")"
	fi
fi
if [ -n "$node_ok" ] &&
    run_example "node example" node-item \
    "$NODE" examples/node/enqueue.js --item node-item &&
    run_rollback "node example rollback" node-fail \
    "$NODE" examples/node/enqueue.js --item node-fail --fail; then
	pass "node example: commit writes both rows, rollback neither"
fi

# --- 4. the schema by hand, as docs/OPERATIONS.md shows -----------------
# psql -f, one file at a time and without -1: the index migrations build
# CONCURRENTLY, which no transaction block allows.
scratch=outboxd_psql_schema
dropdb --if-exists "$scratch" && createdb "$scratch" || exit 1
schema_ok=1
for f in sql/*.sql; do
	if ! out=$(psql -X -q -d "$scratch" -v ON_ERROR_STOP=1 -f "$f" 2>&1); then
		fail "schema by psql" "$f: $out"
		schema_ok=
		break
	fi
done
if [ -n "$schema_ok" ]; then
	got=$(psql -X -q -At -d "$scratch" -c "SELECT count(*) FILTER
		(WHERE i.indisvalid), count(*) FROM pg_index i
		WHERE i.indrelid = 't_transactional_message'::regclass")
	# The primary key, due, dead, per-key, exhausted and sent indexes.
	if [ "$got" = "6|6" ]; then
		pass "schema by psql -f: every file applies, 6 valid indexes"
	else
		fail "schema by psql" "valid|all indexes: got '$got', want '6|6'"
	fi
fi
dropdb "$scratch"

sql "DROP TABLE IF EXISTS orders" >/dev/null
[ "$failed" -eq 0 ]
