#!/usr/bin/env bash
# Installs the Debian 12 packages outboxd needs to build, test and run,
# when any is missing.  Needs root or sudo only when it installs.
set -euo pipefail

packages=(
	gcc make pkg-config
	libpq-dev librabbitmq-dev libhiredis-dev libyaml-dev check
	libsystemd-dev libmicrohttpd-dev
	postgresql-15 postgresql-client-15 rabbitmq-server redis-server
	redis-tools amqp-tools iproute2 procps valgrind
	python3-psycopg2 nodejs systemd docker-compose
	clang libclang-rt-14-dev openssl
)
if [ -n "${OUTBOXD_EXTRA_PACKAGES:-}" ]; then
	read -r -a extra <<<"$OUTBOXD_EXTRA_PACKAGES"
	packages+=("${extra[@]}")
fi

installed() {
	[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = \
		"install ok installed" ]
}

missing=()
for p in "${packages[@]}"; do
	installed "$p" || missing+=("$p")
done
# The Node.js example needs the pg module: Debian's nodejs comes without
# npm, so take Debian's node-pg with it.  A nodejs from elsewhere (one that
# brings npm, like NodeSource's) conflicts with node-pg; the example's
# test installs pg with npm instead.  Only with a nodejs installed now: a
# machine that has everything else must not need root for this alone.
if ! command -v npm >/dev/null && ! installed node-pg &&
	[[ "$(apt-cache policy nodejs 2>/dev/null)" != *nodesource* ]]; then
	if [[ " ${missing[*]} " == *" nodejs "* ]]; then
		missing+=(node-pg)
	else
		echo "deps.sh: the Node.js example's test needs Debian's" \
			"node-pg (apt-get install node-pg)" >&2
	fi
fi
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps.sh: installing ${missing[*]}" >&2
if [ "$(id -u)" = 0 ]; then
	sudo=()
elif command -v sudo >/dev/null; then
	sudo=(sudo)
else
	echo "deps.sh: missing packages: ${missing[*]}; run as root or" \
		"install them with apt-get" >&2
	exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"

# Debian starts (and enables) a server package's system service when it
# installs it.  outboxd's tests and `make run` use private servers on
# ports of their own, so the ones installed just now are stopped: they
# took the default ports that docker-compose publishes, and the memory
# of a 2-core test machine.  A server that was here before is left be.
services=()
for p in "${missing[@]}"; do
	case "$p" in
	postgresql-15) services+=(postgresql) ;;
	rabbitmq-server) services+=(rabbitmq-server) ;;
	redis-server) services+=(redis-server) ;;
	esac
done
if [ ${#services[@]} -gt 0 ] && [ -d /run/systemd/system ]; then
	"${sudo[@]}" systemctl disable --now "${services[@]}" >/dev/null 2>&1 ||
		true
	echo "deps.sh: stopped and disabled the system services just" \
		"installed (${services[*]}); outboxd's tests use private" \
		"servers. 'systemctl enable --now NAME' brings one back." >&2
fi
