/*
 * The suspects table: levels go up one loss at a time, a clear forgets,
 * old losses are forgotten, and a full table makes room by the oldest
 * loss, whatever the ids.
 */
#include <check.h>
#include <stdlib.h>

#include "suspects.h"

START_TEST(test_levels_rise_with_losses)
{
	struct suspects *s = suspects_new(8);

	ck_assert_int_eq(suspects_any(s), 0);
	ck_assert_int_eq(suspects_level(s, 42, 0), SUSPECT_NONE);
	ck_assert_int_eq(suspects_lost(s, 42, 0), SUSPECT_NONE);
	ck_assert_int_ne(suspects_any(s), 0);
	ck_assert_int_eq(suspects_level(s, 42, 0), SUSPECT_GROUP);
	ck_assert_int_eq(suspects_lost(s, 42, 10), SUSPECT_GROUP);
	ck_assert_int_eq(suspects_level(s, 42, 10), SUSPECT_ALONE);
	/* Alone is as far as it goes; the relay counts the third loss. */
	ck_assert_int_eq(suspects_lost(s, 42, 20), SUSPECT_ALONE);
	ck_assert_int_eq(suspects_level(s, 42, 20), SUSPECT_ALONE);
	ck_assert_uint_eq(suspects_count(s), 1);
	ck_assert_int_eq(suspects_level(s, 41, 20), SUSPECT_NONE);
	ck_assert_int_eq(suspects_level(s, 43, 20), SUSPECT_NONE);
	suspects_free(s);
}
END_TEST

START_TEST(test_clear_forgets_one)
{
	struct suspects *s = suspects_new(8);

	/* Out of order, to keep the bisection honest. */
	(void)suspects_lost(s, 30, 0);
	(void)suspects_lost(s, 10, 0);
	(void)suspects_lost(s, 20, 0);
	(void)suspects_lost(s, 20, 0);
	suspects_clear(s, 10);
	suspects_clear(s, 99);	/* not there: nothing happens */
	ck_assert_uint_eq(suspects_count(s), 2);
	ck_assert_int_eq(suspects_level(s, 10, 0), SUSPECT_NONE);
	ck_assert_int_eq(suspects_level(s, 20, 0), SUSPECT_ALONE);
	ck_assert_int_eq(suspects_level(s, 30, 0), SUSPECT_GROUP);
	suspects_clear(s, 20);
	suspects_clear(s, 30);
	ck_assert_int_eq(suspects_any(s), 0);
	/* Cleared, it starts again from nothing. */
	ck_assert_int_eq(suspects_lost(s, 20, 0), SUSPECT_NONE);
	suspects_free(s);
}
END_TEST

START_TEST(test_old_losses_are_forgotten)
{
	struct suspects *s = suspects_new(8);
	int64_t later = SUSPECT_FORGET_MS + 1;

	(void)suspects_lost(s, 7, 0);
	(void)suspects_lost(s, 7, 0);
	ck_assert_int_eq(suspects_level(s, 7, SUSPECT_FORGET_MS),
	    SUSPECT_ALONE);
	/* Lost again past the horizon: a first loss, not a third. */
	ck_assert_int_eq(suspects_lost(s, 7, later), SUSPECT_NONE);
	ck_assert_int_eq(suspects_level(s, 7, later), SUSPECT_GROUP);
	/* Looked up past it: gone. */
	(void)suspects_lost(s, 8, 0);
	ck_assert_int_eq(suspects_level(s, 8, later), SUSPECT_NONE);
	ck_assert_uint_eq(suspects_count(s), 1);
	suspects_free(s);
}
END_TEST

START_TEST(test_full_table_drops_the_oldest_loss)
{
	struct suspects *s = suspects_new(3);

	(void)suspects_lost(s, 300, 10);
	(void)suspects_lost(s, 100, 30);
	(void)suspects_lost(s, 200, 20);
	(void)suspects_lost(s, 400, 40);	/* 300 makes room */
	ck_assert_uint_eq(suspects_count(s), 3);
	ck_assert_int_eq(suspects_level(s, 300, 40), SUSPECT_NONE);
	ck_assert_int_eq(suspects_level(s, 100, 40), SUSPECT_GROUP);
	ck_assert_int_eq(suspects_level(s, 200, 40), SUSPECT_GROUP);
	ck_assert_int_eq(suspects_level(s, 400, 40), SUSPECT_GROUP);
	/* A row already there takes no room: its level rises. */
	ck_assert_int_eq(suspects_lost(s, 100, 50), SUSPECT_GROUP);
	ck_assert_uint_eq(suspects_count(s), 3);
	ck_assert_int_eq(suspects_level(s, 200, 50), SUSPECT_GROUP);
	/* Expired rows go first, all of them. */
	(void)suspects_lost(s, 500, 20 + SUSPECT_FORGET_MS + 1);
	ck_assert_uint_eq(suspects_count(s), 3);
	ck_assert_int_eq(suspects_level(s, 200, 50), SUSPECT_NONE);
	ck_assert_int_eq(suspects_level(s, 100, 50), SUSPECT_ALONE);
	suspects_free(s);
}
END_TEST

static Suite *
suspects_suite(void)
{
	Suite *s = suite_create("suspects");
	TCase *tc = tcase_create("table");

	tcase_add_test(tc, test_levels_rise_with_losses);
	tcase_add_test(tc, test_clear_forgets_one);
	tcase_add_test(tc, test_old_losses_are_forgotten);
	tcase_add_test(tc, test_full_table_drops_the_oldest_loss);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(suspects_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
