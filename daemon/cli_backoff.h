/* `outboxd backoff`: prints a retry schedule so operators can see what a
 * backoff configuration does before a row lives through it. */
#ifndef OUTBOXD_CLI_BACKOFF_H
#define OUTBOXD_CLI_BACKOFF_H

/*
 * argv[0] is "backoff"; the options are described by --help.  Needs no
 * config and no server.  Returns the process exit code: 0 ok, 2 usage
 * error.
 */
int cli_backoff(int argc, char **argv);

#endif
