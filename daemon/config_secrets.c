/*
 * Config, secrets: reading a password file without trusting it (mode,
 * size, never blocking on a FIFO) and wiping libyaml's copy of each
 * password.  Which source a password comes from is the loader's call
 * (secrets_resolve in config.c), since its errors need the file's marks.
 */
#include "config_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A password file's first line; longer is surely the wrong file. */
#define SECRET_MAX_BYTES	1024

/*
 * Reads the first line of a password file, refusing one that others can
 * read: a secret in a world-readable file is no secret.  Messages never
 * name the file: someone may have pasted the password itself there.
 */
char *
cfg_secret_file_read(const char *path, char *why, size_t whysz)
{
	char buf[SECRET_MAX_BYTES + 1];
	char *secret = NULL, *nl;
	struct stat st;
	size_t len = 0;
	int fd;

	/* O_NONBLOCK: opening a FIFO (which the check below refuses)
	 * would otherwise wait for a writer forever.  Regular files
	 * ignore it. */
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd == -1) {
		strfmt(why, whysz, "cannot open the file: %s", strerror(errno));
		return NULL;
	}
	if (fstat(fd, &st) == -1) {
		strfmt(why, whysz, "cannot stat the file: %s", strerror(errno));
		goto fail;
	}
	if (!S_ISREG(st.st_mode)) {
		strfmt(why, whysz, "the file is not a regular file");
		goto fail;
	}
	if (st.st_mode & (S_IRWXG | S_IRWXO)) {
		strfmt(why, whysz, "the file is accessible by group or others "
		    "(mode %04o); run chmod 600 on it",
		    (unsigned)(st.st_mode & 07777));
		goto fail;
	}
	while (len < sizeof(buf) - 1) {
		ssize_t r = read(fd, buf + len, sizeof(buf) - 1 - len);

		if (r == -1 && errno == EINTR)
			continue;
		if (r == -1) {
			strfmt(why, whysz, "cannot read the file: %s",
			    strerror(errno));
			goto fail;
		}
		if (r == 0)
			break;
		len += (size_t)r;
	}
	buf[len] = '\0';
	nl = memchr(buf, '\n', len);
	if (nl == NULL && len == sizeof(buf) - 1) {
		strfmt(why, whysz, "the file's first line is longer than %d "
		    "bytes", SECRET_MAX_BYTES - 1);
		goto fail;
	}
	if (nl != NULL)
		*nl = '\0';
	len = strlen(buf);
	if (len > 0 && buf[len - 1] == '\r')
		buf[--len] = '\0';
	if (len == 0) {
		strfmt(why, whysz, "the file's first line is empty");
		goto fail;
	}
	secret = xstrdup(buf);
fail:
	explicit_bzero(buf, sizeof(buf));
	close(fd);
	return secret;
}

/* libyaml keeps every scalar in the document.  A password may sit under
 * any key (postgres.password, a flat "postgres.password:", inside
 * postgres.conninfo), so every scalar is wiped before the memory goes
 * back to malloc: the document is deleted next anyway. */
void
cfg_document_wipe(yaml_document_t *doc)
{
	for (yaml_node_t *n = doc->nodes.start; n < doc->nodes.top; n++)
		if (n->type == YAML_SCALAR_NODE)
			explicit_bzero(n->data.scalar.value,
			    n->data.scalar.length);
}

/* The parser's input buffers hold the file's text, passwords included,
 * and yaml_parser_delete frees them as they are. */
void
cfg_parser_wipe(yaml_parser_t *parser)
{
	if (parser->raw_buffer.start != NULL)
		explicit_bzero(parser->raw_buffer.start,
		    (size_t)(parser->raw_buffer.end -
		    parser->raw_buffer.start));
	if (parser->buffer.start != NULL)
		explicit_bzero(parser->buffer.start,
		    (size_t)(parser->buffer.end - parser->buffer.start));
}
