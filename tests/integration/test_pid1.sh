#!/usr/bin/env bash
# outboxd as PID 1 (a container's, without --init) reaps the orphans it
# adopts.  It never waited for a child, so each one (a health check's
# pipeline cut short by `timeout`, a `docker exec` left behind) stayed a
# zombie, holding a PID of the container's limit.  Here outboxd runs in
# a PID namespace of its own, an orphan is left in it, and it must be
# gone once it ends.  Needs root (unshare -p, nsenter).
set -uo pipefail

: "${OUTBOXD_BIN:?set OUTBOXD_BIN to the outboxd binary}"
. "$(dirname "$0")/../lib/checks.sh"

if [ "$(id -u)" != 0 ] || ! unshare -p -f --mount-proc true 2>/dev/null; then
	echo "SKIP: pid1: unshare -p is not permitted here (needs root)"
	exit 0
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-pid1.XXXXXX")
runner=
checks_at_exit+=('[ -z "$runner" ] || kill -KILL $runner 2>/dev/null; rm -rf "$tmp"')
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# No server answers (port 1 refuses at once): outboxd keeps trying, which
# is all this needs.
cat > "$tmp/outboxd.yml" <<'YML'
postgres:
  conninfo: "host=127.0.0.1 port=1 dbname=outbox user=outboxd"
rabbitmq:
  nodes: ["127.0.0.1:1"]
redis:
  address: "127.0.0.1:1"
http:
  listen: ""
YML
# --kill-child: a clean-up that ends unshare ends outboxd too.
unshare -p -f --kill-child --mount-proc "$OUTBOXD_BIN" -c "$tmp/outboxd.yml" \
	run 2>"$tmp/outboxd.log" &
runner=$!
daemon=
t0=$(now_ms)
while [ -z "$daemon" ] && [ $(($(now_ms) - t0)) -lt 10000 ]; do
	daemon=$(pgrep -P "$runner" -x outboxd)
	[ -n "$daemon" ] || sleep 0.05
done
if [ -z "$daemon" ]; then
	fail "pid1" "outboxd did not start: $(tail -n 5 "$tmp/outboxd.log")"
	exit 1
fi
# A shell in its namespace starts a sleep and exits: outboxd adopts it.
if ! nsenter -t "$daemon" -p -m sh -c 'sleep 2 & exit 0'; then
	fail "pid1" "nsenter into outboxd's namespaces failed"
	exit 1
fi
if [ "$(pgrep -P "$daemon" -x sleep)" ]; then
	pass "an orphan left in outboxd's PID namespace is outboxd's child"
else
	fail "pid1" "outboxd did not adopt the orphan (it ended too soon?)"
fi
# Wait for outboxd to have no child left, zombie or not.
t0=$(now_ms)
children=x
while [ -n "$children" ] && [ $(($(now_ms) - t0)) -lt 10000 ]; do
	children=$(pgrep -P "$daemon")
	[ -z "$children" ] || sleep 0.1
done
if [ -z "$children" ]; then
	pass "outboxd as PID 1 reaps the orphan it adopted"
else
	fail "pid1" "outboxd's children after 10 s: $(ps -o pid=,stat=,comm= \
		-p "$(echo $children | tr ' ' ,)")"
fi
kill -TERM "$daemon"
t0=$(now_ms)
while kill -0 "$daemon" 2>/dev/null && [ $(($(now_ms) - t0)) -lt 20000 ]; do
	sleep 0.1
done
# Bounded: a SIGTERM not honoured fails here, not at the suite's timeout.
kill -KILL "$runner" 2>/dev/null
if wait "$runner"; then
	pass "outboxd as PID 1 stops on SIGTERM, exit 0"
else
	fail "pid1 stop" "exit $?: $(tail -n 5 "$tmp/outboxd.log")"
fi
runner=
[ "$failed" -eq 0 ]
