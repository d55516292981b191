/*
 * Lock: the Redis leader lock (hiredis) that elects the one instance
 * running compensation.  Correctness never depends on it.
 */
#ifndef OUTBOXD_LOCK_H
#define OUTBOXD_LOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "util.h"

struct lock_conf {
	bool enabled;
	char *host;		/* or "unix:/path/to/socket" */
	int port;
	char *username;		/* Redis 6 ACL user; NULL = default */
	char *password;		/* secret */
	int database;
	char *key;
	int64_t ttl_ms;
	int64_t connect_timeout_ms;
};

#endif
