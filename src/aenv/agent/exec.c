/*
 * aenv-exec: the step between envd and every command it starts.
 *
 * envd (Python, ~37 MiB resident) starts commands with vfork, which shares its memory with the
 * child until the exec, instead of fork, which copies its page tables and then faults in every
 * page the child touches. CPython uses vfork only when the child needs no Python code, no user
 * and no group change, so envd execs this static program, which then does those steps in C:
 *
 *   aenv-exec REPORT_FD OOM_SCORE_ADJ USER CTTY PROGRAM [ARG...]
 *
 *   REPORT_FD      a pipe's write end: on failure "STEP ERRNO" is written to it and the exit
 *                  status is 127; on success the exec closes it (close-on-exec), so envd reads EOF
 *   OOM_SCORE_ADJ  written to /proc/self/oom_score_adj while still root (best effort): the
 *                  command, not envd (-1000, inherited), is what the OOM killer should take
 *   USER           "-" to keep the caller's user, else "UID:GID:GROUP,GROUP,..." (groups may be
 *                  empty), set as real, effective and saved ids
 *   CTTY           "1": take the terminal on fd 0 as the controlling terminal (the caller made
 *                  this process a session leader)
 *   PROGRAM ARG... executed with PATH searched as execvp does, PROGRAM also being argv[0]
 *
 * What that saves is measured in envd's process service (`ProcessService._exec`).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static int report_fd = -1;

static void fail(const char *step)
{
    int err = errno;
    if (report_fd >= 0)
        dprintf(report_fd, "%s %d", step, err);
    _exit(127);
}

/* A decimal number at the start of `text` (digits only: strtoul would take "-1" too). */
static unsigned long number(const char *text, char **end)
{
    if (*text < '0' || *text > '9')
        errno = EINVAL, fail("arguments");
    errno = 0;
    unsigned long value = strtoul(text, end, 10);
    if (errno != 0)
        fail("arguments");
    return value;
}

static void adjust_oom(const char *value)
{
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t written = write(fd, value, strlen(value));
    (void)written; /* best effort, as for a kernel without the file */
    close(fd);
}

static void become(char *spec)
{
    char *end;
    uid_t uid = (uid_t)number(spec, &end);
    if (*end != ':')
        errno = EINVAL, fail("arguments");
    gid_t gid = (gid_t)number(end + 1, &end);
    size_t count = 0;
    gid_t *groups = NULL;
    if (*end == ':' && end[1] != '\0') {
        size_t most = 1;
        for (const char *c = end + 1; *c; c++)
            most += *c == ',';
        groups = calloc(most, sizeof(gid_t));
        if (groups == NULL)
            fail("arguments");
        for (char *next = end + 1; *next; next = end + (*end == ',')) {
            groups[count++] = (gid_t)number(next, &end);
            if (*end != ',' && *end != '\0')
                errno = EINVAL, fail("arguments");
        }
    } else if (*end != ':' && *end != '\0') {
        errno = EINVAL, fail("arguments");
    }
    if (setgroups(count, groups) != 0)
        fail("setgroups");
    if (setresgid(gid, gid, gid) != 0)
        fail("setgid");
    if (setresuid(uid, uid, uid) != 0)
        fail("setuid");
    free(groups);
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: aenv-exec REPORT_FD OOM_SCORE_ADJ USER CTTY PROGRAM [ARG...]\n");
        return 127;
    }
    char *end;
    report_fd = (int)number(argv[1], &end);
    if (fcntl(report_fd, F_SETFD, FD_CLOEXEC) != 0)
        fail("arguments");
    adjust_oom(argv[2]);
    if (strcmp(argv[3], "-") != 0)
        become(argv[3]);
    if (strcmp(argv[4], "1") == 0 && ioctl(0, TIOCSCTTY, 0) != 0)
        fail("controlling terminal");
    execvp(argv[5], argv + 5);
    fail("exec");
}
