/*
 * Fuzzes log_quote(), which makes any string (an error from a server, a
 * row's last_error, a file name) safe as one logfmt value.  Whatever the
 * input and buffer size, the output must fit, be NUL-terminated, hold
 * no byte that would split or forge a log line, and be valid UTF-8 (a
 * character cut in half made journalctl show the line as a blob).
 */
#include <stdbool.h>
#include <string.h>

#include "fuzz.h"
#include "log.h"
#include "util.h"

static bool
is_utf8(const char *s)
{
	size_t n = strlen(s), len;

	for (size_t i = 0; i < n; i += len)
		if ((len = utf8_seq_len((const unsigned char *)s + i,
		    n - i)) == 0)
			return false;
	return true;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s, *buf;
	size_t bufsz, n;
	bool quoted;

	if (size < 1)
		return 0;
	bufsz = data[0];	/* 0 to 255, like the callers' buffers */
	data++;
	size--;
	s = malloc(size + 1);
	buf = malloc(bufsz + 1);
	if (s == NULL || buf == NULL)
		goto out;
	memcpy(s, data, size);
	s[size] = '\0';
	memset(buf, 'x', bufsz + 1);
	FUZZ_CHECK(log_quote(buf, bufsz, s) == buf, "returns another buffer");
	FUZZ_CHECK(buf[bufsz] == 'x', "wrote past size %zu", bufsz);
	if (bufsz == 0)
		goto out;
	n = strnlen(buf, bufsz);
	FUZZ_CHECK(n < bufsz, "unterminated in %zu bytes", bufsz);
	quoted = n > 0 && buf[0] == '"';
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)buf[i];

		/* No newline, no control byte: one event, one line. */
		FUZZ_CHECK(c >= ' ' && c != 0x7f, "byte 0x%02x at %zu", c, i);
		if (!quoted)
			FUZZ_CHECK(c != ' ' && c != '"' && c != '=',
			    "'%c' in an unquoted value", c);
	}
	for (size_t i = 0, len; i < n; i += len) {
		len = utf8_seq_len((const unsigned char *)buf + i, n - i);
		FUZZ_CHECK(len > 0, "not UTF-8 at %zu: %s", i, buf);
	}
	if (quoted && bufsz >= 3) {
		/* Inside the quotes every '"' and '\' is escaped, and the
		 * closing quote is there even when the value was cut. */
		size_t i;

		FUZZ_CHECK(n >= 2 && buf[n - 1] == '"', "no closing quote: %s",
		    buf);
		for (i = 1; i < n - 1; i++) {
			if (buf[i] == '\\') {
				i++;
				FUZZ_CHECK(i < n - 1, "dangling escape: %s",
				    buf);
			} else {
				FUZZ_CHECK(buf[i] != '"', "bare quote: %s",
				    buf);
			}
		}
	}
	/* A value that needs no quoting, is UTF-8 and fits comes out as
	 * it is (bytes that are not UTF-8 become '?'). */
	if (!quoted && size < bufsz && strlen(s) == size && is_utf8(s))
		FUZZ_CHECK(strcmp(buf, s) == 0, "changed %s into %s", s, buf);
out:
	free(s);
	free(buf);
	return 0;
}
