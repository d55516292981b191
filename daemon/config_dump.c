/*
 * Config, dump: every key and its value, one line each (the unit tests
 * and fuzz_config read it).  No secret may reach it: password keys print
 * <set>, and a conninfo is split the way libpq splits it, so that its
 * password is found and redacted.
 */
#include "config_internal.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "config_value.h"

/* Writes n bytes of s escaped as in a double-quoted YAML string, so that
 * a dump is one line per key and never sends control bytes to a terminal.
 * A C1 control (UTF-8 C2 80..C2 9F) is written as its code point, \x85,
 * as YAML reads it: raw, CSI starts a terminal's escape sequence, and
 * YAML reads NEL as a line break, so the dump read back as another value.
 * n must not end inside one. */
static void
escaped_write(FILE *out, const char *s, size_t n)
{
	for (size_t i = 0; i < n && s[i] != '\0'; i++) {
		unsigned char ch = (unsigned char)s[i];

		if (ch == '"' || ch == '\\')
			fprintf(out, "\\%c", ch);
		else if (ch < ' ' || ch == 0x7f)
			fprintf(out, "\\x%02x", ch);
		else if (config_c1_len(s + i) > 0)
			fprintf(out, "\\x%02x", (unsigned char)s[++i]);
		else
			fputc(ch, out);
	}
}

/* What libpq's keyword form takes for white space (isspace in "C"). */
#define CONNINFO_SPACE	" \t\n\r\v\f"

/* The conninfo keywords whose values libpq itself treats as secret
 * (PQconndefaults marks them with dispchar "*"). */
static bool
keyword_is_secret(const char *k, size_t n)
{
	return (n == 8 && memcmp(k, "password", 8) == 0) ||
	    (n == 11 && memcmp(k, "sslpassword", 11) == 0);
}

/* Whether the n bytes at k, %-decoded as libpq decodes URI parameter
 * names, spell a secret keyword. */
static bool
uri_key_is_secret(const char *k, size_t n)
{
	char name[16];
	size_t j = 0;

	for (size_t i = 0; i < n; i++, j++) {
		int ch = (unsigned char)k[i];

		if (ch == '%' && i + 2 < n &&
		    isxdigit((unsigned char)k[i + 1]) &&
		    isxdigit((unsigned char)k[i + 2])) {
			char hex[3] = { k[i + 1], k[i + 2], '\0' };

			ch = (int)strtol(hex, NULL, 16);
			i += 2;
		}
		if (j >= sizeof(name))
			return false;
		name[j] = (char)ch;
	}
	return keyword_is_secret(name, j);
}

bool
conninfo_is_uri(const char *s)
{
	return strncmp(s, "postgresql://", 13) == 0 ||
	    strncmp(s, "postgres://", 11) == 0;
}

/*
 * libpq's user info ends at the first "@" before the first "/", past a
 * "?" too, and holds a password from its first ":".  *at goes on to the
 * host's last "@", so that a password holding an "@" is redacted whole
 * (libpq would take its rest for the host), but not past a "?": an "@"
 * or ":" in a parameter is the parameter's (one such ":" and "@" once
 * bounded a "password" here, and the dump printed the text before it).
 */
const char *
conninfo_uri_password(const char *s, const char **at)
{
	const char *auth, *end, *colon;

	*at = NULL;
	if (!conninfo_is_uri(s))
		return NULL;
	auth = strstr(s, "://") + 3;
	end = auth + strcspn(auth, "/");
	if ((*at = memchr(auth, '@', (size_t)(end - auth))) == NULL)
		return NULL;
	colon = memchr(auth, ':', (size_t)(*at - auth));
	end = *at + strcspn(*at, "/?");
	for (const char *c = *at; c < end; c++)
		if (*c == '@')
			*at = c;
	return colon;
}

/*
 * Writes a conninfo with any password replaced by <set>: both the
 * keyword form (password=x, password='a b') and the URI forms
 * (user:x@host, ?password=x).  It splits the text the way libpq does;
 * tests/fuzz/fuzz_config checks it against libpq's own parser, which
 * found these: libpq ends the user info only at "/" (a password may hold
 * "?" or "#"), decodes %-escapes in parameter names and ends a value at
 * any white space, "\r" too, takes parameters only after the first "?"
 * that follows the user info, and looks for that user info past a "?"
 * up to the first "/"; in the keyword form, a backslash escapes a space
 * in an unquoted value, and a quoted value may run straight into the
 * next keyword.  The rest is escaped as string_dump does (a
 * newline in the conninfo once split the dump's line).
 */
static void
conninfo_dump(FILE *out, const char *s)
{
	const char *p = s;

	fputc('"', out);
	if (conninfo_is_uri(s)) {
		const char *auth = strstr(s, "://") + 3;
		const char *end = auth + strcspn(auth, "/");
		const char *first_at = memchr(auth, '@', (size_t)(end - auth));
		const char *at = NULL, *query;
		const char *colon = conninfo_uri_password(s, &at);

		if (colon != NULL) {
			escaped_write(out, s, (size_t)(colon + 1 - s));
			fputs("<set>", out);
			p = at;
		}
		/* Parameters start at the first "?" after libpq's user
		 * info (it ends at the first "@"); before it an "&"
		 * separates nothing. */
		query = strchr(first_at ? first_at : auth, '?');
		while (*p != '\0') {
			const char *k = p + 1;
			size_t klen = strcspn(k, "=&"), n;
			bool param = query != NULL && (p == query ||
			    (p > query && *p == '&'));

			/* libpq looks for the user info up to the first "/",
			 * past a "?".  A redacted value may hold that "/":
			 * one put before the "?" (an empty database name,
			 * the same to libpq) keeps an "@" after the value
			 * from turning into user info in the dump. */
			if (p == query && end > query)
				fputc('/', out);
			if (param && k[klen] == '=' &&
			    uri_key_is_secret(k, klen)) {
				escaped_write(out, p, klen + 2);
				fputs("<set>", out);
				p = k + klen + 1;
				p += strcspn(p, "&");
				continue;
			}
			/* A C1 control's two bytes go together. */
			n = config_c1_len(p) > 0 ? 2 : 1;
			escaped_write(out, p, n);
			p += n;
		}
		fputs("\"\n", out);
		return;
	}
	while (*p != '\0') {
		const char *kw = p + strspn(p, CONNINFO_SPACE), *v;
		size_t kwlen = strcspn(kw, CONNINFO_SPACE "=");

		escaped_write(out, p, (size_t)(kw - p));
		if (*kw == '\0')
			break;
		v = kw + kwlen;
		v += strspn(v, CONNINFO_SPACE);
		if (*v != '=') {
			/* Not keyword=value: print the rest untouched. */
			escaped_write(out, kw, strlen(kw));
			break;
		}
		v++;
		v += strspn(v, CONNINFO_SPACE);
		p = v;
		if (*p == '\'') {
			for (p++; *p != '\0' && *p != '\''; p++)
				if (*p == '\\' && p[1] != '\0')
					p++;
			if (*p == '\'')
				p++;
		} else {
			/* A backslash escapes the next byte, a space too. */
			for (; *p != '\0' && strchr(CONNINFO_SPACE, *p) == NULL;
			    p++)
				if (*p == '\\' && p[1] != '\0')
					p++;
		}
		escaped_write(out, kw, (size_t)(v - kw));
		if (keyword_is_secret(kw, kwlen)) {
			fputs("<set>", out);
			/* A quoted value may be followed by the next keyword
			 * with no space; the bare <set> needs one. */
			if (*p != '\0' && strchr(CONNINFO_SPACE, *p) == NULL)
				fputc(' ', out);
		} else {
			escaped_write(out, v, (size_t)(p - v));
		}
	}
	fputs("\"\n", out);
}

static void
string_dump(FILE *out, const char *s)
{
	fputc('"', out);
	escaped_write(out, s, strlen(s));
	fputc('"', out);
}

static void
hostport_dump(FILE *out, const char *host, int port)
{
	char buf[300];

	if (port == 0)
		strfmt(buf, sizeof(buf), "%s", host);
	else if (strchr(host, ':') != NULL)
		strfmt(buf, sizeof(buf), "[%s]:%d", host, port);
	else
		strfmt(buf, sizeof(buf), "%s:%d", host, port);
	string_dump(out, buf);
}

/* The shortest decimal that reads back as the same double: %g's six
 * digits showed 1.0000001 as 1, not the value in effect. */
static const char *
float_fmt(char *buf, size_t n, double v)
{
	for (int digits = 6; digits < 17; digits++) {
		snprintf(buf, n, "%.*g", digits, v);
		if (strtod(buf, NULL) == v)
			return buf;
	}
	snprintf(buf, n, "%.17g", v);
	return buf;
}

static const char *
enum_name_of(const struct key *k, int v)
{
	for (const struct enum_name *e = k->names; e->name != NULL; e++)
		if (e->value == v)
			return e->name;
	return "?";
}

void
config_dump(const struct config *c, FILE *out)
{
	for (size_t i = 0; i < cfg_n_keys; i++) {
		const struct key *k = &cfg_keys[i];
		const void *f = cfield(c, k->off);
		char buf[64];

		fprintf(out, "%s: ", k->name);
		switch (k->type) {
		case T_STRING:
		case T_LISTEN:
			if (*(char *const *)f == NULL)
				fputs("<unset>", out);
			else if (k->flags & F_CONNINFO) {
				conninfo_dump(out, *(char *const *)f);
				continue;
			} else
				string_dump(out, *(char *const *)f);
			break;
		case T_SECRET:
		case T_SECRET_ENV:
		case T_SECRET_FILE:
			/* Even the variable name and path: they are where a
			 * misplaced password would end up. */
			fputs(*(char *const *)f ? "<set>" : "<unset>", out);
			break;
		case T_INT:
			fprintf(out, "%d", *(const int *)f);
			break;
		case T_BOOL:
			fputs(*(const bool *)f ? "true" : "false", out);
			break;
		case T_DURATION:
			fputs(config_fmt_duration(buf, sizeof(buf),
			    k->flags & F_SECONDS ?
			    (int64_t)*(const int *)f * 1000 :
			    *(const int64_t *)f), out);
			break;
		case T_SIZE:
			fputs(config_fmt_size(buf, sizeof(buf),
			    (int64_t)*(const size_t *)f), out);
			break;
		case T_FLOAT:
			fputs(float_fmt(buf, sizeof(buf), *(const double *)f),
			    out);
			break;
		case T_ENUM:
			fputs(enum_name_of(k, enum_get(c, k)), out);
			break;
		case T_NODES: {
			const struct broker_conf *b = f;

			fputc('[', out);
			for (size_t j = 0; j < b->n_nodes; j++) {
				if (j > 0)
					fputs(", ", out);
				hostport_dump(out, b->nodes[j].host,
				    b->nodes[j].port);
			}
			fputc(']', out);
			break;
		}
		case T_ADDRESS:
			if (*(char *const *)f == NULL)
				fputs("<unset>", out);
			else
				hostport_dump(out, *(char *const *)f,
				    *(const int *)cfield(c, k->off2));
			break;
		}
		fputc('\n', out);
	}
}
