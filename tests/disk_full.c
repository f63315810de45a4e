/* A full disk under one directory, for tests: LD_PRELOAD this library and every write(2),
 * pwrite(2) or writev(2) to a file under $DISK_FULL_DIR fails with ENOSPC once the process has
 * written $DISK_FULL_AFTER bytes there (only in the process whose $RANK is $DISK_FULL_RANK, when
 * that is set). Python's file objects and torch.save's C++ streams both write through these
 * calls, so the code under test meets the error where a real disk gives it.
 * Build: cc -shared -fPIC -o disk_full.so disk_full.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static long long written;

/* 1 if a write of count bytes to fd may go ahead (counted), 0 if it fails with ENOSPC. */
static int room(int fd, size_t count) {
    const char *dir = getenv("DISK_FULL_DIR"), *after = getenv("DISK_FULL_AFTER");
    const char *only = getenv("DISK_FULL_RANK"), *rank = getenv("RANK");
    char link[64], path[4096];
    if (!dir || !after) return 1;
    if (only && (!rank || strcmp(only, rank) != 0)) return 1;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 1;
    path[n] = 0;
    if (strncmp(path, dir, strlen(dir)) != 0) return 1;
    if (written + (long long)count > atoll(after)) {
        errno = ENOSPC;
        return 0;
    }
    written += (long long)count;
    return 1;
}

#define REAL(name) static __typeof__(name) *real; if (!real) real = dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void *buf, size_t count) {
    REAL(write);
    return room(fd, count) ? real(fd, buf, count) : -1;
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    REAL(pwrite);
    return room(fd, count) ? real(fd, buf, count, offset) : -1;
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    REAL(pwrite64);
    return room(fd, count) ? real(fd, buf, count, offset) : -1;
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    REAL(writev);
    size_t count = 0;
    for (int i = 0; i < iovcnt; i++) count += iov[i].iov_len;
    return room(fd, count) ? real(fd, iov, iovcnt) : -1;
}
