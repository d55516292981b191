#!/usr/bin/env bash
# Starts private PostgreSQL, RabbitMQ and Redis servers in a temporary
# directory, applies the schema, runs each integration suite given, and
# always stops the servers.  Exits 1 if any suite failed.
set -uo pipefail

: "${OUTBOXD_BIN:?set OUTBOXD_BIN to the outboxd binary}"
OUTBOXD_BIN=$(cd "$(dirname "$OUTBOXD_BIN")" && pwd)/$(basename "$OUTBOXD_BIN")
export OUTBOXD_BIN
export OUTBOXD_SRCDIR=${OUTBOXD_SRCDIR:-$PWD}

dir=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-test.XXXXXX")
# The postgres user must be able to reach its data directory.
chmod 755 "$dir"
cleanup() {
	tests/servers.sh stop "$dir" || true
	if [ "${KEEP_TEST_DIR:-0}" = 1 ]; then
		echo "test directory kept: $dir"
	else
		rm -rf "$dir"
	fi
}
trap cleanup EXIT

tests/servers.sh start "$dir" || exit 1
# shellcheck disable=SC1091
. "$dir/env.sh"
"$OUTBOXD_BIN" -c "$dir/outboxd.yml" migrate || exit 1

failed=()
for t in "$@"; do
	echo "== ${t##*/}"
	# Each suite gets a fresh set of rows; servers stay up between them.
	PGOPTIONS="-c client_min_messages=warning" psql -q \
		-c "TRUNCATE t_transactional_message CASCADE" >/dev/null
	if [ "${t%.sh}" != "$t" ]; then
		timeout "${SUITE_TIMEOUT:-900}" bash "$t" || failed+=("${t##*/}")
	else
		timeout "${SUITE_TIMEOUT:-900}" "$t" || failed+=("${t##*/}")
	fi
	# A suite that stopped a server leaves it down: bring it back.
	tests/servers.sh start "$dir" >/dev/null 2>&1 || true
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "integration tests FAILED: ${failed[*]}"
	exit 1
fi
echo "integration tests passed: $#"
