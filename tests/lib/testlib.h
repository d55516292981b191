/*
 * Helpers for integration suites: SQL against the private PostgreSQL, an
 * independent AMQP consumer (so tests do not trust the broker module they
 * test), outboxd as a child process, and waiting with deadlines.
 */
#ifndef OUTBOXD_TESTLIB_H
#define OUTBOXD_TESTLIB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <libpq-fe.h>

/* An environment variable the integration runner sets; aborts the test
 * with a clear message when it is missing. */
const char *tl_env(const char *name);

/* --- PostgreSQL ---------------------------------------------------------- */
PGconn *tl_pg(void);
void tl_sql(PGconn *, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The first column of the first row as an integer (NULL reads as -1). */
long long tl_sql_int(PGconn *, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Same as text into buf ("" for NULL). */
char *tl_sql_text(PGconn *, char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Empties the outbox tables. */
void tl_reset_db(PGconn *);
/* Polls a count query until it equals want or timeout_ms passes; returns
 * the last value seen. */
long long tl_wait_sql_int(PGconn *, long long want, int timeout_ms,
    const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* --- RabbitMQ ------------------------------------------------------------ */
struct tl_amqp;
struct tl_amqp *tl_amqp_open(void);
/* The same, logged in as another RabbitMQ user. */
struct tl_amqp *tl_amqp_open_as(const char *user, const char *password);
void tl_amqp_close(struct tl_amqp *);
/* Declares a durable queue (purged), bound to exchange if not "". */
void tl_queue(struct tl_amqp *, const char *queue, const char *exchange,
    const char *routing_key);
void tl_exchange(struct tl_amqp *, const char *name, const char *type);
/* Not durable, auto-deleted with its last binding (pika's flags). */
void tl_exchange_transient(struct tl_amqp *, const char *name,
    const char *type);
void tl_exchange_delete(struct tl_amqp *, const char *name);
void tl_consume(struct tl_amqp *, const char *queue);

struct tl_msg {
	char *body;
	size_t body_len;
	long long message_id;	/* -1 if absent */
	int delivery_mode;
	char content_type[128];
	uint64_t timestamp;
	char business_module[128];
	char business_key[128];
	int attempt;		/* -1 if absent */
	char routing_key[256];
	char extra_header[256];	/* "key=value" of the first other header */
};
/* Next delivery from tl_consume's queue; false on timeout. */
bool tl_next(struct tl_amqp *, int timeout_ms, struct tl_msg *);
void tl_msg_free(struct tl_msg *);

/* Receives until timeout passes with nothing new, or until `want` ids
 * have been seen; counts[id - first] += 1 for each id in [first,
 * first + n).  Returns the number of deliveries. */
size_t tl_collect(struct tl_amqp *, unsigned *counts, long long first,
    long long n, size_t want, int idle_timeout_ms, int total_timeout_ms);

/* Publishes a marker to queue (tl_consume's) and receives until it comes
 * back, counting as tl_collect does.  A classic queue keeps its order,
 * so every message confirmed to it before the call is read: call it
 * once outboxd has nothing more to send (every row marked, or outboxd
 * stopped), and a late duplicate is counted too.  Returns the
 * deliveries before the marker. */
size_t tl_collect_to_end(struct tl_amqp *, const char *queue,
    unsigned *counts, long long first, long long n, int total_timeout_ms);
/* Its two steps: publishes a marker to queue (its text goes to
 * marker[size]); then each tl_next_before gives the next delivery and
 * true, or false once the marker came back (it must come by deadline,
 * a tl_ms() time). */
void tl_mark_end(struct tl_amqp *, const char *queue, char *marker,
    size_t size);
bool tl_next_before(struct tl_amqp *, const char *marker, int64_t deadline,
    struct tl_msg *);

/* --- outboxd and the servers -------------------------------------------- */
/* Writes a config for the private servers plus extra YAML (whole
 * sections, may be NULL) and starts `outboxd run`; stderr goes to a log
 * file whose path is in tl_outboxd_log().  The child is killed if the
 * test process dies, so a failed test cannot leave a daemon relaying
 * behind the next one. */
pid_t tl_outboxd_start(const char *extra_yaml);
const char *tl_outboxd_log(pid_t);
/* SIGTERM, then waits up to timeout_ms; returns the exit status or -1. */
int tl_outboxd_stop(pid_t, int timeout_ms);
void tl_outboxd_kill(pid_t);
/* tests/servers.sh CMD DIR SERVICE; aborts the test on failure. */
void tl_servers(const char *cmd, const char *service);
/* Milliseconds since the first call; for reporting. */
int64_t tl_ms(void);
/* How many times slower outboxd runs here than plain: upper time limits
 * are multiplied by it.  $OUTBOXD_TEST_SLOWDOWN, set by make tsan and
 * valgrind-integration; 1 without it. */
int tl_slowdown(void);
/* Whether the log of a started outboxd contains needle. */
bool tl_log_contains(pid_t, const char *needle);
/* Lines of the file at path holding needle, and needle2 unless NULL;
 * 0 when the file cannot be read. */
int tl_file_lines(const char *path, const char *needle, const char *needle2);

/* --- outboxd as a command, and its endpoints ----------------------------- */
/* Writes a config like tl_outboxd_start's (same extra_yaml rules) to a new
 * file in the servers directory; its path goes to path[size]. */
void tl_config_write(char *path, size_t size, const char *extra_yaml);
/* Starts `outboxd -c cfg_path run` like tl_outboxd_start (log file, same
 * bookkeeping, killed with the test process). */
pid_t tl_outboxd_start_file(const char *cfg_path);
/* Waits up to timeout_ms for a child started here to exit, without
 * signalling it; returns the exit status (128 + signal when killed) or
 * -1 when it is still running. */
int tl_outboxd_wait(pid_t, int timeout_ms);
/* Waits until sig sent to pid is no longer pending (its handler has
 * run or is running); false on timeout. */
bool tl_signal_taken(pid_t, int sig, int timeout_ms);
/* fork(), but the child is killed when the test's process ends (and
 * exits 127 at once if it already has): a failed test must not leave a
 * daemon or a fake server running.  Asserts the fork worked. */
pid_t tl_fork_bound(void);
/* Runs argv (argv[0] a path, NULL-terminated) with stdout and stderr
 * captured into out and err (NUL-terminated, cut to fit; either may be
 * NULL).  Returns the exit status, 128 + signal, or -1 after timeout_ms
 * (the child is then killed). */
int tl_run(const char *const argv[], char *out, size_t outsz, char *err,
    size_t errsz, int timeout_ms);
/* `$OUTBOXD_BIN -c cfg ARGS...` (NULL-terminated) through tl_run; cfg NULL
 * leaves -c out. */
int tl_outboxd_cli(char *out, size_t outsz, char *err, size_t errsz,
    const char *cfg, ...) __attribute__((sentinel));
/* GET http://127.0.0.1:port/path with a raw socket; the body goes to
 * body[size].  Returns the status code, or -1 when the server cannot be
 * reached or answers nonsense. */
int tl_http_get(int port, const char *path, char *body, size_t size);
/* In a /metrics text, the value of the first sample line that starts
 * with `name ` (name may carry labels); NAN when there is none. */
double tl_metric(const char *text, const char *name);
/* Whether key exists in the private Redis (an independent client). */
bool tl_redis_exists(const char *key);
/* SIGSTOP (true) or SIGCONT (false) to the private RabbitMQ: a broker that
 * accepts bytes and never answers.  Unfreezing a running one is a no-op. */
void tl_rabbitmq_freeze(bool);
/* The private RabbitMQ's pid (its pid file), or 0 when there is none. */
pid_t tl_rabbitmq_pid(void);
/* Polls until every thread of pid is stopped; false after timeout_ms. */
bool tl_wait_stopped(pid_t pid, int timeout_ms);
/* Whether something accepts TCP connections on 127.0.0.1:port. */
bool tl_port_open(int port);
/* An int socket option of fd (getsockopt); aborts the test on error. */
int tl_sockopt(int fd, int level, int name);
/* A "Vm…:" field of /proc/PID/status ("VmRSS", "VmHWM") in KiB. */
long tl_proc_kib(pid_t, const char *field);
/* The share of one core pid used over the next window_ms (0.10 = 10 %):
 * the window is the measurement, not a wait for anything. */
double tl_cpu_share(pid_t, int window_ms);
/* A loopback TCP port that nothing is bound to now, from the kernel:
 * for a listener a test starts, so that nothing left from an earlier
 * test or suite can hold it. */
int tl_free_port(void);
/* Starts tests/integration/fake_amqp.py in mode (see its header) on a
 * free port, put in *port, and waits until it listens.  Bound to the
 * test like tl_fork_bound(); SIGKILL and waitpid() it when done. */
pid_t tl_fake_amqp(const char *mode, int *port);

#endif
