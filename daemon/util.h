/*
 * Small helpers every module uses: monotonic and wall clocks in
 * milliseconds, checked allocation, secret wiping.
 */
#ifndef OUTBOXD_UTIL_H
#define OUTBOXD_UTIL_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#define WARN_UNUSED __attribute__((warn_unused_result))
#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Milliseconds since an arbitrary point; never goes backwards. */
int64_t now_mono_ms(void);
/* Microseconds since an arbitrary point; for latency measurements. */
int64_t now_mono_us(void);
/* Milliseconds since the Unix epoch. */
int64_t now_wall_ms(void);

/* Allocation that aborts the process on out-of-memory (the only sane
 * reaction in a daemon whose every path would otherwise need it). */
void *xmalloc(size_t);
void *xcalloc(size_t, size_t);
void *xrealloc(void *, size_t);
char *xstrdup(const char *);

/* Wipes and frees a secret string; NULL is a no-op. */
void secret_free(char *);

/* snprintf into buf, always NUL-terminated; returns buf. */
char *strfmt(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Replaces every control byte of s (below ' ', DEL, and both bytes of a
 * UTF-8 C1 control) with `with`, so that outside text stays on one line
 * and sends a terminal nothing; returns s. */
char *str_replace_controls(char *s, char with);

/* The length (1-4) of the well-formed UTF-8 sequence at s[0..n), or 0
 * when s starts with a byte that no valid text has there (a stray
 * continuation byte, an overlong form, a surrogate, a sequence cut
 * short, as when outside text is cut at a byte count). */
size_t utf8_seq_len(const unsigned char *s, size_t n);

/* Sleeps for ms milliseconds, restarting after signals unless
 * *stop becomes non-zero (stop may be NULL). */
void sleep_ms(int64_t ms, volatile int *stop);

/*
 * Parses a duration: "250ms", "10s", "5m", "1h", "2d", or a bare number
 * of milliseconds.  Returns 0, or -1 for garbage, negatives or overflow.
 */
int duration_parse(const char *, int64_t *ms);
/* Formats ms in the largest unit that is exact ("1h", "1500ms"). */
char *duration_format(char *buf, size_t size, int64_t ms);

/* Parses s[0..len) as a whole decimal int64 (a message_id, say): false
 * for an empty, overlong, partly numeric or out-of-range text. */
bool int64_parse(const char *s, size_t len, int64_t *out);

#endif
