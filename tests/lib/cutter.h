/*
 * A TCP relay for integration tests that cuts every connection whose
 * client sends a given byte string, as a middlebox that resets
 * connections carrying some content would: a message that, by itself,
 * breaks every connection that carries it to the broker.
 */
#ifndef OUTBOXD_CUTTER_H
#define OUTBOXD_CUTTER_H

struct tl_cutter;

/* Listens on a free loopback port and relays each connection to
 * 127.0.0.1:to_port; aborts the test when it cannot. */
struct tl_cutter *tl_cutter_start(int to_port, const char *marker);
int tl_cutter_port(const struct tl_cutter *);
/* Connections cut so far: each one whose client sent the marker.  The
 * bytes that carried it are not passed on. */
int tl_cutter_cuts(struct tl_cutter *);
/* Closes the listener and every connection, and joins the threads. */
void tl_cutter_stop(struct tl_cutter *);

#endif
