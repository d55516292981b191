/*
 * Integration suite for TLS: outboxd reaches PostgreSQL with
 * sslmode=verify-full and a client certificate, RabbitMQ over amqps with
 * a client certificate, verify_peer and verify_hostname, and Redis over a
 * unix socket, against private servers in TLS mode (tests/servers.sh tls)
 * that this suite starts in a directory of its own and always stops.
 * Then the ways it must fail, clearly and without touching a row: a wrong
 * CA on either side, a plain client on a TLS port and the reverse, no
 * client certificate, a node name the certificate does not list.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "testlib.h"
#include "util.h"

#define N_ROWS 20
#define WAIT_MS 30000

/* The TLS servers: their directory, ports and certificates. */
static char dir[256], tlsdir[300], node[64];
static int amqp_port, amqps_port;
static char conninfo[1200];	/* verify-full with the right CA */
/* The runner's variables, put back when the suite is done. */
static char *saved_env[4];
static const char *const env_names[] = { "OUTBOXD_SERVERS_DIR",
	"OUTBOXD_PG_CONNINFO", "OUTBOXD_AMQP_PORT", "OUTBOXD_REDIS_PORT" };

static void
nap_ms(int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

/* PORT from DIR/ports ("NAME=1234" lines); 0 if missing. */
static int
port_of(const char *name)
{
	char path[600], line[128];
	size_t n = strlen(name);
	FILE *f;
	int port = 0;

	snprintf(path, sizeof(path), "%s/ports", dir);
	f = fopen(path, "r");
	ck_assert_msg(f != NULL, "no %s", path);
	while (fgets(line, sizeof(line), f) != NULL)
		if (strncmp(line, name, n) == 0 && line[n] == '=')
			port = atoi(line + n + 1);
	fclose(f);
	return port;
}

static void
servers(const char *cmd)
{
	char script[600], err[4096];
	const char *src = getenv("OUTBOXD_SRCDIR");
	const char *argv[] = { script, cmd, dir, NULL };
	int rc;

	snprintf(script, sizeof(script), "%s/tests/servers.sh",
	    src != NULL ? src : ".");
	rc = tl_run(argv, NULL, 0, err, sizeof(err), 240000);
	ck_assert_msg(rc == 0, "servers.sh %s %s: exit %d\n%s", cmd, dir, rc,
	    err);
}

/*
 * Starts PostgreSQL, RabbitMQ and Redis in TLS mode in a directory under
 * the runner's, points the test library's variables at them and applies
 * the schema.  Runs once, in the parent, before the tests fork.
 */
static void
suite_setup(void)
{
	char port[16], out[4096], err[4096];
	int rc;

	snprintf(dir, sizeof(dir), "%s/tls", tl_env("OUTBOXD_SERVERS_DIR"));
	snprintf(tlsdir, sizeof(tlsdir), "%s/tls", dir);
	for (size_t i = 0; i < 4; i++) {
		const char *v = getenv(env_names[i]);

		saved_env[i] = v != NULL ? strdup(v) : NULL;
	}
	servers("tls");
	amqp_port = port_of("AMQP_PORT");
	amqps_port = port_of("AMQPS_PORT");
	ck_assert_int_gt(amqps_port, 0);
	snprintf(node, sizeof(node), "outboxd-%d@localhost", amqp_port);
	snprintf(conninfo, sizeof(conninfo), "host=127.0.0.1 port=%d "
	    "dbname=outbox user=postgres sslmode=verify-full "
	    "sslrootcert=%s/ca.crt sslcert=%s/client.crt "
	    "sslkey=%s/client.key", port_of("PG_PORT"), tlsdir, tlsdir,
	    tlsdir);
	/* The library's SQL and AMQP helpers now use the TLS servers:
	 * PostgreSQL over TLS, RabbitMQ on its plain port (an independent
	 * consumer, not the code under test). */
	setenv("OUTBOXD_SERVERS_DIR", dir, 1);
	setenv("OUTBOXD_PG_CONNINFO", conninfo, 1);
	snprintf(port, sizeof(port), "%d", amqp_port);
	setenv("OUTBOXD_AMQP_PORT", port, 1);
	snprintf(port, sizeof(port), "%d", port_of("REDIS_PORT"));
	setenv("OUTBOXD_REDIS_PORT", port, 1);
	snprintf(out, sizeof(out), "%s/outboxd.yml", dir);
	rc = tl_outboxd_cli(NULL, 0, err, sizeof(err), out, "migrate", NULL);
	ck_assert_msg(rc == 0, "migrate over TLS: exit %d\n%s", rc, err);
}

static void
suite_teardown(void)
{
	servers("stop");
	for (size_t i = 0; i < 4; i++) {
		if (saved_env[i] != NULL)
			setenv(env_names[i], saved_env[i], 1);
		else
			unsetenv(env_names[i]);
		free(saved_env[i]);
		saved_env[i] = NULL;
	}
}

/*
 * Writes a config for the TLS servers and starts outboxd on it.  pg is
 * the whole postgres.conninfo; rabbit the lines under "rabbitmq:" (two
 * spaces of indent each).
 */
static pid_t
start(const char *name, const char *pg, const char *rabbit)
{
	char path[700];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s.yml", dir, name);
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fprintf(f, "log:\n  level: info\n"
	    "postgres:\n  conninfo: \"%s\"\n  application_name: outboxd-%s\n"
	    "rabbitmq:\n%s"
	    "redis:\n  address: \"unix:%s/redis/redis.sock\"\n"
	    "relay:\n  poll_interval: 100ms\n"
	    "reconnect:\n  max: 500ms\n"
	    "http:\n  listen: \"\"\n", pg, name, rabbit, dir);
	ck_assert_int_eq(fclose(f), 0);
	return tl_outboxd_start_file(path);
}

/* The rabbitmq: lines for amqps on host:port with our CA and client
 * certificate; ca is "ca" or "other-ca". */
static const char *
amqps(char *buf, size_t size, const char *host, int port, const char *ca)
{
	snprintf(buf, size, "  nodes: [\"%s:%d\"]\n"
	    "  tls:\n    enabled: true\n    ca_file: \"%s/%s.crt\"\n"
	    "    cert_file: \"%s/client.crt\"\n"
	    "    key_file: \"%s/client.key\"\n"
	    "    verify_peer: true\n    verify_hostname: true\n",
	    host, port, tlsdir, ca, tlsdir, tlsdir);
	return buf;
}

/* Lines of pid's log that contain needle. */
static int
log_count(pid_t pid, const char *needle)
{
	return tl_file_lines(tl_outboxd_log(pid), needle, NULL);
}

/* Waits until needle is in at least times lines of pid's log. */
static bool
wait_log(pid_t pid, const char *needle, int times, int timeout_ms)
{
	int64_t deadline = tl_ms() + timeout_ms;

	while (log_count(pid, needle) < times) {
		if (tl_ms() >= deadline)
			return false;
		nap_ms(50);
	}
	return true;
}

/* Enqueues n rows for queue (default exchange); returns the last id. */
static long long
enqueue(PGconn *pg, const char *queue, int n)
{
	tl_reset_db(pg);
	return tl_sql_int(pg, "SELECT max(outbox_enqueue('', '%s', "
	    "'tls-' || g)) FROM generate_series(1, %d) g", queue, n);
}

/* Rows a failed connection must never have touched. */
static long long
rows_touched(PGconn *pg)
{
	return tl_sql_int(pg, "SELECT count(*) FROM t_transactional_message "
	    "WHERE message_status <> 0 OR current_retry_times <> 0 OR "
	    "last_error IS NOT NULL");
}

/*
 * Starts outboxd with a config that cannot connect, waits for the error
 * it must log, and checks that no row was touched and that it still
 * stops cleanly.
 */
static void
expect_failure(const char *name, const char *pg, const char *rabbit,
    const char *error)
{
	PGconn *c = tl_pg();
	pid_t pid;

	enqueue(c, "tls_fail", 5);
	pid = start(name, pg, rabbit);
	/* Seen twice: outboxd went round its loop and retried, and it
	 * still says why, so a row it would wrongly touch is touched. */
	ck_assert_msg(wait_log(pid, error, 2, WAIT_MS), "no \"%s\" in %s",
	    error, tl_outboxd_log(pid));
	ck_assert_int_eq(rows_touched(c), 0);
	ck_assert_int_eq(tl_sql_int(c, "SELECT count(*) FROM "
	    "t_transactional_message"), 5);
	ck_assert_int_eq(tl_outboxd_stop(pid, 20000), 0);
	ck_assert_int_eq(rows_touched(c), 0);
	PQfinish(c);
}

/* Rows go out end to end with every connection encrypted and verified. */
START_TEST(test_tls_delivery)
{
	PGconn *c = tl_pg();
	struct tl_amqp *a = tl_amqp_open();
	unsigned *counts;
	char rabbit[2048], out[4096], err[1024], ctl[600], home[600];
	char epmd[64];
	const char *bin = getenv("RABBIT_BIN");
	const char *argv[] = { "/usr/bin/env", home, epmd, ctl, "-n", node,
		"-q", "list_connections", "ssl", "peer_cert_subject", NULL };
	long long last, first;
	size_t got;
	pid_t pid;

	/* The test's own libpq connection is TLS, verified (verify-full). */
	ck_assert_int_eq(tl_sql_int(c, "SELECT count(*) FROM pg_stat_ssl "
	    "WHERE pid = pg_backend_pid() AND ssl"), 1);
	tl_queue(a, "tls_q", "", NULL);
	last = enqueue(c, "tls_q", N_ROWS);
	first = last - N_ROWS + 1;
	counts = xcalloc(N_ROWS, sizeof(*counts));
	tl_consume(a, "tls_q");

	pid = start("delivery", conninfo, amqps(rabbit, sizeof(rabbit),
	    "localhost", amqps_port, "ca"));
	ck_assert_int_eq(tl_wait_sql_int(c, N_ROWS, WAIT_MS, "SELECT count(*) "
	    "FROM t_transactional_message WHERE message_status = 1"), N_ROWS);
	got = tl_collect(a, counts, first, N_ROWS, N_ROWS, 5000, WAIT_MS);
	ck_assert_uint_ge(got, N_ROWS);
	for (long long id = first; id <= last; id++)
		ck_assert_msg(counts[id - first] >= 1, "row %lld never arrived",
		    id);

	/* outboxd's own sessions, seen from each server. */
	ck_assert_int_ge(tl_sql_int(c, "SELECT count(*) FROM pg_stat_ssl s "
	    "JOIN pg_stat_activity a USING (pid) WHERE a.application_name = "
	    "'outboxd-delivery' AND s.ssl"), 1);
	ck_assert_int_eq(tl_sql_int(c, "SELECT count(*) FROM pg_stat_ssl s "
	    "JOIN pg_stat_activity a USING (pid) WHERE a.application_name = "
	    "'outboxd-delivery' AND NOT s.ssl"), 0);
	snprintf(home, sizeof(home), "HOME=%s/rabbitmq", dir);
	/* This node's own name server (tests/servers.sh). */
	snprintf(epmd, sizeof(epmd), "ERL_EPMD_PORT=%d", port_of("EPMD_PORT"));
	snprintf(ctl, sizeof(ctl), "%s/rabbitmqctl",
	    bin != NULL ? bin : "/usr/lib/rabbitmq/bin");
	ck_assert_int_eq(tl_run(argv, out, sizeof(out), err, sizeof(err),
	    30000), 0);
	/* One line per connection: ssl, then the client cert's subject. */
	ck_assert_msg(strstr(out, "true\tCN=postgres") != NULL,
	    "no amqps connection with our client certificate:\n%s", out);
	ck_assert(tl_log_contains(pid, "tls=on"));
	ck_assert(tl_log_contains(pid, "msg=\"redis connected\" addr=unix:"));
	ck_assert(!tl_log_contains(pid, "level=error"));
	ck_assert_int_eq(tl_outboxd_stop(pid, 20000), 0);
	free(counts);
	tl_amqp_close(a);
	PQfinish(c);
}
END_TEST

/* PostgreSQL's certificate checked against a CA that did not sign it. */
START_TEST(test_pg_wrong_ca)
{
	char pg[1200], rabbit[2048];

	snprintf(pg, sizeof(pg), "host=127.0.0.1 port=%d dbname=outbox "
	    "user=postgres sslmode=verify-full sslrootcert=%s/other-ca.crt "
	    "sslcert=%s/client.crt sslkey=%s/client.key", port_of("PG_PORT"),
	    tlsdir, tlsdir, tlsdir);
	expect_failure("pg-wrong-ca", pg, amqps(rabbit, sizeof(rabbit),
	    "localhost", amqps_port, "ca"),
	    "SSL error: certificate verify failed");
}
END_TEST

/* A client that will not speak TLS to a server that takes nothing else. */
START_TEST(test_pg_plain_client)
{
	char pg[600], rabbit[2048];

	snprintf(pg, sizeof(pg), "host=127.0.0.1 port=%d dbname=outbox "
	    "user=postgres sslmode=disable", port_of("PG_PORT"));
	expect_failure("pg-plain", pg, amqps(rabbit, sizeof(rabbit),
	    "localhost", amqps_port, "ca"), "no encryption");
}
END_TEST

/* The broker's certificate checked against a CA that did not sign it. */
START_TEST(test_amqp_wrong_ca)
{
	char rabbit[2048];

	expect_failure("amqp-wrong-ca", conninfo, amqps(rabbit,
	    sizeof(rabbit), "localhost", amqps_port, "other-ca"),
	    "SSL peer cert verification failed: the broker's certificate is "
	    "not signed by a CA in rabbitmq.tls.ca_file");
}
END_TEST

/* No ca_file: the broker is checked against the system's CAs, which do
 * not include the suite's own CA, so verify_peer must refuse it. */
START_TEST(test_amqp_system_cas)
{
	char rabbit[1024];

	snprintf(rabbit, sizeof(rabbit), "  nodes: [\"localhost:%d\"]\n"
	    "  tls:\n    enabled: true\n"
	    "    cert_file: \"%s/client.crt\"\n"
	    "    key_file: \"%s/client.key\"\n", amqps_port, tlsdir, tlsdir);
	expect_failure("amqp-system-cas", conninfo, rabbit,
	    "SSL peer cert verification failed");
}
END_TEST

/* Plain AMQP to the amqps port. */
START_TEST(test_amqp_plain_client)
{
	char rabbit[256];

	snprintf(rabbit, sizeof(rabbit), "  nodes: [\"localhost:%d\"]\n",
	    amqps_port);
	expect_failure("amqp-plain", conninfo, rabbit,
	    "(an amqps port? then set rabbitmq.tls.enabled)");
}
END_TEST

/* TLS to the plain AMQP port. */
START_TEST(test_amqp_tls_on_plain_port)
{
	char rabbit[2048];

	expect_failure("amqp-tls-plain-port", conninfo, amqps(rabbit,
	    sizeof(rabbit), "localhost", amqp_port, "ca"),
	    "SSL handshake failed: is the port an amqps (TLS) port?");
}
END_TEST

/* The broker wants a client certificate (fail_if_no_peer_cert). */
START_TEST(test_amqp_no_client_cert)
{
	char rabbit[1024];

	snprintf(rabbit, sizeof(rabbit), "  nodes: [\"localhost:%d\"]\n"
	    "  tls:\n    enabled: true\n    ca_file: \"%s/ca.crt\"\n",
	    amqps_port, tlsdir);
	expect_failure("amqp-no-cert", conninfo, rabbit,
	    "did the broker refuse the client certificate?");
}
END_TEST

/*
 * verify_hostname is enforced: the certificate names DNS:localhost and
 * IP:127.0.0.1, and rabbitmq-c 0.11 compares DNS names only, so a node
 * written as 127.0.0.1 fails the check (docs/SECURITY.md).
 */
/*
 * An encrypted client key: OpenSSL would ask for its passphrase on the
 * terminal, with no timeout (in the foreground the connect hung there;
 * without a terminal it failed as "not PEM").  outboxd says what it is.
 */
START_TEST(test_amqp_encrypted_key)
{
	char rabbit[2048], key[700], in[700], err[1024];
	const char *argv[] = { "/usr/bin/openssl", "pkey", "-in", in, "-aes256",
		"-passout", "pass:outboxd-test", "-out", key, NULL };

	snprintf(in, sizeof(in), "%s/client.key", tlsdir);
	snprintf(key, sizeof(key), "%s/client-encrypted.key", tlsdir);
	ck_assert_msg(tl_run(argv, NULL, 0, err, sizeof(err), 30000) == 0,
	    "openssl: %s", err);
	ck_assert_int_eq(chmod(key, 0600), 0);
	snprintf(rabbit, sizeof(rabbit), "  nodes: [\"localhost:%d\"]\n"
	    "  tls:\n    enabled: true\n    ca_file: \"%s/ca.crt\"\n"
	    "    cert_file: \"%s/client.crt\"\n    key_file: \"%s\"\n",
	    amqps_port, tlsdir, tlsdir, key);
	expect_failure("amqp-encrypted-key", conninfo, rabbit,
	    "the key is encrypted, and outboxd cannot ask for its passphrase");
}
END_TEST

START_TEST(test_amqp_hostname_checked)
{
	char rabbit[2048];

	expect_failure("amqp-hostname", conninfo, amqps(rabbit,
	    sizeof(rabbit), "127.0.0.1", amqps_port, "ca"),
	    "SSL hostname verification failed");
}
END_TEST

static Suite *
tls_suite(void)
{
	Suite *s = suite_create("tls");
	TCase *tc = tcase_create("tls");

	tcase_add_unchecked_fixture(tc, suite_setup, suite_teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_tls_delivery);
	tcase_add_test(tc, test_pg_wrong_ca);
	tcase_add_test(tc, test_pg_plain_client);
	tcase_add_test(tc, test_amqp_wrong_ca);
	tcase_add_test(tc, test_amqp_system_cas);
	tcase_add_test(tc, test_amqp_plain_client);
	tcase_add_test(tc, test_amqp_tls_on_plain_port);
	tcase_add_test(tc, test_amqp_no_client_cert);
	tcase_add_test(tc, test_amqp_encrypted_key);
	tcase_add_test(tc, test_amqp_hostname_checked);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(tls_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
