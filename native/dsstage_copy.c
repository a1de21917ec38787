/*
 * dsstage-copy: the verifying copier's per-file work for small files, in C.
 *
 * lib/dsstage/transfer/native.py runs it and decides everything: which files (those not yet
 * staged, below the size the copier splits into byte ranges), how many in flight (its
 * limiter's climb, sent as it moves), when to stop (the stage's deadline). Each file is
 * done as lib/dsstage/transfer/copier.py does it in Python, without the interpreter's cost
 * per file (about 70 us of CPU, serialised by the GIL; docs/benchmarks.md):
 *
 *   - opened below the source's directory descriptor with openat2(RESOLVE_BENEATH |
 *     RESOLVE_NO_SYMLINKS), O_NOFOLLOW, O_NONBLOCK, as the source's reader (a per-thread
 *     setfsuid/setfsgid/setgroups around the open) when one is given; only a regular file
 *     is read, and never more than one byte past the size the manifest records;
 *   - hashed with BLAKE3 from the buffer it was read into; a file that fits the buffer is
 *     written only if its hash matched, a larger one is streamed to its temporary name and
 *     removed if it did not;
 *   - written to a fresh temporary name (O_EXCL, mode 0444) in its directory, opened below
 *     the staging area's descriptor the same way, given the manifest's mtime, and renamed
 *     into place: every file under its final name is whole and verified.
 *
 * It also checks a tree on this node's disk against its manifest (``verify --full``, and
 * what rsync or a peer delivered: dsstage.node.stager.check_tree), as
 * lib/dsstage/transfer/hashing.py does: each file opened the same way, its size taken from
 * fstat (root's own tree, which nothing else changes), read and hashed; nothing written.
 *
 * Usage: dsstage-copy SRC_FD DEST_FD BOUND LIMIT [UID GID GROUPS]
 *        dsstage-copy --check ROOT_FD BOUND LIMIT
 *   SRC_FD, DEST_FD  the source's and the staging area's directories (inherited descriptors)
 *   ROOT_FD          the tree to check (the MTIME of each record is not used)
 *   BOUND, LIMIT     threads at most, and in flight at first
 *   UID GID GROUPS   the source's reader (GROUPS: comma-separated, or "-" for none)
 * stdin:  one record per file, "SIZE MTIME_NS HASH PATH\0", then an empty record "\0";
 *         then lines "L N\n" (N in flight from now on); end of input: hand out no more files.
 * stdout: "+ FILES BYTES\n"   files copied (checked: found as listed) since the last such
 *                             line (every 10 ms at most);
 *         "x INDEX FOUND\n"   a file not copied (checked: not as listed): FOUND is the hash
 *                             it has, "size N", or why ("missing" when checking);
 *         "! source ERRNO INDEX\n" or "! store ERRNO WHAT INDEX\n" (WHAT: dir, create,
 *                             write, publish; read when checking, for an error of the
 *                             disk itself, EIO, EUCLEAN or EBADMSG): a failure that ends it (exit 2);
 *         "= FILES BYTES\n"   the totals, last.
 * Exit 3: openat2 is missing or refused; 4: out of memory or threads (the caller copies in
 * Python either way); 5: the input ended before every file was handed out (the caller stopped
 * it at its deadline, or died: the totals are of what was done, not of the plan); 1: bad usage
 * or input.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "blake3.h"

/* a file that fits is read whole, hashed, and written only if it matched */
#define BUF (1u << 20)
#define REPORT_NS 10000000L

struct entry {
    uint64_t size;
    int64_t mtime_ns;
    char hash[65];
    char *path;
};

static struct entry *entries;
static size_t n_entries;
static int src_fd, dest_fd;
/* --check: the tree at src_fd is hashed against the records, nothing written */
static int checking;
static int reader_set;
static uid_t reader_uid;
static gid_t reader_gid;
static gid_t *reader_groups, *root_groups;
static int n_reader_groups, n_root_groups;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static size_t next_entry;
static int limit, bound, started, exited, stopping;
static char fatal[256];
/* not the store's nor the source's failure (memory, threads): the caller copies in Python */
#define NO_RESOURCES 4
#define INPUT_ENDED 5
static int out_of_resources;
/* the control input ended (the caller wants no more files, or is gone) */
static int input_ended;

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t pending_files, pending_bytes, total_files, total_bytes;
static struct timespec last_report;

static unsigned long temp_seq;

static long openat2_(int dir, const char *path, uint64_t flags, uint64_t mode)
{
    struct open_how how = {.flags = flags, .mode = mode,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS};
    return syscall(SYS_openat2, dir, path, &how, sizeof how);
}

static void fail(const char *line)
{
    pthread_mutex_lock(&mu);
    if (!fatal[0])
        snprintf(fatal, sizeof fatal, "%s", line);
    stopping = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void fail_resources(void)
{
    pthread_mutex_lock(&mu);
    out_of_resources = 1;
    stopping = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void fail_source(int err, size_t i)
{
    char line[64];
    snprintf(line, sizeof line, "! source %d %zu\n", err, i);
    fail(line);
}

static void fail_store(int err, const char *what, size_t i)
{
    char line[96];
    snprintf(line, sizeof line, "! store %d %s %zu\n", err, what, i);
    fail(line);
}

static void report_locked(int force)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
    long ns = (now.tv_sec - last_report.tv_sec) * 1000000000L + (now.tv_nsec - last_report.tv_nsec);
    if (pending_files && (force || ns >= REPORT_NS)) {
        printf("+ %llu %llu\n", (unsigned long long)pending_files, (unsigned long long)pending_bytes);
        fflush(stdout);
        pending_files = pending_bytes = 0;
        last_report = now;
    }
}

static void copied(uint64_t size)
{
    pthread_mutex_lock(&out_mu);
    pending_files++;
    pending_bytes += size;
    total_files++;
    total_bytes += size;
    report_locked(0);
    pthread_mutex_unlock(&out_mu);
}

static void not_copied(size_t i, const char *found)
{
    pthread_mutex_lock(&out_mu);
    printf("x %zu %s\n", i, found);
    fflush(stdout);
    pthread_mutex_unlock(&out_mu);
}

/* This thread's file-system identity: the reader's (1) or root's again (0). */
static int act_as_reader(int on)
{
    if (on) {
        if (syscall(SYS_setgroups, n_reader_groups, reader_groups) != 0)
            return -1;
        setfsgid(reader_gid);
        setfsuid(reader_uid);
        /* both return the previous value: a second call tells whether the switch took */
        if ((uid_t)setfsuid(reader_uid) != reader_uid || (gid_t)setfsgid(reader_gid) != reader_gid) {
            errno = EPERM;
            return -1;
        }
        return 0;
    }
    setfsuid(geteuid());
    setfsgid(getegid());
    if ((uid_t)setfsuid(geteuid()) != geteuid() || (gid_t)setfsgid(getegid()) != getegid()) {
        errno = EPERM;
        return -1;
    }
    return (int)syscall(SYS_setgroups, n_root_groups, root_groups);
}

static void hex(const uint8_t *d, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (int k = 0; k < 32; k++) {
        out[2 * k] = digits[d[k] >> 4];
        out[2 * k + 1] = digits[d[k] & 15];
    }
    out[64] = 0;
}

/* Read up to n bytes (fewer only at end of file): reads can be short on network filesystems. */
static ssize_t read_full(int fd, char *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

static int write_full(int fd, const char *buf, size_t n)
{
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

struct worker {
    int index;
    char *buf;
    char dir[PATH_MAX];
    int dir_fd;  /* the directory of the last file, or -1 */
};

/* The descriptor of the directory of ``path`` in the staging area (made before the copy). */
static int parent_of(struct worker *w, const char *path, const char **name)
{
    const char *slash = strrchr(path, '/');
    *name = slash ? slash + 1 : path;
    size_t len = slash ? (size_t)(slash - path) : 0;
    if (len == 0)
        return dest_fd;
    if (len >= sizeof w->dir) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if (w->dir_fd >= 0 && strlen(w->dir) == len && memcmp(w->dir, path, len) == 0)
        return w->dir_fd;
    if (w->dir_fd >= 0)
        close(w->dir_fd);
    memcpy(w->dir, path, len);
    w->dir[len] = 0;
    w->dir_fd = (int)openat2_(dest_fd, w->dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
    return w->dir_fd;
}

/* 1 where this kernel and filesystem take O_TMPFILE and linkat(AT_EMPTY_PATH) (probed) */
static int anonymous;

/* The copy being written: an unnamed file (O_TMPFILE) linked under its name once whole
 * and verified, or, where that is not to be had, a fresh temporary name renamed into
 * place. Either way nothing appears under a final name before it is whole and verified;
 * an unnamed copy that fails, or a crash, leaves nothing behind at all. Measured on this
 * project's disk: half the system time of a create, a write and a rename per file (20,000
 * files of 1 KB; docs/benchmarks.md). */
struct copy {
    int fd;
    int dir;
    char tmp[96];  /* "" for an unnamed copy */
};

/* A fresh temporary name, short whatever the file's own (dsstage.fs.safe.temp_name's form). */
static void temp_name(char *out, size_t n)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    snprintf(out, n, ".dsstage-%d-%lu-%ld.tmp", (int)getpid(),
             __atomic_add_fetch(&temp_seq, 1, __ATOMIC_RELAXED), t.tv_nsec);
}

static int open_named(struct copy *c)
{
    for (;;) {
        temp_name(c->tmp, sizeof c->tmp);
        c->fd = openat(c->dir, c->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444);
        if (c->fd >= 0 || errno != EEXIST)
            return c->fd;
    }
}

static int open_copy(struct copy *c, int dir)
{
    c->dir = dir;
    c->tmp[0] = 0;
    if (anonymous) {
        c->fd = openat(dir, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0444);
        return c->fd;
    }
    return open_named(c);
}

/* Whether unnamed copies can be linked here (O_TMPFILE on the staging area's filesystem,
 * and linkat(AT_EMPTY_PATH), which takes CAP_DAC_READ_SEARCH). */
static void probe_anonymous(void)
{
    anonymous = 0;
    int fd = openat(dest_fd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0444);
    if (fd < 0)
        return;
    char tmp[96];
    temp_name(tmp, sizeof tmp);
    if (linkat(fd, "", dest_fd, tmp, AT_EMPTY_PATH) == 0) {
        unlinkat(dest_fd, tmp, 0);
        anonymous = 1;
    }
    close(fd);
}

/* Remove the copy (nothing of it stays). */
static void discard(struct copy *c)
{
    close(c->fd);
    if (c->tmp[0])
        unlinkat(c->dir, c->tmp, 0);
}

/* Give the copy the manifest's mtime and put it under ``name``; -1 with errno and *what set
 * on failure (the copy discarded). */
static int publish(struct copy *c, const struct entry *e, const char *name, const char **what)
{
    int64_t sec = e->mtime_ns / 1000000000L, nsec = e->mtime_ns % 1000000000L;
    if (nsec < 0) {  /* before 1970 */
        sec -= 1;
        nsec += 1000000000L;
    }
    struct timespec ts[2] = {{sec, nsec}, {sec, nsec}};
    *what = "write";
    if (futimens(c->fd, ts) != 0)
        goto failed;
    *what = "publish";
    if (!c->tmp[0]) {
        if (linkat(c->fd, "", c->dir, name, AT_EMPTY_PATH) == 0)
            goto done;
        if (errno != EEXIST)
            goto failed;
        /* a copy already under the name: replace it in one step, as rename does */
        char named[sizeof c->tmp];
        int rc;
        do {
            temp_name(named, sizeof named);
            rc = linkat(c->fd, "", c->dir, named, AT_EMPTY_PATH);
        } while (rc != 0 && errno == EEXIST);
        if (rc != 0)
            goto failed;
        memcpy(c->tmp, named, sizeof c->tmp);
    }
    if (renameat(c->dir, c->tmp, c->dir, name) != 0)
        goto failed;
    c->tmp[0] = 0;
done:
    if (close(c->fd) != 0) {
        c->fd = -1;
        *what = "write";
        return -1;
    }
    return 0;
failed:;
    int err = errno;
    discard(c);
    errno = err;
    return -1;
}

/* Copy entry i; 0 when done (copied, or reported as not copied), -1 after fail_*(). */
static int copy_one(struct worker *w, size_t i)
{
    const struct entry *e = &entries[i];
    char found[80];
    if (reader_set && act_as_reader(1) != 0) {
        fail_source(errno, i);
        return -1;
    }
    int fin = (int)openat2_(src_fd, e->path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0);
    int open_err = errno;
    if (reader_set && act_as_reader(0) != 0) {
        if (fin >= 0)
            close(fin);
        fail_store(errno, "identity", i);
        return -1;
    }
    if (fin < 0) {
        switch (open_err) {
        case ENOENT:
            not_copied(i, "missing");
            return 0;
        case ELOOP: case ENOTDIR: case EXDEV:
            not_copied(i, "not a regular file (a symbolic link in its path)");
            return 0;
        case EACCES: case EPERM:
            not_copied(i, "not readable by the source's reader (permission denied)");
            return 0;
        default:
            fail_source(open_err, i);
            return -1;
        }
    }
    struct stat st;
    if (fstat(fin, &st) != 0) {
        fail_source(errno, i);
        close(fin);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        not_copied(i, "not a regular file");
        close(fin);
        return 0;
    }
    const char *name;
    int dfd = parent_of(w, e->path, &name);
    if (dfd < 0) {
        fail_store(errno, "dir", i);
        close(fin);
        return -1;
    }
    blake3_hasher h;
    blake3_hasher_init(&h);
    uint8_t digest[32];
    struct copy c;
    const char *what;
    if (e->size < BUF) {
        /* one byte more than the manifest says: a file that grew shows */
        ssize_t got = read_full(fin, w->buf, (size_t)e->size + 1);
        if (got < 0) {
            fail_source(errno, i);
            close(fin);
            return -1;
        }
        close(fin);
        if ((uint64_t)got != e->size) {
            snprintf(found, sizeof found, "size %zd", got);
            not_copied(i, found);
            return 0;
        }
        blake3_hasher_update(&h, w->buf, (size_t)got);
        blake3_hasher_finalize(&h, digest, 32);
        hex(digest, found);
        if (strcmp(found, e->hash) != 0) {
            not_copied(i, found);
            return 0;
        }
        if (open_copy(&c, dfd) < 0) {
            fail_store(errno, "create", i);
            return -1;
        }
        if (write_full(c.fd, w->buf, (size_t)got) != 0) {
            fail_store(errno, "write", i);
            discard(&c);
            return -1;
        }
    } else {
        posix_fadvise(fin, 0, 0, POSIX_FADV_SEQUENTIAL);
        if (open_copy(&c, dfd) < 0) {
            fail_store(errno, "create", i);
            close(fin);
            return -1;
        }
        uint64_t size = 0;
        while (size <= e->size) {
            size_t want = e->size + 1 - size < BUF ? (size_t)(e->size + 1 - size) : BUF;
            ssize_t got = read_full(fin, w->buf, want);
            if (got < 0) {
                fail_source(errno, i);
                close(fin);
                discard(&c);
                return -1;
            }
            if (got == 0)
                break;
            blake3_hasher_update(&h, w->buf, (size_t)got);
            size += (uint64_t)got;
            if (size <= e->size && write_full(c.fd, w->buf, (size_t)got) != 0) {
                fail_store(errno, "write", i);
                close(fin);
                discard(&c);
                return -1;
            }
        }
        close(fin);
        if (size != e->size) {
            snprintf(found, sizeof found, "size %llu", (unsigned long long)size);
        } else {
            blake3_hasher_finalize(&h, digest, 32);
            hex(digest, found);
        }
        if (strcmp(found, e->hash) != 0) {
            discard(&c);
            not_copied(i, found);
            return 0;
        }
    }
    if (publish(&c, e, name, &what) != 0) {
        fail_store(errno, what, i);
        return -1;
    }
    copied(e->size);
    return 0;
}

/* A file of the tree being checked that cannot be read (fd closed if open; err 0: not a
 * regular file): an error of the disk itself ends the check (-1), anything else is the file
 * missing (0). The disk's errors are lib/dsstage/transfer/hashing.py's DISK_ERRORS: change
 * both together. */
static int unreadable(int fd, int err, size_t i)
{
    if (fd >= 0)
        close(fd);
    if (err == EIO || err == EUCLEAN || err == EBADMSG) {
        fail_store(err, "read", i);
        return -1;
    }
    not_copied(i, "missing");
    return 0;
}

/* Check entry i of the tree at src_fd (--check); 0 when done (found as listed, or reported
 * as not), -1 after fail_store() for an error of the disk itself. */
static int check_one(struct worker *w, size_t i)
{
    const struct entry *e = &entries[i];
    char found[80];
    int fd = (int)openat2_(src_fd, e->path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0);
    if (fd < 0)
        return unreadable(-1, errno, i);
    struct stat st;
    if (fstat(fd, &st) != 0)
        return unreadable(fd, errno, i);
    if (!S_ISREG(st.st_mode))
        return unreadable(fd, 0, i);
    if ((uint64_t)st.st_size != e->size) {
        close(fd);
        snprintf(found, sizeof found, "size %llu", (unsigned long long)st.st_size);
        not_copied(i, found);
        return 0;
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    blake3_hasher h;
    blake3_hasher_init(&h);
    uint64_t size = 0;
    for (;;) {  /* to its end: a size that differs from fstat's is reported as read */
        ssize_t got = read_full(fd, w->buf, BUF);
        if (got < 0)
            return unreadable(fd, errno, i);
        blake3_hasher_update(&h, w->buf, (size_t)got);
        size += (uint64_t)got;
        if ((size_t)got < BUF)
            break;
    }
    close(fd);
    if (size != e->size) {
        snprintf(found, sizeof found, "size %llu", (unsigned long long)size);
    } else {
        uint8_t digest[32];
        blake3_hasher_finalize(&h, digest, 32);
        hex(digest, found);
    }
    if (strcmp(found, e->hash) != 0) {
        not_copied(i, found);
        return 0;
    }
    copied(e->size);
    return 0;
}

static void *work(void *arg)
{
    struct worker *w = arg;
    w->buf = malloc(BUF + 1);
    if (!w->buf)
        fail_resources();
    for (;;) {
        pthread_mutex_lock(&mu);
        while (!stopping && next_entry < n_entries && w->index >= limit)
            pthread_cond_wait(&cv, &mu);
        if (stopping || next_entry >= n_entries) {
            exited++;
            pthread_cond_broadcast(&cv);
            pthread_mutex_unlock(&mu);
            break;
        }
        size_t i = next_entry++;
        pthread_mutex_unlock(&mu);
        if ((checking ? check_one(w, i) : copy_one(w, i)) != 0)
            continue;  /* fail() set stopping */
    }
    if (w->dir_fd >= 0)
        close(w->dir_fd);
    free(w->buf);
    free(w);
    return NULL;
}

/* Start workers up to the limit (holding mu). */
static void grow_locked(void)
{
    while (!stopping && started < limit && started < bound && next_entry < n_entries) {
        struct worker *w = calloc(1, sizeof *w);
        pthread_t t;
        pthread_attr_t attr;
        if (!w)
            break;
        w->index = started;
        w->dir_fd = -1;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        if (pthread_create(&t, &attr, work, w) != 0) {
            free(w);
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        started++;
    }
    if (started == 0 && !stopping && next_entry < n_entries) {  /* not one thread: nothing can be copied */
        out_of_resources = 1;
        stopping = 1;
    }
}

static void *control(void *arg)
{
    (void)arg;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        int n;
        if (sscanf(line, "L %d", &n) == 1 && n > 0) {
            pthread_mutex_lock(&mu);
            limit = n < bound ? n : bound;
            grow_locked();
            pthread_cond_broadcast(&cv);
            pthread_mutex_unlock(&mu);
        }
    }
    pthread_mutex_lock(&mu);  /* the caller is gone or wants no more files */
    stopping = 1;
    input_ended = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    free(line);
    return NULL;
}

static int parse_groups(const char *s, gid_t **out)
{
    int n = 0;
    if (strcmp(s, "-") == 0)
        return 0;
    *out = calloc(strlen(s) / 2 + 2, sizeof **out);
    for (char *end; *s; s = *end ? end + 1 : end) {
        (*out)[n++] = (gid_t)strtoul(s, &end, 10);
        if (end == s)
            return -1;
    }
    return n;
}

static int read_entries(void)
{
    size_t cap = 1024;
    char *rec = NULL;
    size_t rec_cap = 0;
    entries = malloc(cap * sizeof *entries);
    for (;;) {
        ssize_t len = getdelim(&rec, &rec_cap, '\0', stdin);
        if (len <= 0)
            return -1;  /* the list must end with an empty record */
        if (len == 1)
            break;
        if (n_entries == cap)
            entries = realloc(entries, (cap *= 2) * sizeof *entries);
        struct entry *e = &entries[n_entries];
        /* "SIZE MTIME_NS HASH PATH": the path is the rest of the record, whatever it holds */
        char *p = rec, *end;
        errno = 0;
        e->size = strtoull(p, &end, 10);
        if (end == p || *end != ' ' || errno)
            return -1;
        p = end + 1;
        e->mtime_ns = strtoll(p, &end, 10);
        if (end == p || *end != ' ' || errno)
            return -1;
        p = end + 1;
        if (strspn(p, "0123456789abcdef") != 64 || p[64] != ' ' || !p[65])
            return -1;
        memcpy(e->hash, p, 64);
        e->hash[64] = 0;
        e->path = strdup(p + 65);
        if (!e->path)
            return -1;
        n_entries++;
    }
    free(rec);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--check") == 0) {
        checking = 1;  /* the same positions as a copy's: the tree is both ends' */
        argv[1] = argv[2];
    } else if (argc != 5 && argc != 8) {
        fprintf(stderr, "usage: dsstage-copy SRC_FD DEST_FD BOUND LIMIT [UID GID GROUPS]\n"
                        "       dsstage-copy --check ROOT_FD BOUND LIMIT\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);  /* a caller gone shows as a failed write: stop, tidily */
    src_fd = atoi(argv[1]);
    dest_fd = atoi(argv[2]);
    bound = atoi(argv[3]);
    limit = atoi(argv[4]);
    if (bound < 1 || limit < 1) {
        fprintf(stderr, "dsstage-copy: BOUND and LIMIT must be at least 1\n");
        return 1;
    }
    if (limit > bound)
        limit = bound;
    if (argc == 8) {
        reader_set = 1;
        reader_uid = (uid_t)strtoul(argv[5], NULL, 10);
        reader_gid = (gid_t)strtoul(argv[6], NULL, 10);
        n_reader_groups = parse_groups(argv[7], &reader_groups);
        n_root_groups = getgroups(0, NULL);
        root_groups = calloc((size_t)n_root_groups + 1, sizeof *root_groups);
        if (n_reader_groups < 0 || n_root_groups < 0 || getgroups(n_root_groups, root_groups) < 0) {
            fprintf(stderr, "dsstage-copy: bad GROUPS\n");
            return 1;
        }
    }
    /* root's own tree: any failure here is openat2's (absent, or refused by a seccomp filter) */
    long probe = openat2_(dest_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (probe < 0)
        return 3;
    close((int)probe);
    if (!checking)
        probe_anonymous();
    if (read_entries() != 0) {
        fprintf(stderr, "dsstage-copy: the list of files is malformed\n");
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC_COARSE, &last_report);
    pthread_mutex_lock(&mu);
    grow_locked();
    pthread_mutex_unlock(&mu);
    pthread_t ctl;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&ctl, &attr, control, NULL) != 0) {
        fprintf(stderr, "dsstage-copy: cannot start a thread\n");
        return 1;
    }
    pthread_mutex_lock(&mu);
    while (exited < started)
        pthread_cond_wait(&cv, &mu);
    char last[256];
    snprintf(last, sizeof last, "%s", fatal);
    int short_of = out_of_resources;
    int cut_short = input_ended && next_entry < n_entries;  /* files never handed out */
    pthread_mutex_unlock(&mu);
    pthread_mutex_lock(&out_mu);
    report_locked(1);
    if (last[0])
        fputs(last, stdout);
    printf("= %llu %llu\n", (unsigned long long)total_files, (unsigned long long)total_bytes);
    fflush(stdout);
    pthread_mutex_unlock(&out_mu);
    _exit(last[0] ? 2 : short_of ? NO_RESOURCES : cut_short ? INPUT_ENDED : 0);
}
