# outboxd — build, test and run. Plain make with pkg-config; see README.md.
#
#   make                 build build/outboxd
#   make test            install missing packages, build, run every Check suite
#                        (unit, then integration against private servers),
#                        then 60 s of fuzzing
#   make run             start private servers under .run/ and run outboxd
#   make stop            stop the servers that `make run` started
#   make SANITIZER=address,undefined test
#   make asan            unit, relay and bad-row suites under ASan+UBSan
#   make valgrind        unit tests under valgrind memcheck
#   make valgrind-integration  outboxd under memcheck in three suites
#   make tsan            the suites that run relay workers, under ThreadSanitizer
#   make install PREFIX=/usr/local DESTDIR=   (keeps an existing
#                        /etc/outboxd/outboxd.yml; make uninstall)

CC       ?= cc
# clang, for the fuzz targets and its static analyzer (make analyze).
CLANG    ?= clang
PREFIX   ?= /usr/local
DESTDIR  ?=
SANITIZER ?=
VERSION  := 0.1.0

PKGS     := libpq librabbitmq hiredis yaml-0.1 libsystemd libmicrohttpd
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_LIBS := $(shell pkg-config --libs check 2>/dev/null)

WARN := -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes \
	-Wmissing-prototypes -Wformat=2 -Wvla -Werror
CFLAGS ?= -O2 -g
CFLAGS += -std=c11 -D_GNU_SOURCE -DOUTBOXD_VERSION='"$(VERSION)"' \
	$(WARN) -Idaemon $(PKG_CFLAGS)
LDLIBS += $(PKG_LIBS) -lm

SAN_B := build/san
ifneq ($(SANITIZER),)
CFLAGS  += -fsanitize=$(SANITIZER) -fno-omit-frame-pointer \
	-fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SANITIZER)
B := $(SAN_B)
else
B := build
endif

DAEMON_SRCS := $(sort $(wildcard daemon/*.c))
LIB_SRCS    := $(filter-out daemon/main.c,$(DAEMON_SRCS))
LIB_OBJS    := $(LIB_SRCS:%.c=$(B)/%.o) $(B)/gen/migrations.o
SQL_FILES   := $(sort $(wildcard sql/[0-9]*.sql))
UNIT_SRCS   := $(sort $(wildcard tests/unit/check_*.c))
INTEG_SRCS  := $(sort $(wildcard tests/integration/check_*.c))
TESTLIB_SRCS := $(sort $(wildcard tests/lib/*.c))
TESTLIB_OBJS := $(TESTLIB_SRCS:%.c=$(B)/%.o)
UNIT_BINS   := $(UNIT_SRCS:%.c=$(B)/%)
# Shell suites (packaging, examples, dns) print Check's summary line too
# (tests/lib/checks.sh).
UNIT_SCRIPTS  := $(sort $(wildcard tests/unit/test_*.sh))
INTEG_SCRIPTS := $(sort $(wildcard tests/integration/test_*.sh))
INTEG_BINS  := $(INTEG_SRCS:%.c=$(B)/%)
BENCH_SRCS  := $(sort $(wildcard bench/*.c))
BENCH_BINS  := $(BENCH_SRCS:%.c=$(B)/%)

.PHONY: all deps test unit integration run stop servers-status valgrind \
	valgrind-integration asan tsan analyze bench install uninstall format \
	clean
.DEFAULT_GOAL := all

all: $(B)/outboxd

$(B)/%.o: %.c $(wildcard daemon/*.h) $(wildcard tests/lib/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/lib -c -o $@ $<

# The migrations are compiled into the binary, so `outboxd migrate` needs
# no files at run time.  Each file becomes one C string, with the index
# its "-- outboxd: online index NAME" line names, if any.
# The migrations must be ASCII: outboxd sends them in UTF-8, which a
# database in another encoding (LATIN1) refuses for any character it
# lacks, even in a comment.
$(B)/gen/migrations.c: $(SQL_FILES) Makefile
	@if LC_ALL=C grep -n '[^[:print:][:space:]]' $(SQL_FILES); then \
		echo "sql/: migrations must be ASCII (lines above)" >&2; \
		exit 1; fi
	@mkdir -p $(dir $@)
	@awk 'function cstr(s,  out, c, i) { out = ""; \
		for (i = 1; i <= length(s); i++) { c = substr(s, i, 1); \
			if (c == "\\" || c == "\"") out = out "\\"; \
			out = out c } return out } \
	BEGIN { print "/* Generated from the sql/ files by the Makefile. */"; \
		print "#include \"migrations.h\""; \
		print "const struct migration migrations[] = {" } \
	FNR == 1 { if (NR > 1) printf "\", %s },\n", online; \
		online = "0"; n = FILENAME; sub(".*/", "", n); \
		printf "\t{ \"%s\", \"", n } \
	/^-- outboxd: online index / { online = "\"" $$5 "\"" } \
	{ printf "%s\\n\"\n\t\"", cstr($$0) } \
	END { printf "\", %s },\n", online; print "\t{ 0, 0, 0 },"; \
		print "};" }' \
		$(SQL_FILES) > $@

$(B)/gen/migrations.o: $(B)/gen/migrations.c daemon/migrations.h
	$(CC) $(CFLAGS) -Wno-overlength-strings -c -o $@ $<

$(B)/liboutboxd.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(B)/outboxd: $(B)/daemon/main.o $(B)/liboutboxd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(B)/tests/unit/%: $(B)/tests/unit/%.o $(B)/liboutboxd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(CHECK_LIBS) $(LDLIBS)

$(B)/tests/integration/%: $(B)/tests/integration/%.o $(TESTLIB_OBJS) \
		$(B)/liboutboxd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(CHECK_LIBS) $(LDLIBS)

$(B)/bench/%: $(B)/bench/%.o $(B)/liboutboxd.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# Installs what is missing (apt-get) on Debian 12; a no-op when all is there.
deps:
	@tests/deps.sh

# The benchmark programs are built, not run (that is make bench), so
# that a change to a module they share does not break them unnoticed.
test: deps
	@$(MAKE) --no-print-directory $(BENCH_BINS)
	@$(MAKE) --no-print-directory unit integration fuzz FUZZ_SECONDS=60 \
		FUZZ_SEED=1

unit: $(B)/outboxd $(UNIT_BINS)
	@OUTBOXD_BIN=$(B)/outboxd tests/run-unit.sh $(UNIT_BINS) $(UNIT_SCRIPTS)

integration: $(B)/outboxd $(INTEG_BINS)
	@OUTBOXD_BIN=$(B)/outboxd tests/run-integration.sh $(INTEG_BINS) \
		$(INTEG_SCRIPTS)

valgrind: $(B)/outboxd $(UNIT_BINS)
	@VALGRIND=1 tests/run-unit.sh $(UNIT_BINS)

# Relay workers are threads: their unit suite and the integration suites
# that run several of them (relay: 2-4 workers, but not its server
# restarts, which wait on the servers; daemon: reloads reach them, but
# not its command-line and schema tests, nor its measure of the
# process's memory, which the sanitizer's own moves), under
# ThreadSanitizer.  A report aborts the process, and so fails
# its test.  setarch -R: TSan needs the address layout it expects, which
# a kernel with more mmap randomness does not give it.
TSAN_B := build/tsan
TSAN_UNIT := $(TSAN_B)/tests/unit/check_workers
TSAN_INTEG := $(TSAN_B)/tests/integration/check_relay \
	$(TSAN_B)/tests/integration/check_daemon
tsan:
	@$(MAKE) --no-print-directory SANITIZER=thread B=$(TSAN_B) \
		$(TSAN_B)/outboxd $(TSAN_UNIT) $(TSAN_INTEG)
	@export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"; \
	setarch "$$(uname -m)" -R env OUTBOXD_BIN=$(TSAN_B)/outboxd \
		tests/run-unit.sh $(TSAN_UNIT) && \
	setarch "$$(uname -m)" -R env OUTBOXD_BIN=$(TSAN_B)/outboxd \
		OUTBOXD_TEST_SLOWDOWN=4 CK_EXCLUDE_TAGS="cli memory restart" \
		tests/run-integration.sh $(TSAN_INTEG)

# The unit suites, then the integration suites over the relay's memory,
# under ASan+UBSan: the relay suite (plain and pipelined relays, workers)
# and the bad-row suite with pipelined relays (every kind of bad row, the
# broker's channel closes and culprit search, both sides of a pipelined
# relay).  A report aborts outboxd or the test, and so fails the test.
# Sized for CI; all of the suites under the sanitizers:
# make SANITIZER=address,undefined unit integration (slower).
asan:
	@$(MAKE) --no-print-directory SANITIZER=address,undefined unit \
		$(SAN_B)/tests/integration/check_relay \
		$(SAN_B)/tests/integration/check_badrows
	@OUTBOXD_BIN=$(SAN_B)/outboxd PIPELINED_SUITES=check_badrows \
		tests/run-integration.sh $(SAN_B)/tests/integration/check_relay \
		tests/integration/test_pipelined.sh

# outboxd itself under valgrind memcheck (uninitialised reads, which ASan
# does not see, and definite leaks) in the suites that drive it hardest:
# the relay, bad rows and the daemon's signals and reloads.  About six
# minutes on two cores; not run by CI.
VG_INTEG := $(B)/tests/integration/check_relay \
	$(B)/tests/integration/check_badrows $(B)/tests/integration/check_daemon
valgrind-integration: $(B)/outboxd $(VG_INTEG)
	@OUTBOXD_REAL_BIN=$(abspath $(B)/outboxd) \
		OUTBOXD_BIN=tests/valgrind-outboxd.sh OUTBOXD_TEST_SLOWDOWN=10 \
		tests/run-integration.sh $(VG_INTEG)

# Two static analyzers, GCC's (-fanalyzer) and clang's (--analyze), over
# every C source of the daemon, the tests, the fuzz targets and the
# benchmark: null dereferences, leaks, double frees, uninitialised reads
# and file descriptors left open, on the error paths that no test takes.
# Nothing is linked; any finding fails (-Werror, -analyzer-werror).
ANALYZE_B    := build/analyze
ANALYZE_SRCS := $(DAEMON_SRCS) $(TESTLIB_SRCS) $(UNIT_SRCS) $(INTEG_SRCS) \
	$(BENCH_SRCS) $(sort $(wildcard tests/fuzz/*.c))
ANALYZE_OUTS := $(ANALYZE_SRCS:%.c=$(ANALYZE_B)/%.o) \
	$(ANALYZE_SRCS:%.c=$(ANALYZE_B)/%.plist)
ANALYZE_DEPS := $(wildcard daemon/*.h tests/lib/*.h tests/fuzz/*.h) Makefile
ANALYZE_INC  := -Itests/lib -Itests/fuzz
analyze: $(ANALYZE_OUTS)
$(ANALYZE_B)/%.o: %.c $(ANALYZE_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fanalyzer $(ANALYZE_INC) -c -o $@ $<
$(ANALYZE_B)/%.plist: %.c $(ANALYZE_DEPS)
	@mkdir -p $(dir $@)
	$(CLANG) --analyze -Xanalyzer -analyzer-werror \
		$(filter-out -O% -g,$(CFLAGS)) $(ANALYZE_INC) -o $@ $<

# deps first, then a make that reads this file again: the pkg-config
# flags above were worked out before deps could install what they name.
bench: deps
	@$(MAKE) --no-print-directory $(B)/outboxd $(BENCH_BINS)
	@OUTBOXD_BIN=$(B)/outboxd bench/run.sh

# .run is a link to a directory under /tmp: PostgreSQL runs as its own
# user when make runs as root, and could not reach a .run inside a
# private home directory (0700 on Debian).  A link left dangling by a
# reboot is made again.
run: deps
	@$(MAKE) --no-print-directory $(B)/outboxd
	@if [ ! -d .run ]; then \
		rm -f .run && \
		d=$$(mktemp -d "$${TMPDIR:-/tmp}/outboxd-run.XXXXXX") && \
		chmod 755 "$$d" && ln -s "$$d" .run; \
	fi
	@tests/servers.sh start .run
	@. .run/env.sh && $(B)/outboxd migrate -c .run/outboxd.yml && \
		exec $(B)/outboxd run -c .run/outboxd.yml

# Nothing to stop without .run (or with a link a reboot left dangling);
# servers.sh would make a .run directory here, which make run then keeps.
stop:
	@if [ -d .run ]; then tests/servers.sh stop .run; fi

install: $(B)/outboxd
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/outboxd/sql \
		$(DESTDIR)/etc/outboxd $(DESTDIR)/lib/systemd/system
	install -m 755 $(B)/outboxd $(DESTDIR)$(PREFIX)/bin/outboxd
	install -m 644 sql/*.sql $(DESTDIR)$(PREFIX)/share/outboxd/sql/
	@# An upgrade keeps the operator's config (and its group, which lets
	@# the outboxd user read it); the new sample goes beside it.
	@if [ -e $(DESTDIR)/etc/outboxd/outboxd.yml ]; then \
		echo "install: keeping /etc/outboxd/outboxd.yml; the new" \
			"sample is /etc/outboxd/outboxd.yml.dist"; \
		install -m 640 config/outboxd.yml \
			$(DESTDIR)/etc/outboxd/outboxd.yml.dist; \
	else \
		install -m 640 config/outboxd.yml \
			$(DESTDIR)/etc/outboxd/outboxd.yml; \
	fi
	install -m 644 systemd/outboxd.service $(DESTDIR)/lib/systemd/system/
	install -d $(DESTDIR)$(PREFIX)/share/man/man8 \
		$(DESTDIR)$(PREFIX)/share/man/man5
	install -m 644 docs/man/man8/outboxd.8 $(DESTDIR)$(PREFIX)/share/man/man8/
	install -m 644 docs/man/man5/outboxd.yml.5 \
		$(DESTDIR)$(PREFIX)/share/man/man5/

# Leaves /etc/outboxd (the operator's config and password files) and the
# database alone.
uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/outboxd \
		$(DESTDIR)/lib/systemd/system/outboxd.service \
		$(DESTDIR)$(PREFIX)/share/man/man8/outboxd.8 \
		$(DESTDIR)$(PREFIX)/share/man/man5/outboxd.yml.5
	rm -rf $(DESTDIR)$(PREFIX)/share/outboxd

format:
	clang-format -i daemon/*.c daemon/*.h tests/*/*.c

clean:
	rm -rf build

# --- Fuzzing -----------------------------------------------------------------
# libFuzzer targets for the parsers of outside input (tests/fuzz/), built
# with clang and ASan + UBSan + LeakSanitizer from the daemon sources each
# one needs (not from the gcc-built liboutboxd.a).  `make fuzz` shares
# FUZZ_SECONDS (default 60) among them and fails on any crash, leak,
# timeout or broken invariant that the failing input reproduces
# (tests/fuzz/run.sh); `make fuzz-long` gives them FUZZ_LONG_SECONDS.
# `make test` fixes the seed (FUZZ_SEED=1), so its inputs come in the
# same order every time (how far it gets depends on the machine's speed);
# the others explore anew.  Needs clang and
# libclang-rt-14-dev (Debian 12).
FUZZ_SECONDS      ?= 60
FUZZ_LONG_SECONDS ?= 1800
FUZZ_SEED         ?=
FUZZ_B            := build/fuzz
# No -Werror: a warning only clang gives must not stop the fuzzers.
FUZZ_CFLAGS := -g -O1 -std=c11 -D_GNU_SOURCE -DOUTBOXD_VERSION='"$(VERSION)"' \
	$(filter-out -Werror,$(WARN)) -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=all -fno-omit-frame-pointer \
	-Idaemon -Itests/fuzz $(PKG_CFLAGS)
FUZZ_TARGETS := config duration listen logquote backoff pgarray
FUZZ_BINS    := $(FUZZ_TARGETS:%=$(FUZZ_B)/fuzz_%)
FUZZ_DEPS    := $(wildcard daemon/*.h) tests/fuzz/fuzz.h Makefile

# $(1) target, $(2) daemon sources, $(3) extra flags, $(4) libraries.
define FUZZ_RULE
$(FUZZ_B)/fuzz_$(1): tests/fuzz/fuzz_$(1).c $(2) $(FUZZ_DEPS)
	@mkdir -p $(FUZZ_B)
	$(CLANG) $(FUZZ_CFLAGS) $(3) -o $$@ tests/fuzz/fuzz_$(1).c \
		$(filter %.c,$(2)) $(4)
endef

FUZZ_HTTP := daemon/http.c daemon/metrics.c daemon/log.c daemon/util.c
# The config module (every daemon/config*.c) opens files: config_load,
# and password files through secret.c.  -Dopen keeps the fuzzer in its
# sandbox.
FUZZ_CONFIG := $(sort $(wildcard daemon/config*.c)) daemon/secret.c
$(eval $(call FUZZ_RULE,config,$(FUZZ_CONFIG) \
	daemon/backoff.c \
	$(FUZZ_HTTP),-Dopen=fuzz_open,-lyaml -lpq -lmicrohttpd -lm -lpthread))
$(eval $(call FUZZ_RULE,duration,daemon/util.c,,))
$(eval $(call FUZZ_RULE,listen,$(FUZZ_HTTP),,-lmicrohttpd -lm -lpthread))
$(eval $(call FUZZ_RULE,logquote,daemon/log.c daemon/util.c,,))
$(eval $(call FUZZ_RULE,backoff,daemon/backoff.c,,-lm))
# fuzz_pgarray.c includes daemon/store.c to reach its static decoder.
$(eval $(call FUZZ_RULE,pgarray,daemon/backoff.c daemon/log.c \
	daemon/secret.c daemon/util.c $(B)/gen/migrations.c,,-lpq -lm))
$(FUZZ_B)/fuzz_pgarray: daemon/store.c

.PHONY: fuzz fuzz-long fuzz-build
fuzz-build: $(FUZZ_BINS)

fuzz: $(FUZZ_BINS)
	@FUZZ_SEED=$(FUZZ_SEED) tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_BINS)

fuzz-long: $(FUZZ_BINS)
	@tests/fuzz/run.sh $(FUZZ_LONG_SECONDS) $(FUZZ_BINS)

# The fault suite for longer (100,000 rows a scenario, 60 SIGKILLs, more
# restarts): FAULTS_SOAK=1; FAULTS_SEED=n replays a run's random moments.
.PHONY: soak
soak: all $(B)/tests/integration/check_faults
	@FAULTS_SOAK=1 SUITE_TIMEOUT=$${SUITE_TIMEOUT:-7200} \
		OUTBOXD_BIN=$(B)/outboxd tests/run-integration.sh \
		$(B)/tests/integration/check_faults
