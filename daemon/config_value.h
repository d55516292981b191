/*
 * Config values: strict parsers for the scalar forms of the config file
 * and the quoting used to echo a value in an error message.
 */
#ifndef OUTBOXD_CONFIG_VALUE_H
#define OUTBOXD_CONFIG_VALUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Echoed values are cut so one bad line cannot flood the terminal. */
#define ECHO_MAX		60

/* s in double quotes, terminal controls escaped, cut at ECHO_MAX bytes;
 * returns buf.  Never for secrets. */
const char *config_echo(char *buf, size_t size, const char *s);
/* 2 if s starts with a C1 control in UTF-8 (C2 80..C2 9F: NEL, CSI...),
 * else 0; the echo and the dump escape these as \x85 (the code point). */
size_t config_c1_len(const char *s);
/* ms as the config writes it ("0", "250ms", "30s", "5m"); returns buf. */
const char *config_fmt_duration(char *buf, size_t size, int64_t ms);
/* Bytes in the largest binary unit that divides them ("4MiB"). */
const char *config_fmt_size(char *buf, size_t size, int64_t bytes);

/* Each returns 0 and sets *out, or a negative code saying what is wrong. */
/* Optional sign and digits, nothing else.  -1 garbage, -2 too big. */
int config_parse_int(const char *s, int64_t *out);
/* A number with a unit (ms, s, m, h, d), or a bare 0.  -1 garbage, -2 a
 * bare number other than 0 (30 would be ambiguous), -3 overflow. */
int config_parse_duration(const char *s, int64_t *ms);
/* Bytes, optionally with B, KiB/MiB/GiB or kB/KB/MB/GB.  -1 garbage, -2
 * overflow. */
int config_parse_size(const char *s, int64_t *out);
/* Plain decimal (no nan, inf or hex floats).  -1 otherwise. */
int config_parse_float(const char *s, double *out);
/*
 * "host:port", "[v6]:port", or a bare host when default_port is not 0.
 * On success *host is a new string.  On error -1, with the reason in
 * why; example_port goes into the hints ("as in 127.0.0.1:5672").
 */
int config_parse_hostport(const char *s, int default_port, int example_port,
    char **host, int *port, char *why, size_t whysz);

#endif
