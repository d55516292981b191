/*
 * outboxd: command line, signals and the daemon's lifecycle.  Signal
 * handlers only set flags; the main loop acts on them between steps.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "cli.h"
#include "cli_backoff.h"
#include "config.h"
#include "http.h"
#include "leader.h"
#include "log.h"
#include "metrics.h"
#include "relay.h"
#include "refused.h"
#include "suspects.h"
#include "workers.h"

#define DEFAULT_CONFIG "/etc/outboxd/outboxd.yml"

static volatile sig_atomic_t stop_requested;
static volatile sig_atomic_t reload_requested;
/* Until `outboxd run` has read its config a stop has nothing to finish
 * (and the read of a FIFO may never end): it exits at once. */
static volatile sig_atomic_t config_read;
/* An eventfd the handlers write: the main relay's waits end on it.  A
 * flag alone was seen only if the signal cut a poll() short; one that
 * came during a claim, a mark or a connect waited for the next wait to
 * run out (up to a second). */
static volatile sig_atomic_t signal_wake_fd = -1;

/* Async-signal-safe; keeps errno for the code the signal interrupted. */
static void
wake_main_relay(void)
{
	const uint64_t one = 1;
	int saved = errno;

	if (signal_wake_fd >= 0)
		(void)!write(signal_wake_fd, &one, sizeof(one));
	errno = saved;
}

/* Reads the handlers' wake-ups, once acted on: left readable, they
 * would end every later wait at once. */
static void
drain_wakes(void)
{
	uint64_t n;

	if (signal_wake_fd >= 0)
		(void)!read(signal_wake_fd, &n, sizeof(n));
}

static void
close_wakes(void)
{
	int fd = signal_wake_fd;

	signal_wake_fd = -1;
	if (fd >= 0)
		close(fd);
}
/* relay.shutdown_timeout in whole seconds, for the handler's alarm(). */
static volatile sig_atomic_t shutdown_timeout_s;
/* Set once every relay's last batch has ended and the workers are
 * joined.  Atomic: SIGALRM may be taken by the HTTP thread. */
static atomic_bool batches_settled;
_Static_assert(ATOMIC_BOOL_LOCK_FREE == 2, "read in a signal handler");
/* The worker relays, told of a stop by the handler itself: the main
 * loop sees the stop only once its own batch is done, and until then
 * the workers claimed new batches, which could outlast
 * relay.shutdown_timeout (its rows then sent again). */
static _Atomic(struct workers *) signal_workers;
_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2, "read in a signal handler");

static void
on_stop(int sig)
{
	(void)sig;
	if (!config_read) {
		log_from_signal_handler(LOG_INFO, "msg=\"outboxd stopped "
		    "before its config was read\"");
		_exit(0);
	}
	/* A second signal means "now": skip the graceful path, and say
	 * so (an exit 1 with no word sent on-call looking for a cause). */
	if (stop_requested) {
		log_from_signal_handler(LOG_ERROR, "msg=\"second stop signal: "
		    "exiting at once with batches unfinished\" hint=\"their "
		    "rows stay due and are sent again\"");
		_exit(1);
	}
	stop_requested = 1;
	workers_ask_to_stop(atomic_load(&signal_workers));
	/* If the batch in flight cannot finish in time, SIGALRM ends the
	 * process (on_shutdown_timeout): its rows stay due and are sent
	 * again later. */
	if (shutdown_timeout_s > 0)
		alarm((unsigned)shutdown_timeout_s);
	wake_main_relay();
}

/*
 * relay.shutdown_timeout ran out.  A handler, not SIGALRM's default
 * action: the kernel drops default-action signals sent to PID 1, so in a
 * container (the image's outboxd is PID 1) the deadline did nothing and
 * the stop waited for docker's SIGKILL; and where it did end the process,
 * the log had no word of why.
 */
static void
on_shutdown_timeout(int sig)
{
	(void)sig;
	/* Every batch ended, what is left is to say goodbye (the Redis
	 * key, the connections' polite closes): no batch is cut short, so
	 * not the failure systemd would mark the unit with. */
	if (atomic_load(&batches_settled)) {
		log_from_signal_handler(LOG_WARN, "msg=\"shutdown timeout "
		    "reached after every batch ended: exiting without closing "
		    "the connections\" hint=\"the leader key, if still held, "
		    "expires after redis.ttl\"");
		_exit(0);
	}
	log_from_signal_handler(LOG_ERROR, "msg=\"shutdown timeout reached: "
	    "exiting with batches unfinished\" hint=\"their rows stay due and "
	    "are sent again; raise relay.shutdown_timeout if confirms are "
	    "slow\"");
	_exit(1);
}

static void
on_reload(int sig)
{
	(void)sig;
	reload_requested = 1;
	wake_main_relay();
}

static void
install_signals(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sigemptyset(&sa.sa_mask);
	/* No SA_RESTART: a signal must cut poll() waits short. */
	sa.sa_handler = on_stop;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sa.sa_handler = on_reload;
	sigaction(SIGHUP, &sa, NULL);
	sa.sa_handler = on_shutdown_timeout;
	sigaction(SIGALRM, &sa, NULL);
	sa.sa_handler = SIG_IGN;
	sigaction(SIGPIPE, &sa, NULL);
	/* PID 1 in a container adopts every orphan there (a health check's
	 * pipeline cut short by `timeout`, a `docker exec` left behind),
	 * and outboxd never waits for a child: they stayed zombies, each
	 * holding a PID of the container's limit.  Ignored SIGCHLD has the
	 * kernel reap them; outboxd starts no process of its own. */
	if (getpid() == 1)
		sigaction(SIGCHLD, &sa, NULL);
}

/*
 * glibc's resolver waits 5 s for each nameserver and goes round them
 * twice: with three that do not answer, one lookup took 28 s.  libpq,
 * rabbitmq-c and hiredis resolve with it on the thread that connects,
 * so the main loop stood still past the 30 s watchdog and the shutdown
 * timeout.  Unless RES_OPTIONS is set (empty keeps resolv.conf's own
 * options), each query now waits 1 s and is sent twice: 6 s with three
 * nameservers.  Before any thread and lookup: each thread's resolver
 * reads it when it starts.
 */
static void
bound_dns_lookups(void)
{
	(void)setenv("RES_OPTIONS", "timeout:1 attempts:2", 0);
}

static void
usage(FILE *out)
{
	fprintf(out,
	    "usage: outboxd [-c FILE] [COMMAND [ARGS]]\n"
	    "\n"
	    "Relays rows of a PostgreSQL outbox table to RabbitMQ with\n"
	    "publisher confirms.\n"
	    "\n"
	    "commands:\n"
	    "  run              run the daemon in the foreground (default)\n"
	    "  check            check the config; print \"configuration OK\"\n"
	    "  config           print the config in effect, defaults filled\n"
	    "                   in, secrets hidden\n"
	    "  migrate          apply the schema (sql/ migrations)\n"
	    "  status           rows per state, oldest due age, dead count\n"
	    "  dead [--limit N] [FILTER]\n"
	    "                   list dead rows with their last error\n"
	    "  replay ID | --all | FILTER\n"
	    "                   make dead rows due again (retries reset)\n"
	    "                   FILTER: --exchange NAME, --routing-key KEY,\n"
	    "                   --error TEXT (a part of last_error)\n"
	    "  purge --older-than DURATION   delete sent rows\n"
	    "  backoff [...]    print a backoff schedule (backoff --help)\n"
	    "  version          print the version\n"
	    "\n"
	    "options:\n"
	    "  -c, --config FILE  config file (default: $OUTBOXD_CONFIG,\n"
	    "                     else " DEFAULT_CONFIG ")\n"
	    "  -n                 check the config and exit (same as `check`)\n"
	    "  -h, --help         this help\n"
	    "  -V, --version      print the version\n"
	    "\n"
	    "exit codes: 0 ok, 1 runtime error (or a password file that does\n"
	    "not exist yet), 2 usage or config error\n");
}

/* Loads the config or prints every error; returns 0 or -1.  Into the
 * journal they go as log lines, so that they are stored as errors: the
 * reason a service did not start must show with `journalctl -p err`. */
static int
load_config(struct config *cfg, const char *path)
{
	int rc;

	config_defaults(cfg);
	rc = config_load(cfg, path, log_journal() ? NULL : stderr);
	if (rc != 0)
		config_free(cfg);
	return rc;
}

/* The exit status for a config that did not load: 2, a usage or config
 * error, which the unit does not restart; but 1 for password files that
 * are not there yet (a secrets agent still starting): a start again,
 * RestartSec later, may find them. */
static int
config_exit_status(int load_rc)
{
	if (load_rc != CONFIG_SECRET_ABSENT)
		return 2;
	log_error("password file missing", "exit_status=1 hint=%s",
	    log_quote((char[200]){ 0 }, 200, "it may not be written yet; a "
	    "service manager may start outboxd again"));
	return 1;
}

/* What the daemon is made of; main owns them all. */
/* Rows whose message was in flight at a lost connection, remembered at
 * once: two full batches for each of four relays, and a table that
 * stays untouched memory until a loss writes it. */
#define SUSPECTS_CAP 8192
/* Rows whose marks are refused, left out of claims (refused.h); each
 * claim sends at most STORE_SKIP_MAX of them. */
#define REFUSED_CAP STORE_SKIP_MAX

struct daemon {
	struct config *cfg;
	struct store *store;
	struct store *store2;		/* relay.pipeline's second session */
	struct broker *broker;
	struct relay *relay;		/* the main thread's own */
	struct suspects *suspects;	/* every relay's (suspects.h) */
	struct refused *refused;	/* every relay's (refused.h) */
	struct workers *workers;	/* relay.workers - 1 more */
	struct leader *leader;
	struct http *http;
	int64_t stall_limit_ms;		/* config_longest_step_ms() */
	uint64_t redis_reconnects;	/* counted in metrics so far */
	char status[160];		/* the last STATUS= sent to systemd */
};

/*
 * /healthz's verdict, and the same words for `systemctl status` (the
 * unit's STATUS=), sent when they change: an operator at the service
 * sees "postgres unreachable" there, not the "relaying" of start-up.
 */
static void
set_health(struct daemon *d, bool healthy, const char *reason)
{
	bool standby = d->cfg->relay.mode == RELAY_SINGLE_ACTIVE &&
	    !leader_is_leader(d->leader);
	const char *status = !healthy ? reason : standby ? "standing by: "
	    "another instance leads (single-active)" : "relaying";
	char line[sizeof(d->status) + 8];

	metrics_set_health(healthy, reason);
	if (strcmp(status, d->status) == 0)
		return;
	snprintf(d->status, sizeof(d->status), "%s", status);
	snprintf(line, sizeof(line), "STATUS=%s", status);
	sd_notify(0, line);
}

static void
reload(struct daemon *d, bool ready)
{
	struct config *cfg = d->cfg;
	struct config fresh;

	sd_notify(0, "RELOADING=1");
	config_defaults(&fresh);
	if (config_load_again(&fresh, cfg->path, NULL) != 0) {
		log_error("reload failed, keeping the old config",
		    "path=%s", log_quote((char[600]){ 0 }, 600, cfg->path));
	} else {
		/* Keys that need a restart keep their old values. */
		(void)config_reload_check(cfg, &fresh, NULL);
		config_apply_reloadable(cfg, &fresh);
		log_set_level(cfg->log_level);
		shutdown_timeout_s = (sig_atomic_t)((cfg->relay.
		    shutdown_timeout_ms + 999) / 1000);
		relay_set_conf(d->relay, &cfg->relay);
		workers_set_conf(d->workers, &cfg->relay);
		leader_set_conf(d->leader, &cfg->relay);
		log_info("config reloaded", "path=%s",
		    log_quote((char[600]){ 0 }, 600, cfg->path));
	}
	config_free(&fresh);
	/* Not ready yet (the servers have not answered): READY=1 comes
	 * when they do, and would tell systemd the start is done now. */
	if (ready)
		sd_notify(0, "READY=1");
}

/* Publishes connection, leader and row state to metrics and health. */
static void
report_state(struct daemon *d)
{
	const struct leader_gauges *g = leader_gauges(d->leader);
	bool pg = relay_store_up(d->relay), amqp = relay_broker_up(d->relay);
	int blocked = (relay_blocked_ms(d->relay) > 0) +
	    workers_count(d->workers, WORKER_BLOCKED);

	metrics_set_connection(METRICS_SERVER_POSTGRES, pg);
	metrics_set_connection(METRICS_SERVER_RABBITMQ, amqp);
	metrics_set_connection(METRICS_SERVER_REDIS,
	    leader_redis_up(d->leader));
	for (uint64_t n = leader_redis_reconnects(d->leader);
	    d->redis_reconnects < n; d->redis_reconnects++)
		metrics_inc_reconnect(METRICS_SERVER_REDIS);
	metrics_set_relays((unsigned)((pg && amqp ? 1 : 0) +
	    workers_count(d->workers, WORKER_CONNECTED)),
	    (unsigned)blocked,
	    (unsigned)d->cfg->relay.workers);
	metrics_set_leader(leader_is_leader(d->leader),
	    (enum metrics_backend)leader_backend(d->leader));
	/* Only the leader counts rows.  An instance that stopped leading
	 * shows 0, not its last count: alerts take max() over instances,
	 * and a frozen count fired them long after a replay. */
	if (!leader_is_leader(d->leader))
		metrics_set_rows(0, 0, 0, 0, 0);
	else if (g->valid)
		metrics_set_rows((uint64_t)g->counts.pending,
		    (uint64_t)g->counts.due, (uint64_t)g->counts.dead,
		    g->counts.oldest_due_age_s, g->counted_at_s);
	if (!pg)
		set_health(d, false, "postgres unreachable");
	else if (!amqp)
		set_health(d, false, "rabbitmq unreachable");
	else if (workers_stalled_ms(d->workers) > d->stall_limit_ms)
		set_health(d, false, "stalled: a relay worker has not "
		    "reported");
	else if (blocked > 0)
		set_health(d, false, "blocked: rabbitmq blocks publishing "
		    "(a memory or disk alarm; see the log)");
	else if (relay_failing_ms(d->relay) > 0 ||
	    workers_count(d->workers, WORKER_FAILING) > 0)
		set_health(d, false, "failing: claims or marks fail on "
		    "postgres (see the log)");
	else
		set_health(d, true, "");
}

/* One turn of the main loop: leadership, then relaying or standing by. */
static void
daemon_step(struct daemon *d, int64_t max_wait_ms)
{
	bool leader = leader_tick(d->leader);
	bool single = d->cfg->relay.mode == RELAY_SINGLE_ACTIVE;
	int64_t next = leader_next_tick_ms(d->leader);

	if (next < max_wait_ms)
		max_wait_ms = next;
	/* The leader also retries FAIL rows; other instances relay new
	 * rows only (parallel) or stand by (single-active). */
	relay_set_retries(d->relay, leader || single);
	workers_set_role(d->workers, leader || single, !single || leader);
	if (!single || leader) {
		if (relay_step(d->relay, max_wait_ms))
			workers_kick(d->workers);
	} else
		relay_standby(d->relay, max_wait_ms);
	report_state(d);
}

static int
run_daemon(struct config *cfg)
{
	struct daemon d = { .cfg = cfg };
	char err[256];
	uint64_t watchdog_us = 0;
	struct relay_stats totals;
	sigset_t main_only, mask;
	bool ready = false;

	metrics_init(OUTBOXD_VERSION);
	d.stall_limit_ms = config_longest_step_ms(cfg);
	metrics_set_stall_limit(d.stall_limit_ms);
	/* The endpoint's thread inherits this mask: with SIGTERM and SIGHUP
	 * blocked there, they reach the main thread, whose poll() they cut
	 * short (on the HTTP thread they waited for its next wake-up). */
	sigemptyset(&main_only);
	sigaddset(&main_only, SIGTERM);
	sigaddset(&main_only, SIGINT);
	sigaddset(&main_only, SIGHUP);
	pthread_sigmask(SIG_BLOCK, &main_only, &mask);
	d.http = http_start(&cfg->http, err, sizeof(err));
	pthread_sigmask(SIG_SETMASK, &mask, NULL);
	if (d.http == NULL) {
		log_error("cannot start the http endpoint", "error=%s",
		    log_quote((char[300]){ 0 }, 300, err));
		return 1;
	}
	/* A batch's transaction idles while its confirms are awaited: give
	 * it that long and a margin before the server may end it.  A batch
	 * with suspects is sent in parts, which take up to two waits (see
	 * side_publish in relay.c).  A pipelined relay claims the next
	 * batch while the current one is awaited: one wait more. */
	cfg->store.idle_in_transaction_timeout_ms =
	    cfg->broker.confirm_timeout_ms * (cfg->relay.pipeline ? 3 : 2) +
	    30000;
	/* Plans that hold up whatever the statistics say (store.c). */
	cfg->store.index_plans = true;
	cfg->store.read_write = true;
	d.store = store_new(&cfg->store);
	d.store2 = cfg->relay.pipeline ? store_new(&cfg->store) : NULL;
	d.broker = broker_new(&cfg->broker);
	d.suspects = suspects_new(SUSPECTS_CAP);
	d.refused = refused_new(REFUSED_CAP);
	d.relay = relay_new(&cfg->relay, d.store, d.store2, d.broker,
	    d.suspects, d.refused);
	d.leader = leader_new(&cfg->lock, &cfg->relay, d.store);
	shutdown_timeout_s = (sig_atomic_t)((cfg->relay.shutdown_timeout_ms +
	    999) / 1000);
	/* A stop that came since the config was read had no deadline. */
	if (stop_requested && shutdown_timeout_s > 0)
		alarm((unsigned)shutdown_timeout_s);
	signal_wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (signal_wake_fd == -1)	/* signals then act at a wait's end */
		log_warn("no eventfd for signals", "error=%s",
		    log_quote((char[128]){ 0 }, 128, strerror(errno)));
	relay_set_wake_fd(d.relay, signal_wake_fd);
	d.workers = workers_start(cfg->relay.workers - 1,
	    cfg->relay.mode == RELAY_PARALLEL, &cfg->relay, &cfg->store,
	    &cfg->broker, d.suspects, d.refused, err, sizeof(err));
	if (d.workers == NULL) {
		log_error("cannot start", "error=%s",
		    log_quote((char[300]){ 0 }, 300, err));
		leader_free(d.leader);
		relay_free(d.relay);
		suspects_free(d.suspects);
		refused_free(d.refused);
		broker_free(d.broker);
		store_free(d.store2);
		store_free(d.store);
		http_stop(d.http);
		close_wakes();
		return 1;
	}
	atomic_store(&signal_workers, d.workers);
	if (stop_requested)	/* a stop before the workers were known */
		workers_ask_to_stop(d.workers);
	if (sd_watchdog_enabled(0, &watchdog_us) <= 0)
		watchdog_us = 0;
	log_info("outboxd starting", "version=%s config=%s mode=%s "
	    "workers=%d", OUTBOXD_VERSION,
	    log_quote((char[600]){ 0 }, 600, cfg->path), cfg->relay.mode ==
	    RELAY_PARALLEL ? "parallel" : "single-active", cfg->relay.workers);
	/* The loop pings only between steps: a step its timeouts allow,
	 * longer than WatchdogSec=, gets a healthy daemon killed (the unit
	 * once had 30 s, and the defaults allow 32). */
	if (watchdog_us > 0 && (int64_t)(watchdog_us / 1000) <=
	    d.stall_limit_ms)
		log_warn("systemd watchdog shorter than outboxd's longest "
		    "step", "watchdog_ms=%" PRId64 " longest_step_ms=%" PRId64
		    " hint=\"set WatchdogSec= to more than %" PRId64 "s, or "
		    "lower rabbitmq.confirm_timeout or the connect "
		    "timeouts\"", (int64_t)(watchdog_us / 1000),
		    d.stall_limit_ms, d.stall_limit_ms / 1000);
	while (!stop_requested) {
		if (reload_requested) {
			reload_requested = 0;
			drain_wakes();
			reload(&d, ready);
			continue;	/* a stop that came meanwhile */
		}
		/* Wake at least twice per watchdog period. */
		daemon_step(&d, watchdog_us ? (int64_t)watchdog_us / 2000 :
		    1000);
		if (!ready && relay_store_up(d.relay) &&
		    relay_broker_up(d.relay)) {
			ready = true;
			sd_notify(0, "READY=1");
			log_info("outboxd ready", NULL);
		}
		/* A worker stuck as long as the watchdog allows the main
		 * loop is a stuck daemon: let systemd restart it. */
		if (watchdog_us && workers_stalled_ms(d.workers) <
		    (int64_t)watchdog_us / 1000)
			sd_notify(0, "WATCHDOG=1");
	}
	/* The batch in flight finished inside relay_step (its confirms
	 * awaited, its rows marked); what is left is to let go. */
	sd_notify(0, "STOPPING=1");
	totals = *relay_stats(d.relay);
	/* Any signal from here on ends the process at once (on_stop). */
	atomic_store(&signal_workers, NULL);
	/* Every batch settled before the goodbyes, which can take a while
	 * (a polite close waits up to a second per connection): the alarm
	 * then cuts only those short (on_shutdown_timeout). */
	workers_join(d.workers, &totals);
	atomic_store(&batches_settled, true);
	leader_release(d.leader);
	workers_stop(d.workers, NULL);
	log_info("outboxd stopped", "published=%" PRIu64 " failed=%" PRIu64
	    " dead=%" PRIu64, totals.published, totals.retried, totals.dead);
	leader_free(d.leader);
	relay_free(d.relay);
	suspects_free(d.suspects);
	refused_free(d.refused);
	broker_free(d.broker);
	store_free(d.store2);
	store_free(d.store);
	http_stop(d.http);
	close_wakes();
	return 0;
}

/*
 * `outboxd check -c FILE` and `outboxd run -c FILE` are documented (and
 * `make run` uses them), but getopt stops at the command: take "-c FILE"
 * (or "--config FILE", "--config=FILE") out of the command's own
 * arguments too.  Returns the new argc, or -1 when the file name is
 * missing.
 */
static int
take_config_option(int argc, char **argv, const char **path)
{
	static const char long_eq[] = "--config=";
	int n = 1;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--") == 0) {
			while (i < argc)
				argv[n++] = argv[i++];
			break;
		}
		if (strncmp(argv[i], long_eq, sizeof(long_eq) - 1) == 0) {
			*path = argv[i] + sizeof(long_eq) - 1;
			continue;
		}
		if (strcmp(argv[i], "-c") == 0 ||
		    strcmp(argv[i], "--config") == 0) {
			if (i + 1 == argc) {
				fprintf(stderr, "outboxd: %s needs a FILE\n",
				    argv[i]);
				return -1;
			}
			*path = argv[++i];
			continue;
		}
		argv[n++] = argv[i];
	}
	argv[n] = NULL;
	return n;
}

static int
run_command(int argc, char **argv)
{
	const char *path = getenv("OUTBOXD_CONFIG");
	static const struct option long_options[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	const char *command = "run";
	struct config cfg;
	sigset_t hup, mask;
	bool daemon;
	int opt, rc, load_rc;

	bound_dns_lookups();
	(void)log_detect_journal();
	if (path == NULL)
		path = DEFAULT_CONFIG;
	/* '+' stops at the command so its own options pass through. */
	while ((opt = getopt_long(argc, argv, "+c:nhV", long_options,
	    NULL)) != -1) {
		switch (opt) {
		case 'c':
			path = optarg;
			break;
		case 'n':
		case 'V':
			/* -n -V: one of the two would be ignored (the last
			 * won: -n -V checked nothing, and said nothing). */
			if (strcmp(command, "run") != 0 &&
			    strcmp(command, opt == 'n' ? "check" : "version") !=
			    0) {
				fprintf(stderr, "outboxd: -n and -V cannot go "
				    "together\n");
				return 2;
			}
			command = opt == 'n' ? "check" : "version";
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		/* -n is `check` and -V `version`: with another command after
		 * it, one of the two would be ignored (it was the option: the
		 * daemon ran, or `-V migrate` migrated). */
		if (strcmp(command, "run") != 0 &&
		    strcmp(argv[optind], command) != 0) {
			fprintf(stderr, "outboxd: %s cannot go with '%s'\n",
			    strcmp(command, "check") == 0 ? "-n checks the "
			    "config; it" : "-V prints the version; it",
			    argv[optind]);
			return 2;
		}
		command = argv[optind];
		if (strcmp(command, "backoff") != 0) {
			int left = take_config_option(argc - optind,
			    argv + optind, &path);

			if (left == -1)
				return 2;
			argc = optind + left;
		}
	}
	/* These take nothing after them: `check other.yml` checked the
	 * default file and said "configuration OK" of it. */
	if (argc - optind > 1 && (strcmp(command, "help") == 0 ||
	    strcmp(command, "version") == 0 || strcmp(command, "check") == 0 ||
	    strcmp(command, "config") == 0 || strcmp(command, "run") == 0)) {
		fprintf(stderr, "outboxd: '%s' takes no arguments (got '%s'); "
		    "give the config file with -c FILE\n", command,
		    argv[optind + 1]);
		return 2;
	}
	if (strcmp(command, "help") == 0) {
		usage(stdout);
		return 0;
	}
	if (strcmp(command, "version") == 0) {
		printf("outboxd %s\n", OUTBOXD_VERSION);
		return 0;
	}
	if (strcmp(command, "backoff") == 0)
		return cli_backoff(argc - optind, argv + optind);
	if (strcmp(command, "check") == 0)
		/* Into the journal (ExecReload) as error lines, as run's. */
		return config_check_file(path, stdout, log_journal() ? NULL :
		    stderr) == 0 ? 0 : 2;
	/* A daemon's handlers before anything it does: a SIGHUP (a reload
	 * soon after a start) or a SIGTERM in the milliseconds it takes to
	 * read the config and start up ended the process by the default
	 * action, or, for PID 1 in a container, was dropped.  Now a stop
	 * that early stops it (on_stop), and a SIGHUP waits, blocked, for
	 * the config to be read (no read cut short), then reloads it. */
	daemon = strcmp(command, "run") == 0;
	if (daemon) {
		sigemptyset(&hup);
		sigaddset(&hup, SIGHUP);
		install_signals();
		sigprocmask(SIG_BLOCK, &hup, &mask);
	}
	load_rc = load_config(&cfg, path);
	if (daemon) {
		config_read = load_rc == 0;
		sigprocmask(SIG_SETMASK, &mask, NULL);
	}
	if (load_rc != 0)
		return config_exit_status(load_rc);
	if (strcmp(command, "config") == 0) {
		config_dump(&cfg, stdout);
		config_free(&cfg);
		return 0;
	}
	log_set_level(cfg.log_level);
	if (daemon)
		rc = run_daemon(&cfg);
	else
		rc = cli_admin(&cfg, command, argc - optind, argv + optind);
	config_free(&cfg);
	return rc;
}

/* A listing cut short is no success: `outboxd dead > dead.tsv` on a
 * full disk exited 0, and so did every command but `config`. */
int
main(int argc, char **argv)
{
	int rc = run_command(argc, argv);

	if (fflush(stdout) != 0 || ferror(stdout)) {
		fprintf(stderr, "outboxd: cannot write the output: %s\n",
		    strerror(errno));
		return rc == 0 ? 1 : rc;
	}
	return rc;
}
