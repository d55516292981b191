/*
 * The config module's insides, shared by its parts: config.c (the key
 * table and the loader), config_secrets.c, config_dump.c and
 * config_reload.c.  Private to the config module: nothing outside it
 * includes this; the public API is config.h.
 */
#ifndef OUTBOXD_CONFIG_INTERNAL_H
#define OUTBOXD_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <yaml.h>

#include "config.h"

enum key_type {
	T_STRING,
	T_INT,		/* int */
	T_BOOL,		/* bool */
	T_DURATION,	/* int64_t milliseconds (int seconds with F_SECONDS) */
	T_SIZE,		/* size_t bytes */
	T_FLOAT,	/* double */
	T_ENUM,		/* an enum, or a bool with F_AS_BOOL */
	T_SECRET,	/* password: the secret itself */
	T_SECRET_ENV,	/* password_env: the variable to read it from */
	T_SECRET_FILE,	/* password_file: the file to read it from */
	T_NODES,	/* "host:port" list into broker_conf.nodes */
	T_ADDRESS,	/* "host:port" or "unix:/path" into host + port */
	T_LISTEN,	/* "host:port", or "" for off */
};

#define F_RELOAD	0x01	/* SIGHUP applies it; others need a restart */
#define F_OPTIONAL	0x02	/* may be unset (NULL) */
#define F_NONEMPTY	0x04	/* "" can never work */
#define F_ABSOLUTE	0x08	/* a file's path: must start with / */
#define F_SECONDS	0x10	/* duration kept as whole seconds in an int */
#define F_AS_BOOL	0x20	/* two-name enum kept as a bool */
#define F_CONNINFO	0x40	/* may embed a password: redacted in dumps */

struct enum_name {
	const char *name;
	int value;
};

struct key {
	const char *name;
	enum key_type type;
	unsigned flags;
	size_t off;		/* the field in struct config */
	size_t off2;		/* T_ADDRESS: the port field */
	const char *def;	/* default, as written in a file; NULL: unset */
	int64_t min, max;	/* T_INT, T_DURATION (ms), T_SIZE (bytes) */
	double fmin, fmax;	/* T_FLOAT */
	const struct enum_name *names;	/* T_ENUM, ends with a NULL name */
	int port;		/* address types: the port when none is given
				 * (0 = a port is required), and the example */
	int group;		/* T_SECRET*: which password (1..3), else 0 */
};

/* The table, defined in config.c: load, defaults, dump and reload all
 * walk its cfg_n_keys entries. */
extern const struct key cfg_keys[];
extern const size_t cfg_n_keys;

/* The field a key's off (or off2) names in c. */
static inline void *
field(struct config *c, size_t off)
{
	return (char *)c + off;
}

static inline const void *
cfield(const struct config *c, size_t off)
{
	return (const char *)c + off;
}

/* An enum key's value, whether kept as an int or (F_AS_BOOL) a bool. */
static inline int
enum_get(const struct config *c, const struct key *k)
{
	const void *f = cfield(c, k->off);

	if (k->flags & F_AS_BOOL)
		return *(const bool *)f ? 1 : 0;
	return *(const int *)f;
}

/* *dst becomes a copy of s (NULL: unset); the old value is freed, and
 * wiped first when secret.  The loader and reload both set strings. */
void cfg_string_set(char **dst, const char *s, bool secret);

/* config_secrets.c.  Zero libyaml's copies of the file (every scalar of
 * a document, the parser's buffers) before they are freed: they hold its
 * passwords. */
void cfg_document_wipe(yaml_document_t *doc);
void cfg_parser_wipe(yaml_parser_t *parser);

/* Whether a conninfo is libpq's URI form. */
bool conninfo_is_uri(const char *s);
/* In a URI conninfo, the ":" before a password in the user info, which
 * libpq ends at the first "@" before the first "/"; *at is the last "@"
 * after it and before a "/" or "?" (a password holding an "@" counts
 * whole); NULL if there is none. */
const char *conninfo_uri_password(const char *s, const char **at);

#endif
