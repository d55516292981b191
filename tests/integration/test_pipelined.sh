#!/usr/bin/env bash
# Runs the bad-row suite and the fault scenarios that kill or restart a
# server mid-stream again, with every outboxd of theirs pipelined
# (relay.pipeline: true, which check_relay also tests on its own).  Needs
# the servers of tests/run-integration.sh and the suites built beside
# OUTBOXD_BIN (make integration builds them).  PIPELINED_SUITES picks
# fewer (make asan: the bad-row suite only).
set -uo pipefail

: "${OUTBOXD_BIN:?set OUTBOXD_BIN to the outboxd binary}"
bin=$(dirname "$OUTBOXD_BIN")/tests/integration
export OUTBOXD_TEST_YAML="relay.pipeline: true"
failed=0
for suite in ${PIPELINED_SUITES:-check_badrows check_faults}; do
	echo "== $suite, pipelined"
	[ -x "$bin/$suite" ] || { echo "FAIL: $bin/$suite not built"; exit 1; }
	FAULTS_ONLY=sigkill,rabbitmq-crash,postgres-crash,hung \
		"$bin/$suite" || failed=1
	# A scenario that stopped a server leaves it down: bring it back.
	"${OUTBOXD_SRCDIR:-.}/tests/servers.sh" start "$OUTBOXD_SERVERS_DIR" \
		>/dev/null 2>&1 || true
done
exit $failed
