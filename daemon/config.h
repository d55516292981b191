/*
 * Config: reads config/outboxd.yml (libyaml) into a validated struct
 * config.  One table drives parsing, defaults, bounds and reloadability;
 * every error is reported as path:line:col: message.  Only the config
 * module's files include yaml.h.
 */
#ifndef OUTBOXD_CONFIG_H
#define OUTBOXD_CONFIG_H

#include <stdbool.h>
#include <stdio.h>

#include "broker.h"
#include "http.h"
#include "lock.h"
#include "log.h"
#include "relay.h"
#include "store.h"
#include "util.h"

/* The longest relay.retention, and `outboxd purge --older-than`. */
#define CONFIG_RETENTION_MAX_MS ((int64_t)3650 * 86400000)
/* backoff.max's longest; `outboxd backoff --max` takes what it takes. */
#define CONFIG_BACKOFF_MAX_MS ((int64_t)30 * 86400000)

/* Where a password came from, so that dump and reload can say so.  These
 * are a variable name and a path, never the secret itself. */
struct config_secret_src {
	char *env;			/* password_env, or NULL */
	char *file;			/* password_file, or NULL */
};

struct config {
	char *path;
	enum log_level log_level;
	struct store_conf store;	/* postgres: */
	struct broker_conf broker;	/* rabbitmq: */
	struct lock_conf lock;		/* redis: */
	struct relay_conf relay;	/* relay:, backoff:, reconnect: */
	struct http_conf http;		/* http: */
	struct config_secret_src store_password_src;
	struct config_secret_src broker_password_src;
	struct config_secret_src lock_password_src;
};

/* Fills c with every default (no file read); free with config_free(). */
void config_defaults(struct config *);

/*
 * Loads path over the defaults.  c must hold a config (from
 * config_defaults() or an earlier load) or be all zeroes: whatever it
 * holds is freed and replaced.  On success c->path is a copy of path.
 * On error returns -1, leaves c empty (config_free() is still safe) and
 * writes every problem found, one "path:line:col: message" per line, to
 * errs (NULL: logs each one).  password_env and password_file are read
 * here, at load time.  Returns CONFIG_SECRET_ABSENT instead when the
 * only problems are password files that do not exist: not yet, at boot,
 * when a secrets agent (Vault's, a CSI driver) writes them after
 * outboxd starts.  A start again later may find them; a wrong key or
 * value never goes away that way.
 */
#define CONFIG_SECRET_ABSENT (-2)
int config_load(struct config *, const char *path, FILE *errs) WARN_UNUSED;
/* Same, for a reload: path must be a regular file, and not empty (a pipe
 * read again, or a file truncated before its write, read as every
 * default). */
int config_load_again(struct config *, const char *path, FILE *errs)
    WARN_UNUSED;
/* Same, from a string (for tests and fuzzing); name appears in errors. */
int config_load_string(struct config *, const char *name, const char *yaml,
    size_t len, FILE *errs) WARN_UNUSED;

void config_free(struct config *);

/* Writes every key with its current value (secrets, and a password
 * inside a conninfo, as "<set>") — for `outboxd config` and the test
 * that the sample file documents them. */
void config_dump(const struct config *, FILE *);

/* The table's keys ("postgres.conninfo", …), NULL-terminated. */
const char *const *config_keys(void);

/*
 * Reload (SIGHUP).  Keys marked reloadable (log.level, relay.batch_size,
 * relay.poll_interval, relay.shutdown_timeout, relay.retention, backoff.*,
 * reconnect.*) take effect in place; every other change needs a restart.
 *
 * config_reload_check() writes one line per changed key that is not
 * reloadable to warn (NULL: logs a warning for each) and returns how
 * many there were.  It never prints a secret, only the key's name.
 *
 * config_apply_reloadable() copies the reloadable fields of next into cur and
 * leaves every other field of cur as it was, so pointers that modules
 * hold into cur (&cur->relay, &cur->store, ...) stay valid.
 *
 * config_reload() does the whole dance on cur->path: load into a new
 * struct; if that fails, return -1 with the errors on errs (NULL: logged)
 * and cur untouched (the old config stays in force); else warn about
 * restart-only changes, apply the reloadable ones, free the new struct
 * and return 0.  The caller then calls log_set_level(cur->log_level).
 */
int config_reload_check(const struct config *old, const struct config *next,
    FILE *warn);
void config_apply_reloadable(struct config *cur, const struct config *next);
int config_reload(struct config *cur, FILE *errs) WARN_UNUSED;

/*
 * How long one step of the main loop or of a relay worker may take
 * within the configured time limits: /healthz calls a loop that has not
 * reported for longer stalled, and systemd's WatchdogSec= must be
 * longer (main.c warns at start when it is not).
 */
int64_t config_longest_step_ms(const struct config *);

/*
 * For `outboxd -n -c FILE` and `outboxd check -c FILE`: loads path and
 * writes every error to err (NULL: logged, as config_load does), or
 * "configuration OK" to out.  (Errors on stdout were lost to `check
 * >/dev/null || ...`, and reached the journal at info priority under
 * ExecReload.)  Returns 0 when the file is valid, 1 when it is not.
 */
int config_check_file(const char *path, FILE *out, FILE *err);

#endif
