/*
 * Logging: one logfmt line per event on stderr (ts=… level=… msg=… k=v),
 * which journald and docker collect as they are.  Never log secrets.
 */
#ifndef OUTBOXD_LOG_H
#define OUTBOXD_LOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR };

void log_set_level(enum log_level);
enum log_level log_get_level(void);
int log_level_parse(const char *, enum log_level *);
const char *log_level_name(enum log_level);
/* A key=value field added to every line this thread logs ("worker=1");
 * NULL or "" for none. */
void log_set_thread_field(const char *);

/*
 * Call once at start-up, before any thread.  When stderr is the
 * journal's stream (systemd sets JOURNAL_STREAM to its device:inode),
 * each line starts with its syslog priority ("<4>" for warn), which
 * journald takes off and stores as the entry's priority, so that
 * `journalctl -p warning` finds warnings and errors; without it every
 * line was stored as info.  Returns whether lines are prefixed.
 */
bool log_detect_journal(void);
/* What the last log_detect_journal() found. */
bool log_journal(void);

/*
 * msg is a short fixed event name ("batch published"); fmt, if not NULL,
 * appends key=value fields.  Values that may hold spaces must be passed
 * through log_quote() or printed with %s of a quoted buffer.
 */
void log_event(enum log_level, const char *msg, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define log_debug(msg, ...) log_event(LOG_DEBUG, msg, __VA_ARGS__)
#define log_info(msg, ...) log_event(LOG_INFO, msg, __VA_ARGS__)
#define log_warn(msg, ...) log_event(LOG_WARN, msg, __VA_ARGS__)
#define log_error(msg, ...) log_event(LOG_ERROR, msg, __VA_ARGS__)

/*
 * For signal handlers: writes one line, "ts=… level=… " and then fields
 * as given (msg first, already logfmt), with nothing that is not
 * async-signal-safe (no stdio, no gmtime, no locks).  Written whatever
 * the level, unless stderr would block: then it is dropped.
 */
void log_from_signal_handler(enum log_level, const char *fields);
/* Writes epoch_s and ms as "2026-11-23T11:30:00.123Z" (at most 24
 * bytes and a NUL, years 1970–9999) without gmtime; returns the length. */
size_t log_utc_stamp(char *out, int64_t epoch_s, long ms);

/*
 * A limit for a line that repeats while a fault lasts ("rabbitmq
 * unavailable" at every reconnect): with reconnect.max at 1ms a refused
 * port would write a thousand lines a second, and the journal would
 * rotate away what came before.  The first LOG_LIMIT_BURST lines pass,
 * then one per LOG_LIMIT_EVERY_MS; a line that passes reports how many
 * were skipped since the one before.  A zeroed struct is a full burst.
 * Not shared between threads: each relay keeps its own.
 */
#define LOG_LIMIT_BURST 10
#define LOG_LIMIT_EVERY_MS 1000
struct log_limit {
	int64_t busy_until_ms;	/* when the burst is whole again */
	unsigned long skipped;	/* lines held back since the last one */
};
/* Whether a line may be written at now_ms (a monotonic clock); when it
 * may, *skipped gets the count held back before it (then 0 again). */
bool log_limit_pass(struct log_limit *, int64_t now_ms,
    unsigned long *skipped);
/* The fault is over: the next one starts with a whole burst. */
void log_limit_reset(struct log_limit *);
/* " lines_skipped=N" for a line written after N were held back, or ""
 * when none was; buf needs 40 bytes. */
const char *log_skipped_field(char *buf, size_t size, unsigned long skipped);
/* log_event for a line that repeats while a fault lasts: written only
 * when limit lets it pass (now), and then with " lines_skipped=N"
 * after fmt's fields when some were held back. */
void log_event_limited(struct log_limit *limit, enum log_level,
    const char *msg, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/*
 * Writes s into buf as a logfmt value: quoted and escaped when it holds
 * spaces, quotes, '=' or control bytes; truncated to fit.  Returns buf.
 */
const char *log_quote(char *buf, unsigned long size, const char *s);

#endif
