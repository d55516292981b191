/* The operator's commands: migrate, status, dead, replay, purge. */
#ifndef OUTBOXD_CLI_H
#define OUTBOXD_CLI_H

#include "config.h"

/* Runs `command` (argv[0]) against the configured database; returns the
 * process exit code: 0 ok, 1 runtime error, 2 usage error. */
int cli_admin(const struct config *, const char *command, int argc,
    char **argv);

#endif
