/*
 * Fuzzes duration_parse() (config values, `outboxd purge --older-than`)
 * and checks that every duration it accepts formats and parses back to
 * the same number of milliseconds.
 */
#include <inttypes.h>
#include <string.h>

#include "fuzz.h"
#include "util.h"

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s, buf[64];
	int64_t ms, again;

	/* duration_parse takes a C string: an embedded NUL ends it. */
	s = malloc(size + 1);
	if (s == NULL)
		return 0;
	memcpy(s, data, size);
	s[size] = '\0';
	if (duration_parse(s, &ms) == 0) {
		FUZZ_CHECK(ms >= 0, "\"%s\" gave %" PRId64, s, ms);
		duration_format(buf, sizeof(buf), ms);
		FUZZ_CHECK(duration_parse(buf, &again) == 0,
		    "\"%s\" formats as unparsable \"%s\"", s, buf);
		FUZZ_CHECK(again == ms, "\"%s\" = %" PRId64 " but \"%s\" = %"
		    PRId64, s, ms, buf, again);
	}
	free(s);
	return 0;
}
