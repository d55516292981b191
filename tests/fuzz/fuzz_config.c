/*
 * Fuzzes the config loader with whole YAML files: load (twice, the
 * second over the first, as a reload does), dump, reload checks, free.
 * No crash, no leak, and these invariants:
 *  - a loaded http.listen is one the HTTP endpoint will bind
 *    (otherwise `outboxd check` says OK and the daemon fails at start);
 *  - a dump never shows a password: the secret keys read <set>/<unset>,
 *    and libpq finds no password (nor sslpassword) in the dumped
 *    postgres.conninfo;
 *  - a dump holds no control byte, C1 controls (C2 80..C2 9F) included.
 * The config sources are compiled with -Dopen=fuzz_open: only files under
 * /fuzz-secrets/ (absolute, as password_file must be) can be opened, and
 * they are looked up in a temporary directory made here, so no input can
 * make the fuzzer read a FIFO, a device or a real file.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "config.h"
#include "fuzz.h"

#define SECRETS "fuzz-secrets/"

static FILE *devnull;
static char sandbox[64];
static int sandbox_fd = -1;	/* "fuzz-secrets/..." is opened under it */

int fuzz_open(const char *, int, ...);

int
fuzz_open(const char *path, int flags, ...)
{
	if (path[0] != '/' ||
	    strncmp(path + 1, SECRETS, strlen(SECRETS)) != 0 ||
	    strstr(path, "..") != NULL) {
		errno = ENOENT;
		return -1;
	}
	/* openat: "open" itself is this function in this file. */
	return openat(sandbox_fd, path + 1, flags & ~O_CREAT);
}

static void
put_file(const char *name, const char *text, mode_t mode)
{
	char path[128];
	int fd;

	snprintf(path, sizeof(path), "%s%s", SECRETS, name);
	fd = openat(sandbox_fd, path, O_WRONLY | O_CREAT | O_TRUNC, mode);
	if (fd == -1 || write(fd, text, strlen(text)) < 0 ||
	    fchmod(fd, mode) == -1) {
		perror(path);
		exit(1);
	}
	close(fd);
}

static void
sandbox_remove(void)
{
	static const char *const names[] = { "ok", "crlf", "open", "empty",
		"long", NULL };
	char path[128];

	if (sandbox_fd == -1)
		return;
	for (int i = 0; names[i] != NULL; i++) {
		snprintf(path, sizeof(path), "%s%s", SECRETS, names[i]);
		unlinkat(sandbox_fd, path, 0);
	}
	unlinkat(sandbox_fd, SECRETS, AT_REMOVEDIR);
	close(sandbox_fd);
	rmdir(sandbox);
}

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
	char longline[1100];

	(void)argc;
	(void)argv;
	devnull = fopen("/dev/null", "w");
	snprintf(sandbox, sizeof(sandbox), "%s/outboxd-fuzz.XXXXXX",
	    getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (devnull == NULL || mkdtemp(sandbox) == NULL ||
	    (sandbox_fd = openat(AT_FDCWD, sandbox, O_RDONLY | O_DIRECTORY)) ==
	    -1 || mkdirat(sandbox_fd, SECRETS, 0700) != 0) {
		perror("fuzz_config: sandbox");
		exit(1);
	}
	atexit(sandbox_remove);
	memset(longline, 'a', sizeof(longline) - 1);
	longline[sizeof(longline) - 1] = '\0';
	put_file("ok", "fuzz-file-secret\nsecond line\n", 0600);
	put_file("crlf", "fuzz-crlf-secret\r\n", 0600);
	put_file("open", "fuzz-open-secret\n", 0644);
	put_file("empty", "", 0600);
	put_file("long", longline, 0600);
	setenv("FUZZ_SECRET", "fuzz-env-secret", 1);
	setenv("FUZZ_EMPTY", "", 1);
	return 0;
}

/* The dump line of key: "key: value\n"; NULL if missing. */
static const char *
dump_value(const char *dump, const char *key, size_t *len)
{
	size_t klen = strlen(key);

	for (const char *p = dump; p != NULL && *p != '\0';) {
		const char *eol = strchr(p, '\n');

		if (strncmp(p, key, klen) == 0 && p[klen] == ':' &&
		    p[klen + 1] == ' ') {
			p += klen + 2;
			*len = eol ? (size_t)(eol - p) : strlen(p);
			return p;
		}
		p = eol ? eol + 1 : NULL;
	}
	return NULL;
}

/* Undoes the dump's escapes (\" \\ \xHH) of n bytes of s; \x80..\x9f is
 * a C1 control, the code point, two bytes in UTF-8. */
static char *
unescape(const char *s, size_t n)
{
	char *out = malloc(n + 1), *o = out;

	FUZZ_CHECK(out != NULL, "malloc");
	for (size_t i = 0; i < n; i++) {
		if (s[i] != '\\') {
			*o++ = s[i];
			continue;
		}
		FUZZ_CHECK(i + 1 < n, "dangling escape in %.*s", (int)n, s);
		if (s[i + 1] == 'x') {
			unsigned v;

			FUZZ_CHECK(i + 3 < n &&
			    sscanf(s + i + 2, "%2x", &v) == 1 && v <= 0x9f,
			    "bad \\x escape in %.*s", (int)n, s);
			if (v >= 0x80)
				*o++ = (char)0xc2;
			*o++ = (char)v;
			i += 3;
		} else {
			FUZZ_CHECK(s[i + 1] == '"' || s[i + 1] == '\\',
			    "unknown escape in %.*s", (int)n, s);
			*o++ = s[++i];
		}
	}
	*o = '\0';
	return out;
}

static void
check_dump(const struct config *c)
{
	static const char *const secret_keys[] = { "postgres.password",
		"postgres.password_env", "postgres.password_file",
		"rabbitmq.password", "rabbitmq.password_env",
		"rabbitmq.password_file", "redis.password",
		"redis.password_env", "redis.password_file", NULL };
	char *dump = NULL, *info;
	size_t dlen = 0, len;
	const char *v;
	FILE *f = open_memstream(&dump, &dlen);
	PQconninfoOption *opts;

	FUZZ_CHECK(f != NULL, "open_memstream");
	config_dump(c, f);
	fclose(f);
	for (int i = 0; secret_keys[i] != NULL; i++) {
		v = dump_value(dump, secret_keys[i], &len);
		FUZZ_CHECK(v != NULL, "%s missing from the dump",
		    secret_keys[i]);
		FUZZ_CHECK((len == 5 && memcmp(v, "<set>", 5) == 0) ||
		    (len == 7 && memcmp(v, "<unset>", 7) == 0),
		    "%s dumped as %.*s", secret_keys[i], (int)len, v);
	}
	/* The conninfo is dumped escaped, between double quotes, on one
	 * line: what libpq makes of it must hold no password. */
	v = dump_value(dump, "postgres.conninfo", &len);
	FUZZ_CHECK(v != NULL && len >= 2 && v[0] == '"' && v[len - 1] == '"',
	    "postgres.conninfo dumped as %.*s", (int)len, v ? v : "");
	for (size_t i = 0; i < dlen; i++) {
		FUZZ_CHECK((unsigned char)dump[i] >= ' ' || dump[i] == '\n',
		    "control byte 0x%02x in the dump",
		    (unsigned char)dump[i]);
		/* C1 controls (UTF-8 C2 80..C2 9F) too: CSI, NEL. */
		FUZZ_CHECK((unsigned char)dump[i] != 0xc2 || i + 1 == dlen ||
		    (unsigned char)dump[i + 1] < 0x80 ||
		    (unsigned char)dump[i + 1] > 0x9f,
		    "C1 control 0x%02x in the dump",
		    (unsigned char)dump[i + 1]);
	}
	info = unescape(v + 1, len - 2);
	opts = PQconninfoParse(info, NULL);
	for (PQconninfoOption *o = opts; o != NULL && o->keyword != NULL;
	    o++)
		/* dispchar "*": libpq's own mark of a secret (password,
		 * sslpassword). */
		if (o->dispchar[0] == '*' && o->val != NULL)
			FUZZ_CHECK(strcmp(o->val, "<set>") == 0,
			    "%s \"%s\" in the dumped conninfo %s", o->keyword,
			    o->val, info);
	PQconninfoFree(opts);
	free(info);
	free(dump);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct config c, d;
	char err[256];

	memset(&c, 0, sizeof(c));
	if (config_load_string(&c, "fuzz.yml", (const char *)data, size,
	    devnull) != 0) {
		config_free(&c);
		return 0;
	}
	FUZZ_CHECK(http_listen_check(c.http.listen, err, sizeof(err)) == 0,
	    "config took http.listen but the endpoint refuses it: %s", err);
	check_dump(&c);
	config_defaults(&d);
	(void)config_reload_check(&d, &c, devnull);
	config_apply_reloadable(&d, &c);
	config_free(&d);
	/* Loading over a loaded config frees what it held first. */
	FUZZ_CHECK(config_load_string(&c, "fuzz.yml", (const char *)data,
	    size, devnull) == 0, "a second load of the same text failed");
	config_free(&c);
	return 0;
}
