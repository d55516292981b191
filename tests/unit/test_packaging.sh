#!/usr/bin/env bash
# Packaging checks that need no servers: the systemd unit (verify and a
# hardening score of 2.0 or better), docker-compose.yml, the Dockerfile
# against the Makefile, the shipped configs, and `make install`.
# Prints a Check-style summary line; exits 1 when anything failed.
set -uo pipefail

cd "${OUTBOXD_SRCDIR:-$(dirname "$0")/../..}" || exit 1
UNIT=systemd/outboxd.service
MAX_EXPOSURE=2.0
# The binary `make` builds; `make SANITIZER=...` callers may pass theirs.
BIN=${OUTBOXD_BIN:-build/outboxd}

. tests/lib/checks.sh
tmp=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-packaging.XXXXXX")
checks_at_exit+=('rm -rf "$tmp"')
have() { command -v "$1" >/dev/null 2>&1; }

# make as a developer runs it: no PREFIX, SANITIZER or DESTDIR inherited
# from the environment or from a parent make's MAKEFLAGS.
pmake() {
	env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u PREFIX -u SANITIZER \
	    -u DESTDIR make --no-print-directory "$@"
}

# The default PREFIX of `make install`, read from the Makefile itself.
make_prefix() {
	# shellcheck disable=SC2016  # $(PREFIX) is make's, not the shell's
	pmake -s --eval 'print-prefix: ; @echo $(PREFIX)' print-prefix
}

# --- systemd unit ----------------------------------------------------------
# verify checks that ExecStart's binary exists, and it does not on a build
# machine: check a copy whose outboxd path points at /bin/true instead.
# The man pages named in Documentation= come from docs/man via MANPATH.
if ! have systemd-analyze; then
	fail "systemd-analyze verify" "systemd-analyze not found (Debian: systemd)"
else
	mkdir -p "$tmp/unit"
	sed 's#^\(Exec[A-Za-z]*=[-@:+!]*\)/[^ ]*/outboxd #\1/bin/true #' \
	    "$UNIT" >"$tmp/unit/outboxd.service"
	man_opt=()
	have man || man_opt=(--man=no)
	if ! grep -q '^ExecStart=/bin/true ' "$tmp/unit/outboxd.service"; then
		fail "systemd-analyze verify" "could not rewrite ExecStart"
	elif out=$(MANPATH="$PWD/docs/man" SYSTEMD_LOG_COLOR=0 \
	    systemd-analyze verify "${man_opt[@]}" \
	    "$tmp/unit/outboxd.service" 2>&1) && [ -z "$out" ]; then
		pass "systemd-analyze verify is clean"
	else
		fail "systemd-analyze verify" "$out"
	fi

	out=$(systemd-analyze security --offline=true --no-pager "$UNIT" 2>&1)
	score=$(printf '%s\n' "$out" |
	    sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
	if [ -z "$score" ]; then
		fail "systemd-analyze security" "no exposure level in: $out"
	elif awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s <= m) }'
	then
		pass "systemd-analyze security: exposure $score <= $MAX_EXPOSURE"
	else
		fail "systemd-analyze security" \
		    "exposure $score > $MAX_EXPOSURE:" \
		    "$(printf '%s\n' "$out" | grep '✗')"
	fi
fi

# ExecStart must name the binary where `make install` puts it.
prefix=$(make_prefix)
if grep -q "^ExecStart=$prefix/bin/outboxd -c /etc/outboxd/outboxd.yml run\$" \
    "$UNIT"; then
	pass "unit ExecStart matches make install (PREFIX=$prefix)"
else
	fail "unit ExecStart" "want $prefix/bin/outboxd -c" \
	    "/etc/outboxd/outboxd.yml run, got: $(grep '^ExecStart=' "$UNIT")"
fi

# --- docker-compose.yml ----------------------------------------------------
if ! have docker-compose; then
	fail "docker-compose config" "docker-compose not found" \
	    "(Debian: docker-compose)"
elif out=$(docker-compose -f docker-compose.yml config -q 2>&1); then
	pass "docker-compose config -q"
else
	fail "docker-compose config" "$out"
fi

# --- Dockerfile ------------------------------------------------------------
# The build stage must build what a developer's `make` builds: its make
# goals (none = the default goal) must produce build/outboxd, and that is
# the file the runtime stage copies.
build_stage=$(awk '/^FROM /{n++} n == 1' Dockerfile)
make_line=$(printf '%s\n' "$build_stage" | grep -E '^RUN .*\bmake\b' | head -1)
goals=$(printf '%s\n' "$make_line" |
    sed -e 's/.*\bmake\b//' -e 's/&&.*//' |
    tr ' ' '\n' | grep -v -e '^-' -e '=' -e '^$' | tr '\n' ' ')
goals=${goals% }
read -r -a goal_args <<<"$goals"
if [ -z "$make_line" ]; then
	fail "Dockerfile make" "no RUN make in the build stage"
elif ! pmake -n -B "${goal_args[@]}" 2>/dev/null |
    grep -q -- '-o build/outboxd '; then
	fail "Dockerfile make" "'make ${goals:-<default>}' does not link" \
	    "build/outboxd"
elif ! grep -q '^COPY --from=build /src/build/outboxd ' Dockerfile; then
	fail "Dockerfile make" "the runtime stage does not copy build/outboxd"
else
	pass "Dockerfile builds build/outboxd with 'make ${goals}'"
fi

# Every -dev package tests/deps.sh installs for the build (Check and the
# fuzzers' clang runtime are for tests only) must be in the build stage.
missing=
# shellcheck disable=SC2013  # package names are single words
for p in $(grep -o '\blib[a-z0-9.-]*-dev\b' tests/deps.sh |
    grep -v '^libclang-rt' | sort -u); do
	# A here-string, not printf | grep -q: bash writes its output a
	# line at a time, grep -q exits at the match, and a write after
	# that failed the pipeline (pipefail) under load, once in CI.
	grep -qw -- "$p" <<<"$build_stage" ||
		missing="$missing $p"
done
if [ -z "$missing" ]; then
	pass "Dockerfile build stage has every -dev package of deps.sh"
else
	fail "Dockerfile build packages" "missing:$missing"
fi

# --- make install ----------------------------------------------------------
dest="$tmp/dest"
# This builds build/outboxd first when it is missing or stale.
if ! out=$(pmake -s install DESTDIR="$dest" 2>&1); then
	fail "make install" "$out"
else
	problems=
	# want PATH MODE
	want() {
		if [ ! -f "$dest$1" ]; then
			problems="$problems missing:$1"
		elif [ "$(stat -c %a "$dest$1")" != "$2" ]; then
			problems="$problems mode:$1:$(stat -c %a "$dest$1")!=$2"
		fi
	}
	want "$prefix/bin/outboxd" 755
	want /lib/systemd/system/outboxd.service 644
	want /etc/outboxd/outboxd.yml 640
	for s in sql/[0-9]*.sql; do
		want "$prefix/share/outboxd/$s" 644
	done
	cmp -s "$dest/lib/systemd/system/outboxd.service" "$UNIT" ||
		problems="$problems unit-differs"
	if [ -z "$problems" ]; then
		pass "make install DESTDIR=... installs binary, unit, config, SQL"
	else
		fail "make install" "$problems"
	fi
	# An upgrade: the operator's config, its group and mode stay; the
	# new sample goes beside it.
	cfg="$dest/etc/outboxd/outboxd.yml"
	echo "# the operator's" >"$cfg"
	chgrp nogroup "$cfg" 2>/dev/null || true
	group=$(stat -c %G "$cfg")
	if ! out=$(pmake -s install DESTDIR="$dest" 2>&1); then
		fail "make install again" "$out"
	elif [ "$(cat "$cfg")" != "# the operator's" ] ||
		[ "$(stat -c %G:%a "$cfg")" != "$group:640" ]; then
		fail "make install again" "it replaced the config:" \
			"$(stat -c %G:%a "$cfg") $(head -1 "$cfg")"
	elif ! cmp -s "$dest/etc/outboxd/outboxd.yml.dist" config/outboxd.yml; then
		fail "make install again" "no outboxd.yml.dist beside it"
	else
		pass "make install again keeps the config; the sample is .dist"
	fi
	# Uninstall: the program goes, the config stays.
	if ! out=$(pmake -s uninstall DESTDIR="$dest" 2>&1); then
		fail "make uninstall" "$out"
	elif [ -e "$dest$prefix/bin/outboxd" ] ||
		[ -e "$dest/lib/systemd/system/outboxd.service" ] ||
		[ -e "$dest$prefix/share/outboxd" ] || [ ! -f "$cfg" ]; then
		fail "make uninstall" "$(cd "$dest" && find . -type f)"
	else
		pass "make uninstall removes the program, keeps /etc/outboxd"
	fi
fi

# --- make stop without servers ---------------------------------------------
# No .run, or one left dangling by a reboot: nothing to stop, exit 0, and no
# .run directory made in its place (make run would then keep it, inside a
# home PostgreSQL's own user may not enter).
mkdir -p "$tmp/stop/none" "$tmp/stop/dangling"
ln -s "$tmp/stop/gone" "$tmp/stop/dangling/.run"
stop_problems=
for d in none dangling; do
	if ! out=$(pmake -s -f "$PWD/Makefile" -C "$tmp/stop/$d" stop 2>&1); then
		stop_problems="$stop_problems $d:$out"
	elif [ -d "$tmp/stop/$d/.run" ]; then
		stop_problems="$stop_problems $d:made-.run"
	fi
done
if [ -z "$stop_problems" ]; then
	pass "make stop without servers (no .run, or a dangling link) exits 0"
else
	fail "make stop" "$stop_problems"
fi

# --- checks that need the binary -------------------------------------------
if [ ! -x "$BIN" ]; then
	fail "outboxd check config/outboxd.yml" "no binary at $BIN (run make)"
	fail "outboxd check config/docker.yml" "no binary at $BIN (run make)"
	fail "Dockerfile runtime libraries" "no binary at $BIN (run make)"
else
	# config/docker.yml reads its passwords from these variables.
	for f in config/outboxd.yml config/docker.yml; do
		if out=$(OUTBOXD_PG_PASSWORD=x OUTBOXD_RABBITMQ_PASSWORD=x \
		    "$BIN" -c "$f" check 2>&1) &&
		    [ "$out" = "configuration OK" ]; then
			pass "outboxd check $f"
		else
			fail "outboxd check $f" "$out"
		fi
	done

	# Under systemd, stderr is the journal's stream (JOURNAL_STREAM names
	# its device:inode), and each line starts with its syslog priority,
	# which journald keeps: `journalctl -p warning` needs it.  Servers
	# on port 1 refuse at once; outboxd logs that until SIGTERM.
	cat >"$tmp/refused.yml" <<-EOF
	postgres: { conninfo: "host=127.0.0.1 port=1 dbname=x user=x" }
	rabbitmq: { nodes: ["127.0.0.1:1"] }
	redis: { address: "127.0.0.1:1" }
	http: { listen: "" }
	EOF
	log="$tmp/journal-stream.log"
	: >"$log"
	JOURNAL_STREAM=$(stat -c '%d:%i' "$log") timeout -s TERM 2 \
	    "$BIN" -c "$tmp/refused.yml" run 2>>"$log" >/dev/null
	if grep -q '^<6>ts=.* level=info msg="outboxd starting"' "$log" &&
	    grep -q '^<4>ts=.* level=warn msg="postgres unavailable"' "$log" &&
	    ! grep -q '^ts=' "$log"; then
		pass "outboxd marks each line's priority for the journal"
	else
		fail "journal priority" "want <6>ts=... and <4>ts=... lines," \
		    "got: $(head -n 5 "$log")"
	fi
	: >"$log"
	JOURNAL_STREAM=1:1 timeout -s TERM 2 \
	    "$BIN" -c "$tmp/refused.yml" run 2>>"$log" >/dev/null
	if grep -q '^ts=.* level=warn msg="postgres unavailable"' "$log" &&
	    ! grep -q '^<' "$log"; then
		pass "outboxd writes plain logfmt when stderr is not the journal"
	else
		fail "plain logfmt" "$(head -n 5 "$log")"
	fi
	# A config error, why a service did not start, is stored as an error.
	printf 'relay: {batch_size: 0}\n' >"$tmp/bad.yml"
	: >"$log"
	JOURNAL_STREAM=$(stat -c '%d:%i' "$log") \
	    "$BIN" -c "$tmp/bad.yml" run 2>>"$log" >/dev/null
	if grep -q '^<3>ts=.* level=error msg="config error" .*line=1 .*' \
	    "$log" && grep -q 'relay.batch_size: must be between' "$log"; then
		pass "a config error goes to the journal as an error"
	else
		fail "config error in the journal" "$(head -n 5 "$log")"
	fi
	# check's too (ExecReload runs it), and nothing on stdout.
	: >"$log"
	out=$(JOURNAL_STREAM=$(stat -c '%d:%i' "$log") \
	    "$BIN" -c "$tmp/bad.yml" check 2>>"$log")
	if [ -z "$out" ] &&
	    grep -q '^<3>ts=.* level=error msg="config error" .*line=1 .*' \
	    "$log" && grep -q 'relay.batch_size: must be between' "$log"; then
		pass "check's config errors go to the journal as errors"
	else
		fail "check's errors in the journal" "out: $out log: $(head -n 5 "$log")"
	fi

	# Each library outboxd links directly must come from a package the
	# runtime stage installs (libc6 is in every Debian image).
	runtime_stage=$(awk '/^FROM /{n++} n == 2' Dockerfile)
	missing=
	for lib in $(readelf -d "$BIN" 2>/dev/null |
	    sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
		path=$(ldd "$BIN" | awk -v l="$lib" '$1 == l { print $3 }')
		pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null |
		    head -1 | cut -d: -f1)
		[ -n "$pkg" ] || pkg=$(dpkg -S "$path" 2>/dev/null |
		    head -1 | cut -d: -f1)
		case "$pkg" in
		# A sanitizer build (make SANITIZER=…) links its runtimes;
		# the image never ships that build.
		libc6 | libasan* | libubsan* | liblsan* | libtsan*) continue ;;
		"") missing="$missing $lib(no package)"; continue ;;
		esac
		grep -qw -- "$pkg" <<<"$runtime_stage" ||
			missing="$missing $pkg"
	done
	if [ -z "$missing" ]; then
		pass "Dockerfile runtime stage installs every linked library"
	else
		fail "Dockerfile runtime libraries" "missing:$missing"
	fi
fi

[ "$failed" -eq 0 ]
