#!/usr/bin/env bash
# Runs libFuzzer targets for a bounded time and fails on any crash, leak,
# timeout or broken invariant that its input reproduces; a failure that
# replaying its input does not reproduce is reported and the target run
# again, and fails the run the second time.  Called by `make fuzz` and
# `make fuzz-long`.
#
#   tests/fuzz/run.sh SECONDS build/fuzz/fuzz_config build/fuzz/fuzz_...
#
# SECONDS is the total, shared by the targets in proportion to their
# weight (the config parser, the largest, gets the most).  Each target
# starts from its seeds in tests/fuzz/corpus/NAME/ plus what earlier runs
# found (build/fuzz/corpus/NAME/, never written back to the repo).  A
# failing input is left in build/fuzz/artifacts/; reproduce it with
# `build/fuzz/fuzz_NAME FILE`, and add it to the seeds once it is fixed.
# FUZZ_SEED=N fixes libFuzzer's seed.
set -uo pipefail

[ $# -ge 2 ] || { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
total=$1
shift
out=build/fuzz

weight() {
	case "$1" in
	config) echo 4 ;;
	*) echo 1 ;;
	esac
}

sum=0
for bin in "$@"; do
	name=${bin##*/fuzz_}
	sum=$((sum + $(weight "$name")))
done

# How much a passing run did, from its log.
pass_stats() {
	grep -E '^(Done|stat::number_of_executed_units|#[0-9]+ +DONE)' \
		"$out/$1.log" | head -3
}

passed=0
failed=()
flaky=()
for bin in "$@"; do
	name=${bin##*/fuzz_}
	secs=$((total * $(weight "$name") / sum))
	[ "$secs" -ge 1 ] || secs=1
	seeds=tests/fuzz/corpus/$name
	work=$out/corpus/$name
	mkdir -p "$work" "$out/artifacts"
	opts=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048
		-max_len=16384 -print_final_stats=1
		-artifact_prefix="$out/artifacts/$name-")
	[ -f "tests/fuzz/$name.dict" ] && opts+=(-dict="tests/fuzz/$name.dict")
	# A fixed seed (make test sets one) replays the same inputs on every
	# run, so that a failure is reproducible, not luck; without one each
	# run explores anew (make fuzz-long).
	[ -n "${FUZZ_SEED:-}" ] && opts+=(-seed="$FUZZ_SEED")
	echo "== fuzz_$name for ${secs}s"
	# New inputs go to the first directory only: the seeds stay as
	# they are.  The log is kept whole; the summary is shown.
	if "$bin" "${opts[@]}" "$work" "$seeds" >"$out/$name.log" 2>&1; then
		pass_stats "$name"
		passed=$((passed + 1))
		continue
	fi
	tail -40 "$out/$name.log"
	echo "fuzz_$name FAILED (log: $out/$name.log)"
	# A failure its input reproduces is a bug.  One that it does not
	# (the machine stalled past the timeout, a sanitizer could not
	# run) is reported, and the target runs once more: a second
	# failure fails the run.
	unit=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' \
		"$out/$name.log" | tail -1)
	if [ -n "$unit" ] && [ -f "$unit" ] && ! "$bin" -timeout=10 \
		-rss_limit_mb=2048 "$unit" >"$out/$name.replay.log" 2>&1; then
		failed+=("$name")
		continue
	fi
	flaky+=("$name")
	cp "$out/$name.log" "$out/$name.first.log"
	echo "== fuzz_$name: the failure did not reproduce from its input" \
		"(${unit:-none written}); running it again"
	if "$bin" "${opts[@]}" "$work" "$seeds" >"$out/$name.log" 2>&1; then
		pass_stats "$name"
		passed=$((passed + 1))
	else
		tail -40 "$out/$name.log"
		echo "fuzz_$name FAILED again (log: $out/$name.log)"
		failed+=("$name")
	fi
done
# Each failure's reason and input again, last: a CI report that keeps
# only the end of the output still says what broke and how to replay it.
reasons='^(fuzz: |==[0-9]+== ?(ERROR|LeakSanitizer|WARNING)|ALARM: |SUMMARY: |[a-zA-Z/_.-]+:[0-9]+:[0-9]+: runtime error|artifact_prefix|Test unit written|Base64: )'
for name in "${flaky[@]}"; do
	echo "-- fuzz_$name failed once, not reproduced by its input:"
	grep -E "$reasons" "$out/$name.first.log" | cut -c1-400 | head -12
done
for name in "${failed[@]}"; do
	echo "-- fuzz_$name failed:"
	grep -E "$reasons" "$out/$name.log" | cut -c1-400 | head -12
done
echo "fuzz: $passed passed, ${#failed[@]} failed, ${#flaky[@]} failed once" \
	"without reproducing"
[ ${#failed[@]} -eq 0 ]
