#!/usr/bin/env bash
# Runs each unit-test binary given, under valgrind when VALGRIND=1;
# every suite prints Check's summary line.  Exits 1 if any failed.
set -uo pipefail

# Each suite's output is kept, so a failure can be repeated at the end,
# where a reader of a long CI log (often only its tail) will see it.
outdir=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-unit.XXXXXX")
trap 'rm -rf "$outdir"' EXIT

# A hung suite fails alone instead of running into CI's own limit:
# without fork (valgrind) Check's per-test timeouts do not apply.
run() {
	local name=$1
	shift
	timeout "${SUITE_TIMEOUT:-900}" "$@" 2>&1 | tee "$outdir/$name.out" ||
		failed+=("$name")
}

failed=()
skipped=()
for t in "$@"; do
	echo "== ${t##*/}"
	if [ "${t%.sh}" != "$t" ]; then
		# Shell suites have nothing for valgrind to check.
		[ "${VALGRIND:-0}" = 1 ] && continue
		run "${t##*/}" bash "$t"
	elif [ "${VALGRIND:-0}" = 1 ]; then
		# No fork: valgrind must see the tests themselves.
		CK_FORK=no run "${t##*/}" valgrind -q --error-exitcode=99 \
			--leak-check=full --errors-for-leak-kinds=definite,indirect \
			--show-leak-kinds=definite,indirect "$t"
	else
		run "${t##*/}" "$t"
	fi
	# A check this machine cannot make says SKIP: counted, not hidden.
	if [ -f "$outdir/${t##*/}.out" ] &&
		grep -q '^SKIP' "$outdir/${t##*/}.out"; then
		skipped+=("${t##*/}")
	fi
done
if [ ${#skipped[@]} -gt 0 ]; then
	echo "== skipped here, in part or whole:"
	for s in "${skipped[@]}"; do
		grep '^SKIP' "$outdir/$s.out"
	done
fi
if [ ${#failed[@]} -gt 0 ]; then
	for f in "${failed[@]}"; do
		echo "== what failed in $f:"
		# Check's failure lines (file:line:F|E:...), else the tail.
		grep -E '^[^ ]+:[0-9]+:[FE]:' "$outdir/$f.out" ||
			tail -n 15 "$outdir/$f.out"
	done
	echo "unit tests FAILED: ${failed[*]}"
	exit 1
fi
echo "unit tests passed: $#"
