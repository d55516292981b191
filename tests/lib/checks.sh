# Sourced by the shell suites: they report as Check's suites do, with
# PASS and FAIL lines and, however the script ends, one summary line
# "N%: Checks: T, Failures: F, Errors: E", so that CI and a reader count
# them with the C suites.  An exit with a non-zero status and no FAIL
# counted (a step the checks need broke) is an error.  checks_at_exit
# holds commands for the script's own clean-up, run before the summary.

passed=0
failed=0
checks_at_exit=()

pass() { echo "PASS: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1: ${*:2}"; failed=$((failed + 1)); }

checks_exit() {
	local rc=$? errors=0 total c
	for c in "${checks_at_exit[@]}"; do
		eval "$c"
	done
	[ "$rc" -ne 0 ] && [ "$failed" -eq 0 ] && errors=1
	total=$((passed + failed + errors))
	echo "$((total > 0 ? 100 * passed / total : 100))%: Checks: $total," \
		"Failures: $failed, Errors: $errors"
	exit "$rc"
}
trap checks_exit EXIT
