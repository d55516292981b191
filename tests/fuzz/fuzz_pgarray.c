/*
 * Fuzzes the decoder of binary text[] values that store.c reads the
 * header keys and values of claimed rows with.  Those arrays come from
 * the server, but their strings come from whatever producers put in the
 * headers column.  store.c is included so its static decoder is reachable.
 */
#include "../../daemon/store.c"

#include "fuzz.h"

#define MAX_ELEMS 64

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct store s;
	size_t offs[MAX_ELEMS], max;
	long n;

	if (size < 1)
		return 0;
	max = data[0] % (MAX_ELEMS + 1);	/* the caller's array size */
	memset(&s, 0, sizeof(s));
	n = decode_text_array(&s, (const char *)data + 1, size - 1, offs,
	    max);
	FUZZ_CHECK(n >= -1 && n <= (long)max, "count %ld of at most %zu", n,
	    max);
	for (long i = 0; i < n; i++) {
		FUZZ_CHECK(offs[i] < s.arena_len, "offset %zu past %zu",
		    offs[i], s.arena_len);
		/* Every element is a terminated string inside the arena. */
		FUZZ_CHECK(memchr(s.arena + offs[i], '\0',
		    s.arena_len - offs[i]) != NULL, "unterminated element");
	}
	free(s.arena);
	return 0;
}
