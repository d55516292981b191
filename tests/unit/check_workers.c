/*
 * Relay workers without servers: they start, keep trying to connect (to
 * a port that refuses at once), take a new config and a role, and stop
 * promptly when asked, threads joined and everything freed (valgrind and
 * ASan check the last part).
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "refused.h"
#include "suspects.h"
#include "util.h"
#include "workers.h"

static struct relay_conf rconf;
static struct suspects *suspects;
static struct refused *refused;
static struct store_conf sconf;
static struct broker_conf bconf;

static void
setup(void)
{
	log_set_level(LOG_ERROR);	/* the refused connects are expected */
	suspects = suspects_new(16);
	refused = refused_new(4);
	memset(&rconf, 0, sizeof(rconf));
	rconf.batch_size = 10;
	rconf.workers = 4;
	rconf.poll_interval_ms = 1000;
	backoff_params_default(&rconf.backoff);
	backoff_params_default(&rconf.reconnect);
	/* Far longer than a step: a worker sits in its nap until woken. */
	rconf.reconnect.init_ms = 60000;
	rconf.reconnect.max_ms = 60000;
	memset(&sconf, 0, sizeof(sconf));
	sconf.conninfo = "host=127.0.0.1 port=1 dbname=none user=none";
	sconf.connect_timeout_ms = 1000;
	memset(&bconf, 0, sizeof(bconf));
	bconf.nodes[0].host = "127.0.0.1";
	bconf.nodes[0].port = 1;
	bconf.n_nodes = 1;
	bconf.vhost = "/";
	bconf.user = "guest";
	bconf.password = "guest";
	bconf.connect_timeout_ms = 1000;
	bconf.confirm_timeout_ms = 1000;
}

static void
teardown(void)
{
	log_set_level(LOG_INFO);
	suspects_free(suspects);
	refused_free(refused);
	suspects = NULL;
}

START_TEST(test_stop_wakes_napping_workers)
{
	char err[256] = "";
	struct relay_stats sum;
	struct workers *w = workers_start(3, true, &rconf, &sconf, &bconf, suspects,
	    refused, err, sizeof(err));
	int64_t deadline, t0, took;

	ck_assert_msg(w != NULL, "workers_start: %s", err);
	workers_set_role(w, false, true);
	rconf.batch_size = 7;
	workers_set_conf(w, &rconf);
	/* Every connect is refused at once, so a worker that has not
	 * finished a step for a while is napping until its retry time. */
	deadline = now_mono_ms() + 10000;
	while (workers_stalled_ms(w) < 300 && now_mono_ms() < deadline)
		sleep_ms(10, NULL);
	ck_assert_int_ge(workers_stalled_ms(w), 300);
	/* None connected; the three are there, counted by state. */
	ck_assert_int_eq(workers_count(w, WORKER_CONNECTED), 0);
	memset(&sum, 0, sizeof(sum));
	sum.published = 5;	/* the caller's own count is kept */
	t0 = now_mono_ms();
	workers_join(w, &sum);
	took = now_mono_ms() - t0;
	/* Without the wake fd each would sleep out its step (1 s). */
	ck_assert_msg(took < 500, "stopping took %lld ms", (long long)took);
	/* Joined once: the stop after it adds nothing, and frees. */
	workers_stop(w, &sum);
	ck_assert_uint_eq(sum.published, 5);
	ck_assert_uint_eq(sum.batches, 0);
}
END_TEST

START_TEST(test_standby_workers_stop_too)
{
	char err[256] = "";
	struct workers *w = workers_start(2, false, &rconf, &sconf, &bconf, suspects,
	    refused, err, sizeof(err));
	int64_t t0;

	ck_assert_msg(w != NULL, "workers_start: %s", err);
	workers_set_role(w, false, false);
	t0 = now_mono_ms();
	workers_stop(w, NULL);
	ck_assert_int_lt(now_mono_ms() - t0, 2500);
}
END_TEST

START_TEST(test_no_workers)
{
	char err[256] = "";
	struct workers *w = workers_start(0, true, &rconf, &sconf, &bconf, suspects,
	    refused, err, sizeof(err));

	ck_assert_msg(w != NULL, "workers_start: %s", err);
	workers_set_role(w, true, true);
	workers_set_conf(w, &rconf);
	ck_assert_int_eq(workers_stalled_ms(w), 0);
	workers_stop(w, NULL);
	workers_stop(NULL, NULL);	/* a no-op */
}
END_TEST

static Suite *
workers_suite(void)
{
	Suite *s = suite_create("workers");
	TCase *tc = tcase_create("lifecycle");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_stop_wakes_napping_workers);
	tcase_add_test(tc, test_standby_workers_stop_too);
	tcase_add_test(tc, test_no_workers);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(workers_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
