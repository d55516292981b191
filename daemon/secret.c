/*
 * Secrets: reading a password file without trusting it (mode, size,
 * never blocking on a FIFO), and reading it again before each connection.
 */
#include "secret.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "util.h"

/* A password file's first line; longer is surely the wrong file. */
#define SECRET_MAX_BYTES	1024

/*
 * Reads the first line of a password file, refusing one that others can
 * read: a secret in a world-readable file is no secret.  Its group may
 * read it only when root owns it.  Messages never
 * name the file: someone may have pasted the password itself there.
 */
char *
secret_file_read(const char *path, char *why, size_t whysz, bool *absent)
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
	if (absent != NULL)
		*absent = fd == -1 && errno == ENOENT;
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
	/* libpq's rule for its key files: a file root owns may also be
	 * read by its group.  That is how a Kubernetes secret reaches a
	 * container's user (owned by root, mode 0440, the pod's fsGroup),
	 * and 0600 there could not be read at all. */
	if (st.st_uid == 0 && (st.st_mode & ((S_IRWXG & ~S_IRGRP) |
	    S_IRWXO))) {
		strfmt(why, whysz, "the file is accessible by others, or its "
		    "group may do more than read it (mode %04o); give it mode "
		    "0640 or less (a Kubernetes secret: defaultMode 0440, "
		    "with the pod's fsGroup)", (unsigned)(st.st_mode & 07777));
		goto fail;
	}
	if (st.st_uid != 0 && (st.st_mode & (S_IRWXG | S_IRWXO))) {
		strfmt(why, whysz, "the file is accessible by group or others "
		    "(mode %04o); run chmod 600 on it (only a file owned by "
		    "root may be readable by its group)",
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

/*
 * Kubernetes updates a mounted secret in place, and a Vault agent
 * rewrites its file: a password read once at start-up kept the old one,
 * and the first reconnect after a rotation failed until a restart.  The
 * file is cheap to read, and only read when a connection is made.
 */
void
secret_reread(char **password, const char *path, const char *key)
{
	char why[256], *fresh;

	if (path == NULL)
		return;
	fresh = secret_file_read(path, why, sizeof(why), NULL);
	if (fresh == NULL) {
		log_warn("password file not read; using the password read "
		    "before", "key=%s error=%s", key,
		    log_quote((char[400]){ 0 }, 400, why));
		return;
	}
	if (*password != NULL && strcmp(*password, fresh) == 0) {
		secret_free(fresh);
		return;
	}
	secret_free(*password);
	*password = fresh;
	log_info("password file changed; using the new password", "key=%s",
	    key);
}
