/*
 * The operator's commands.  Each connects with the daemon's own
 * postgres settings, does one thing, prints a result and exits.
 */
#include "cli.h"

#include <stdio.h>
#include <string.h>

#include "store.h"

static int
cmd_migrate(struct store *s)
{
	if (store_migrate(s) == -1) {
		fprintf(stderr, "outboxd: %s\n", store_error(s));
		return 1;
	}
	printf("schema up to date\n");
	return 0;
}

int
cli_admin(const struct config *cfg, const char *command, int argc,
    char **argv)
{
	struct store *s;
	int rc;

	(void)argc;
	(void)argv;
	if (strcmp(command, "migrate") != 0) {
		fprintf(stderr, "outboxd: unknown command '%s' (see outboxd "
		    "-h)\n", command);
		return 2;
	}
	s = store_new(&cfg->store);
	if (store_connect(s) == -1) {
		fprintf(stderr, "outboxd: %s\n", store_error(s));
		store_free(s);
		return 1;
	}
	rc = cmd_migrate(s);
	store_free(s);
	return rc;
}
