/*
 * latencyfs: a read-only FUSE passthrough of a backing directory in which every metadata
 * operation (lookup/getattr, readlink, opendir, readdir, statfs), every open and every
 * read request waits a fixed delay before it is answered: one emulated network round
 * trip. Requests are served concurrently by up to `threads` worker threads, so the
 * delays of concurrent requests overlap, as on a network filesystem with many RPCs in
 * flight. For the benchmarks and functional tests of dsstage (see tests/latencyfs.py
 * and docs/benchmarks.md); not a production filesystem.
 *
 *   latencyfs BACKING MOUNTPOINT [-f] [-o delay_us=1000,threads=256,rate=0,stats=FILE,hang=FILE,fail=FILE,
 *             entry_timeout=1,attr_timeout=1,readdirplus,uncached,allow_other,...]
 *
 * Bandwidth: with rate=N (bytes per second, 0 = unlimited), the read replies of all
 * threads of this mount together deliver at most N bytes per second, as a shared filesystem whose
 * aggregate bandwidth is the bottleneck for all its clients: after its round trip and
 * its pread, each read reply is given the next free slot of the link (n / N seconds,
 * starting when the previous slot ends or now, whichever is later) and is answered when
 * its slot ends. An idle link earns no credit, so no burst goes beyond the rate.
 *
 * Kernel caching follows NFS's cold path: entries and attributes are cached for
 * entry_timeout / attr_timeout seconds (libfuse's options, default 1 s here as there),
 * negative lookups are not cached, and a file's page cache is dropped when it is opened
 * (no keep_cache), so every open reads through the delay again. With `uncached`, no page
 * cache is used at all (direct_io): readers that share the mount, standing for separate
 * nodes, never share a read, as separate NFS clients do not.
 *
 * Hanging: with hang=FILE, every request but release waits for as long as FILE exists (checked
 * every 20 ms), as a hard NFS mount whose server stopped answering: the client's system call
 * blocks until the file is removed or the client is killed (the kernel then abandons the
 * request; its thread replies to nobody once the file is gone).
 *
 * Failing: with fail=FILE, every read request is answered EIO for as long as FILE exists, as
 * a server whose disk fails under a file that was opened and listed fine; or the errno whose
 * number FILE holds (74: EBADMSG, a checksum that does not match; 117: EUCLEAN, corruption).
 *
 * Counters: operations by kind, bytes delivered by read replies (`bytes_read`), and the
 * peak number of requests in flight (all kinds, and opens alone). They are written as
 * JSON to the `stats` file (written to FILE.tmp and renamed) on SIGUSR1 and at exit;
 * SIGUSR2 resets them and writes the file too. Each write carries a sequence number
 * `seq`, so a reader can wait for it. The operations are also counted by area (`by_area`):
 * the first component of the path, cut at its first dot after the first character
 * ("nodes", "budget", "demand" for demand.json and its temporary files, ".clock"; "/" for
 * the mount's root), at most 63 areas and the rest as "*": where in a shared directory the
 * requests go.
 *
 * Root squashed (option `squash`): the mount is writable, and every request runs with the
 * caller's file-system identity (setfsuid, setfsgid and its groups, per worker thread), but
 * a caller with uid 0 is served as squash_uid:squash_gid (65534:65534, no groups), as an NFS
 * server exporting with root_squash serves root on a client: the backing directory's own
 * permissions decide, as the server's do. Writes, directories, links, renames, modes, owners
 * and times are passed through; extended attributes (so POSIX ACLs) are not.
 *
 * Paths are resolved beneath the backing directory's descriptor with openat2's
 * RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, never following a symlink: a symlink is
 * reported as one (lstat, readlink) and the kernel follows it inside the mount.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum kind { K_GETATTR, K_READLINK, K_OPENDIR, K_READDIR, K_OPEN, K_READ, K_RELEASE, K_RELEASEDIR,
            K_STATFS, K_WRITE, K_CHANGE, K_COUNT };
static const char *const kind_names[K_COUNT] = {
    "getattr", "readlink", "opendir", "readdir", "open", "read", "release", "releasedir", "statfs",
    "write", "change"};

static struct options {
    char *backing;
    char *stats;
    char *hang;  /* while this file exists, requests are not answered */
    char *fail;  /* while this file exists, reads are answered EIO */
    unsigned delay_us;
    unsigned threads;
    unsigned long rate;  /* bytes per second over all read replies, 0 = unlimited */
    int readdirplus;
    int direct_io;  /* no page cache at all: several clients of one mount read separately */
    int squash;  /* writable, each request as its caller, root as squash_uid:squash_gid */
    unsigned squash_uid, squash_gid;
} opt = {.delay_us = 1000, .threads = 256, .squash_uid = 65534, .squash_gid = 65534};

static int backing_fd = -1;
static atomic_long counts[K_COUNT];
static atomic_long bytes_read, in_flight, peak, opens_in_flight, opens_peak;
static long seq;
static pthread_mutex_t stats_lock = PTHREAD_MUTEX_INITIALIZER;

static void raise_peak(atomic_long *p, long n)
{
    long cur = atomic_load(p);
    while (n > cur && !atomic_compare_exchange_weak(p, &cur, n))
        ;
}

/* The areas: a name, and its counts by kind. A name is written before area_count covers it. */
#define AREAS 64
static struct area {
    char name[64];
    atomic_long n[K_COUNT];
} areas[AREAS];
static atomic_int area_count;
static pthread_mutex_t areas_lock = PTHREAD_MUTEX_INITIALIZER;

static int find_area(const char *name, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(areas[i].name, name) == 0)
            return i;
    return -1;
}

/* The area of PATH (as FUSE gives it, "/a/b"): see the header. */
static struct area *area_of(const char *path)
{
    const char *p = path && path[0] == '/' ? path + 1 : path ? path : "";
    size_t len = strcspn(p, "/");
    const char *dot = len > 1 ? memchr(p + 1, '.', len - 1) : NULL;
    if (dot)
        len = (size_t)(dot - p);
    char name[64] = "/";
    if (len) {
        len = len < sizeof name - 1 ? len : sizeof name - 1;
        memcpy(name, p, len);
        name[len] = '\0';
    }
    int i = find_area(name, atomic_load(&area_count));
    if (i >= 0)
        return &areas[i];
    pthread_mutex_lock(&areas_lock);
    int n = atomic_load(&area_count);
    i = find_area(name, n);
    if (i < 0 && n < AREAS - 1) {
        strcpy(areas[n].name, name);
        atomic_store(&area_count, n + 1);
        i = n;
    } else if (i < 0) {
        strcpy(areas[AREAS - 1].name, "*");
        i = AREAS - 1;
    }
    pthread_mutex_unlock(&areas_lock);
    return &areas[i];
}

/* One request on PATH: count it, mark it in flight, wait the round trip. */
static void enter(enum kind k, const char *path)
{
    atomic_fetch_add(&counts[k], 1);
    atomic_fetch_add(&area_of(path)->n[k], 1);
    raise_peak(&peak, atomic_fetch_add(&in_flight, 1) + 1);
    if (k == K_OPEN)
        raise_peak(&opens_peak, atomic_fetch_add(&opens_in_flight, 1) + 1);
    while (opt.hang && k != K_RELEASE && k != K_RELEASEDIR && access(opt.hang, F_OK) == 0) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (opt.delay_us && k != K_RELEASE && k != K_RELEASEDIR) {
        struct timespec ts = {opt.delay_us / 1000000, (long)(opt.delay_us % 1000000) * 1000};
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
            ;
    }
}

static int leave(enum kind k, int res)
{
    if (k == K_OPEN)
        atomic_fetch_sub(&opens_in_flight, 1);
    atomic_fetch_sub(&in_flight, 1);
    return res;
}

/*
 * Pace a read reply of N bytes to opt.rate: reserve the link's next free N / rate seconds
 * under the mutex, then sleep (outside it) until the end of that slot, when the bytes
 * have been "delivered". Slots are in nanoseconds of CLOCK_MONOTONIC.
 */
static pthread_mutex_t link_lock = PTHREAD_MUTEX_INITIALIZER;
static long long link_free_ns;  /* when the link's last reserved slot ends */

static long long monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void pace(size_t n)
{
    if (!opt.rate || !n)
        return;
    long long cost = (long long)((unsigned __int128)n * 1000000000u / opt.rate);
    pthread_mutex_lock(&link_lock);
    long long now = monotonic_ns();
    long long due = (link_free_ns > now ? link_free_ns : now) + cost;
    link_free_ns = due;
    pthread_mutex_unlock(&link_lock);
    struct timespec ts = {(time_t)(due / 1000000000LL), (long)(due % 1000000000LL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

static void write_stats(int final)
{
    if (!opt.stats)
        return;
    pthread_mutex_lock(&stats_lock);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", opt.stats);
    FILE *f = fopen(tmp, "w");
    if (f) {
        fprintf(f, "{\"seq\": %ld, \"final\": %s, \"pid\": %ld, \"delay_us\": %u, \"threads\": %u, "
                   "\"rate\": %lu, \"ops\": {",
                ++seq, final ? "true" : "false", (long)getpid(), opt.delay_us, opt.threads, opt.rate);
        for (int k = 0; k < K_COUNT; k++)
            fprintf(f, "%s\"%s\": %ld", k ? ", " : "", kind_names[k], atomic_load(&counts[k]));
        fprintf(f, "}, \"by_area\": {");
        int areas_now = atomic_load(&area_count);
        for (int i = 0, first = 1; i < AREAS; i++) {
            if (i >= areas_now && i != AREAS - 1)
                continue;
            if (!areas[i].name[0])
                continue;
            fprintf(f, "%s\"", first ? "" : ", ");
            for (const char *c = areas[i].name; *c; c++)  /* a JSON string: escape what must be */
                fprintf(f, (*c == '"' || *c == '\\') ? "\\%c" : (unsigned char)*c < 0x20 ? "\\u%04x" : "%c", *c);
            fprintf(f, "\": {");
            for (int k = 0, any = 0; k < K_COUNT; k++) {
                long v = atomic_load(&areas[i].n[k]);
                if (v) {
                    fprintf(f, "%s\"%s\": %ld", any ? ", " : "", kind_names[k], v);
                    any = 1;
                }
            }
            fprintf(f, "}");
            first = 0;
        }
        fprintf(f, "}, \"bytes_read\": %ld, \"in_flight\": %ld, \"peak_in_flight\": %ld, "
                   "\"peak_opens_in_flight\": %ld}\n",
                atomic_load(&bytes_read), atomic_load(&in_flight), atomic_load(&peak),
                atomic_load(&opens_peak));
        if (fclose(f) == 0)
            rename(tmp, opt.stats);
    }
    pthread_mutex_unlock(&stats_lock);
}

static void reset_stats(void)
{
    for (int k = 0; k < K_COUNT; k++) {
        atomic_store(&counts[k], 0);
        for (int i = 0; i < AREAS; i++)
            atomic_store(&areas[i].n[k], 0);
    }
    atomic_store(&bytes_read, 0);
    atomic_store(&peak, atomic_load(&in_flight));
    atomic_store(&opens_peak, atomic_load(&opens_in_flight));
}

/* SIGUSR1 and SIGUSR2 are blocked in every thread; this one takes them with sigwait. */
static void *signal_thread(void *arg)
{
    sigset_t *set = arg;
    for (;;) {
        int sig;
        if (sigwait(set, &sig) != 0)
            continue;
        if (sig == SIGUSR2)
            reset_stats();
        write_stats(0);
    }
    return NULL;
}

static sigset_t usr_signals;

/* With `squash`: this worker thread takes the caller's file-system identity (root's squashed)
 * for the request, and gives it back after. setfsuid/setfsgid and the raw setgroups call are
 * per thread (glibc's setgroups() would change every thread). */
static void as_caller(void)
{
    if (!opt.squash)
        return;
    struct fuse_context *c = fuse_get_context();
    uid_t uid = c->uid;
    gid_t gid = c->gid;
    gid_t groups[64];
    int n = 0;
    if (uid == 0) {
        uid = opt.squash_uid;
        gid = opt.squash_gid;
    } else {
        n = fuse_getgroups(64, groups);
        if (n < 0 || n > 64)
            n = 0;
    }
    syscall(SYS_setgroups, n, groups);
    syscall(SYS_setfsgid, gid);
    syscall(SYS_setfsuid, uid);
}

static void as_server(void)
{
    if (!opt.squash)
        return;
    syscall(SYS_setfsuid, 0);
    syscall(SYS_setfsgid, 0);
    syscall(SYS_setgroups, 0, NULL);
}

/* PATH (as FUSE gives it, "/a/b") relative to the backing directory */
static const char *rel(const char *path)
{
    const char *r = path[0] == '/' ? path + 1 : path;
    return *r ? r : ".";
}

/* A descriptor for PATH (as FUSE gives it, "/a/b") beneath the backing directory. */
static int open_beneath(const char *path, int flags)
{
    const char *rel = path[0] == '/' ? path + 1 : path;
    if (!*rel)
        rel = ".";
    struct open_how how = {.flags = (unsigned long long)(flags | O_NOFOLLOW | O_CLOEXEC),
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, backing_fd, rel, &how, sizeof how);
    return fd < 0 ? -errno : fd;
}

/*
 * Parallel lookups and readdirs in one directory. Without FUSE_PARALLEL_DIROPS in the INIT
 * reply the kernel serializes them per directory (one LOOKUP in flight per directory,
 * where an NFS client sends many). libfuse before 3.16 never sent that flag, whatever the
 * filesystem wants (libfuse pull requests 861 and 880); Debian 12 has 3.14. So this
 * program defines writev(), which libfuse calls to answer the kernel: the one reply
 * written while init() is being answered (the INIT reply: out header, then
 * fuse_init_out whose `flags` is at byte 12) gets the flag added; every other call is
 * the plain system call. The high-level library takes its own per-node locks and is
 * safe with concurrent lookups.
 */
#define KERNEL_PARALLEL_DIROPS (1u << 18)  /* FUSE_PARALLEL_DIROPS in linux/fuse.h */
static atomic_int patch_init_reply;

ssize_t writev(int fd, const struct iovec *iov, int iovcnt)
{
    if (atomic_load(&patch_init_reply) && iovcnt >= 2 && iov[0].iov_len == 16 && iov[1].iov_len >= 16 &&
        ((const int32_t *)iov[0].iov_base)[1] == 0) {
        uint32_t flags;
        memcpy(&flags, (char *)iov[1].iov_base + 12, sizeof flags);
        flags |= KERNEL_PARALLEL_DIROPS;
        memcpy((char *)iov[1].iov_base + 12, &flags, sizeof flags);
        atomic_store(&patch_init_reply, 0);
    }
    return syscall(SYS_writev, fd, iov, iovcnt);
}

static void *lfs_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
    cfg->use_ino = 1;
    cfg->kernel_cache = 0;  /* the page cache is dropped on every open */
    cfg->auto_cache = 0;
    cfg->nullpath_ok = 0;
    cfg->direct_io = opt.direct_io;
    /* asynchronous reads and readahead are background requests: let as many be in flight
     * as there are threads (the kernel's default is 12) */
    conn->max_background = opt.threads;
    conn->congestion_threshold = opt.threads * 3 / 4;
    if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) {
        conn->want |= FUSE_CAP_PARALLEL_DIROPS;
        atomic_store(&patch_init_reply, 1);  /* see writev() */
    }
    if (conn->capable & FUSE_CAP_ASYNC_READ)
        conn->want |= FUSE_CAP_ASYNC_READ;
    if (!opt.readdirplus)
        conn->want &= ~(unsigned)(FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO);
    pthread_t t;
    if (pthread_create(&t, NULL, signal_thread, &usr_signals) == 0)
        pthread_detach(t);
    write_stats(0);
    return NULL;
}

static void lfs_destroy(void *data)
{
    (void)data;
    write_stats(1);
}

static int lfs_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    (void)fi;
    enter(K_GETATTR, path);
    as_caller();
    int fd = open_beneath(path, O_PATH);
    as_server();
    if (fd < 0)
        return leave(K_GETATTR, fd);
    int res = fstatat(fd, "", st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) == 0 ? 0 : -errno;
    close(fd);
    return leave(K_GETATTR, res);
}

static int lfs_readlink(const char *path, char *buf, size_t size)
{
    enter(K_READLINK, path);
    if (size == 0)
        return leave(K_READLINK, -EINVAL);
    as_caller();
    int fd = open_beneath(path, O_PATH);
    as_server();
    if (fd < 0)
        return leave(K_READLINK, fd);
    ssize_t n = readlinkat(fd, "", buf, size - 1);
    int res = n < 0 ? -errno : 0;
    close(fd);
    if (n >= 0)
        buf[n] = '\0';
    return leave(K_READLINK, res);
}

static int lfs_open(const char *path, struct fuse_file_info *fi)
{
    enter(K_OPEN, path);
    if ((fi->flags & O_ACCMODE) != O_RDONLY && !opt.squash)
        return leave(K_OPEN, -EROFS);
    as_caller();
    int fd = open_beneath(path, opt.squash ? (fi->flags & ~(O_CREAT | O_EXCL | O_NOCTTY)) : O_RDONLY);
    as_server();
    if (fd < 0)
        return leave(K_OPEN, fd);
    fi->fh = (uint64_t)fd;
    fi->keep_cache = 0;
    return leave(K_OPEN, 0);
}

/* The errno the fail file asks for: the number it holds, EIO if none. */
static int failing_errno(void)
{
    int err = EIO;
    FILE *f = fopen(opt.fail, "r");
    if (f) {
        int n;
        if (fscanf(f, "%d", &n) == 1 && n > 0 && n < 4096)
            err = n;
        fclose(f);
    }
    return err;
}

static int lfs_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)path;
    enter(K_READ, path);
    if (opt.fail && access(opt.fail, F_OK) == 0)
        return leave(K_READ, -failing_errno());
    ssize_t n = pread((int)fi->fh, buf, size, off);
    if (n < 0)
        return leave(K_READ, -errno);
    pace((size_t)n);
    atomic_fetch_add(&bytes_read, n);
    return leave(K_READ, (int)n);
}

static int lfs_release(const char *path, struct fuse_file_info *fi)
{
    (void)path;
    enter(K_RELEASE, path);
    close((int)fi->fh);
    return leave(K_RELEASE, 0);
}

struct dir {
    DIR *dp;
    struct dirent *entry;
    off_t offset;
};

static int lfs_opendir(const char *path, struct fuse_file_info *fi)
{
    enter(K_OPENDIR, path);
    as_caller();
    int fd = open_beneath(path, O_RDONLY | O_DIRECTORY);
    as_server();
    if (fd < 0)
        return leave(K_OPENDIR, fd);
    struct dir *d = calloc(1, sizeof *d);
    if (!d || !(d->dp = fdopendir(fd))) {
        int err = d ? -errno : -ENOMEM;
        free(d);
        close(fd);
        return leave(K_OPENDIR, err);
    }
    fi->fh = (uint64_t)(uintptr_t)d;
    return leave(K_OPENDIR, 0);
}

/* One call per kernel READDIR request (entries carry their offsets), as NFS answers a
 * large directory in several READDIR round trips. */
static int lfs_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
                       struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void)path;
    enter(K_READDIR, path);
    struct dir *d = (struct dir *)(uintptr_t)fi->fh;
    if (offset != d->offset) {
        seekdir(d->dp, offset);
        d->entry = NULL;
        d->offset = offset;
    }
    for (;;) {
        if (!d->entry) {
            errno = 0;
            d->entry = readdir(d->dp);
            if (!d->entry) {
                if (errno)
                    return leave(K_READDIR, -errno);
                break;
            }
        }
        struct stat st;
        enum fuse_fill_dir_flags fill = 0;
        memset(&st, 0, sizeof st);
        if ((flags & FUSE_READDIR_PLUS) &&
            fstatat(dirfd(d->dp), d->entry->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
            fill = FUSE_FILL_DIR_PLUS;
        } else {
            st.st_ino = d->entry->d_ino;
            st.st_mode = (mode_t)DTTOIF(d->entry->d_type);
        }
        off_t next = telldir(d->dp);
        if (filler(buf, d->entry->d_name, &st, next, fill))
            break;
        d->entry = NULL;
        d->offset = next;
    }
    return leave(K_READDIR, 0);
}

static int lfs_releasedir(const char *path, struct fuse_file_info *fi)
{
    (void)path;
    enter(K_RELEASEDIR, path);
    struct dir *d = (struct dir *)(uintptr_t)fi->fh;
    closedir(d->dp);
    free(d);
    return leave(K_RELEASEDIR, 0);
}

static int lfs_statfs(const char *path, struct statvfs *sv)
{
    (void)path;
    enter(K_STATFS, path);
    return leave(K_STATFS, fstatvfs(backing_fd, sv) == 0 ? 0 : -errno);
}

/* -- the writable operations (squash): each as its caller, relative to the backing directory -- */

static int done(int ok)
{
    int res = ok ? 0 : -errno;
    as_server();
    return leave(K_CHANGE, res);
}

static int lfs_mkdir(const char *path, mode_t mode)
{
    enter(K_CHANGE, path);
    as_caller();
    return done(mkdirat(backing_fd, rel(path), mode) == 0);
}

static int lfs_unlink(const char *path)
{
    enter(K_CHANGE, path);
    as_caller();
    return done(unlinkat(backing_fd, rel(path), 0) == 0);
}

static int lfs_rmdir(const char *path)
{
    enter(K_CHANGE, path);
    as_caller();
    return done(unlinkat(backing_fd, rel(path), AT_REMOVEDIR) == 0);
}

static int lfs_rename(const char *from, const char *to, unsigned int flags)
{
    enter(K_CHANGE, to);
    as_caller();
    return done(syscall(SYS_renameat2, backing_fd, rel(from), backing_fd, rel(to), flags) == 0);
}

static int lfs_link(const char *from, const char *to)
{
    enter(K_CHANGE, to);
    as_caller();
    return done(linkat(backing_fd, rel(from), backing_fd, rel(to), 0) == 0);
}

static int lfs_symlink(const char *target, const char *path)
{
    enter(K_CHANGE, path);
    as_caller();
    return done(symlinkat(target, backing_fd, rel(path)) == 0);
}

static int lfs_chmod(const char *path, mode_t mode, struct fuse_file_info *fi)
{
    enter(K_CHANGE, path);
    as_caller();
    return done((fi ? fchmod((int)fi->fh, mode) : fchmodat(backing_fd, rel(path), mode, 0)) == 0);
}

static int lfs_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi)
{
    enter(K_CHANGE, path);
    as_caller();
    return done((fi ? fchown((int)fi->fh, uid, gid)
                    : fchownat(backing_fd, rel(path), uid, gid, AT_SYMLINK_NOFOLLOW)) == 0);
}

static int lfs_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
    enter(K_CHANGE, path);
    as_caller();
    if (fi)
        return done(ftruncate((int)fi->fh, size) == 0);
    int fd = open_beneath(path, O_WRONLY);
    if (fd < 0) {
        errno = -fd;
        return done(0);
    }
    int ok = ftruncate(fd, size) == 0;
    int err = errno;
    close(fd);
    errno = err;
    return done(ok);
}

static int lfs_utimens(const char *path, const struct timespec ts[2], struct fuse_file_info *fi)
{
    enter(K_CHANGE, path);
    as_caller();
    return done((fi ? futimens((int)fi->fh, ts) : utimensat(backing_fd, rel(path), ts, AT_SYMLINK_NOFOLLOW)) == 0);
}

static int lfs_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
    enter(K_OPEN, path);
    as_caller();
    struct open_how how = {.flags = (unsigned long long)(fi->flags | O_CREAT | O_NOFOLLOW | O_CLOEXEC),
                           .mode = mode & 07777,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, backing_fd, rel(path), &how, sizeof how);
    int res = fd < 0 ? -errno : 0;
    as_server();
    if (fd >= 0) {
        fi->fh = (uint64_t)fd;
        fi->keep_cache = 0;
    }
    return leave(K_OPEN, res);
}

static int lfs_write(const char *path, const char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)path;
    enter(K_WRITE, path);
    ssize_t n = pwrite((int)fi->fh, buf, size, off);
    return leave(K_WRITE, n < 0 ? -errno : (int)n);
}

static int lfs_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
    (void)path;
    enter(K_CHANGE, path);
    int res = (datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh)) == 0 ? 0 : -errno;
    return leave(K_CHANGE, res);
}

static const struct fuse_operations ops = {
    .init = lfs_init,
    .destroy = lfs_destroy,
    .getattr = lfs_getattr,
    .readlink = lfs_readlink,
    .open = lfs_open,
    .read = lfs_read,
    .release = lfs_release,
    .opendir = lfs_opendir,
    .readdir = lfs_readdir,
    .releasedir = lfs_releasedir,
    .statfs = lfs_statfs,
    /* squash only: a read-only mount refuses them in the kernel before they come here */
    .mkdir = lfs_mkdir,
    .unlink = lfs_unlink,
    .rmdir = lfs_rmdir,
    .rename = lfs_rename,
    .link = lfs_link,
    .symlink = lfs_symlink,
    .chmod = lfs_chmod,
    .chown = lfs_chown,
    .truncate = lfs_truncate,
    .utimens = lfs_utimens,
    .create = lfs_create,
    .write = lfs_write,
    .fsync = lfs_fsync,
};

#define OPT(t, p) {t, offsetof(struct options, p), 1}
static const struct fuse_opt option_spec[] = {
    OPT("delay_us=%u", delay_us),
    OPT("threads=%u", threads),
    OPT("rate=%lu", rate),
    OPT("stats=%s", stats),
    OPT("hang=%s", hang),
    OPT("fail=%s", fail),
    OPT("readdirplus", readdirplus),
    OPT("uncached", direct_io),
    OPT("squash", squash),
    OPT("squash_uid=%u", squash_uid),
    OPT("squash_gid=%u", squash_gid),
    FUSE_OPT_END,
};

static int take_backing(void *data, const char *arg, int key, struct fuse_args *args)
{
    (void)data;
    (void)args;
    if (key == FUSE_OPT_KEY_NONOPT && !opt.backing) {
        opt.backing = strdup(arg);
        return 0;
    }
    return 1;
}

int main(int argc, char *argv[])
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    if (fuse_opt_parse(&args, &opt, option_spec, take_backing) == -1)
        return 2;
    if (!opt.backing) {
        fprintf(stderr, "usage: %s BACKING MOUNTPOINT [-f] [-o delay_us=N,threads=N,rate=N,stats=FILE,hang=FILE,fail=FILE,"
                        "entry_timeout=S,attr_timeout=S,readdirplus,uncached]\n", argv[0]);
        return 2;
    }
    if (opt.threads < 1)
        opt.threads = 1;
    backing_fd = open(opt.backing, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (backing_fd < 0) {
        fprintf(stderr, "latencyfs: %s: %s\n", opt.backing, strerror(errno));
        return 1;
    }
    if (opt.hang && opt.hang[0] != '/') {
        fprintf(stderr, "latencyfs: hang=%s: give an absolute path\n", opt.hang);
        return 2;
    }
    if (opt.fail && opt.fail[0] != '/') {
        fprintf(stderr, "latencyfs: fail=%s: give an absolute path\n", opt.fail);
        return 2;
    }
    if (opt.stats && opt.stats[0] != '/') {  /* fuse_main may chdir("/") */
        char *abs = realpath(".", NULL);
        char *joined = NULL;
        if (!abs || asprintf(&joined, "%s/%s", abs, opt.stats) < 0)
            return 1;
        free(abs);
        opt.stats = joined;
    }
    /* defaults first, so that options given on the command line override them */
    char threads_opt[128], fsname_opt[4200];
    snprintf(threads_opt, sizeof threads_opt, "-omax_threads=%u,max_idle_threads=%u", opt.threads,
             opt.threads);
    snprintf(fsname_opt, sizeof fsname_opt, "-ofsname=latencyfs:%s,subtype=latencyfs", opt.backing);
    struct fuse_args full = FUSE_ARGS_INIT(0, NULL);
    fuse_opt_add_arg(&full, args.argv[0]);
    fuse_opt_add_arg(&full, opt.squash ? "-orw,allow_other,entry_timeout=1,attr_timeout=1,negative_timeout=0"
                                       : "-oro,entry_timeout=1,attr_timeout=1,negative_timeout=0");
    fuse_opt_add_arg(&full, threads_opt);
    fuse_opt_add_arg(&full, strchr(opt.backing, ',') ? "-osubtype=latencyfs" : fsname_opt);
    for (int i = 1; i < args.argc; i++)
        fuse_opt_add_arg(&full, args.argv[i]);
    sigemptyset(&usr_signals);
    sigaddset(&usr_signals, SIGUSR1);
    sigaddset(&usr_signals, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &usr_signals, NULL);
    int res = fuse_main(full.argc, full.argv, &ops, NULL);
    fuse_opt_free_args(&full);
    fuse_opt_free_args(&args);
    return res;
}
