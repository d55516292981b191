/* Clocks, checked allocation and secret wiping shared by all modules. */
#include "util.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int64_t
now_mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t
now_mono_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t
now_wall_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void
out_of_memory(size_t size)
{
	static const char msg[] = "level=error msg=\"out of memory\"\n";

	(void)size;
	(void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
	abort();
}

void *
xmalloc(size_t size)
{
	void *p = malloc(size ? size : 1);

	if (p == NULL)
		out_of_memory(size);
	return p;
}

void *
xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size ? size : 1);

	if (p == NULL)
		out_of_memory(n * size);
	return p;
}

void *
xrealloc(void *old, size_t size)
{
	void *p = realloc(old, size ? size : 1);

	if (p == NULL)
		out_of_memory(size);
	return p;
}

char *
xstrdup(const char *s)
{
	char *p = strdup(s ? s : "");

	if (p == NULL)
		out_of_memory(s ? strlen(s) + 1 : 1);
	return p;
}

void
secret_free(char *s)
{
	if (s == NULL)
		return;
	explicit_bzero(s, strlen(s));
	free(s);
}

char *
strfmt(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	return buf;
}

char *
str_replace_controls(char *s, char with)
{
	for (unsigned char *c = (unsigned char *)s; *c != '\0'; c++) {
		if (*c < ' ' || *c == 0x7f) {
			*c = (unsigned char)with;
		} else if (*c == 0xc2 && c[1] >= 0x80 && c[1] <= 0x9f) {
			/* A C1 control (NEL, CSI: what ESC [ does) in
			 * UTF-8; its two bytes, lest a half stay. */
			c[0] = c[1] = (unsigned char)with;
			c++;
		}
	}
	return s;
}

void
sleep_ms(int64_t ms, volatile int *stop)
{
	struct timespec ts;

	if (ms <= 0)
		return;
	ts.tv_sec = ms / 1000;
	ts.tv_nsec = (ms % 1000) * 1000000;
	while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
		if (stop != NULL && *stop)
			return;
	}
}

int
duration_parse(const char *s, int64_t *ms)
{
	static const struct {
		const char *suffix;
		int64_t ms;
	} units[] = {
		{ "ms", 1 }, { "s", 1000 }, { "m", 60000 }, { "h", 3600000 },
		{ "d", 86400000 }, { "", 1 },
	};
	int64_t value = 0;
	const char *p = s;

	if (s == NULL || *s < '0' || *s > '9')
		return -1;
	for (; *p >= '0' && *p <= '9'; p++) {
		if (value > (INT64_MAX - (*p - '0')) / 10)
			return -1;
		value = value * 10 + (*p - '0');
	}
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		if (strcmp(p, units[i].suffix) != 0)
			continue;
		if (value > INT64_MAX / units[i].ms)
			return -1;
		*ms = value * units[i].ms;
		return 0;
	}
	return -1;
}

char *
duration_format(char *buf, size_t size, int64_t ms)
{
	if (ms != 0 && ms % 86400000 == 0)
		snprintf(buf, size, "%" PRId64 "d", ms / 86400000);
	else if (ms != 0 && ms % 3600000 == 0)
		snprintf(buf, size, "%" PRId64 "h", ms / 3600000);
	else if (ms != 0 && ms % 60000 == 0)
		snprintf(buf, size, "%" PRId64 "m", ms / 60000);
	else if (ms != 0 && ms % 1000 == 0)
		snprintf(buf, size, "%" PRId64 "s", ms / 1000);
	else
		snprintf(buf, size, "%" PRId64 "ms", ms);
	return buf;
}

bool
int64_parse(const char *s, size_t len, int64_t *out)
{
	char buf[24], *end;

	if (len == 0 || len >= sizeof(buf))
		return false;
	memcpy(buf, s, len);
	buf[len] = '\0';
	errno = 0;
	*out = strtoll(buf, &end, 10);
	return errno == 0 && *end == '\0';
}

size_t
utf8_seq_len(const unsigned char *s, size_t n)
{
	size_t len;
	unsigned char lo = 0x80, hi = 0xbf;	/* the second byte's range */

	if (n == 0)
		return 0;
	if (s[0] < 0x80)
		return 1;
	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		len = 2;
	else if (s[0] >= 0xe0 && s[0] <= 0xef) {
		len = 3;
		if (s[0] == 0xe0)
			lo = 0xa0;	/* overlong */
		else if (s[0] == 0xed)
			hi = 0x9f;	/* UTF-16 surrogates */
	} else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
		len = 4;
		if (s[0] == 0xf0)
			lo = 0x90;	/* overlong */
		else if (s[0] == 0xf4)
			hi = 0x8f;	/* past U+10FFFF */
	} else {
		return 0;	/* a continuation byte, 0xc0, 0xc1, 0xf5+ */
	}
	if (n < len || s[1] < lo || s[1] > hi)
		return 0;
	for (size_t i = 2; i < len; i++)
		if (s[i] < 0x80 || s[i] > 0xbf)
			return 0;
	return len;
}
