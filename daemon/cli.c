/*
 * The operator's commands.  Each connects with the daemon's own
 * postgres settings, does one thing, prints a result and exits with a
 * code scripts can rely on: 0 ok, 1 runtime error, 2 usage error.
 * Every command is called once without a store (s NULL) to check its
 * arguments first: a usage error is 2 whether PostgreSQL answers or not.
 */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_value.h"
#include "store.h"
#include "util.h"

#define EXIT_RUNTIME 1
#define EXIT_USAGE 2

static int
fail(struct store *s)
{
	fprintf(stderr, "outboxd: %s\n", store_error(s));
	return EXIT_RUNTIME;
}

static int
cmd_migrate(struct store *s, int argc, char **argv)
{
	(void)argv;
	if (argc > 1) {
		fprintf(stderr, "usage: outboxd migrate\n");
		return EXIT_USAGE;
	}
	if (s == NULL)
		return 0;
	if (store_migrate(s) == -1)
		return fail(s);
	printf("schema up to date\n");
	return 0;
}

static int
cmd_status(struct store *s, int argc, char **argv)
{
	struct store_counts c;

	(void)argv;
	if (argc > 1) {
		fprintf(stderr, "usage: outboxd status\n");
		return EXIT_USAGE;
	}
	if (s == NULL)
		return 0;
	if (store_counts(s, true, &c) == -1)
		return fail(s);
	printf("pending:          %" PRId64 "\n", c.pending);
	printf("due now:          %" PRId64 "\n", c.due);
	printf("oldest due age:   %.1fs\n", c.oldest_due_age_s);
	printf("dead:             %" PRId64 "\n", c.dead);
	printf("sent:             %" PRId64 "\n", c.sent);
	return 0;
}

/* A field of the tab-separated table: a tab or line break in it (a
 * broker's or producer's text) would break the row, so it is a space;
 * so are C1 controls (NEL, a line end to some tools; CSI, which a
 * terminal obeys). */
static void
put_field(const char *s, char end)
{
	char *clean = xstrdup(s);

	fputs(str_replace_controls(clean, ' '), stdout);
	free(clean);
	putchar(end);
}

static void
print_dead(const struct dead_row *d, void *arg)
{
	(void)arg;
	printf("%" PRId64 "\t", d->id);
	put_field(*d->exchange_name ? d->exchange_name : "(default)", '\t');
	put_field(d->routing_key, '\t');
	put_field(d->business_key, '\t');
	printf("%d\t", d->retries);
	put_field(d->edit_time, '\t');
	put_field(d->last_error, '\n');
}

/* Digits only: strtol also took " 7" and "+7", and clamped an id too
 * large for a long to LONG_MAX. */
static int
parse_int(const char *s, long min, long max, long *out)
{
	char *end;
	long v;

	if (*s < '0' || *s > '9')
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno != 0 || *end != '\0' || v < min || v > max)
		return -1;
	*out = v;
	return 0;
}

/* The options that pick dead rows, shared by dead and replay. */
#define DEAD_FILTER_OPTIONS \
	{ "exchange", required_argument, NULL, 'x' }, \
	{ "routing-key", required_argument, NULL, 'k' }, \
	{ "error", required_argument, NULL, 'e' }
#define DEAD_FILTER_USAGE \
	"[--exchange NAME] [--routing-key KEY] [--error TEXT]"

/* Whether f picks rows at all (a field is given). */
static bool
filter_given(const struct dead_filter *f)
{
	return f->exchange != NULL || f->routing_key != NULL ||
	    f->error != NULL;
}

/* Takes a filter option into f: 1, or 0 when opt is not one, or -1
 * (said on stderr) for a value that would pick more than was meant: an
 * empty --error is a part of every last_error, and a value that is an
 * option ("--exchange --all") is a slip of the command line. */
static int
take_filter_option(int opt, const char *arg, struct dead_filter *f)
{
	if (opt != 'x' && opt != 'k' && opt != 'e')
		return 0;
	if (strncmp(arg, "--", 2) == 0) {
		fprintf(stderr, "outboxd: '%s' is an option, not the value of "
		    "the one before it\n", arg);
		return -1;
	}
	if (opt == 'e' && *arg == '\0') {
		fputs("outboxd: --error needs some text: an empty one is in "
		    "every last_error\n", stderr);
		return -1;
	}
	if (opt == 'x')
		f->exchange = arg;
	else if (opt == 'k')
		f->routing_key = arg;
	else
		f->error = arg;
	return 1;
}

static int
cmd_dead(struct store *s, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "limit", required_argument, NULL, 'l' },
		DEAD_FILTER_OPTIONS,
		{ NULL, 0, NULL, 0 },
	};
	static const char usage[] = "usage: outboxd dead [--limit N] "
	    DEAD_FILTER_USAGE "\n";
	struct dead_filter filter = { NULL, NULL, NULL };
	long limit = 100;
	int opt, taken;

	optind = 1;
	while ((opt = getopt_long(argc, argv, "l:", opts, NULL)) != -1) {
		if ((taken = take_filter_option(opt, optarg, &filter)) == -1)
			return EXIT_USAGE;
		if (taken == 1)
			continue;
		if (opt != 'l' || parse_int(optarg, 1, 100000, &limit) == -1) {
			fputs(usage, stderr);
			return EXIT_USAGE;
		}
	}
	/* "dead 5" must not quietly list 100 rows. */
	if (optind < argc) {
		fputs(usage, stderr);
		return EXIT_USAGE;
	}
	if (s == NULL)
		return 0;
	printf("id\texchange\trouting_key\tbusiness_key\tattempts\t"
	    "edit_time\tlast_error\n");
	if (store_list_dead(s, (int)limit, &filter, print_dead, NULL) == -1)
		return fail(s);
	return 0;
}

/*
 * replay ID, replay --all, or replay with filters (--all with them too):
 * the rows of one exchange, routing key or error, once its cause is
 * fixed, and not every dead row with them.
 */
static int
cmd_replay(struct store *s, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "all", no_argument, NULL, 'a' },
		DEAD_FILTER_OPTIONS,
		{ NULL, 0, NULL, 0 },
	};
	static const char usage[] = "usage: outboxd replay ID | --all | "
	    DEAD_FILTER_USAGE "\n";
	struct dead_filter filter = { NULL, NULL, NULL };
	bool all = false;
	int64_t n;
	long id = 0;
	int opt, taken;

	optind = 1;
	while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if ((taken = take_filter_option(opt, optarg, &filter)) == -1)
			return EXIT_USAGE;
		if (taken == 1)
			continue;
		if (opt == 'a')
			all = true;
		else {
			fputs(usage, stderr);
			return EXIT_USAGE;
		}
	}
	if (optind + 1 == argc && !all && !filter_given(&filter)) {
		if (parse_int(argv[optind], 1, LONG_MAX, &id) == -1) {
			fprintf(stderr, "outboxd: replay: '%s' is not a row "
			    "id\n", argv[optind]);
			return EXIT_USAGE;
		}
	} else if (optind < argc || (!all && !filter_given(&filter))) {
		/* Nothing named, or an id with --all or a filter. */
		fputs(usage, stderr);
		return EXIT_USAGE;
	}
	if (s == NULL)
		return 0;
	if (store_replay_dead(s, id, &filter, &n) == -1)
		return fail(s);
	printf("%" PRId64 " row%s replayed\n", n, n == 1 ? "" : "s");
	/* Asking for one id that is not dead is worth a non-zero exit. */
	return (id != 0 && n == 0) ? EXIT_RUNTIME : 0;
}

#define PURGE_CHUNK 5000

static int
cmd_purge(struct store *s, int argc, char **argv)
{
	int64_t age, n, total = 0, started = now_mono_ms();
	/* Rows the database refuses to delete (an application table still
	 * references them): left out, so that the rest goes. */
	struct store_skip skip = { .n = 0 };
	char why[sizeof(skip.why)] = "";

	/* A unit is required, as in the config: a bare 30 read as 30 ms
	 * would purge every sent row; so would 0, which in relay.retention
	 * means keep them all.  At most relay.retention's longest:
	 * PostgreSQL refused an age far beyond it (out of range), which
	 * made a usage slip exit 1. */
	if (argc != 3 || strcmp(argv[1], "--older-than") != 0 ||
	    config_parse_duration(argv[2], &age) != 0 || age <= 0 ||
	    age > CONFIG_RETENTION_MAX_MS) {
		fprintf(stderr, "usage: outboxd purge --older-than DURATION "
		    "(with a unit: 7d, 12h, 30m; more than 0, at most "
		    "3650d)\n");
		return EXIT_USAGE;
	}
	if (s == NULL)
		return 0;
	/* Chunks keep each transaction, and its locks, short.  The cutoff
	 * stays where it was at the start (the age grows with the time
	 * taken), and a chunk that is not full was the last: counted from
	 * each chunk's now(), the cutoff moved on, and on a busy outbox
	 * every chunk found the rows sent meanwhile, without end. */
	do {
		if (store_purge_sent(s, age + (now_mono_ms() - started),
		    PURGE_CHUNK, 0, &skip, &n) == -1)
			return fail(s);
		total += n;
		if (skip.refused > 0 && why[0] == '\0')
			snprintf(why, sizeof(why), "%s", skip.why);
	} while (n > 0 && n + (int64_t)skip.refused == PURGE_CHUNK);
	printf("%" PRId64 " sent row%s purged\n", total, total == 1 ? "" :
	    "s");
	/* Each refused row is in the list once, whichever chunk met it. */
	if (skip.n > 0)
		fprintf(stderr, "%zu sent row%s refused to the purge, left: "
		    "%s\n", skip.n, skip.n == 1 ? "" : "s", why);
	if (skip.n == ARRAY_LEN(skip.ids))
		fprintf(stderr, "the purge stopped there: more rows may be "
		    "refused, and the sent rows behind them were not purged\n");
	return skip.n > 0 ? 1 : 0;
}

/* writes: the command needs a server that takes writes.  With several
 * hosts in postgres.conninfo (a failover pair), libpq then skips a
 * standby; the others read a standby as well. */
static const struct {
	const char *name;
	int (*fn)(struct store *, int, char **);
	bool writes;
} commands[] = {
	{ "migrate", cmd_migrate, true },
	{ "status", cmd_status, false },
	{ "dead", cmd_dead, false },
	{ "replay", cmd_replay, true },
	{ "purge", cmd_purge, true },
};

int
cli_admin(const struct config *cfg, const char *command, int argc,
    char **argv)
{
	struct store_conf conf = cfg->store;
	struct store *s;
	int rc;

	for (size_t i = 0; i < ARRAY_LEN(commands); i++) {
		if (strcmp(command, commands[i].name) != 0)
			continue;
		rc = commands[i].fn(NULL, argc, argv);
		if (rc != 0)
			return rc;
		conf.read_write = commands[i].writes;
		s = store_new(&conf);
		if (store_connect(s) == -1)
			rc = fail(s);
		else
			rc = commands[i].fn(s, argc, argv);
		store_free(s);
		return rc;
	}
	fprintf(stderr, "outboxd: unknown command '%s' (see outboxd -h)\n",
	    command);
	return EXIT_USAGE;
}
