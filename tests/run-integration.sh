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
skipped=()
for t in "$@"; do
	echo "== ${t##*/}"
	started=$SECONDS
	# Each suite gets a fresh set of rows; servers stay up between them.
	PGOPTIONS="-c client_min_messages=warning" psql -q \
		-c "TRUNCATE t_transactional_message CASCADE" >/dev/null
	# Each suite's output is kept, so a failure can be repeated at the end,
	# where a reader of a long CI log (often only its tail) will see it.
	out="$dir/${t##*/}.out"
	if [ "${t%.sh}" != "$t" ]; then
		timeout "${SUITE_TIMEOUT:-900}" bash "$t" 2>&1 | tee "$out" ||
			failed+=("${t##*/}")
	else
		# TEST_XML_DIR: Check's XML log per suite, with each test's
		# duration (where a long run spends its time).
		${TEST_XML_DIR:+env CK_XML_LOG_FILE_NAME="$TEST_XML_DIR/${t##*/}.xml"} \
			timeout "${SUITE_TIMEOUT:-900}" "$t" 2>&1 | tee "$out" ||
			failed+=("${t##*/}")
	fi
	# Where a long run spends its time, at a glance in the CI log.
	echo "-- ${t##*/}: $((SECONDS - started)) s"
	# A check this machine cannot make says SKIP: counted, not hidden.
	grep -q '^SKIP' "$out" && skipped+=("${t##*/}")
	# A suite that stopped a server leaves it down: bring it back.
	tests/servers.sh start "$dir" >/dev/null 2>&1 || true
done
if [ ${#skipped[@]} -gt 0 ]; then
	echo "== skipped here, in part or whole:"
	for s in "${skipped[@]}"; do
		grep '^SKIP' "$dir/$s.out"
	done
fi
if [ ${#failed[@]} -gt 0 ]; then
	for f in "${failed[@]}"; do
		echo "== what failed in $f:"
		# Check's failure lines (file:line:F|E:...), else the tail.
		grep -E '^[^ ]+:[0-9]+:[FE]:' "$dir/$f.out" ||
			tail -n 15 "$dir/$f.out"
		# What outboxd said is usually the cause, and the directory
		# goes with this script: the logs the failures name (at most
		# five), else the three newest.
		logs=$(grep -oE "$dir/[^ ]*\.log" "$dir/$f.out" | sort -u |
			head -n 5)
		[ -n "$logs" ] ||
			logs=$(ls -t "$dir"/daemon-*.log 2>/dev/null | head -n 3)
		for l in $logs; do
			[ -f "$l" ] || continue
			echo "-- the end of $l:"
			tail -n 20 "$l"
		done
	done
	echo "integration tests FAILED: ${failed[*]}"
	exit 1
fi
echo "integration tests passed: $#"
