/*
 * Logging to stderr in logfmt.  A line is built in one buffer and written
 * with one write(2) (finished if a signal or a short write cuts it) so
 * lines from several threads do not interleave.
 */
#include "log.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

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

/* Each level's syslog priority, as journald reads it at a line's start
 * (sd-daemon(3): "<3>" error, "<4>" warning, "<6>" info, "<7>" debug). */
static const char *const level_prefixes[] = {
	[LOG_DEBUG] = "<7>",
	[LOG_INFO] = "<6>",
	[LOG_WARN] = "<4>",
	[LOG_ERROR] = "<3>",
};

/*
 * Writes the whole line.  SIGTERM and SIGHUP interrupt the main thread
 * (their handlers have no SA_RESTART): a write blocked on a slow journal
 * returned EINTR with nothing written, and the line was lost.  A short
 * write on a stream socket is finished the same way.  Async-signal-safe.
 */
static void
write_line(const char *line, size_t len)
{
	int saved = errno;

	while (len > 0) {
		ssize_t n = write(STDERR_FILENO, line, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;	/* stderr is gone: nothing useful to do */
		line += n;
		len -= (size_t)n;
	}
	errno = saved;
}

/* Set at start-up, before any thread: stderr is the journal's stream. */
static bool journal_prefix;

bool
log_detect_journal(void)
{
	const char *stream = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;
	char end;

	journal_prefix = stream != NULL &&
	    sscanf(stream, "%llu:%llu%c", &dev, &ino, &end) == 2 &&
	    fstat(STDERR_FILENO, &st) == 0 &&
	    (unsigned long long)st.st_dev == dev &&
	    (unsigned long long)st.st_ino == ino;
	return journal_prefix;
}

bool
log_journal(void)
{
	return journal_prefix;
}

/* The prefix a line of this level starts with: "" outside the journal. */
static const char *
line_prefix(enum log_level level)
{
	if (!journal_prefix || level < LOG_DEBUG || level > LOG_ERROR)
		return "";
	return level_prefixes[level];
}

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

/*
 * The generic cell rate algorithm: busy_until_ms moves on by one
 * interval per line written and never lags behind now, so it holds the
 * burst's state in one number.
 */
bool
log_limit_pass(struct log_limit *limit, int64_t now_ms,
    unsigned long *skipped)
{
	int64_t start = limit->busy_until_ms > now_ms ?
	    limit->busy_until_ms : now_ms;

	if (start - now_ms > (int64_t)(LOG_LIMIT_BURST - 1) *
	    LOG_LIMIT_EVERY_MS) {
		limit->skipped++;
		return false;
	}
	limit->busy_until_ms = start + LOG_LIMIT_EVERY_MS;
	*skipped = limit->skipped;
	limit->skipped = 0;
	return true;
}

void
log_limit_reset(struct log_limit *limit)
{
	limit->busy_until_ms = 0;
	limit->skipped = 0;
}

const char *
log_skipped_field(char *buf, size_t size, unsigned long skipped)
{
	if (skipped > 0)
		snprintf(buf, size, " lines_skipped=%lu", skipped);
	else if (size > 0)
		buf[0] = '\0';
	return buf;
}

void
log_event_limited(struct log_limit *limit, enum log_level level,
    const char *msg, const char *fmt, ...)
{
	char fields[3072], skipped_field[40];
	unsigned long skipped;
	va_list ap;

	if ((int)level < atomic_load(&current_level) ||
	    !log_limit_pass(limit, now_mono_ms(), &skipped))
		return;
	va_start(ap, fmt);
	(void)vsnprintf(fields, sizeof(fields), fmt, ap);
	va_end(ap);
	log_event(level, msg, "%s%s", fields, log_skipped_field(skipped_field,
	    sizeof(skipped_field), skipped));
}

/*
 * Appends what stands for the character at *p to buf if it fits (room
 * counts what is left before the terminator and any closing quote) and
 * returns how many input bytes it used, 0 when it did not fit.  Text is
 * cut between characters only: a UTF-8 sequence cut in half made the
 * whole line invalid, and journalctl showed it as "[N B blob data]"
 * (a localized PostgreSQL error, a non-ASCII exchange name).  Bytes
 * that are not UTF-8 become '?'.  A C1 control (U+0080-U+009F: NEL,
 * CSI) becomes a space, as the C0 ones do: journalctl hid the whole line
 * as a blob, a terminal acted on a CSI, and shippers split at a NEL (an
 * exchange name in the broker's words, say).
 */
static bool
is_c1(const unsigned char *p)
{
	return p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f;
}

static size_t
put_char(char *buf, size_t *n, size_t room, const unsigned char *p,
    int quoted)
{
	char esc[2];
	const char *out = esc;
	size_t in = 1, len = 1;

	if (quoted && (*p == '"' || *p == '\\' || *p == '\n')) {
		esc[0] = '\\';
		esc[1] = *p == '\n' ? 'n' : (char)*p;
		len = 2;
	} else if (*p < ' ' || *p == 0x7f) {
		esc[0] = ' ';
	} else if (is_c1(p)) {
		esc[0] = ' ';
		in = 2;
	} else if (*p >= 0x80) {
		/* The sequence ends at the string's NUL at the latest. */
		in = len = utf8_seq_len(p, 4);
		if (len == 0) {
			esc[0] = '?';
			in = len = 1;
		} else {
			out = (const char *)p;
		}
	} else {
		esc[0] = (char)*p;
	}
	if (len > room)
		return 0;
	memcpy(buf + *n, out, len);
	*n += len;
	return in;
}

const char *
log_quote(char *buf, unsigned long size, const char *s)
{
	size_t n = 0, room, used;
	int quoted = (s == NULL || *s == '\0');

	if (size == 0)
		return buf;
	if (s == NULL)
		s = "";
	for (const char *p = s; *p != '\0'; p++) {
		unsigned char c = (unsigned char)*p;
		if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f ||
		    is_c1((const unsigned char *)p))
			quoted = 1;
	}
	/* Room for the text: less the terminator and both quotes (in a
	 * buffer too small for both, the opening one alone). */
	room = size - 1;
	if (quoted && room > 0) {
		buf[n++] = '"';
		room = room >= 2 ? room - 2 : 0;
	}
	for (const unsigned char *p = (const unsigned char *)s; *p != '\0';
	    p += used) {
		size_t before = n;

		used = put_char(buf, &n, room, p, quoted);
		if (used == 0)
			break;
		room -= n - before;
	}
	if (quoted && n + 1 < size)
		buf[n++] = '"';
	buf[n] = '\0';
	return buf;
}

/* Appends the decimal digits of v, at least width of them. */
static size_t
put_digits(char *out, uint64_t v, int width)
{
	char tmp[24];
	size_t n = 0, len = 0;

	do {
		tmp[n++] = (char)('0' + v % 10);
		v /= 10;
	} while (v > 0 || (int)n < width);
	while (n > 0)
		out[len++] = tmp[--n];
	return len;
}

size_t
log_utc_stamp(char *out, int64_t epoch_s, long ms)
{
	int64_t secs = epoch_s % 86400, days = epoch_s / 86400;
	int64_t era, doe, yoe, doy, mp, year, month, day;
	size_t len = 0;

	/* Days since 1970-01-01 to a civil date (proleptic Gregorian, in
	 * 400-year eras from 0000-03-01): gmtime_r is not signal-safe. */
	days += 719468;
	era = days / 146097;
	doe = days - era * 146097;
	yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
	doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
	mp = (5 * doy + 2) / 153;
	day = doy - (153 * mp + 2) / 5 + 1;
	month = mp < 10 ? mp + 3 : mp - 9;
	year = yoe + era * 400 + (month <= 2);

	len += put_digits(out + len, (uint64_t)year, 4);
	out[len++] = '-';
	len += put_digits(out + len, (uint64_t)month, 2);
	out[len++] = '-';
	len += put_digits(out + len, (uint64_t)day, 2);
	out[len++] = 'T';
	len += put_digits(out + len, (uint64_t)(secs / 3600), 2);
	out[len++] = ':';
	len += put_digits(out + len, (uint64_t)(secs / 60 % 60), 2);
	out[len++] = ':';
	len += put_digits(out + len, (uint64_t)(secs % 60), 2);
	out[len++] = '.';
	len += put_digits(out + len, (uint64_t)ms, 3);
	out[len++] = 'Z';
	out[len] = '\0';
	return len;
}

void
log_from_signal_handler(enum log_level level, const char *fields)
{
	char line[512];
	struct timespec now;
	size_t len, flen = strlen(fields), nlen;
	const char *name = log_level_name(level), *prefix = line_prefix(level);

	clock_gettime(CLOCK_REALTIME, &now);
	len = strlen(prefix);
	memcpy(line, prefix, len);
	memcpy(line + len, "ts=", 3);
	len += 3;
	len += log_utc_stamp(line + len, (int64_t)now.tv_sec,
	    now.tv_nsec / 1000000);
	memcpy(line + len, " level=", 7);
	len += 7;
	nlen = strlen(name);
	memcpy(line + len, name, nlen);
	len += nlen;
	line[len++] = ' ';
	if (flen > sizeof(line) - len - 1)
		flen = sizeof(line) - len - 1;
	memcpy(line + len, fields, flen);
	len += flen;
	line[len++] = '\n';
	/* A handler must not block on a stderr that nobody reads (a stalled
	 * journal or pipe: often why a second SIGTERM came, or the shutdown
	 * timeout ran out): the line is dropped then, and the exit that
	 * follows is not held.  A pipe or socket that polls writable takes
	 * a line this short. */
	if (poll(&(struct pollfd){ .fd = STDERR_FILENO, .events = POLLOUT },
	    1, 0) == 1)
		write_line(line, len);
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
	n = snprintf(line, sizeof(line), "%sts=%s.%03ldZ level=%s msg=%s",
	    line_prefix(level), ts, now.tv_nsec / 1000000,
	    log_level_name(level),
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
	write_line(line, len);
}
