/*
 * Shared bits of the libFuzzer targets: the entry points libFuzzer calls
 * and a check that aborts (so the fuzzer records the input) with a reason.
 */
#ifndef OUTBOXD_FUZZ_H
#define OUTBOXD_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* An invariant the code under test broke: abort with a message. */
#define FUZZ_CHECK(cond, ...)						\
	do {								\
		if (!(cond)) {						\
			fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__,	\
			    __LINE__, #cond);				\
			fprintf(stderr, __VA_ARGS__);			\
			fputc('\n', stderr);				\
			abort();					\
		}							\
	} while (0)

#endif
