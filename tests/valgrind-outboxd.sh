#!/bin/sh
# outboxd under valgrind memcheck, standing in for the binary in the
# integration suites (make valgrind-integration).  OUTBOXD_REAL_BIN is
# the binary.  What memcheck finds goes to stderr, which is the test's
# outboxd log, and makes outboxd exit 99 when it ends: the test that
# stops it and expects 0 fails.  Memory held by valgrind's own free list
# makes resident-size checks meaningless under it.
exec valgrind -q --error-exitcode=99 --track-origins=yes \
	--leak-check=full --errors-for-leak-kinds=definite \
	--show-leak-kinds=definite "${OUTBOXD_REAL_BIN:?set OUTBOXD_REAL_BIN}" "$@"
