/*
 * Config values: the scalar forms a config file may hold (integers,
 * durations, sizes, decimals, "host:port") parsed strictly, and quoted
 * back for error messages.  Pure functions; config.c applies them to
 * keys.
 */
#include "config_value.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

size_t
config_c1_len(const char *s)
{
	return (unsigned char)s[0] == 0xc2 && (unsigned char)s[1] >= 0x80 &&
	    (unsigned char)s[1] <= 0x9f ? 2 : 0;
}

/*
 * Writes s quoted for an error message, escaping what a terminal would
 * act on (C1 controls too: CSI works as ESC [ does) and cutting it at
 * ECHO_MAX bytes.  Never used for secrets.
 */
const char *
config_echo(char *buf, size_t size, const char *s)
{
	size_t n = 0, i;

	buf[n++] = '"';
	for (i = 0; s[i] != '\0' && n + 8 < size; i++) {
		unsigned char ch = (unsigned char)s[i];

		/* ">=": a C1 control takes two bytes at once. */
		if (i >= ECHO_MAX) {
			memcpy(buf + n, "...", 3);
			n += 3;
			break;
		}
		if (ch == '"' || ch == '\\') {
			buf[n++] = '\\';
			buf[n++] = (char)ch;
		} else if (ch < ' ' || ch == 0x7f) {
			n += (size_t)snprintf(buf + n, size - n, "\\x%02x", ch);
		} else if (config_c1_len(s + i) > 0) {
			n += (size_t)snprintf(buf + n, size - n, "\\x%02x",
			    (unsigned char)s[++i]);
		} else {
			buf[n++] = (char)ch;
		}
	}
	buf[n++] = '"';
	buf[n] = '\0';
	return buf;
}

const char *
config_fmt_duration(char *buf, size_t size, int64_t ms)
{
	if (ms == 0)
		return strfmt(buf, size, "0");
	return duration_format(buf, size, ms);
}

const char *
config_fmt_size(char *buf, size_t size, int64_t b)
{
	static const struct {
		const char *unit;
		int64_t bytes;
	} units[] = {
		{ "GiB", 1073741824 }, { "MiB", 1048576 }, { "KiB", 1024 },
	};

	for (size_t i = 0; i < ARRAY_LEN(units); i++) {
		if (b != 0 && b % units[i].bytes == 0)
			return strfmt(buf, size, "%" PRId64 "%s",
			    b / units[i].bytes, units[i].unit);
	}
	return strfmt(buf, size, "%" PRId64, b);
}

/* Strict integer: optional sign, digits, nothing else.  -2 = too big. */
int
config_parse_int(const char *s, int64_t *out)
{
	const char *p = s;
	char *end;
	long long v;

	if (*p == '+' || *p == '-')
		p++;
	if (*p < '0' || *p > '9')
		return -1;
	for (; *p != '\0'; p++)
		if (*p < '0' || *p > '9')
			return -1;
	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno == ERANGE)
		return -2;
	*out = v;
	return 0;
}

/*
 * A duration needs a unit, except 0: a bare "30" would be read as 30 ms
 * by someone who meant 30 s.  Returns 0, -1 for garbage, -2 for a bare
 * number, -3 for a well-formed value that overflows.
 */
int
config_parse_duration(const char *s, int64_t *ms)
{
	const char *p = s;
	bool zero = true;

	for (; *p >= '0' && *p <= '9'; p++)
		if (*p != '0')
			zero = false;
	if (p == s)
		return -1;
	if (*p == '\0') {
		if (!zero)
			return -2;
		*ms = 0;
		return 0;
	}
	if (duration_parse(s, ms) == 0)
		return 0;
	if (strcmp(p, "ms") == 0 || strcmp(p, "s") == 0 ||
	    strcmp(p, "m") == 0 || strcmp(p, "h") == 0 || strcmp(p, "d") == 0)
		return -3;
	return -1;
}

/* Bytes, with binary (KiB) or decimal (kB) units.  -2 = overflow. */
int
config_parse_size(const char *s, int64_t *out)
{
	static const struct {
		const char *unit;
		int64_t mult;
	} units[] = {
		{ "", 1 }, { "B", 1 },
		{ "KiB", 1024 }, { "MiB", 1048576 }, { "GiB", 1073741824 },
		{ "kB", 1000 }, { "KB", 1000 }, { "MB", 1000000 },
		{ "GB", 1000000000 },
	};
	int64_t v = 0;
	const char *p = s;

	if (*p < '0' || *p > '9')
		return -1;
	for (; *p >= '0' && *p <= '9'; p++) {
		if (v > (INT64_MAX - (*p - '0')) / 10)
			return -2;
		v = v * 10 + (*p - '0');
	}
	for (size_t i = 0; i < ARRAY_LEN(units); i++) {
		if (strcmp(p, units[i].unit) != 0)
			continue;
		if (v > INT64_MAX / units[i].mult)
			return -2;
		*out = v * units[i].mult;
		return 0;
	}
	return -1;
}

/* Plain decimal numbers only: strtod would also take "nan", "inf" and
 * hex floats, none of which belong in a config file. */
int
config_parse_float(const char *s, double *out)
{
	bool digit = false;
	char *end;
	double v;

	for (const char *p = s; *p != '\0'; p++) {
		if (*p >= '0' && *p <= '9')
			digit = true;
		else if (strchr("+-.eE", *p) == NULL)
			return -1;
	}
	if (!digit)
		return -1;
	errno = 0;
	v = strtod(s, &end);
	if (*end != '\0' || errno == ERANGE || !isfinite(v))
		return -1;
	*out = v;
	return 0;
}

static bool
host_char(char ch, bool bracketed)
{
	if (isalnum((unsigned char)ch) || ch == '.' || ch == '-' || ch == '_')
		return true;
	return bracketed && (ch == ':' || ch == '%');
}

/*
 * Splits "host:port", "[v6]:port" or, when default_port is not 0, a bare
 * host.  On error returns -1 with the reason in why (which may echo s:
 * an address is not a secret, and one with '@' is refused unechoed).
 */
int
config_parse_hostport(const char *s, int default_port, int example_port,
    char **host, int *port, char *why, size_t whysz)
{
	char q[ECHO_MAX * 4 + 8];
	const char *h = s, *hend, *rest;
	bool bracketed = false;
	int64_t p;

	if (strchr(s, '@') != NULL) {
		strfmt(why, whysz, "must be \"host:port\", without a user "
		    "name or password");
		return -1;
	}
	config_echo(q, sizeof(q), s);
	if (*s == '\0') {
		strfmt(why, whysz, "expected \"host:port\", got \"\"");
		return -1;
	}
	if (strstr(s, "://") != NULL) {
		strfmt(why, whysz, "expected \"host:port\", not a URL, got %s",
		    q);
		return -1;
	}
	if (*s == '[') {
		bracketed = true;
		h = s + 1;
		hend = strchr(h, ']');
		if (hend == NULL) {
			strfmt(why, whysz, "missing \"]\" after the IPv6 "
			    "address, got %s", q);
			return -1;
		}
		rest = hend + 1;
		if (memchr(h, ':', (size_t)(hend - h)) == NULL) {
			strfmt(why, whysz, "expected an IPv6 address inside "
			    "\"[]\", got %s", q);
			return -1;
		}
	} else {
		hend = strchr(s, ':');
		if (hend != NULL && strchr(hend + 1, ':') != NULL) {
			strfmt(why, whysz, "IPv6 addresses need brackets, "
			    "as in \"[::1]:%d\", got %s", example_port, q);
			return -1;
		}
		if (hend == NULL)
			hend = s + strlen(s);
		rest = hend;
	}
	for (const char *c = h; c < hend; c++) {
		if (!host_char(*c, bracketed)) {
			hend = h;	/* report below as a bad host */
			break;
		}
	}
	if (hend == h) {
		strfmt(why, whysz, "invalid host name, got %s", q);
		return -1;
	}
	if (*rest == '\0') {
		if (default_port == 0) {
			strfmt(why, whysz, "needs a port, as in "
			    "\"127.0.0.1:%d\", got %s", example_port, q);
			return -1;
		}
		p = default_port;
	} else if (*rest != ':' || rest[1] == '+' || rest[1] == '-' ||
	    config_parse_int(rest + 1, &p) != 0 || p < 1 || p > 65535) {
		strfmt(why, whysz, "port must be a number from 1 to 65535, "
		    "got %s", q);
		return -1;
	}
	*host = xmalloc((size_t)(hend - h) + 1);
	memcpy(*host, h, (size_t)(hend - h));
	(*host)[hend - h] = '\0';
	*port = (int)p;
	return 0;
}
