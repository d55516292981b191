/*
 * The refused-rows table: a row is held back for a wait that doubles at
 * each refusal up to the maximum (the table says whether it knew the
 * row), comes back when its wait is over, is
 * forgotten when it is marked or long past its try, and a full table
 * makes room by the row whose try is due first.
 */
#include <check.h>
#include <stdlib.h>

#include "refused.h"

/* Whether id is among the n ids. */
static int
has(const int64_t *ids, size_t n, int64_t id)
{
	for (size_t i = 0; i < n; i++)
		if (ids[i] == id)
			return 1;
	return 0;
}

START_TEST(test_wait_doubles_to_the_max)
{
	struct refused *t = refused_new(4);
	enum refused_entry e;
	int64_t ids[4];

	ck_assert_uint_eq(refused_held(t, 0, ids, 4), 0);
	ck_assert_int_eq(refused_wait_ms(t, 0), 0);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 0, &e), 100);
	ck_assert_int_eq(e, REFUSED_NEW);
	ck_assert_uint_eq(refused_count(t), 1);
	ck_assert_int_eq(refused_wait_ms(t, 30), 70);
	ck_assert_uint_eq(refused_held(t, 99, ids, 4), 1);
	ck_assert_int_eq(ids[0], 7);
	/* Its wait is over: claims take it again, and the table still
	 * knows it, for the next wait. */
	ck_assert_uint_eq(refused_held(t, 100, ids, 4), 0);
	ck_assert_uint_eq(refused_count(t), 1);
	ck_assert_int_eq(refused_wait_ms(t, 100), 0);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 100, &e), 200);
	ck_assert_int_eq(e, REFUSED_AGAIN);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 300, &e), 400);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 700, &e), 800);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 1500, &e), 1000);
	ck_assert_int_eq(refused_hold(t, 7, 100, 1000, 2500, &e), 1000);
	ck_assert_uint_eq(refused_count(t), 1);
	refused_free(t);
}
END_TEST

START_TEST(test_marked_or_old_rows_are_forgotten)
{
	struct refused *t = refused_new(4);
	enum refused_entry e;
	int64_t ids[4];

	(void)refused_hold(t, 1, 100, 1000, 0, &e);
	(void)refused_hold(t, 2, 100, 1000, 0, &e);
	refused_clear(t, 1);
	refused_clear(t, 99);	/* not there: nothing happens */
	ck_assert_uint_eq(refused_count(t), 1);
	ck_assert_uint_eq(refused_held(t, 50, ids, 4), 1);
	ck_assert_int_eq(ids[0], 2);
	/* Refused again after a clear: the wait starts over. */
	ck_assert_int_eq(refused_hold(t, 1, 100, 1000, 50, &e), 100);
	ck_assert_int_eq(e, REFUSED_NEW);
	/* No claim met them again for long after their try. */
	ck_assert_uint_eq(refused_held(t, 150 + REFUSED_FORGET_MS + 1, ids,
	    4), 0);
	ck_assert_uint_eq(refused_count(t), 0);
	refused_free(t);
}
END_TEST

/* The rows a claim could take (their hold over) are the ones to look
 * for when a claim finds nothing; held ones and a full cap are not. */
START_TEST(test_ended_holds_are_listed)
{
	struct refused *t = refused_new(4);
	enum refused_entry e;
	int64_t ids[4];

	ck_assert_uint_eq(refused_ended(t, 0, ids, 4), 0);
	(void)refused_hold(t, 1, 100, 1000, 0, &e);
	(void)refused_hold(t, 2, 300, 1000, 0, &e);
	(void)refused_hold(t, 3, 100, 1000, 50, &e);
	ck_assert_uint_eq(refused_ended(t, 99, ids, 4), 0);
	ck_assert_uint_eq(refused_ended(t, 100, ids, 4), 1);
	ck_assert_int_eq(ids[0], 1);
	ck_assert_uint_eq(refused_ended(t, 150, ids, 4), 2);
	ck_assert(has(ids, 2, 1) && has(ids, 2, 3));
	ck_assert_uint_eq(refused_ended(t, 300, ids, 1), 1);
	ck_assert_uint_eq(refused_ended(t, 300, ids, 4), 3);
	/* Listing forgets nothing; clearing does. */
	ck_assert_uint_eq(refused_count(t), 3);
	refused_clear(t, 3);
	ck_assert_uint_eq(refused_ended(t, 300, ids, 4), 2);
	ck_assert(!has(ids, 2, 3));
	refused_free(t);
}
END_TEST

START_TEST(test_full_table_drops_the_first_due)
{
	struct refused *t = refused_new(3);
	enum refused_entry e;
	int64_t ids[4];
	size_t n;

	(void)refused_hold(t, 10, 500, 1000, 0, &e);
	(void)refused_hold(t, 20, 100, 1000, 0, &e);	/* due first */
	(void)refused_hold(t, 30, 300, 1000, 0, &e);
	ck_assert_int_eq(e, REFUSED_NEW);
	(void)refused_hold(t, 40, 100, 1000, 50, &e);
	ck_assert_int_eq(e, REFUSED_EVICTED);
	ck_assert_uint_eq(refused_count(t), 3);
	n = refused_held(t, 60, ids, 4);
	ck_assert_uint_eq(n, 3);
	ck_assert(has(ids, n, 10) && has(ids, n, 30) && has(ids, n, 40));
	ck_assert(!has(ids, n, 20));
	/* At most cap ids go to a claim. */
	ck_assert_uint_eq(refused_held(t, 60, ids, 2), 2);
	refused_free(t);
}
END_TEST

static Suite *
refused_suite(void)
{
	Suite *s = suite_create("refused");
	TCase *tc = tcase_create("table");

	tcase_add_test(tc, test_wait_doubles_to_the_max);
	tcase_add_test(tc, test_marked_or_old_rows_are_forgotten);
	tcase_add_test(tc, test_full_table_drops_the_first_due);
	tcase_add_test(tc, test_ended_holds_are_listed);
	suite_add_tcase(s, tc);
	return s;
}

int
main(void)
{
	SRunner *sr = srunner_create(refused_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
