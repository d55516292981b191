/*
 * Fuzzes http_listen_check(), the parser of http.listen, with error
 * buffers of every small size: it must always terminate the message
 * inside the buffer, and say something when it refuses.
 */
#include <string.h>

#include "fuzz.h"
#include "http.h"

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s, *err;
	size_t errlen;
	int rc;

	if (size < 1)
		return 0;
	/* The first byte picks the error buffer's size, 0 to 255. */
	errlen = data[0];
	data++;
	size--;
	s = malloc(size + 1);
	err = malloc(errlen + 1);
	if (s == NULL || err == NULL)
		goto out;
	memcpy(s, data, size);
	s[size] = '\0';
	/* A guard byte past the end catches a write beyond errlen even
	 * where ASan's redzone would round it away. */
	memset(err, 'x', errlen + 1);
	rc = http_listen_check(s, errlen > 0 ? err : NULL, errlen);
	FUZZ_CHECK(rc == 0 || rc == -1, "rc %d", rc);
	FUZZ_CHECK(err[errlen] == 'x', "wrote past errlen %zu", errlen);
	if (rc == -1 && errlen > 0) {
		FUZZ_CHECK(memchr(err, '\0', errlen) != NULL,
		    "unterminated error");
		FUZZ_CHECK(errlen < 2 || err[0] != '\0', "empty error");
	}
	if (*s == '\0')
		FUZZ_CHECK(rc == 0, "\"\" (disabled) refused");
out:
	free(s);
	free(err);
	return 0;
}
