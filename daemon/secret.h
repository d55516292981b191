/*
 * Secrets: password files, read without trusting them, and read again
 * before each connection so that a rotated password needs no restart.
 */
#ifndef OUTBOXD_SECRET_H
#define OUTBOXD_SECRET_H

#include <stdbool.h>
#include <stddef.h>

/* The first line of a password file, as a new string (free it with
 * secret_free); NULL, with the reason in why (never naming the file nor
 * showing its text), when the file cannot be trusted or read: it is not
 * a regular file, others may access it, its group may (unless root owns
 * it and the group may only read it), or its first line is
 * empty or over 1023 bytes.  *absent (when not NULL) says whether it
 * failed because the file does not exist. */
char *secret_file_read(const char *path, char *why, size_t whysz,
    bool *absent);

/* Before a connection: *password becomes path's first line when that
 * changed (logged, by key, never the value).  Nothing when path is NULL;
 * when the file cannot be read, *password stays and a warning says why. */
void secret_reread(char **password, const char *path, const char *key);

#endif
