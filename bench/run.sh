#!/usr/bin/env bash
# Runs the performance benchmark (issue 6, docs/PERFORMANCE.md): starts
# private PostgreSQL (fsync and synchronous_commit on), RabbitMQ and Redis
# in a temporary directory, applies the schema, runs bench/outbox_bench
# and always stops the servers.
#
#   OUTBOXD_BIN=build/outboxd bench/run.sh [outbox_bench options]
#   BENCH_ARGS=--quick make bench          (options through make)
#
# The table goes to stdout; progress and the machine's description go to
# stderr.  KEEP_BENCH_DIR=1 keeps the directory (server and outboxd logs);
# BENCH_SQL runs SQL first (diagnostics, see below).
set -euo pipefail

: "${OUTBOXD_BIN:?set OUTBOXD_BIN to the outboxd binary}"
OUTBOXD_BIN=$(cd "$(dirname "$OUTBOXD_BIN")" && pwd)/$(basename "$OUTBOXD_BIN")
BENCH_BIN=${BENCH_BIN:-$(dirname "$OUTBOXD_BIN")/bench/outbox_bench}
if [ ! -x "$BENCH_BIN" ]; then
	echo "run.sh: $BENCH_BIN is not built (make bench)" >&2
	exit 1
fi
export OUTBOXD_BIN

dir=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-bench.XXXXXX")
# The postgres user must be able to reach its data directory.
chmod 755 "$dir"
cleanup() {
	tests/servers.sh stop "$dir" >/dev/null 2>&1 || true
	if [ "${KEEP_BENCH_DIR:-0}" = 1 ]; then
		echo "run.sh: bench directory kept: $dir" >&2
	else
		rm -rf "$dir"
	fi
}
trap cleanup EXIT

# Realistic durability: every commit reaches the disk.
export OUTBOXD_PG_FSYNC=on OUTBOXD_PG_SYNC_COMMIT=on
tests/servers.sh start "$dir" >&2
# shellcheck disable=SC1091
. "$dir/env.sh"
"$OUTBOXD_BIN" -c "$dir/outboxd.yml" migrate >&2
# Diagnostics: SQL to run before the benchmark, e.g. to log slow plans
# in DIR/pg/postgres.log (with KEEP_BENCH_DIR=1):
#   BENCH_SQL="ALTER DATABASE outbox SET session_preload_libraries =
#     'auto_explain'; ALTER DATABASE outbox SET
#     auto_explain.log_min_duration = 20"
if [ -n "${BENCH_SQL:-}" ]; then
	psql -q -v ON_ERROR_STOP=1 -c "$BENCH_SQL" >&2
fi

# What the table was measured on, for docs/PERFORMANCE.md.
pkg() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null || echo '?'; }
pgset() { psql -tAc "SHOW $1"; }
{
	echo "== machine"
	echo "nproc $(nproc); $(free -m | awk '/^Mem:/ { print $2 }') MiB memory"
	echo "kernel $(uname -sr);" \
		"$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
	echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
	echo "postgres $(pgset server_version), fsync $(pgset fsync)," \
		"synchronous_commit $(pgset synchronous_commit)," \
		"shared_buffers $(pgset shared_buffers)"
	echo "rabbitmq $(pkg rabbitmq-server), erlang $(pkg erlang-base)," \
		"librabbitmq $(pkg librabbitmq4), libpq $(pkg libpq5)"
} >&2

# shellcheck disable=SC2086
"$BENCH_BIN" ${BENCH_ARGS:-} "$@"
