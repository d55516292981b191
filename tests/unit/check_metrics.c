/* The metrics registry: exposition format, values, truncation, health
 * and exact counts under concurrent writers. */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "util.h"

/* The whole text, grown the way a caller is meant to. */
static char *
render(void)
{
	size_t size = 64, need;
	char *buf = xmalloc(size);

	/* up_seconds may gain a digit between calls: hence a loop. */
	while ((need = metrics_render(buf, size)) >= size) {
		size = need + 1;
		buf = xrealloc(buf, size);
	}
	ck_assert_uint_eq(strlen(buf), need);
	return buf;
}

/* True when line (without its newline) is a whole line of text. */
static bool
has_line(const char *text, const char *line)
{
	size_t n = strlen(line);

	for (const char *p = text; p != NULL && *p != '\0';) {
		if (strncmp(p, line, n) == 0 && p[n] == '\n')
			return true;
		p = strchr(p, '\n');
		if (p != NULL)
			p++;
	}
	return false;
}

#define ck_assert_line(text, line) \
	ck_assert_msg(has_line(text, line), "missing line: %s", line)

static void
setup(void)
{
	metrics_init("1.2.3");
}

static const struct {
	const char *name, *type;
} families[] = {
	{ "outboxd_build_info", "gauge" },
	{ "outboxd_up_seconds", "gauge" },
	{ "outboxd_messages_published_total", "counter" },
	{ "outboxd_messages_failed_total", "counter" },
	{ "outboxd_messages_dead_total", "counter" },
	{ "outboxd_messages_released_total", "counter" },
	{ "outboxd_rows_pending", "gauge" },
	{ "outboxd_rows_due", "gauge" },
	{ "outboxd_rows_dead", "gauge" },
	{ "outboxd_oldest_due_age_seconds", "gauge" },
	{ "outboxd_rows_counted_timestamp_seconds", "gauge" },
	{ "outboxd_batch_duration_seconds", "histogram" },
	{ "outboxd_confirm_duration_seconds", "histogram" },
	{ "outboxd_leader", "gauge" },
	{ "outboxd_leader_backend", "gauge" },
	{ "outboxd_connection_up", "gauge" },
	{ "outboxd_relays", "gauge" },
	{ "outboxd_relays_connected", "gauge" },
	{ "outboxd_relays_blocked", "gauge" },
	{ "outboxd_reconnects_total", "counter" },
};

START_TEST(test_help_and_type)
{
	char *text = render();
	char line[160];

	for (size_t i = 0; i < ARRAY_LEN(families); i++) {
		const char *help;

		strfmt(line, sizeof(line), "# HELP %s ", families[i].name);
		help = strstr(text, line);
		ck_assert_msg(help != NULL, "no HELP for %s", families[i].name);
		/* Some help text, then TYPE on the very next line. */
		ck_assert_ptr_ne(strchr(help, '\n'), NULL);
		ck_assert_int_gt(strchr(help, '\n') - help, (long)strlen(line));
		strfmt(line, sizeof(line), "# TYPE %s %s\n", families[i].name,
		    families[i].type);
		ck_assert_msg(strncmp(strchr(help, '\n') + 1, line,
		    strlen(line)) == 0, "TYPE after HELP: %s",
		    families[i].name);
	}
	free(text);
}
END_TEST

/* Which family a sample belongs to; histograms add suffixes. */
static int
family_of(const char *name, size_t len)
{
	static const char *const suffixes[] = { "", "_bucket", "_sum",
		"_count" };

	for (size_t i = 0; i < ARRAY_LEN(families); i++) {
		size_t n = strlen(families[i].name);

		for (size_t j = 0; j < ARRAY_LEN(suffixes); j++) {
			if (j > 0 && strcmp(families[i].type, "histogram"))
				break;
			if (len == n + strlen(suffixes[j]) &&
			    strncmp(name, families[i].name, n) == 0 &&
			    strncmp(name + n, suffixes[j], len - n) == 0)
				return (int)i;
		}
	}
	return -1;
}

/*
 * Every sample line parses as name{k="v",...} value, belongs to a known
 * family and comes after that family's TYPE line.
 */
START_TEST(test_sample_syntax)
{
	char *text = render();
	int typed[ARRAY_LEN(families)] = { 0 };
	int samples = 0;
	char *save = NULL;

	for (char *l = strtok_r(text, "\n", &save); l != NULL;
	    l = strtok_r(NULL, "\n", &save)) {
		size_t n;
		char *end;
		int fam;

		if (strncmp(l, "# TYPE ", 7) == 0) {
			n = strcspn(l + 7, " ");
			fam = family_of(l + 7, n);
			ck_assert_int_ge(fam, 0);
			typed[fam] = 1;
			continue;
		}
		if (l[0] == '#')
			continue;
		n = strspn(l, "abcdefghijklmnopqrstuvwxyz_:"
		    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
		ck_assert_msg(n > 0 && !(l[0] >= '0' && l[0] <= '9'),
		    "bad name: %s", l);
		fam = family_of(l, n);
		ck_assert_msg(fam >= 0, "unknown family: %s", l);
		ck_assert_msg(typed[fam], "sample before TYPE: %s", l);
		end = l + n;
		if (*end == '{') {
			end++;
			for (;;) {
				size_t k = strspn(end, "abcdefghijklmnopqrstu"
				    "vwxyz_");

				ck_assert_msg(k > 0 && end[k] == '=' &&
				    end[k + 1] == '"', "bad label: %s", l);
				end += k + 2;
				while (*end != '"' && *end != '\0')
					end += (*end == '\\') ? 2 : 1;
				ck_assert_msg(*end == '"', "open label: %s",
				    l);
				end++;
				if (*end == '}')
					break;
				ck_assert_msg(*end == ',', "bad label: %s", l);
				end++;
			}
			end++;
		}
		ck_assert_msg(*end == ' ', "no value: %s", l);
		(void)strtod(end + 1, &end);
		ck_assert_msg(*end == '\0', "bad value: %s", l);
		samples++;
	}
	/* 14 plain values (relays, relays_connected and relays_blocked
	 * among them), 8 reasons, 2 x 17 histogram lines, 3 backends,
	 * 3 + 3 per server. */
	ck_assert_int_eq(samples, 14 + 8 + 34 + 3 + 3 + 3);
	free(text);
}
END_TEST

START_TEST(test_counters)
{
	char *text;

	metrics_inc_published(3);
	metrics_inc_published(4);
	metrics_inc_failed(METRICS_FAIL_NACKED, 2);
	metrics_inc_failed(METRICS_FAIL_OVERSIZED, 1);
	metrics_inc_failed(METRICS_FAIL_CONNECTION_LOST, 2);
	metrics_inc_failed(METRICS_FAIL_NACKED, 5);
	metrics_inc_failed(METRICS_FAIL_COUNT, 9);	/* ignored */
	metrics_inc_dead(1);
	metrics_inc_released(6);
	metrics_inc_reconnect(METRICS_SERVER_REDIS);
	metrics_inc_reconnect(METRICS_SERVER_REDIS);
	metrics_inc_reconnect(METRICS_SERVER_POSTGRES);
	metrics_inc_reconnect(METRICS_SERVER_COUNT);	/* ignored */
	text = render();
	ck_assert_line(text, "outboxd_build_info{version=\"1.2.3\"} 1");
	ck_assert_line(text, "outboxd_messages_published_total 7");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"nacked\"} 7");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"unroutable\"} 0");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"rejected\"} 0");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"no_content\"} 0");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"bad_row\"} 0");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"oversized\"} 1");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"connection_lost\"} 2");
	ck_assert_line(text,
	    "outboxd_messages_failed_total{reason=\"mark_refused\"} 0");
	ck_assert_line(text, "outboxd_messages_dead_total 1");
	ck_assert_line(text, "outboxd_messages_released_total 6");
	ck_assert_line(text, "outboxd_reconnects_total{server=\"postgres\"} 1");
	ck_assert_line(text, "outboxd_reconnects_total{server=\"rabbitmq\"} 0");
	ck_assert_line(text, "outboxd_reconnects_total{server=\"redis\"} 2");
	free(text);

	/* metrics_init starts over (a reload or the next test). */
	metrics_init(NULL);
	text = render();
	ck_assert_line(text, "outboxd_build_info{version=\"unknown\"} 1");
	ck_assert_line(text, "outboxd_messages_published_total 0");
	ck_assert_line(text, "outboxd_reconnects_total{server=\"redis\"} 0");
	free(text);
}
END_TEST

START_TEST(test_gauges)
{
	char *text = render();

	/* Before anything is set: zeros, backend none, no connection. */
	ck_assert_line(text, "outboxd_rows_pending 0");
	ck_assert_line(text, "outboxd_leader 0");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"none\"} 1");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"redis\"} 0");
	ck_assert_line(text, "outboxd_connection_up{server=\"postgres\"} 0");
	ck_assert_line(text, "outboxd_relays 0");
	ck_assert_line(text, "outboxd_relays_connected 0");
	ck_assert_line(text, "outboxd_relays_blocked 0");
	free(text);

	metrics_set_rows(10, 4, 2, 12.5, 1795500000);
	metrics_set_leader(true, METRICS_BACKEND_REDIS);
	metrics_set_connection(METRICS_SERVER_POSTGRES, true);
	metrics_set_connection(METRICS_SERVER_RABBITMQ, true);
	metrics_set_connection(METRICS_SERVER_RABBITMQ, false);
	metrics_set_relays(1, 2, 3);
	text = render();
	ck_assert_line(text, "outboxd_rows_pending 10");
	ck_assert_line(text, "outboxd_rows_due 4");
	ck_assert_line(text, "outboxd_rows_dead 2");
	ck_assert_line(text, "outboxd_oldest_due_age_seconds 12.500");
	ck_assert_line(text, "outboxd_rows_counted_timestamp_seconds "
	    "1795500000");
	ck_assert_line(text, "outboxd_leader 1");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"none\"} 0");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"redis\"} 1");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"postgres\"} 0");
	ck_assert_line(text, "outboxd_connection_up{server=\"postgres\"} 1");
	ck_assert_line(text, "outboxd_connection_up{server=\"rabbitmq\"} 0");
	ck_assert_line(text, "outboxd_connection_up{server=\"redis\"} 0");
	ck_assert_line(text, "outboxd_relays 3");
	ck_assert_line(text, "outboxd_relays_connected 1");
	ck_assert_line(text, "outboxd_relays_blocked 2");
	free(text);
	/* More connected or blocked than running cannot be: capped. */
	metrics_set_relays(5, 7, 2);
	text = render();
	ck_assert_line(text, "outboxd_relays_connected 2");
	ck_assert_line(text, "outboxd_relays_blocked 2");
	free(text);

	/* Gauges are set, not added; nonsense ages read as 0. */
	metrics_set_rows(1, 0, 0, -3, -5);
	metrics_set_leader(false, METRICS_BACKEND_POSTGRES);
	text = render();
	ck_assert_line(text, "outboxd_rows_pending 1");
	ck_assert_line(text, "outboxd_rows_due 0");
	ck_assert_line(text, "outboxd_oldest_due_age_seconds 0.000");
	ck_assert_line(text, "outboxd_rows_counted_timestamp_seconds 0");
	ck_assert_line(text, "outboxd_leader 0");
	ck_assert_line(text, "outboxd_leader_backend{backend=\"postgres\"} 1");
	free(text);
	metrics_set_rows(1, 1, 0, NAN, 0);
	text = render();
	ck_assert_line(text, "outboxd_oldest_due_age_seconds 0.000");
	free(text);
}
END_TEST

START_TEST(test_histogram)
{
	static const struct {
		const char *le;
		int count;
	} want[] = {
		{ "0.001", 3 }, { "0.0025", 3 }, { "0.005", 4 },
		{ "0.01", 4 }, { "0.025", 4 }, { "0.05", 4 }, { "0.1", 4 },
		{ "0.25", 5 }, { "0.5", 5 }, { "1", 5 }, { "2.5", 5 },
		{ "5", 5 }, { "10", 5 }, { "30", 5 }, { "+Inf", 6 },
	};
	char line[128];
	char *text;

	metrics_observe_batch(0.0005);
	metrics_observe_batch(0.001);	/* le is inclusive */
	metrics_observe_batch(0.003);
	metrics_observe_batch(0.2);
	metrics_observe_batch(45);	/* over 30 s: only +Inf */
	metrics_observe_batch(-1);	/* counts as 0 */
	metrics_observe_batch(NAN);	/* dropped */
	metrics_observe_batch(INFINITY);	/* dropped */
	metrics_observe_confirm(0.02);
	text = render();
	for (size_t i = 0; i < ARRAY_LEN(want); i++) {
		strfmt(line, sizeof(line),
		    "outboxd_batch_duration_seconds_bucket{le=\"%s\"} %d",
		    want[i].le, want[i].count);
		ck_assert_line(text, line);
	}
	ck_assert_line(text, "outboxd_batch_duration_seconds_sum 45.204500");
	ck_assert_line(text, "outboxd_batch_duration_seconds_count 6");
	/* The other histogram is separate. */
	ck_assert_line(text,
	    "outboxd_confirm_duration_seconds_bucket{le=\"0.01\"} 0");
	ck_assert_line(text,
	    "outboxd_confirm_duration_seconds_bucket{le=\"0.025\"} 1");
	ck_assert_line(text,
	    "outboxd_confirm_duration_seconds_bucket{le=\"+Inf\"} 1");
	ck_assert_line(text, "outboxd_confirm_duration_seconds_sum 0.020000");
	ck_assert_line(text, "outboxd_confirm_duration_seconds_count 1");
	free(text);
}
END_TEST

START_TEST(test_label_escaping)
{
	char *text;

	metrics_init("v\"1\\2\n3");
	text = render();
	ck_assert_line(text,
	    "outboxd_build_info{version=\"v\\\"1\\\\2\\n3\"} 1");
	free(text);
}
END_TEST

/* up_seconds moves between two renders: zero its digits to compare. */
static char *
mask_up(char *text)
{
	char *p = strstr(text, "\noutboxd_up_seconds ");

	if (p != NULL)
		for (p += strlen("\noutboxd_up_seconds "); *p != '\0' &&
		    *p != '\n'; p++)
			if (*p >= '0' && *p <= '9')
				*p = '0';
	return text;
}

START_TEST(test_buffer_too_small)
{
	size_t need = metrics_render(NULL, 0);
	char *full = mask_up(render()), *buf = xmalloc(need + 1);

	ck_assert_uint_gt(need, 1000);
	ck_assert_uint_eq(metrics_render(buf, 0), need);
	/* snprintf semantics: a NUL-terminated prefix of the text. */
	memset(buf, 'x', need + 1);
	ck_assert_uint_eq(metrics_render(buf, 1), need);
	ck_assert_str_eq(buf, "");
	ck_assert_uint_eq(metrics_render(buf, 10), need);
	ck_assert_uint_eq(strlen(buf), 9);
	ck_assert_int_eq(strncmp(buf, full, 9), 0);
	ck_assert_uint_eq(metrics_render(buf, need), need);
	ck_assert_uint_eq(strlen(buf), need - 1);
	ck_assert_int_eq(strncmp(mask_up(buf), full, need - 1), 0);
	/* Exactly enough room: the whole text. */
	ck_assert_uint_eq(metrics_render(buf, need + 1), need);
	ck_assert_str_eq(mask_up(buf), full);
	ck_assert_int_eq(buf[need - 1], '\n');
	free(buf);
	free(full);
}
END_TEST

START_TEST(test_health)
{
	char reason[128], tiny[4], longer[300];

	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "starting");
	metrics_set_health(true, NULL);
	ck_assert(metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "");
	metrics_set_health(false, "rabbitmq down");
	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "rabbitmq down");
	ck_assert(!metrics_health(NULL, 0));
	ck_assert(!metrics_health(tiny, sizeof(tiny)));
	ck_assert_str_eq(tiny, "rab");
	/* One line, however the reason was written. */
	metrics_set_health(false, "no progress\nfor 60s\r");
	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "no progress for 60s ");
	memset(longer, 'a', sizeof(longer) - 1);
	longer[sizeof(longer) - 1] = '\0';
	metrics_set_health(false, longer);
	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_uint_eq(strlen(reason), 127);
}
END_TEST

/* A main loop that stops reporting turns the health false by itself,
 * after the stall limit and not before; a report clears it. */
START_TEST(test_health_stall)
{
	char reason[128];
	int64_t set_at, deadline;

	metrics_set_health(true, NULL);
	ck_assert(metrics_health(reason, sizeof(reason)));
	metrics_set_stall_limit(200);
	metrics_set_health(true, NULL);
	set_at = now_mono_ms();
	ck_assert(metrics_health(reason, sizeof(reason)));
	deadline = set_at + 5000;
	while (metrics_health(NULL, 0) && now_mono_ms() < deadline)
		;
	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_int_ge(now_mono_ms() - set_at, 200);
	ck_assert_msg(strncmp(reason, "stalled: ", 9) == 0, "%s", reason);
	metrics_set_health(true, NULL);
	ck_assert(metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "");
	/* A failure reported in time keeps its own reason. */
	metrics_set_health(false, "postgres unreachable");
	ck_assert(!metrics_health(reason, sizeof(reason)));
	ck_assert_str_eq(reason, "postgres unreachable");
	/* No limit: silence is no stall. */
	metrics_set_stall_limit(0);
	metrics_set_health(true, NULL);
	ck_assert(metrics_health(NULL, 0));
}
END_TEST

START_TEST(test_names)
{
	ck_assert_str_eq(metrics_failure_name(METRICS_FAIL_NO_CONTENT),
	    "no_content");
	ck_assert_str_eq(metrics_failure_name(METRICS_FAIL_COUNT), "unknown");
	ck_assert_str_eq(metrics_server_name(METRICS_SERVER_RABBITMQ),
	    "rabbitmq");
	ck_assert_str_eq(metrics_server_name((enum metrics_server)-1),
	    "unknown");
	ck_assert_str_eq(metrics_backend_name(METRICS_BACKEND_NONE), "none");
	ck_assert_str_eq(metrics_backend_name(METRICS_BACKEND_COUNT),
	    "unknown");
}
END_TEST

START_TEST(test_up_seconds)
{
	char *text = render(), *p = strstr(text, "\noutboxd_up_seconds ");
	double up;

	ck_assert_ptr_ne(p, NULL);
	up = strtod(p + strlen("\noutboxd_up_seconds "), NULL);
	ck_assert(up >= 0 && up < 5);
	free(text);
}
END_TEST

#define ROUNDS 100000

static void *
writer(void *arg)
{
	(void)arg;
	for (int i = 0; i < ROUNDS; i++) {
		metrics_inc_published(1);
		metrics_inc_failed(METRICS_FAIL_BAD_ROW, 2);
		if (i % 100 == 0)
			metrics_observe_confirm(0.003);
	}
	return NULL;
}

static void *
reader(void *arg)
{
	char *buf = xmalloc(16384);

	(void)arg;
	for (int i = 0; i < 200; i++)
		(void)metrics_render(buf, 16384);
	free(buf);
	return NULL;
}

START_TEST(test_concurrent)
{
	pthread_t a, b, r;
	char line[128];
	char *text;

	ck_assert_int_eq(pthread_create(&a, NULL, writer, NULL), 0);
	ck_assert_int_eq(pthread_create(&b, NULL, writer, NULL), 0);
	ck_assert_int_eq(pthread_create(&r, NULL, reader, NULL), 0);
	ck_assert_int_eq(pthread_join(a, NULL), 0);
	ck_assert_int_eq(pthread_join(b, NULL), 0);
	ck_assert_int_eq(pthread_join(r, NULL), 0);
	text = render();
	strfmt(line, sizeof(line), "outboxd_messages_published_total %d",
	    2 * ROUNDS);
	ck_assert_line(text, line);
	strfmt(line, sizeof(line),
	    "outboxd_messages_failed_total{reason=\"bad_row\"} %d",
	    4 * ROUNDS);
	ck_assert_line(text, line);
	strfmt(line, sizeof(line), "outboxd_confirm_duration_seconds_count %d",
	    2 * ROUNDS / 100);
	ck_assert_line(text, line);
	strfmt(line, sizeof(line),
	    "outboxd_confirm_duration_seconds_bucket{le=\"+Inf\"} %d",
	    2 * ROUNDS / 100);
	ck_assert_line(text, line);
	free(text);
}
END_TEST

static Suite *
metrics_suite(void)
{
	Suite *s = suite_create("metrics");
	TCase *tc = tcase_create("render");

	tcase_add_checked_fixture(tc, setup, NULL);
	tcase_add_test(tc, test_help_and_type);
	tcase_add_test(tc, test_sample_syntax);
	tcase_add_test(tc, test_counters);
	tcase_add_test(tc, test_gauges);
	tcase_add_test(tc, test_histogram);
	tcase_add_test(tc, test_label_escaping);
	tcase_add_test(tc, test_buffer_too_small);
	tcase_add_test(tc, test_names);
	tcase_add_test(tc, test_up_seconds);
	suite_add_tcase(s, tc);

	tc = tcase_create("health");
	tcase_add_checked_fixture(tc, setup, NULL);
	tcase_add_test(tc, test_health);
	tcase_add_test(tc, test_health_stall);
	suite_add_tcase(s, tc);

	tc = tcase_create("threads");
	tcase_add_checked_fixture(tc, setup, NULL);
	/* Valgrind serialises threads: give it time. */
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_concurrent);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(metrics_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
