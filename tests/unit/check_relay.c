/*
 * The relay's state changes without servers: what a failed publish does
 * to a row (retry with the row's backoff, or dead), which refused marks
 * are retried row by row, and how often the leader's compensation may
 * take the relay's session.
 */
#include <check.h>
#include <stdlib.h>

#include "leader.h"
#include "relay.h"

static struct backoff_params global;

static void
setup(void)
{
	backoff_params_default(&global);
	global.max_ms = 3600000;
}

static struct outbox_row
row(int retries, int max, int64_t init_ms, double factor)
{
	struct outbox_row r = { 0 };

	r.id = 1;
	r.current_retry_times = retries;
	r.max_retry_times = max;
	r.init_backoff_ms = init_ms;
	r.backoff_factor = factor;
	return r;
}

/* Table: retries so far → expected kind and delay, seed defaults. */
START_TEST(test_reschedule_table)
{
	static const struct {
		int retries, max;
		int64_t init_ms;
		double factor;
		bool permanent;
		enum mark_kind kind;
		int64_t delay_ms;
	} cases[] = {
		{ 0, 5, 10000, 2, false, MARK_RETRY, 10000 },
		{ 1, 5, 10000, 2, false, MARK_RETRY, 20000 },
		{ 2, 5, 10000, 2, false, MARK_RETRY, 40000 },
		{ 3, 5, 10000, 2, false, MARK_RETRY, 80000 },
		{ 4, 5, 10000, 2, false, MARK_DEAD, 0 },	/* 5th failure */
		{ 0, 1, 10000, 2, false, MARK_DEAD, 0 },
		{ 0, 5, 10000, 2, true, MARK_DEAD, 0 },	/* permanent */
		{ 0, 0, 10000, 2, false, MARK_DEAD, 0 },	/* max 0 */
		{ 2, 10, 1000, 3, false, MARK_RETRY, 9000 },
		{ 20, 30, 1000, 2, false, MARK_RETRY, 3600000 }, /* capped */
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct outbox_row r = row(cases[i].retries, cases[i].max,
		    cases[i].init_ms, cases[i].factor);
		int64_t delay;
		const char *note;
		enum mark_kind k = relay_reschedule(&global, &r,
		    cases[i].permanent, NULL, &delay, &note);

		ck_assert_msg(k == cases[i].kind, "case %zu: kind %d", i, k);
		ck_assert_msg(delay == cases[i].delay_ms,
		    "case %zu: delay %lld", i, (long long)delay);
		ck_assert_ptr_null(note);
	}
}
END_TEST

/* A row with unusable backoff values is retried on the global ones and
 * says so, rather than being lost or scheduled at nonsense times. */
START_TEST(test_bad_row_backoff_falls_back)
{
	struct outbox_row r[] = { row(0, 5, -5, 2), row(0, 5, 1000, 0),
		row(0, 5, 0, 2) };

	for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++) {
		int64_t delay;
		const char *note;

		ck_assert_int_eq(relay_reschedule(&global, &r[i], false, NULL,
		    &delay, &note), MARK_RETRY);
		ck_assert_ptr_nonnull(note);
		ck_assert_int_eq(delay, global.init_ms);
	}
}
END_TEST

/* Compensation every poll_interval while it is quick; a slow one (a
 * huge backlog to count) waits 20 times as long as it took instead, so
 * that it never takes more than 5% of the relay's session. */
START_TEST(test_compensation_interval)
{
	static const struct {
		int64_t poll_ms, took_ms, want_ms;
	} cases[] = {
		{ 5000, 0, 5000 },
		{ 5000, 80, 5000 },	/* 1,000,000 rows: 80 ms */
		{ 5000, 250, 5000 },	/* exactly 1/20 */
		{ 5000, 251, 5020 },
		{ 5000, 800, 16000 },	/* 10,000,000 rows */
		{ 100, 80, 1600 },	/* a short poll_interval is stretched */
		{ 100, 2, 100 },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ck_assert_int_eq(leader_compensation_interval_ms(
		    cases[i].poll_ms, cases[i].took_ms), cases[i].want_ms);
}
END_TEST

/* A pass that left a backlog to sweep or purge: the next follows after
 * four times its length, at least 100 ms (it followed 100 ms later
 * however long it took, holding the session most of the time). */
START_TEST(test_backlog_interval)
{
	ck_assert_int_eq(leader_backlog_interval_ms(0), 100);
	ck_assert_int_eq(leader_backlog_interval_ms(25), 100);
	ck_assert_int_eq(leader_backlog_interval_ms(26), 104);
	ck_assert_int_eq(leader_backlog_interval_ms(300), 1200);
}
END_TEST

/* A refused mark is tried row by row only for errors one row can
 * cause: retrying a timeout or a full disk row by row repeats it. */
START_TEST(test_row_specific_sqlstates)
{
	static const char *const one_row[] = {
		"P0001",	/* raise_exception in a trigger */
		"23514",	/* check_violation */
		"23505",	/* unique_violation */
		"22021",	/* character_not_in_repertoire */
		"22008",	/* datetime_field_overflow */
		"27000",	/* triggered_data_change_violation */
		"09000",	/* triggered_action_exception */
		"38000", "39000", "2F000", "44000",
	};
	static const char *const every_row[] = {
		"55P03",	/* lock_not_available: lock_timeout */
		"57014",	/* query_canceled: statement_timeout */
		"53100",	/* disk_full */
		"42501",	/* insufficient_privilege */
		"40001",	/* serialization_failure */
		"40P01",	/* deadlock_detected */
		"25P02",	/* in_failed_sql_transaction */
		"08006",	/* connection_failure */
		"57P01",	/* admin_shutdown */
		"XX000",	/* internal_error */
		"", "P0", "P00011",
	};

	for (size_t i = 0; i < sizeof(one_row) / sizeof(*one_row); i++)
		ck_assert_msg(store_sqlstate_row_specific(one_row[i]), "%s",
		    one_row[i]);
	for (size_t i = 0; i < sizeof(every_row) / sizeof(*every_row); i++)
		ck_assert_msg(!store_sqlstate_row_specific(every_row[i]),
		    "%s", every_row[i]);
	ck_assert(!store_sqlstate_row_specific(NULL));
}
END_TEST

int
main(void)
{
	Suite *s = suite_create("relay-state");
	TCase *tc = tcase_create("reschedule");
	TCase *tc_comp = tcase_create("compensation");
	TCase *tc_marks = tcase_create("marks");
	SRunner *sr;
	int failed;

	tcase_add_checked_fixture(tc, setup, NULL);
	tcase_add_test(tc, test_reschedule_table);
	tcase_add_test(tc, test_bad_row_backoff_falls_back);
	suite_add_tcase(s, tc);
	tcase_add_test(tc_comp, test_compensation_interval);
	tcase_add_test(tc_comp, test_backlog_interval);
	suite_add_tcase(s, tc_comp);
	tcase_add_test(tc_marks, test_row_specific_sqlstates);
	suite_add_tcase(s, tc_marks);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? 0 : 1;
}
