/*
 * Logging to stderr in logfmt.  A line is built in one buffer and written
 * with one write(2) so lines from several threads never interleave.
 */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Set by SIGHUP's reload on the main thread, read by every thread. */
static atomic_int current_level = LOG_INFO;
/* This thread's fixed field ("worker=1"), or "". */
static _Thread_local char thread_field[32];

static const char *const level_names[] = {
	[LOG_DEBUG] = "debug",
	[LOG_INFO] = "info",
	[LOG_WARN] = "warn",
	[LOG_ERROR] = "error",
};

void
log_set_level(enum log_level level)
{
	atomic_store(&current_level, (int)level);
}

enum log_level
log_get_level(void)
{
	return (enum log_level)atomic_load(&current_level);
}

void
log_set_thread_field(const char *field)
{
	snprintf(thread_field, sizeof(thread_field), "%s",
	    field != NULL ? field : "");
}

const char *
log_level_name(enum log_level level)
{
	if (level < LOG_DEBUG || level > LOG_ERROR)
		return "unknown";
	return level_names[level];
}

int
log_level_parse(const char *s, enum log_level *out)
{
	for (int i = LOG_DEBUG; i <= LOG_ERROR; i++) {
		if (strcmp(s, level_names[i]) == 0) {
			*out = (enum log_level)i;
			return 0;
		}
	}
	if (strcmp(s, "warning") == 0) {
		*out = LOG_WARN;
		return 0;
	}
	return -1;
}

const char *
log_quote(char *buf, unsigned long size, const char *s)
{
	size_t n = 0;
	int needs_quotes = (s == NULL || *s == '\0');

	if (size == 0)
		return buf;
	if (s == NULL)
		s = "";
	for (const char *p = s; *p != '\0'; p++) {
		unsigned char c = (unsigned char)*p;
		if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f)
			needs_quotes = 1;
	}
	if (!needs_quotes) {
		snprintf(buf, size, "%s", s);
		return buf;
	}
	/* Reserve room for the closing quote and NUL. */
	if (n + 1 < size)
		buf[n++] = '"';
	for (const char *p = s; *p != '\0' && n + 3 < size; p++) {
		unsigned char c = (unsigned char)*p;
		if (c == '"' || c == '\\') {
			buf[n++] = '\\';
			buf[n++] = (char)c;
		} else if (c == '\n') {
			buf[n++] = '\\';
			buf[n++] = 'n';
		} else if (c < ' ' || c == 0x7f) {
			buf[n++] = ' ';
		} else {
			buf[n++] = (char)c;
		}
	}
	if (n + 1 < size)
		buf[n++] = '"';
	buf[n < size ? n : size - 1] = '\0';
	return buf;
}

void
log_event(enum log_level level, const char *msg, const char *fmt, ...)
{
	char line[4096], ts[40], qmsg[256];
	struct timespec now;
	struct tm tm;
	size_t len;
	int n;

	if ((int)level < atomic_load(&current_level))
		return;
	clock_gettime(CLOCK_REALTIME, &now);
	gmtime_r(&now.tv_sec, &tm);
	strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
	n = snprintf(line, sizeof(line), "ts=%s.%03ldZ level=%s msg=%s", ts,
	    now.tv_nsec / 1000000, log_level_name(level),
	    log_quote(qmsg, sizeof(qmsg), msg));
	len = n < 0 ? 0 : (size_t)n;
	if (thread_field[0] != '\0' && len + sizeof(thread_field) + 1 <
	    sizeof(line)) {
		line[len++] = ' ';
		len += (size_t)snprintf(line + len, sizeof(line) - len, "%s",
		    thread_field);
	}
	if (fmt != NULL && *fmt != '\0' && len + 2 < sizeof(line)) {
		va_list ap;
		line[len++] = ' ';
		va_start(ap, fmt);
		n = vsnprintf(line + len, sizeof(line) - len, fmt, ap);
		va_end(ap);
		if (n > 0)
			len += (size_t)n;
	}
	if (len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	/* Nothing useful can be done if stderr is gone. */
	(void)!write(STDERR_FILENO, line, len);
}
