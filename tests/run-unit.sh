#!/usr/bin/env bash
# Runs each unit-test binary given, under valgrind when VALGRIND=1;
# every suite prints Check's summary line.  Exits 1 if any failed.
set -uo pipefail

failed=()
for t in "$@"; do
	echo "== ${t##*/}"
	if [ "${t%.sh}" != "$t" ]; then
		# Shell suites have nothing for valgrind to check.
		[ "${VALGRIND:-0}" = 1 ] && continue
		bash "$t" || failed+=("${t##*/}")
	elif [ "${VALGRIND:-0}" = 1 ]; then
		# No fork: valgrind must see the tests themselves.
		CK_FORK=no valgrind -q --error-exitcode=99 --leak-check=full \
			--errors-for-leak-kinds=definite,indirect \
			--show-leak-kinds=definite,indirect "$t" || failed+=("${t##*/}")
	else
		"$t" || failed+=("${t##*/}")
	fi
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "unit tests FAILED: ${failed[*]}"
	exit 1
fi
echo "unit tests passed: $#"
