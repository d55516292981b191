#!/usr/bin/env bash
# Private PostgreSQL, RabbitMQ and Redis servers for tests and `make run`:
# each lives under DIR on free loopback ports, never the system services.
#
#   tests/servers.sh start   DIR [pg|rabbitmq|redis ...]   (default: all)
#   tests/servers.sh stop    DIR [pg|rabbitmq|redis ...]
#   tests/servers.sh restart DIR  pg|rabbitmq|redis ...
#   tests/servers.sh kill    DIR  pg|rabbitmq|redis ...    (SIGKILL: crash)
#   tests/servers.sh status  DIR
#   tests/servers.sh tls     DIR [pg|rabbitmq|redis ...]   (start, with TLS)
#
# `start` writes DIR/env.sh (ports and connection strings to source) and
# DIR/outboxd.yml (a config for outboxd against these servers).  Ports are
# chosen once per DIR and kept, so a restarted server comes back on the
# same port.
#
# TLS mode (opt-in: `tls DIR`, or OUTBOXD_TLS=1 with `start`) makes a CA,
# server and client certificates under DIR/tls; PostgreSQL then takes only
# TLS with a client certificate, RabbitMQ adds an amqps listener
# (OUTBOXD_AMQPS_PORT) and Redis a unix socket.  It sticks to the DIR.
set -euo pipefail

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
RABBIT_BIN=${RABBIT_BIN:-/usr/lib/rabbitmq/bin}
DEADLINE_S=${SERVERS_DEADLINE_S:-60}

die() { echo "servers.sh: $*" >&2; exit 1; }
note() { echo "servers.sh: $*" >&2; }

usage() {
	sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
	exit 2
}

# Runs a command as the unprivileged owner of the PostgreSQL files:
# initdb and postgres refuse to run as root.
as_pg() {
	if [ "$(id -u)" = 0 ]; then
		# From /, which that user can always enter: from a private
		# clone, pg_ctl said "could not change directory to …".
		(cd / && runuser -u postgres -- "$@")
	else
		"$@"
	fi
}

port_in_use() {
	# Not grep -q: with pipefail, ss killed by the pipe grep -q closed
	# at its first line (a port with two listeners) read as free.
	[ -n "$(ss -Htln "sport = :$1" 2>/dev/null)" ]
}

# Sets the variable named $1 to a free TCP port in 20000-29999 that is
# not already handed out in this DIR.  rabbitmqctl takes 35672-35682 for
# itself, so stay clear of it.  Not $(pick_port): PORTS_TAKEN, set in
# that subshell, was lost, and two servers could draw the same port.
# SERVERS_PORT_BASE moves the range (10000: 10000-19999), so that two
# sets of servers started at the same moment (CI's sanitizer steps) can
# never draw the same free port before either has bound it.
pick_port() {
	local p
	for _ in $(seq 1 200); do
		p=$((${SERVERS_PORT_BASE:-20000} + RANDOM % 10000))
		case " ${PORTS_TAKEN:-} " in *" $p "*) continue ;; esac
		port_in_use "$p" && continue
		PORTS_TAKEN="${PORTS_TAKEN:-} $p"
		printf -v "$1" '%s' "$p"
		return 0
	done
	die "no free port found"
}

# Polls a command until it succeeds or the deadline passes.
wait_for() {
	local what=$1; shift
	local end=$((SECONDS + DEADLINE_S))
	until "$@" >/dev/null 2>&1; do
		[ $SECONDS -lt $end ] || die "$what did not become ready in ${DEADLINE_S}s"
		sleep 0.1
	done
}

load_ports() {
	if [ -f "$DIR/ports" ]; then
		# shellcheck disable=SC1091
		. "$DIR/ports"
		epmd_port
		if tls_on; then tls_port; fi
		return 0
	fi
	pick_port PG_PORT
	pick_port AMQP_PORT
	pick_port AMQP_DIST_PORT
	pick_port REDIS_PORT
	pick_port HTTP_PORT
	pick_port EPMD_PORT
	cat >"$DIR/ports" <<-EOF
	PG_PORT=$PG_PORT
	AMQP_PORT=$AMQP_PORT
	AMQP_DIST_PORT=$AMQP_DIST_PORT
	REDIS_PORT=$REDIS_PORT
	HTTP_PORT=$HTTP_PORT
	EPMD_PORT=$EPMD_PORT
	EOF
	if tls_on; then tls_port; fi
	return 0
}

# RabbitMQ's name server (epmd) gets a port of the DIR's too: on the
# default 4369 it was shared with any system RabbitMQ, listened on every
# address, and outlived `stop`.  A DIR made before it has none: add one.
epmd_port() {
	[ -n "${EPMD_PORT:-}" ] && return 0
	PORTS_TAKEN=" $PG_PORT $AMQP_PORT $AMQP_DIST_PORT $REDIS_PORT $HTTP_PORT ${AMQPS_PORT:-}"
	pick_port EPMD_PORT
	echo "EPMD_PORT=$EPMD_PORT" >>"$DIR/ports"
}

write_env() {
	local node="outboxd-$AMQP_PORT@localhost"
	cat >"$DIR/env.sh" <<-EOF
	# Source this file to talk to the private servers in $DIR.
	export OUTBOXD_SERVERS_DIR='$DIR'
	export OUTBOXD_PG_PORT=$PG_PORT
	export OUTBOXD_PG_CONNINFO='host=127.0.0.1 port=$PG_PORT dbname=outbox user=postgres'
	export OUTBOXD_AMQP_PORT=$AMQP_PORT
	export OUTBOXD_RABBIT_NODE='$node'
	export OUTBOXD_EPMD_PORT=$EPMD_PORT ERL_EPMD_PORT=$EPMD_PORT
	export OUTBOXD_REDIS_PORT=$REDIS_PORT
	export OUTBOXD_HTTP_PORT=$HTTP_PORT
	export PGHOST=127.0.0.1 PGPORT=$PG_PORT PGUSER=postgres PGDATABASE=outbox
	EOF
	cat >"$DIR/outboxd.yml" <<-EOF
	# outboxd against the private servers in this directory
	# (written by tests/servers.sh; see config/outboxd.yml for every key).
	postgres:
	  conninfo: "host=127.0.0.1 port=$PG_PORT dbname=outbox user=postgres"
	rabbitmq:
	  nodes: ["127.0.0.1:$AMQP_PORT"]
	redis:
	  address: "127.0.0.1:$REDIS_PORT"
	relay:
	  poll_interval: 5s
	http:
	  listen: "127.0.0.1:$HTTP_PORT"
	EOF
	if tls_on; then tls_write_env; fi
	return 0
}

# --- TLS (opt-in) ----------------------------------------------------------

# TLS mode is on for a DIR once its certificates exist; nobody who never
# asked for it ever has DIR/tls.
tls_on() {
	[ -f "$DIR/tls/client.key" ]
}

# An amqps port, picked once and kept in DIR/ports like the others.
tls_port() {
	[ -n "${AMQPS_PORT:-}" ] && return 0
	PORTS_TAKEN=" $PG_PORT $AMQP_PORT $AMQP_DIST_PORT $REDIS_PORT $HTTP_PORT $EPMD_PORT"
	pick_port AMQPS_PORT
	echo "AMQPS_PORT=$AMQPS_PORT" >>"$DIR/ports"
}

# Signs DIR/tls/NAME.crt for a fresh key with the CA (x509 extensions in
# the last argument).
tls_sign() {
	local t=$1 name=$2 cn=$3 ext=$4
	printf '%s\n' "$ext" >"$t/$name.ext"
	if ! openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
		-nodes -keyout "$t/$name.key" -out "$t/$name.csr" \
		-subj "/CN=$cn" 2>/dev/null ||
		! openssl x509 -req -in "$t/$name.csr" -CA "$t/ca.crt" \
		-CAkey "$t/ca.key" -set_serial "0x$(openssl rand -hex 8)" \
		-days 825 -extfile "$t/$name.ext" -out "$t/$name.crt" \
		2>/dev/null; then
		die "openssl could not sign $name.crt"
	fi
	rm -f "$t/$name.csr" "$t/$name.ext"
}

tls_ca() {
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
		-nodes -keyout "$2.key" -out "$2.crt" -days 825 -subj "/CN=$1" \
		-addext "basicConstraints=critical,CA:TRUE" \
		-addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null ||
		die "openssl could not make $2.crt"
}

# A CA, a server certificate for localhost and 127.0.0.1, a client
# certificate (CN=postgres, the database user it logs in as) and a second,
# unrelated CA for tests that need the wrong one.  Keys are mode 0600.
tls_certs() {
	local t="$DIR/tls"
	tls_on && return 0
	command -v openssl >/dev/null || die "TLS mode needs openssl"
	mkdir -p "$t"
	chmod 700 "$t"
	(
		umask 077
		tls_ca "outboxd test CA" "$t/ca"
		tls_ca "outboxd other CA" "$t/other-ca"
		rm -f "$t/other-ca.key"
		tls_sign "$t" server localhost "$(printf '%s\n' \
			"basicConstraints=critical,CA:FALSE" \
			"keyUsage=critical,digitalSignature" \
			"extendedKeyUsage=serverAuth" \
			"subjectAltName=DNS:localhost,IP:127.0.0.1")"
		# client.key last: its presence is what turns TLS mode on.
		tls_sign "$t" client postgres "$(printf '%s\n' \
			"basicConstraints=critical,CA:FALSE" \
			"keyUsage=critical,digitalSignature" \
			"extendedKeyUsage=clientAuth")"
	) || exit 1
	chmod 644 "$t"/*.crt
	note "TLS certificates in $t"
}

# libpq settings for this script's own psql, createdb and pg_isready.
tls_pg_env() {
	export PGSSLMODE=verify-full PGSSLROOTCERT="$DIR/tls/ca.crt" \
		PGSSLCERT="$DIR/tls/client.crt" PGSSLKEY="$DIR/tls/client.key"
}

tls_write_env() {
	local t="$DIR/tls"
	local ssl="sslmode=verify-full sslrootcert=$t/ca.crt sslcert=$t/client.crt sslkey=$t/client.key"
	local conninfo="host=127.0.0.1 port=$PG_PORT dbname=outbox user=postgres $ssl"
	cat >>"$DIR/env.sh" <<-EOF
	# TLS mode: PostgreSQL takes only TLS with a client certificate.
	export OUTBOXD_TLS_DIR='$t'
	export OUTBOXD_AMQPS_PORT=$AMQPS_PORT
	export OUTBOXD_REDIS_SOCKET='$DIR/redis/redis.sock'
	export OUTBOXD_PG_CONNINFO='$conninfo'
	export PGSSLMODE=verify-full PGSSLROOTCERT='$t/ca.crt'
	export PGSSLCERT='$t/client.crt' PGSSLKEY='$t/client.key'
	EOF
	# RabbitMQ checks host names against DNS names only (rabbitmq-c
	# 0.11), so the amqps node is "localhost", which the cert names.
	cat >"$DIR/outboxd.yml" <<-EOF
	# outboxd against the private servers in this directory, over TLS
	# (written by tests/servers.sh; see config/outboxd.yml for every key).
	postgres:
	  conninfo: "$conninfo"
	rabbitmq:
	  nodes: ["localhost:$AMQPS_PORT"]
	  tls:
	    enabled: true
	    ca_file: "$t/ca.crt"
	    cert_file: "$t/client.crt"
	    key_file: "$t/client.key"
	redis:
	  address: "unix:$DIR/redis/redis.sock"
	relay:
	  poll_interval: 5s
	http:
	  listen: "127.0.0.1:$HTTP_PORT"
	EOF
}

# Turns TLS on in an initialised cluster: server key and certificate in
# the data directory (owned by the server's user, as PostgreSQL wants),
# client certificates required, plain TCP refused.  Returns 0 if it
# changed anything.
tls_pg_conf() {
	local data=$1
	grep -q '^# outboxd TLS' "$data/postgresql.conf" && return 1
	install -m 600 "$DIR/tls/server.key" "$data/server.key"
	install -m 644 "$DIR/tls/server.crt" "$data/server.crt"
	install -m 644 "$DIR/tls/ca.crt" "$data/ca.crt"
	if [ "$(id -u)" = 0 ]; then
		chown postgres: "$data/server.key" "$data/server.crt" \
			"$data/ca.crt"
	fi
	cat >>"$data/postgresql.conf" <<-EOF
	# outboxd TLS (tests/servers.sh tls)
	ssl = on
	ssl_cert_file = 'server.crt'
	ssl_key_file = 'server.key'
	ssl_ca_file = 'ca.crt'
	ssl_min_protocol_version = 'TLSv1.2'
	EOF
	cat >"$data/pg_hba.conf" <<-EOF
	# TLS mode (tests/servers.sh): a client certificate whose CN is the
	# user name; anything without TLS is refused.
	hostssl   all all 127.0.0.1/32 cert
	hostnossl all all 127.0.0.1/32 reject
	EOF
	if [ "$(id -u)" = 0 ]; then chown postgres: "$data/pg_hba.conf"; fi
	return 0
}

# --- PostgreSQL ------------------------------------------------------------

pg_ready() {
	"$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -d postgres
}

start_pg() {
	local data="$DIR/pg/data"
	mkdir -p "$DIR/pg"
	if [ "$(id -u)" = 0 ]; then
		chown postgres: "$DIR/pg"
		as_pg test -w "$DIR/pg" ||
			die "user postgres cannot write $DIR/pg (is a parent directory private?)"
	fi
	if [ ! -f "$data/PG_VERSION" ]; then
		as_pg "$PG_BIN/initdb" -D "$data" -U postgres --auth=trust \
			-E UTF8 --locale=C.UTF-8 >"$DIR/pg/initdb.log" 2>&1 ||
			{ cat "$DIR/pg/initdb.log" >&2; die "initdb failed"; }
		cat >>"$data/postgresql.conf" <<-EOF
		listen_addresses = '127.0.0.1'
		unix_socket_directories = ''
		max_connections = 60
		shared_buffers = 128MB
		fsync = ${OUTBOXD_PG_FSYNC:-off}
		synchronous_commit = ${OUTBOXD_PG_SYNC_COMMIT:-off}
		full_page_writes = off
		log_min_messages = warning
		EOF
		# Every role is trusted but outboxd_pw, which must give its
		# password: the tests of password files and of the roles in
		# examples/roles.sql log in as it.
		as_pg sed -i '1i host all outboxd_pw 127.0.0.1/32 scram-sha-256' \
			"$data/pg_hba.conf"
	fi
	if tls_on && tls_pg_conf "$data" && pg_ready; then
		as_pg "$PG_BIN/pg_ctl" -D "$data" reload >/dev/null
	fi
	if pg_ready; then
		note "postgres already running on $PG_PORT"
	else
		as_pg setsid "$PG_BIN/pg_ctl" -D "$data" -o "-p $PG_PORT" \
			-l "$DIR/pg/postgres.log" -w -t "$DEADLINE_S" start \
			>/dev/null || { tail -20 "$DIR/pg/postgres.log" >&2
			die "postgres did not start"; }
		wait_for "postgres" pg_ready
		note "postgres ready on 127.0.0.1:$PG_PORT"
	fi
	# Running already, too: a first start cut short between the server
	# and this left it without the database, and every later start
	# said "already running" and went on without one.
	if ! "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres \
		-tAc "SELECT 1 FROM pg_database WHERE datname='outbox'" | grep -q 1; then
		"$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres outbox
	fi
}

stop_pg() {
	[ -f "$DIR/pg/data/postmaster.pid" ] || return 0
	as_pg "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -m fast -w -t "$DEADLINE_S" \
		stop >/dev/null 2>&1 || true
}

kill_pg() {
	local pid
	pid=$(head -1 "$DIR/pg/data/postmaster.pid" 2>/dev/null) || return 0
	kill -9 "$pid" 2>/dev/null || true
	# The postmaster's children notice its death and exit on their own;
	# a start must wait until the old postmaster is really gone.
	local end=$((SECONDS + DEADLINE_S))
	while { pg_ready || kill -0 "$pid" 2>/dev/null; } &&
		[ $SECONDS -lt $end ]; do
		sleep 0.1
	done
}

# --- RabbitMQ --------------------------------------------------------------

rabbit_env() {
	export HOME="$DIR/rabbitmq"
	export RABBITMQ_NODENAME="outboxd-$AMQP_PORT@localhost"
	export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
	export RABBITMQ_NODE_PORT=$AMQP_PORT
	export RABBITMQ_DIST_PORT=$AMQP_DIST_PORT
	export RABBITMQ_MNESIA_BASE="$DIR/rabbitmq/mnesia"
	export RABBITMQ_LOG_BASE="$DIR/rabbitmq/log"
	export RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/rabbitmq/enabled_plugins"
	export RABBITMQ_PID_FILE="$DIR/rabbitmq/rabbitmq.pid"
	export RABBITMQ_CONFIG_FILE="$DIR/rabbitmq/rabbitmq"
	export RABBITMQ_ADVANCED_CONFIG_FILE="$DIR/rabbitmq/advanced.config"
	export ERL_EPMD_PORT=$EPMD_PORT ERL_EPMD_ADDRESS=127.0.0.1
}

rabbitctl() {
	"$RABBIT_BIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" "$@"
}

start_rabbitmq() {
	mkdir -p "$DIR/rabbitmq/log"
	rabbit_env
	echo "[]." >"$RABBITMQ_ENABLED_PLUGINS_FILE"
	echo "[]." >"$RABBITMQ_ADVANCED_CONFIG_FILE"
	# A small max_message_size lets tests reach the limit cheaply.
	cat >"$RABBITMQ_CONFIG_FILE.conf" <<-EOF
	loopback_users = none
	max_message_size = ${OUTBOXD_RABBIT_MAX_MESSAGE:-4194304}
	vm_memory_high_watermark.relative = 0.2
	disk_free_limit.absolute = 50MB
	EOF
	if tls_on; then
		# The plain listener stays: tests and tools use it; verify_peer
		# with fail_if_no_peer_cert wants a client certificate.
		cat >>"$RABBITMQ_CONFIG_FILE.conf" <<-EOF
		listeners.ssl.1 = 127.0.0.1:$AMQPS_PORT
		ssl_options.cacertfile = $DIR/tls/ca.crt
		ssl_options.certfile = $DIR/tls/server.crt
		ssl_options.keyfile = $DIR/tls/server.key
		ssl_options.verify = verify_peer
		ssl_options.fail_if_no_peer_cert = true
		ssl_options.versions.1 = tlsv1.3
		ssl_options.versions.2 = tlsv1.2
		EOF
		# Started plain before TLS was asked for: restart it.
		if ! port_in_use "$AMQPS_PORT" &&
			rabbitctl status >/dev/null 2>&1; then
			stop_rabbitmq
		fi
	fi
	if rabbitctl status >/dev/null 2>&1; then
		note "rabbitmq already running on $AMQP_PORT"
		return
	fi
	# A session of its own: a test runner that kills its process group
	# when a test ends (Check does) must not take the server with it.
	# Its working directory is where Mnesia drops core files on a crash.
	(cd "$DIR/rabbitmq" && exec setsid "$RABBIT_BIN/rabbitmq-server") \
		>"$DIR/rabbitmq/console.log" 2>&1 &
	local server_pid=$!
	# await_startup fails at once until the node has registered with epmd,
	# so poll it; give up early if the server process died.
	local end=$((SECONDS + DEADLINE_S))
	until rabbitctl await_startup --timeout 10 >/dev/null 2>&1; do
		if ! kill -0 "$server_pid" 2>/dev/null || [ $SECONDS -ge $end ]; then
			tail -20 "$DIR/rabbitmq/console.log" >&2
			die "rabbitmq did not start"
		fi
		sleep 0.2
	done
	note "rabbitmq ready on 127.0.0.1:$AMQP_PORT"
	if tls_on; then
		wait_for "rabbitmq amqps" port_in_use "$AMQPS_PORT"
		note "rabbitmq amqps ready on 127.0.0.1:$AMQPS_PORT"
	fi
}

stop_rabbitmq() {
	[ -d "$DIR/rabbitmq" ] || return 0
	rabbit_env
	rabbitctl shutdown >/dev/null 2>&1 || kill_rabbitmq
	# The node's epmd, started by the node; a crash (kill) leaves it for
	# the restart.
	epmd -port "$EPMD_PORT" -kill >/dev/null 2>&1 || true
}

kill_rabbitmq() {
	[ -d "$DIR/rabbitmq" ] || return 0
	rabbit_env
	local pid
	pid=$(cat "$RABBITMQ_PID_FILE" 2>/dev/null) || true
	[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
	local end=$((SECONDS + DEADLINE_S))
	while port_in_use "$AMQP_PORT" && [ $SECONDS -lt $end ]; do
		sleep 0.1
	done
	rm -f "$RABBITMQ_PID_FILE"
}

# --- Redis -----------------------------------------------------------------

redis_ready() {
	redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping | grep -q PONG
}

start_redis() {
	mkdir -p "$DIR/redis"
	if redis_ready 2>/dev/null; then
		note "redis already running on $REDIS_PORT"
		return
	fi
	local sock=()
	# TLS mode: also a unix socket, the way docs/SECURITY.md recommends
	# reaching Redis (hiredis 0.14 has no TLS).
	if tls_on; then
		sock=(--unixsocket "$DIR/redis/redis.sock" --unixsocketperm 700)
	fi
	redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$DIR/redis" \
		--daemonize yes --pidfile "$DIR/redis/redis.pid" \
		--logfile "$DIR/redis/redis.log" --save "" --appendonly no \
		"${sock[@]}" >/dev/null || die "redis-server did not start"
	wait_for "redis" redis_ready
	note "redis ready on 127.0.0.1:$REDIS_PORT"
}

stop_redis() {
	[ -f "$DIR/redis/redis.pid" ] || return 0
	redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 ||
		kill_redis
	rm -f "$DIR/redis/redis.pid"
}

kill_redis() {
	local pid
	pid=$(cat "$DIR/redis/redis.pid" 2>/dev/null) || return 0
	kill -9 "$pid" 2>/dev/null || true
	local end=$((SECONDS + DEADLINE_S))
	while port_in_use "$REDIS_PORT" && [ $SECONDS -lt $end ]; do
		sleep 0.1
	done
	rm -f "$DIR/redis/redis.pid"
}

# --- main ------------------------------------------------------------------

[ $# -ge 2 ] || usage
cmd=$1
mkdir -p "$2"
# The physical path: a link (make run's .run) may pass through a private
# directory that PostgreSQL's own user cannot enter.
DIR=$(cd "$2" && pwd -P)
shift 2
# TLS mode is asked for here, and only here; it then sticks to the DIR.
if [ "$cmd" = tls ] ||
	{ [ "$cmd" = start ] && [ "${OUTBOXD_TLS:-0}" = 1 ]; }; then
	tls_certs
	cmd=start
fi
services=("$@")
[ ${#services[@]} -gt 0 ] || services=(pg rabbitmq redis)
for s in "${services[@]}"; do
	case "$s" in pg|rabbitmq|redis) ;; *) die "unknown server '$s'" ;; esac
done
load_ports
if tls_on; then tls_pg_env; fi

case "$cmd" in
start)
	write_env
	for s in "${services[@]}"; do "start_$s"; done
	;;
stop)
	# Stop in reverse so the relay's dependencies go last.
	for ((i = ${#services[@]} - 1; i >= 0; i--)); do
		"stop_${services[$i]}"
	done
	# A suite may start servers of its own in a directory under DIR
	# (check_tls does): stopping all of DIR stops them too.
	if [ $# -eq 0 ]; then
		for f in "$DIR"/*/ports; do
			if [ -f "$f" ]; then "$0" stop "${f%/ports}" || true; fi
		done
	fi
	;;
restart)
	for s in "${services[@]}"; do "stop_$s"; "start_$s"; done
	;;
kill)
	for s in "${services[@]}"; do "kill_$s"; done
	;;
status)
	pg_ready && echo "pg: up on $PG_PORT" || echo "pg: down"
	port_in_use "$AMQP_PORT" && echo "rabbitmq: up on $AMQP_PORT" ||
		echo "rabbitmq: down"
	redis_ready 2>/dev/null && echo "redis: up on $REDIS_PORT" ||
		echo "redis: down"
	if tls_on; then
		port_in_use "$AMQPS_PORT" && echo "amqps: up on $AMQPS_PORT" ||
			echo "amqps: down"
	fi
	;;
*) usage ;;
esac
