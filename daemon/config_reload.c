/*
 * Config, reload: what a SIGHUP may change.  Reloadable keys are copied
 * into the config in force, whose fields other modules point into; a
 * change to any other key only earns a warning to restart.
 */
#include "config_internal.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

static bool
str_eq(const char *a, const char *b)
{
	if (a == NULL || b == NULL)
		return a == b;
	return strcmp(a, b) == 0;
}

static bool
key_equal(const struct config *a, const struct config *b, const struct key *k)
{
	const void *fa = cfield(a, k->off), *fb = cfield(b, k->off);

	switch (k->type) {
	case T_STRING:
	case T_SECRET:
	case T_SECRET_ENV:
	case T_SECRET_FILE:
	case T_LISTEN:
		return str_eq(*(char *const *)fa, *(char *const *)fb);
	case T_ADDRESS:
		return str_eq(*(char *const *)fa, *(char *const *)fb) &&
		    *(const int *)cfield(a, k->off2) ==
		    *(const int *)cfield(b, k->off2);
	case T_INT:
		return *(const int *)fa == *(const int *)fb;
	case T_BOOL:
		return *(const bool *)fa == *(const bool *)fb;
	case T_DURATION:
		if (k->flags & F_SECONDS)
			return *(const int *)fa == *(const int *)fb;
		return *(const int64_t *)fa == *(const int64_t *)fb;
	case T_SIZE:
		return *(const size_t *)fa == *(const size_t *)fb;
	case T_FLOAT:
		return *(const double *)fa == *(const double *)fb;
	case T_ENUM:
		return enum_get(a, k) == enum_get(b, k);
	case T_NODES: {
		const struct broker_conf *x = fa, *y = fb;

		if (x->n_nodes != y->n_nodes)
			return false;
		for (size_t i = 0; i < x->n_nodes; i++)
			if (!str_eq(x->nodes[i].host, y->nodes[i].host) ||
			    x->nodes[i].port != y->nodes[i].port)
				return false;
		return true;
	}
	}
	return false;
}

/* Where group's password (config.c's groups 1..3) came from. */
static const struct config_secret_src *
password_src(const struct config *c, int group)
{
	switch (group) {
	case 1:
		return &c->store_password_src;
	case 2:
		return &c->broker_password_src;
	case 3:
		return &c->lock_password_src;
	}
	return NULL;
}

/* A password read from the same file before and after: new text there
 * needs no restart, since the file is read again at the next connection
 * (secret.h). */
static bool
same_password_file(const struct config *old, const struct config *next,
    const struct key *k)
{
	const struct config_secret_src *a = password_src(old, k->group),
	    *b = password_src(next, k->group);

	return k->type == T_SECRET && a != NULL && b != NULL &&
	    a->file != NULL && str_eq(a->file, b->file);
}

int
config_reload_check(const struct config *old, const struct config *next,
    FILE *warn)
{
	int n = 0;

	for (size_t i = 0; i < cfg_n_keys; i++) {
		const struct key *k = &cfg_keys[i];

		if (k->flags & F_RELOAD || key_equal(old, next, k) ||
		    same_password_file(old, next, k))
			continue;
		n++;
		if (warn != NULL)
			fprintf(warn, "%s changed; restart outboxd to apply "
			    "it\n", k->name);
		else
			log_warn("config change needs a restart", "key=%s",
			    k->name);
	}
	return n;
}

void
config_apply_reloadable(struct config *cur, const struct config *next)
{
	for (size_t i = 0; i < cfg_n_keys; i++) {
		const struct key *k = &cfg_keys[i];
		void *dst = field(cur, k->off);
		const void *src = cfield(next, k->off);

		if (!(k->flags & F_RELOAD))
			continue;
		switch (k->type) {
		case T_INT:
			*(int *)dst = *(const int *)src;
			break;
		case T_BOOL:
			*(bool *)dst = *(const bool *)src;
			break;
		case T_DURATION:
			if (k->flags & F_SECONDS)
				*(int *)dst = *(const int *)src;
			else
				*(int64_t *)dst = *(const int64_t *)src;
			break;
		case T_SIZE:
			*(size_t *)dst = *(const size_t *)src;
			break;
		case T_FLOAT:
			*(double *)dst = *(const double *)src;
			break;
		case T_ENUM:
			if (k->flags & F_AS_BOOL)
				*(bool *)dst = *(const bool *)src;
			else
				*(int *)dst = *(const int *)src;
			break;
		case T_STRING:
		case T_LISTEN:
			cfg_string_set(dst, *(char *const *)src, false);
			break;
		default:
			/* Secrets, nodes and addresses shape connections
			 * and are never marked reloadable. */
			abort();
		}
	}
}

int
config_reload(struct config *cur, FILE *errs)
{
	struct config next;

	memset(&next, 0, sizeof(next));
	if (cur->path == NULL)
		return -1;
	if (config_load_again(&next, cur->path, errs) != 0)
		return -1;
	(void)config_reload_check(cur, &next, NULL);
	config_apply_reloadable(cur, &next);
	config_free(&next);
	return 0;
}
