/*
 * The cutter: a thread accepts, and each connection gets two threads,
 * one per direction, that copy with blocking reads and writes (a single
 * poll loop blocked in one write could hold up the other direction).
 * Cutting is shutdown() of both sockets, which ends both threads' reads.
 */
#include "cutter.h"

#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

#define CUTTER_MAX_CONNS 1024
#define CUTTER_CHUNK 65536

struct conn {
	struct tl_cutter *c;
	int client, server;
	pthread_t up, down;	/* client -> server, server -> client */
	bool up_started, down_started;
};

struct tl_cutter {
	int listen_fd, port, to_port;
	char *marker;
	size_t marker_len;
	pthread_t acceptor;
	pthread_mutex_t mu;
	bool stopping;
	int cuts;
	struct conn conns[CUTTER_MAX_CONNS];
	int n;
};

static void
cut(struct conn *k)
{
	shutdown(k->client, SHUT_RDWR);
	shutdown(k->server, SHUT_RDWR);
}

static bool
write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);

		if (w == -1 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		p += w;
		n -= (size_t)w;
	}
	return true;
}

/* Client to server, looking for the marker; the last marker_len - 1
 * bytes seen are kept before each read, so that a marker split between
 * two reads is found too. */
static void *
copy_up(void *arg)
{
	struct conn *k = arg;
	struct tl_cutter *c = k->c;
	size_t keep = c->marker_len - 1, held = 0;
	char *buf = xmalloc(keep + CUTTER_CHUNK);
	ssize_t n;

	while ((n = read(k->client, buf + held, CUTTER_CHUNK)) > 0) {
		if (memmem(buf, held + (size_t)n, c->marker,
		    c->marker_len) != NULL) {
			pthread_mutex_lock(&c->mu);
			c->cuts++;
			pthread_mutex_unlock(&c->mu);
			break;
		}
		if (!write_all(k->server, buf + held, (size_t)n))
			break;
		held += (size_t)n;
		if (held > keep) {
			memmove(buf, buf + held - keep, keep);
			held = keep;
		}
	}
	cut(k);
	free(buf);
	return NULL;
}

static void *
copy_down(void *arg)
{
	struct conn *k = arg;
	char *buf = xmalloc(CUTTER_CHUNK);
	ssize_t n;

	while ((n = read(k->server, buf, CUTTER_CHUNK)) > 0)
		if (!write_all(k->client, buf, (size_t)n))
			break;
	cut(k);
	free(buf);
	return NULL;
}

static int
connect_to(int port)
{
	struct sockaddr_in sin = { .sin_family = AF_INET };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	sin.sin_port = htons((uint16_t)port);
	if (fd != -1 && connect(fd, (struct sockaddr *)&sin,
	    sizeof(sin)) == 0)
		return fd;
	if (fd != -1)
		close(fd);
	return -1;
}

static void *
accept_loop(void *arg)
{
	struct tl_cutter *c = arg;

	for (;;) {
		int client = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
		struct conn *k;

		if (client == -1 && errno == EINTR)
			continue;
		if (client == -1)
			break;	/* the listener was shut down */
		pthread_mutex_lock(&c->mu);
		if (c->stopping || c->n == CUTTER_MAX_CONNS) {
			pthread_mutex_unlock(&c->mu);
			close(client);
			continue;
		}
		k = &c->conns[c->n++];
		k->c = c;
		k->client = client;
		k->server = connect_to(c->to_port);
		if (k->server == -1)
			k->server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC,
			    0);	/* refused: its read ends the client's */
		k->up_started = pthread_create(&k->up, NULL, copy_up, k) == 0;
		k->down_started = k->up_started &&
		    pthread_create(&k->down, NULL, copy_down, k) == 0;
		if (!k->down_started)
			cut(k);
		pthread_mutex_unlock(&c->mu);
	}
	return NULL;
}

struct tl_cutter *
tl_cutter_start(int to_port, const char *marker)
{
	struct tl_cutter *c = xcalloc(1, sizeof(*c));
	struct sockaddr_in sin = { .sin_family = AF_INET };
	socklen_t len = sizeof(sin);

	c->to_port = to_port;
	c->marker = xstrdup(marker);
	c->marker_len = strlen(marker);
	ck_assert_msg(c->marker_len > 0, "the cutter needs a marker");
	pthread_mutex_init(&c->mu, NULL);
	c->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_msg(c->listen_fd != -1 && bind(c->listen_fd,
	    (struct sockaddr *)&sin, sizeof(sin)) == 0 &&
	    listen(c->listen_fd, 16) == 0 && getsockname(c->listen_fd,
	    (struct sockaddr *)&sin, &len) == 0, "cutter: %s",
	    strerror(errno));
	c->port = ntohs(sin.sin_port);
	ck_assert_int_eq(pthread_create(&c->acceptor, NULL, accept_loop, c),
	    0);
	return c;
}

int
tl_cutter_port(const struct tl_cutter *c)
{
	return c->port;
}

int
tl_cutter_cuts(struct tl_cutter *c)
{
	int n;

	pthread_mutex_lock(&c->mu);
	n = c->cuts;
	pthread_mutex_unlock(&c->mu);
	return n;
}

void
tl_cutter_stop(struct tl_cutter *c)
{
	pthread_mutex_lock(&c->mu);
	c->stopping = true;
	pthread_mutex_unlock(&c->mu);
	shutdown(c->listen_fd, SHUT_RDWR);
	pthread_join(c->acceptor, NULL);
	close(c->listen_fd);
	for (int i = 0; i < c->n; i++) {
		struct conn *k = &c->conns[i];

		cut(k);
		if (k->up_started)
			pthread_join(k->up, NULL);
		if (k->down_started)
			pthread_join(k->down, NULL);
		close(k->client);
		close(k->server);
	}
	pthread_mutex_destroy(&c->mu);
	free(c->marker);
	free(c);
}
