/* The HTTP endpoint, scraped by a tiny raw-socket HTTP/1.0 client: routes,
 * status codes, bad listen values, a busy port and misbehaving clients. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "http.h"
#include "metrics.h"
#include "util.h"

struct reply {
	int status;		/* 0: no HTTP answer at all */
	char head[2048];	/* status line and headers */
	char *body;
	size_t body_len;
};

/* A connected socket from a loopback address (NULL: any) to addr:port
 * (numeric), or -1. */
static int
dial_from(const char *from, const char *addr, int port, int timeout_ms)
{
	struct sockaddr_storage ss;
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
	socklen_t len;
	int fd;

	memset(&ss, 0, sizeof(ss));
	if (strchr(addr, ':') != NULL) {
		struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;

		s6->sin6_family = AF_INET6;
		s6->sin6_port = htons((uint16_t)port);
		ck_assert_int_eq(inet_pton(AF_INET6, addr, &s6->sin6_addr), 1);
		len = sizeof(*s6);
	} else {
		struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;

		s4->sin_family = AF_INET;
		s4->sin_port = htons((uint16_t)port);
		ck_assert_int_eq(inet_pton(AF_INET, addr, &s4->sin_addr), 1);
		len = sizeof(*s4);
	}
	fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(fd, 0);
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (from != NULL) {
		struct sockaddr_in src = { .sin_family = AF_INET };

		ck_assert_int_eq(inet_pton(AF_INET, from, &src.sin_addr), 1);
		ck_assert_int_eq(bind(fd, (struct sockaddr *)&src,
		    sizeof(src)), 0);
	}
	if (connect(fd, (struct sockaddr *)&ss, len) == -1) {
		close(fd);
		return -1;
	}
	return fd;
}

static int
dial(const char *addr, int port, int timeout_ms)
{
	return dial_from(NULL, addr, port, timeout_ms);
}

/* Sends raw request text and reads the answer until the server closes. */
static void
request(const char *addr, int port, const char *raw, struct reply *r,
    int timeout_ms)
{
	size_t cap = 4096, len = 0;
	char *buf = xmalloc(cap), *sep;
	int fd = dial(addr, port, timeout_ms);

	memset(r, 0, sizeof(*r));
	if (fd == -1)
		goto done;
	if (send(fd, raw, strlen(raw), MSG_NOSIGNAL) != (ssize_t)strlen(raw))
		goto done;
	for (;;) {
		ssize_t n;

		if (len + 1 >= cap)
			buf = xrealloc(buf, cap *= 2);
		n = recv(fd, buf + len, cap - len - 1, 0);
		if (n <= 0)
			break;
		len += (size_t)n;
	}
	buf[len] = '\0';
	sep = strstr(buf, "\r\n\r\n");
	if (sep == NULL || sscanf(buf, "HTTP/1.%*d %d", &r->status) != 1) {
		r->status = 0;
		goto done;
	}
	strfmt(r->head, sizeof(r->head), "%.*s", (int)(sep - buf + 2), buf);
	r->body_len = len - (size_t)(sep + 4 - buf);
	r->body = xmalloc(r->body_len + 1);
	memcpy(r->body, sep + 4, r->body_len);
	r->body[r->body_len] = '\0';
done:
	if (fd != -1)
		close(fd);
	free(buf);
	if (r->body == NULL)
		r->body = xcalloc(1, 1);
}

static void
get(int port, const char *path, struct reply *r)
{
	char raw[256];

	strfmt(raw, sizeof(raw), "GET %s HTTP/1.0\r\n\r\n", path);
	request("127.0.0.1", port, raw, r, 5000);
}

static struct http *
start(const char *listen, char *err, size_t errlen)
{
	char buf[64];
	struct http_conf conf = { .listen = strfmt(buf, sizeof(buf), "%s",
	    listen) };

	return http_start(&conf, err, errlen);
}

static struct http *server;
static int port;

static void
setup(void)
{
	char err[256] = "";

	metrics_init("9.9.9");
	server = start("127.0.0.1:0", err, sizeof(err));
	ck_assert_msg(server != NULL, "%s", err);
	port = http_port(server);
	ck_assert_int_gt(port, 0);
}

static void
teardown(void)
{
	http_stop(server);
	server = NULL;
}

START_TEST(test_metrics)
{
	struct reply r;

	metrics_inc_published(42);
	metrics_set_connection(METRICS_SERVER_RABBITMQ, true);
	get(port, "/metrics", &r);
	ck_assert_int_eq(r.status, 200);
	ck_assert_ptr_ne(strstr(r.head, "\r\nContent-Type: text/plain; "
	    "version=0.0.4; charset=utf-8\r\n"), NULL);
	ck_assert_ptr_ne(strstr(r.body, "# TYPE outboxd_messages_published_"
	    "total counter\noutboxd_messages_published_total 42\n"), NULL);
	ck_assert_ptr_ne(strstr(r.body,
	    "\noutboxd_build_info{version=\"9.9.9\"} 1\n"), NULL);
	ck_assert_ptr_ne(strstr(r.body,
	    "\noutboxd_connection_up{server=\"rabbitmq\"} 1\n"), NULL);
	/* The body is the whole rendering, nothing more. */
	ck_assert_uint_eq(r.body_len, metrics_render(NULL, 0));
	free(r.body);

	/* A query string does not change the route. */
	get(port, "/metrics?name[]=x", &r);
	ck_assert_int_eq(r.status, 200);
	free(r.body);
}
END_TEST

START_TEST(test_healthz)
{
	struct reply r;

	/* Not judged yet: the module starts unhealthy. */
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 503);
	ck_assert_str_eq(r.body, "unhealthy: starting\n");
	free(r.body);

	metrics_set_health(true, NULL);
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 200);
	ck_assert_str_eq(r.body, "ok\n");
	ck_assert_ptr_ne(strstr(r.head, "\r\nContent-Type: text/plain; "
	    "charset=utf-8\r\n"), NULL);
	free(r.body);

	metrics_set_health(false, "rabbitmq down");
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 503);
	ck_assert_str_eq(r.body, "unhealthy: rabbitmq down\n");
	free(r.body);

	/* HTTP/1.1 works too, and HEAD gives the headers only. */
	metrics_set_health(true, "");
	request("127.0.0.1", port, "GET /healthz HTTP/1.1\r\nHost: x\r\n"
	    "Connection: close\r\n\r\n", &r, 5000);
	ck_assert_int_eq(r.status, 200);
	ck_assert_str_eq(r.body, "ok\n");
	free(r.body);
	request("127.0.0.1", port, "HEAD /healthz HTTP/1.0\r\n\r\n", &r, 5000);
	ck_assert_int_eq(r.status, 200);
	ck_assert_uint_eq(r.body_len, 0);
	free(r.body);
}
END_TEST

START_TEST(test_not_found)
{
	static const char *const paths[] = { "/", "/metrics/", "/health",
		"/healthz/x", "/METRICS", "/favicon.ico" };
	struct reply r;

	for (size_t i = 0; i < ARRAY_LEN(paths); i++) {
		get(port, paths[i], &r);
		ck_assert_msg(r.status == 404, "%s: %d", paths[i], r.status);
		ck_assert_str_eq(r.body, "not found\n");
		free(r.body);
	}
	/* An unknown path is unknown whatever the method. */
	request("127.0.0.1", port, "POST /nope HTTP/1.0\r\n\r\n", &r, 5000);
	ck_assert_int_eq(r.status, 404);
	free(r.body);
}
END_TEST

START_TEST(test_method_not_allowed)
{
	static const char *const raws[] = {
		"POST /metrics HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello",
		"PUT /healthz HTTP/1.0\r\nContent-Length: 0\r\n\r\n",
		"DELETE /metrics HTTP/1.0\r\n\r\n",
		"OPTIONS /healthz HTTP/1.0\r\n\r\n",
	};
	struct reply r;

	for (size_t i = 0; i < ARRAY_LEN(raws); i++) {
		request("127.0.0.1", port, raws[i], &r, 5000);
		ck_assert_msg(r.status == 405, "%s: %d", raws[i], r.status);
		ck_assert_ptr_ne(strstr(r.head, "\r\nAllow: GET, HEAD\r\n"),
		    NULL);
		ck_assert_str_eq(r.body, "method not allowed\n");
		free(r.body);
	}
}
END_TEST

static const struct {
	const char *listen, *why;
} bad_cases[] = {
	{ "nohost", "expected address:port" },
	{ "127.0.0.1", "expected address:port" },
	{ "127.0.0.1:99999", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:65536", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:-1", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:+80", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:80 ", "port must be a number from 0 to 65535" },
	{ "127.0.0.1:0009187", "port must be a number from 0 to 65535" },
	{ ":9187", "missing address" },
	{ "[]:9187", "missing address" },
	{ "[::1", "expected [IPv6 address]:port" },
	{ "[::1]9187", "expected [IPv6 address]:port" },
	{ "[127.0.0.1]:9187", "not an IPv6 address" },
	{ "[zz]:1", "not an IPv6 address" },
	{ "256.0.0.1:9187", "not an IPv4 address" },
	{ "localhost:9187", "names are not resolved" },
	{ "::1:9187", "IPv6 goes in brackets" },
	{ "127.0.0.1 :9187", "not an IPv4 address" },
};

START_TEST(test_bad_listen)
{
	const char *listen = bad_cases[_i].listen;
	char err[256], want[256];

	strfmt(want, sizeof(want), "http.listen %s: ", listen);
	err[0] = '\0';
	ck_assert_ptr_eq(start(listen, err, sizeof(err)), NULL);
	ck_assert_msg(strncmp(err, want, strlen(want)) == 0 &&
	    strstr(err, bad_cases[_i].why) != NULL, "%s: %s", listen, err);
	/* The check alone says the same, without binding. */
	err[0] = '\0';
	ck_assert_int_eq(http_listen_check(listen, err, sizeof(err)), -1);
	ck_assert_msg(strstr(err, bad_cases[_i].why) != NULL, "%s", err);
	/* A short or missing error buffer is fine. */
	ck_assert_ptr_eq(start(listen, want, 8), NULL);
	ck_assert_uint_eq(strlen(want), 7);
	ck_assert_ptr_eq(start(listen, NULL, 0), NULL);
}
END_TEST

START_TEST(test_good_listen_syntax)
{
	static const char *const good[] = { "", "127.0.0.1:9187",
		"0.0.0.0:9187", "[::1]:9187", "[::]:0", "10.1.2.3:65535" };
	char err[128];

	for (size_t i = 0; i < ARRAY_LEN(good); i++)
		ck_assert_msg(http_listen_check(good[i], err,
		    sizeof(err)) == 0, "%s", good[i]);
	ck_assert_int_eq(http_listen_check(NULL, err, sizeof(err)), 0);
}
END_TEST

START_TEST(test_port_in_use)
{
	char listen[64], err[256], want[256];
	struct http *again;
	struct reply r;

	strfmt(listen, sizeof(listen), "127.0.0.1:%d", port);
	ck_assert_ptr_eq(start(listen, err, sizeof(err)), NULL);
	strfmt(want, sizeof(want), "http.listen %s: Address already in use",
	    listen);
	ck_assert_str_eq(err, want);
	/* The failed start left the running server alone. */
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 503);
	free(r.body);

	/* Stopping releases the port at once (a reload can rebind). */
	http_stop(server);
	server = NULL;
	again = start(listen, err, sizeof(err));
	ck_assert_msg(again != NULL, "%s", err);
	ck_assert_int_eq(http_port(again), port);
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 503);
	free(r.body);
	http_stop(again);
}
END_TEST

START_TEST(test_disabled)
{
	struct http_conf conf = { .listen = NULL };
	char err[64] = "";
	struct http *h = start("", err, sizeof(err));

	ck_assert_ptr_ne(h, NULL);
	ck_assert_int_eq(http_port(h), 0);
	ck_assert_str_eq(err, "");
	http_stop(h);
	h = http_start(&conf, err, sizeof(err));
	ck_assert_ptr_ne(h, NULL);
	http_stop(h);
	ck_assert_int_eq(http_port(NULL), 0);
	http_stop(NULL);
}
END_TEST

/*
 * A socket bound to 127.0.0.1:at and not listening, or -1 when that
 * address is taken.  While it is held, no listener of another process
 * can answer there, so a refused connection is the server's doing.
 */
static int
hold_ipv4(int at)
{
	struct sockaddr_in a;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ck_assert_int_ge(fd, 0);
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons((uint16_t)at);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == -1) {
		close(fd);
		return -1;
	}
	return fd;
}

START_TEST(test_ipv6)
{
	char err[256];
	struct http *h = NULL;
	struct reply r;
	int held = -1;

	/* The port is the kernel's choice for ::1, and some other process
	 * may listen on 127.0.0.1 with the same number: then choose again. */
	for (int tries = 0; tries < 5 && held == -1; tries++) {
		http_stop(h);
		h = start("[::1]:0", err, sizeof(err));
		if (h == NULL) {
			/* A host without IPv6 loopback: the error says so,
			 * and so does the run's summary. */
			ck_assert_ptr_ne(strstr(err, "http.listen [::1]:0: "),
			    NULL);
			printf("SKIP: check_http test_ipv6: no IPv6 loopback "
			    "(%s)\n", err);
			fflush(stdout);
			return;
		}
		ck_assert_int_gt(http_port(h), 0);
		held = hold_ipv4(http_port(h));
	}
	ck_assert_int_ge(held, 0);
	metrics_set_health(true, NULL);
	request("::1", http_port(h), "GET /healthz HTTP/1.0\r\n\r\n", &r,
	    5000);
	ck_assert_int_eq(r.status, 200);
	free(r.body);
	/* Bound to ::1 only: not reachable over IPv4. */
	ck_assert_int_eq(dial("127.0.0.1", http_port(h), 1000), -1);
	close(held);
	http_stop(h);
}
END_TEST

/* A client that sends half a request and waits must not block others. */
START_TEST(test_slow_client)
{
	int slow = dial("127.0.0.1", port, 5000);
	struct reply r;

	ck_assert_int_ge(slow, 0);
	ck_assert_int_eq(send(slow, "GET /metr", 9, MSG_NOSIGNAL), 9);
	get(port, "/metrics", &r);
	ck_assert_int_eq(r.status, 200);
	free(r.body);
	close(slow);
}
END_TEST

/*
 * One client holding connections with half a request each, trickling a
 * byte now and then (the idle timeout never ends them): it gets a few
 * slots, and others are still served.  Before, it could take all 16.
 */
START_TEST(test_one_client_cannot_take_every_slot)
{
	int held[16], accepted = 0;
	struct reply r;

	for (size_t i = 0; i < ARRAY_LEN(held); i++) {
		held[i] = dial_from("127.0.0.2", "127.0.0.1", port, 5000);
		ck_assert_int_ge(held[i], 0);
		ck_assert_int_eq(send(held[i], "GET /metr", 9, MSG_NOSIGNAL),
		    9);
	}
	get(port, "/healthz", &r);
	ck_assert_int_eq(r.status, 503);
	free(r.body);
	/* The server closed those past the per-address limit. */
	for (size_t i = 0; i < ARRAY_LEN(held); i++) {
		char c;
		ssize_t n = send(held[i], "i", 1, MSG_NOSIGNAL);

		if (n == 1 && recv(held[i], &c, 1, MSG_DONTWAIT) == -1 &&
		    (errno == EAGAIN || errno == EWOULDBLOCK))
			accepted++;
		close(held[i]);
	}
	ck_assert_int_le(accepted, 4);
	ck_assert_int_ge(accepted, 1);
}
END_TEST

/*
 * Past the connection limit (64: four from each of sixteen addresses)
 * new clients are turned away (or kept waiting), and service comes back
 * as soon as the idle ones leave.
 */
START_TEST(test_connection_limit)
{
	int idle[64];
	char from[32];
	struct reply r;
	int64_t deadline;

	for (size_t i = 0; i < ARRAY_LEN(idle); i++) {
		strfmt(from, sizeof(from), "127.0.1.%zu", 1 + i / 4);
		idle[i] = dial_from(from, "127.0.0.1", port, 5000);
		ck_assert_int_ge(idle[i], 0);
	}
	/* Let the server take all of them before the next one arrives. */
	sleep_ms(200, NULL);
	request("127.0.0.1", port, "GET /healthz HTTP/1.0\r\n\r\n", &r, 500);
	ck_assert_int_eq(r.status, 0);
	free(r.body);
	for (size_t i = 0; i < ARRAY_LEN(idle); i++)
		close(idle[i]);
	deadline = now_mono_ms() + 5000;
	do {
		get(port, "/healthz", &r);
		free(r.body);
		if (r.status != 0)
			break;
		sleep_ms(50, NULL);
	} while (now_mono_ms() < deadline);
	ck_assert_int_eq(r.status, 503);
}
END_TEST

static Suite *
http_suite(void)
{
	Suite *s = suite_create("http");
	TCase *tc = tcase_create("routes");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_metrics);
	tcase_add_test(tc, test_healthz);
	tcase_add_test(tc, test_not_found);
	tcase_add_test(tc, test_method_not_allowed);
	suite_add_tcase(s, tc);

	tc = tcase_create("listen");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 30);
	tcase_add_loop_test(tc, test_bad_listen, 0, ARRAY_LEN(bad_cases));
	tcase_add_test(tc, test_good_listen_syntax);
	tcase_add_test(tc, test_port_in_use);
	tcase_add_test(tc, test_disabled);
	tcase_add_test(tc, test_ipv6);
	suite_add_tcase(s, tc);

	tc = tcase_create("clients");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_slow_client);
	tcase_add_test(tc, test_one_client_cannot_take_every_slot);
	tcase_add_test(tc, test_connection_limit);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(http_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
