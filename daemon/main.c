/*
 * outboxd: command line, signals and the daemon's lifecycle.  Signal
 * handlers only set flags; the main loop acts on them between steps.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "cli.h"
#include "cli_backoff.h"
#include "config.h"
#include "log.h"
#include "relay.h"

#define DEFAULT_CONFIG "/etc/outboxd/outboxd.yml"

static volatile sig_atomic_t stop_requested;
static volatile sig_atomic_t reload_requested;

static void
on_stop(int sig)
{
	(void)sig;
	/* A second signal means "now": skip the graceful path. */
	if (stop_requested)
		_exit(1);
	stop_requested = 1;
}

static void
on_reload(int sig)
{
	(void)sig;
	reload_requested = 1;
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
	sa.sa_handler = SIG_IGN;
	sigaction(SIGPIPE, &sa, NULL);
}

static void
usage(FILE *out)
{
	fprintf(out,
	    "usage: outboxd [-c FILE] COMMAND [ARGS]\n"
	    "\n"
	    "Relays rows of a PostgreSQL outbox table to RabbitMQ with\n"
	    "publisher confirms.\n"
	    "\n"
	    "commands:\n"
	    "  run              run the daemon in the foreground (default)\n"
	    "  check            check the config; print \"configuration OK\"\n"
	    "  migrate          apply the schema (sql/ migrations)\n"
	    "  status           rows per state, oldest due age, dead count\n"
	    "  dead [--limit N] list dead rows with their last error\n"
	    "  replay ID|--all  make dead rows due again (retries reset)\n"
	    "  purge --older-than DURATION   delete sent rows\n"
	    "  backoff [...]    print a backoff schedule (backoff --help)\n"
	    "  version          print the version\n"
	    "\n"
	    "options:\n"
	    "  -c FILE   config file (default " DEFAULT_CONFIG ")\n"
	    "  -n        check the config and exit (same as `check`)\n"
	    "  -h        this help\n"
	    "\n"
	    "exit codes: 0 ok, 1 runtime error, 2 usage or config error\n");
}

/* Loads the config or prints every error; returns 0 or -1. */
static int
load_config(struct config *cfg, const char *path)
{
	config_defaults(cfg);
	if (config_load(cfg, path, stderr) == -1) {
		config_free(cfg);
		return -1;
	}
	return 0;
}

static void
reload(struct config *cfg, struct relay *relay)
{
	struct config fresh;

	sd_notify(0, "RELOADING=1");
	config_defaults(&fresh);
	if (config_load(&fresh, cfg->path, stderr) == -1) {
		log_error("reload failed, keeping the old config",
		    "path=%s", cfg->path);
		config_free(&fresh);
	} else {
		/* Keys that need a restart keep their old values. */
		config_reload_check(cfg, &fresh, stderr);
		config_apply_reloadable(cfg, &fresh);
		config_free(&fresh);
		log_set_level(cfg->log_level);
		relay_set_conf(relay, &cfg->relay);
		log_info("config reloaded", "path=%s", cfg->path);
	}
	sd_notify(0, "READY=1");
}

static int
run_daemon(struct config *cfg)
{
	struct store *store = store_new(&cfg->store);
	struct broker *broker = broker_new(&cfg->broker);
	struct relay *relay = relay_new(&cfg->relay, store, broker);
	uint64_t watchdog_us = 0;
	bool ready = false;

	install_signals();
	if (sd_watchdog_enabled(0, &watchdog_us) <= 0)
		watchdog_us = 0;
	log_info("outboxd starting", "version=%s config=%s", OUTBOXD_VERSION,
	    cfg->path);
	while (!stop_requested) {
		if (reload_requested) {
			reload_requested = 0;
			reload(cfg, relay);
		}
		/* Wake at least twice per watchdog period. */
		relay_step(relay, watchdog_us ? (int64_t)watchdog_us / 2000 :
		    1000);
		if (!ready && relay_store_up(relay) && relay_broker_up(relay)) {
			ready = true;
			sd_notify(0, "READY=1\nSTATUS=relaying");
			log_info("outboxd ready", NULL);
		}
		if (watchdog_us)
			sd_notify(0, "WATCHDOG=1");
	}
	sd_notify(0, "STOPPING=1");
	log_info("outboxd stopping", "published=%" PRIu64 " failed=%" PRIu64
	    " dead=%" PRIu64, relay_stats(relay)->published,
	    relay_stats(relay)->retried, relay_stats(relay)->dead);
	relay_free(relay);
	broker_free(broker);
	store_free(store);
	return 0;
}

int
main(int argc, char **argv)
{
	const char *path = getenv("OUTBOXD_CONFIG");
	const char *command = "run";
	struct config cfg;
	int opt, rc;

	if (path == NULL)
		path = DEFAULT_CONFIG;
	/* '+' stops at the command so its own options pass through. */
	while ((opt = getopt(argc, argv, "+c:nhV")) != -1) {
		switch (opt) {
		case 'c':
			path = optarg;
			break;
		case 'n':
			command = "check";
			break;
		case 'V':
			command = "version";
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc)
		command = argv[optind];
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
		return config_check_file(path, stdout) == 0 ? 0 : 2;
	if (load_config(&cfg, path) == -1)
		return 2;
	log_set_level(cfg.log_level);
	if (strcmp(command, "run") == 0)
		rc = run_daemon(&cfg);
	else
		rc = cli_admin(&cfg, command, argc - optind, argv + optind);
	config_free(&cfg);
	return rc;
}
