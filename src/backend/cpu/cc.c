/* cc.c: the compiler driver (see cc.h): finds the C compiler and its
 * identity, runs it without a shell, and loads the resulting module through
 * the disk cache with dlopen.
 *
 * It also finds the build-id of the running build (the identity a backend
 * puts in a program description, cc.h) and, for rfi_cc_load_program, asks the
 * disk cache's index before generating a source at all.
 *
 * It does not generate source (the renderer does, through the backend's
 * callback), decide where objects live or when they are reused (disk_cache.c
 * does), or call the module (the CPU backend does). Process-wide state: the
 * compiler-identity cache (one entry, under a mutex that no thread holds while
 * it runs the compiler, so a forked child never inherits it held) and four
 * statistics counters.
 */
#include "cc.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Flags between the program name and "-o"; -lm goes after the source.
 * -funswitch-loops: a select on a condition that does not change along the
 * innermost loop (a padding guard of the outer indices) otherwise keeps gcc
 * -O2 from vectorising that loop; unswitched, each copy vectorises (the cnn's
 * second max-pool gradient: 0.75 -> 0.2 ms).
 * -ffp-contract=fast: a * b + c as one fused multiply-add, as the libraries'
 * kernels do (-std=c11 turns contraction off). On a 2-core AVX2 machine the
 * direct convolutions' inner loops (a broadcast, a multiply and an add per
 * accumulator without it) ran 15-20% faster, the ResNet step 34.5-35.0 ->
 * 31.5-32.3 ms (3 interleaved pairs).
 * -mno-red-zone (x86-64): gcc 12.2 (Debian 12.2.0-14) placed a reduce
 * kernel's local accumulator array (double accs[12]) in the red zone below
 * three pushed registers, 8 bytes off the 16-byte alignment its vectorised
 * read of that array (vmovapd) assumed: a crash on the first run (found by
 * the training fuzzer; fuzz/corpus/fuzz_train_compiled holds the input).
 * Without the red zone the frame is allocated with a sub that keeps the
 * alignment; a leaf kernel pays one sub and one add. */
static const char *const compile_flags[] = {
    "-O2", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno",
    "-fno-trapping-math", "-funswitch-loops", "-march=native", "-ffp-contract=fast",
#if defined(__x86_64__)
    "-mno-red-zone",
#endif
};
#define N_COMPILE_FLAGS (sizeof compile_flags / sizeof compile_flags[0])
#define OUTPUT_KEEP (64 * 1024)  /* compiler output kept in memory; the rest is drained */
#define MSG_OUTPUT_MAX 1200      /* compiler output quoted in an error message */

static atomic_uint_fast64_t n_compiles, n_disk_hits, n_sources, n_index_hits;

uint64_t rfi_cc_n_compiles(void) { return atomic_load(&n_compiles); }
uint64_t rfi_cc_n_disk_hits(void) { return atomic_load(&n_disk_hits); }
uint64_t rfi_cc_n_sources(void) { return atomic_load(&n_sources); }
uint64_t rfi_cc_n_index_hits(void) { return atomic_load(&n_index_hits); }

/* ---- Running a program ------------------------------------------------------------------ */

/* Moves fd to a number >= 3 (close-on-exec), so dup2 onto 0..2 in the child
 * never aliases it. Returns the new fd or -1. */
static int fd_above_stdio(int fd)
{
    if (fd < 0 || fd > 2)
        return fd;
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    close(fd);
    return moved;
}

/* The exit status of a child that could not start the program (as a shell's). */
#define CHILD_EXEC_FAILED 127

/* In the child, between fork and exec: async-signal-safe calls only. */
static void child_exec(const char *path, char *const argv[], int in_fd, int out_fd,
                       long max_fd, const char *exec_fail_msg, pid_t parent)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* a process group of its own, so a timeout kills what it started too;
     * SIGCHLD as the compiler expects it (SIG_IGN would survive exec) */
    setpgid(0, 0);
    signal(SIGCHLD, SIG_DFL);
    /* and it dies with the thread waiting for it: a user's Ctrl-C or kill
     * of the process left compilers running, writing into the cache */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(CHILD_EXEC_FAILED);
    if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(out_fd, 2) < 0)
        _exit(CHILD_EXEC_FAILED);
#ifdef SYS_close_range
    if (syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
#endif
        for (long fd = 3; fd < max_fd; fd++)
            close((int)fd);
    execv(path, argv);
    ssize_t w = write(2, exec_fail_msg, strlen(exec_fail_msg));
    (void)w;
    _exit(CHILD_EXEC_FAILED);
}

/* wstatus values of run_program that no process gives */
#define WS_LOST (-1)      /* waitpid could not tell (SIGCHLD ignored) */
#define WS_TIMED_OUT (-2) /* killed after RF_CC_TIMEOUT seconds */

/* How long a compiler may run: RF_CC_TIMEOUT seconds (a positive integer),
 * else 600. */
static int cc_timeout_seconds(void)
{
    const char *v = getenv("RF_CC_TIMEOUT");
    char *end;
    long t = v ? strtol(v, &end, 10) : 0;
    return v && *v && !*end && t > 0 && t <= 86400 ? (int)t : 600;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

typedef enum read_result { READ_DATA, READ_NONE_NOW, READ_EOF } read_result;

/* Appends what one read of fd gives to out (at most OUTPUT_KEEP bytes in
 * all; the rest is read and dropped so the child never blocks on a full
 * pipe). fd is non-blocking. */
static read_result read_some(int fd, rfi_strbuf *out, bool *truncated)
{
    char buf[4096];
    ssize_t r = read(fd, buf, sizeof buf);
    if (r < 0)
        return errno == EINTR || errno == EAGAIN ? READ_NONE_NOW : READ_EOF;
    if (r == 0)
        return READ_EOF;
    size_t room = out->len < OUTPUT_KEEP ? OUTPUT_KEEP - out->len : 0;
    size_t take = (size_t)r < room ? (size_t)r : room;
    if (take < (size_t)r)
        *truncated = true;
    if (take)
        rfi_sb_printf(out, "%.*s", (int)take, buf);
    return READ_DATA;
}

/* Collects the output of child pid from the non-blocking fd until the child
 * has exited and what it wrote is read, or the deadline passes (then its
 * process group is killed). Returns the wait status, WS_LOST or
 * WS_TIMED_OUT. A grandchild that keeps the pipe open past the child's exit
 * is not waited for. */
static int collect(pid_t pid, int fd, rfi_strbuf *out, bool *truncated)
{
    int64_t deadline = now_ms() + 1000 * (int64_t)cc_timeout_seconds();
    bool open_pipe = true;
    for (;;) {
        int ws = 0;
        pid_t r = waitpid(pid, &ws, WNOHANG);
        if (r == pid || (r < 0 && errno != EINTR)) {
            bool lost = r != pid;
            while (open_pipe && read_some(fd, out, truncated) == READ_DATA)
                ;
            return lost ? WS_LOST : ws;
        }
        if (now_ms() > deadline) {
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            while (waitpid(pid, &ws, 0) < 0 && errno == EINTR)
                ;
            return WS_TIMED_OUT;
        }
        struct pollfd pf = {fd, POLLIN, 0};
        if (open_pipe && poll(&pf, 1, 50) > 0 && read_some(fd, out, truncated) == READ_EOF)
            open_pipe = false;
        else if (!open_pipe)
            poll(NULL, 0, 1); /* only the child's exit is left: it follows its EOF */
    }
}

/* Runs path with argv (no shell), stdin from /dev/null, stdout+stderr into
 * *output. *wstatus gets waitpid's status, WS_LOST or WS_TIMED_OUT. Returns
 * -1 (errno set) when the program could not be started at all. */
static int run_program(const char *path, char *const argv[], rfi_strbuf *output,
                       bool *truncated, int *wstatus)
{
    char fail_msg[PATH_MAX + 64];
    snprintf(fail_msg, sizeof fail_msg, "reflux: cannot execute %s\n", path);
    long max_fd = sysconf(_SC_OPEN_MAX);
    if (max_fd < 0 || max_fd > 65536)
        max_fd = 65536;
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return -1;
    int in_fd = fd_above_stdio(open("/dev/null", O_RDONLY | O_CLOEXEC));
    p[0] = fd_above_stdio(p[0]);
    p[1] = fd_above_stdio(p[1]);
    if (in_fd < 0 || p[0] < 0 || p[1] < 0) {
        int e = errno;
        if (in_fd >= 0)
            close(in_fd);
        if (p[0] >= 0)
            close(p[0]);
        if (p[1] >= 0)
            close(p[1]);
        errno = e;
        return -1;
    }
    pid_t parent = getpid(), pid = fork();
    if (pid == 0)
        child_exec(path, argv, in_fd, p[1], max_fd, fail_msg, parent);
    int e = errno;
    close(in_fd);
    close(p[1]);
    if (pid < 0) {
        close(p[0]);
        errno = e;
        return -1;
    }
    fcntl(p[0], F_SETFL, O_NONBLOCK);
    *wstatus = collect(pid, p[0], output, truncated);
    close(p[0]);
    return 0;
}

static bool sigchld_ignored(void)
{
    struct sigaction sa;
    return sigaction(SIGCHLD, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN;
}

static void describe_status(char *buf, size_t n, int ws)
{
    if (ws == WS_TIMED_OUT)
        snprintf(buf, n, "timed out after %d s (RF_CC_TIMEOUT) and killed",
                 cc_timeout_seconds());
    else if (ws == WS_LOST && sigchld_ignored())
        snprintf(buf, n, "its exit status is lost: this process ignores SIGCHLD (SIG_IGN); "
                 "set it to SIG_DFL while reflux compiles");
    else if (ws == WS_LOST)
        snprintf(buf, n, "lost track of the process: something else in this process reaped "
                 "it (a SIGCHLD handler or thread calling wait() or waitpid(-1)); reap only "
                 "your own children's pids while reflux compiles");
    else if (WIFEXITED(ws))
        snprintf(buf, n, "exit status %d", WEXITSTATUS(ws));
    else if (WIFSIGNALED(ws))
        snprintf(buf, n, "killed by signal %d", WTERMSIG(ws));
    else
        snprintf(buf, n, "wait status %d", ws);
}

static bool status_ok(int ws) { return ws >= 0 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0; }

/* ---- The compiler and its identity ------------------------------------------------------ */

/* $CC may name a wrapper and its compiler ("ccache gcc") or add flags ("gcc
 * -m64"), as make's does: its words (split at blanks; no quoting, no shell)
 * start every compiler command. */
#define CC_MAX_ARGS 8
#define CC_ARG_MAX 256

typedef struct compiler_info {
    char name[PATH_MAX];     /* $CC's first word, or "cc": argv[0] */
    char args[CC_MAX_ARGS][CC_ARG_MAX]; /* $CC's other words, argv[1..] */
    int n_args;
    char exec_path[PATH_MAX]; /* what is executed: name, or its PATH match */
    char no_gather[96];      /* the flag that keeps it from emitting gathers, or "" */
} compiler_info;

/* Splits cc into ci's program name and arguments. */
static rf_status split_compiler(const char *cc, compiler_info *ci)
{
    ci->n_args = -1;
    for (const char *at = cc + strspn(cc, " \t"); *at; at += strspn(at, " \t")) {
        size_t len = strcspn(at, " \t");
        bool first = ci->n_args < 0;
        if (ci->n_args >= CC_MAX_ARGS || len >= (first ? sizeof ci->name : CC_ARG_MAX))
            return rfi_error(RF_E_COMPILE, "CC='%s': a compiler and at most %d more words of "
                             "at most %d characters", cc, CC_MAX_ARGS, CC_ARG_MAX - 1);
        char *word = first ? ci->name : ci->args[ci->n_args];
        memcpy(word, at, len);
        word[len] = '\0';
        ci->n_args++;
        at += len;
    }
    if (ci->n_args < 0) { /* blank: the default */
        snprintf(ci->name, sizeof ci->name, "cc");
        ci->n_args = 0;
    }
    return RF_OK;
}

/* Puts the start of a compiler command (argv[0] and $CC's other words) into
 * argv; returns how many. argv has room for CC_MAX_ARGS + 1 more. */
static int command_start(const compiler_info *ci, char **argv)
{
    argv[0] = (char *)ci->name;
    for (int i = 0; i < ci->n_args; i++)
        argv[1 + i] = (char *)ci->args[i];
    return 1 + ci->n_args;
}

/* Finds the program to execute for `name` as execvp would. */
static rf_status find_program(const char *name, char *out, size_t n)
{
    if (strchr(name, '/')) {
        if ((size_t)snprintf(out, n, "%s", name) >= n)
            return rfi_error(RF_E_COMPILE, "compiler path too long: %s", name);
        if (access(out, X_OK) != 0)
            return rfi_error(RF_E_COMPILE, "C compiler %s is not executable: %s (set CC)", name,
                             strerror(errno));
        return RF_OK;
    }
    const char *path = getenv("PATH");
    if (!path || !*path)
        path = "/usr/local/bin:/usr/bin:/bin";
    for (const char *dir = path; *dir;) {
        size_t len = strcspn(dir, ":");
        struct stat st;
        if ((size_t)snprintf(out, n, "%.*s/%s", (int)len, len ? dir : ".", name) < n &&
            stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0)
            return RF_OK;
        dir += len;
        if (*dir == ':')
            dir++;
    }
    return rfi_error(RF_E_COMPILE, "C compiler '%s' not found in PATH (set CC to a compiler)",
                     name);
}

/* First line of `$CC --version` (exec_path and $CC's other words) into buf. */
static rf_status compiler_version(const compiler_info *ci, char *buf, size_t n)
{
    char *argv[CC_MAX_ARGS + 3];
    int a = command_start(ci, argv);
    argv[a++] = "--version";
    argv[a] = NULL;
    rfi_strbuf out = {0};
    bool trunc = false;
    int ws = 0;
    if (run_program(ci->exec_path, argv, &out, &trunc, &ws) != 0) {
        rfi_sb_free(&out);
        return rfi_error(RF_E_COMPILE, "cannot run C compiler %s: %s", ci->exec_path,
                         strerror(errno));
    }
    const char *text = out.data ? out.data : "";
    if (!status_ok(ws)) {
        char why[256];
        describe_status(why, sizeof why, ws);
        rf_status st = rfi_error(RF_E_COMPILE, "C compiler %s --version failed (%s): %.500s",
                                 ci->exec_path, why, text);
        rfi_sb_free(&out);
        return st;
    }
    snprintf(buf, n, "%.*s", (int)strcspn(text, "\n"), text);
    rfi_sb_free(&out);
    return RF_OK;
}

/* "key: value; " for the /proc/cpuinfo lines of the first CPU that decide code generation. */
static void cpuinfo_features(rfi_strbuf *sb)
{
    static const char *const keys[] = {"vendor_id", "cpu family", "model", "flags",
                                       "Features", "CPU implementer", "CPU part", "isa"};
    bool seen[sizeof keys / sizeof keys[0]] = {false};
    FILE *f = fopen("/proc/cpuinfo", "re");
    if (!f)
        return;
    char line[16384];
    while (fgets(line, sizeof line, f)) {
        size_t klen = strcspn(line, "\t:");
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
            if (seen[k] || klen != strlen(keys[k]) || strncmp(line, keys[k], klen) != 0)
                continue;
            seen[k] = true;
            const char *value = line + klen + strspn(line + klen, "\t :");
            rfi_sb_printf(sb, "%s: %.*s; ", keys[k], (int)strcspn(value, "\n"), value);
        }
    }
    fclose(f);
}

static void cpu_features(rfi_strbuf *sb)
{
    size_t before = sb->len;
    cpuinfo_features(sb);
    if (sb->len != before)
        return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    rfi_sb_printf(sb, "builtin: sse4.2=%d avx=%d avx2=%d fma=%d avx512f=%d avx512bw=%d "
                      "avx512vl=%d",
                  __builtin_cpu_supports("sse4.2") != 0, __builtin_cpu_supports("avx") != 0,
                  __builtin_cpu_supports("avx2") != 0, __builtin_cpu_supports("fma") != 0,
                  __builtin_cpu_supports("avx512f") != 0,
                  __builtin_cpu_supports("avx512bw") != 0,
                  __builtin_cpu_supports("avx512vl") != 0);
#else
    rfi_sb_printf(sb, "unknown");
#endif
}

/* The identity cache: the compiler and context for one ($CC, $PATH).
 * Building it runs the compiler (tens of milliseconds), so it is built outside
 * ident_lock by one thread at a time (ident_building) while the others wait on
 * ident_built: a lock held across the build would be copied, held, into a
 * child another thread forks meanwhile, and the child's first compile would
 * wait for ever for a builder it does not have. The lock itself is held only
 * to read or publish the state, and is taken around every fork (watch_forks)
 * so a child gets that state whole; in the child nobody is building (the
 * builder was not forked: the child builds again if it needs to) and the
 * condition variable is made afresh (its waiters were not forked either). The
 * builder itself forks (the compiler runs through fork), which is why it must
 * not hold the lock. */
static pthread_mutex_t ident_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ident_built = PTHREAD_COND_INITIALIZER;
static bool ident_building;
static pthread_once_t ident_fork_once = PTHREAD_ONCE_INIT;
static uint64_t ident_env_hash;
static bool ident_valid;
static compiler_info ident_info;
static char *ident_context; /* rfi_malloc'd, kept for the process lifetime */

static uint64_t compiler_env_hash(const char *cc)
{
    const char *path = getenv("PATH");
    uint64_t h = rfi_hash_bytes(RFI_HASH_INIT, cc, strlen(cc) + 1);
    return path ? rfi_hash_bytes(h, path, strlen(path)) : h;
}

/* Hashes the identity of the file at path (device, inode, size, times):
 * false if there is none. */
static bool hash_file_id(uint64_t *h, const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return false;
    int64_t id[] = {(int64_t)st.st_dev, (int64_t)st.st_ino, (int64_t)st.st_size,
                    (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec,
                    (int64_t)st.st_ctim.tv_sec, (int64_t)st.st_ctim.tv_nsec};
    *h = rfi_hash_bytes(*h, id, sizeof id);
    return true;
}

/* The memo name for what (the version line, the gather flag) of the compiler
 * binary `resolved` run as argv[0] = ci->name (gcc prints its argv[0]) with
 * $CC's other words: a hash of them and of the binary's identity (device,
 * inode, size, modification and change times), so a replaced or upgraded
 * compiler is asked again. False when it cannot be stat'ed. */
static bool memo_name(const char *what, const compiler_info *ci, const char *resolved,
                      char *out, size_t n)
{
    uint64_t h = rfi_hash_bytes(RFI_HASH_INIT, ci->name, strlen(ci->name) + 1);
    h = rfi_hash_bytes(h, resolved, strlen(resolved) + 1);
    if (!hash_file_id(&h, resolved))
        return false;
    /* A wrapper ("ccache gcc", "env gcc") runs the compiler its words name,
     * found in PATH: the words, PATH and the files they resolve to are part
     * of the name, so another or an upgraded compiler is asked again. */
    if (ci->n_args > 0) {
        const char *path = getenv("PATH");
        h = rfi_hash_bytes(h, path ? path : "", path ? strlen(path) + 1 : 1);
    }
    for (int i = 0; i < ci->n_args; i++) {
        h = rfi_hash_bytes(h, ci->args[i], strlen(ci->args[i]) + 1);
        char found[PATH_MAX]; /* a word that is no program only sets a message, unused */
        if (ci->args[i][0] != '-' && find_program(ci->args[i], found, sizeof found) == RF_OK)
            hash_file_id(&h, found);
    }
    uint64_t a = rfi_hash_u64(h, 0);
    uint64_t b = rfi_hash_u64(a, RF_MODULE_ABI);
    snprintf(out, n, "cc-%s-%016llx%016llx", what, (unsigned long long)a, (unsigned long long)b);
    return true;
}

/* The compiler's version line: from the cache directory's memo when the same
 * binary was asked before (saves starting the compiler, ~2 ms), else by
 * running `--version` (and memoising the answer). */
static rf_status compiler_version_memo(const compiler_info *ci, const char *resolved,
                                       char *buf, size_t n)
{
    char memo[96];
    bool named = memo_name("version", ci, resolved, memo, sizeof memo);
    char *value = NULL;
    if (named && rfi_disk_cache_memo_get(memo, &value)) {
        snprintf(buf, n, "%s", value);
        rfi_free(value);
        return RF_OK;
    }
    rf_status st = compiler_version(ci, buf, n);
    if (st == RF_OK && named)
        rfi_disk_cache_memo_put(memo, buf);
    return st;
}

/* ---- Gathers ---------------------------------------------------------------------------- *
 * Generated modules are compiled so that they contain no AVX2 gather
 * instruction. gcc 12.2 (Debian 12.2.0-14) miscompiled the pieces of a padded
 * reduce_window: with two edge kernels inlined into the entry point, the
 * clamped loads of one, vectorised as vgatherqps, got as their mask a register
 * holding a broadcast's source instead of all ones, so lanes were not loaded
 * and a sum lost three of its four terms (found by the op fuzzer; the same C
 * is right at -O0, with the kernels not inlined, and with no gathers). In
 * this backend's kernels gathers only ever vectorised loads whose index is not
 * affine in the innermost loop (clamped at a padding, or divided): edge pieces
 * of windows and concatenations, and a direct convolution's row copy from
 * channel blocks, which render_conv.c now writes with contiguous loads. The
 * flag's name differs across compilers and versions, so the first of
 * no_gather_flags that the compiler accepts is used (none when it accepts
 * none of them), asked once per compiler binary and memoised like its
 * version line. The list goes from the most complete flag to the least:
 * Debian's gcc 12.2 accepts "^use_gather" alone, but that knob covers only
 * gathers of eight or more elements, and with an AVX-512 CPU's tuning it
 * still emitted two-element ones; it also knows the two- and four-element
 * knobs, which the third entry adds. */
#if defined(__x86_64__) || defined(__i386__)
static const char *const no_gather_flags[] = {
    "-mno-gather",                                                          /* gcc 13, clang */
    "-mtune-ctrl=^use_gather_2parts,^use_gather_4parts,^use_gather_8parts", /* gcc 13's names */
    "-mtune-ctrl=^use_gather,^use_gather_2parts,^use_gather_4parts",        /* Debian's 12.2 */
    "-mtune-ctrl=^use_gather",                                              /* gcc 11-12.2 */
};

typedef enum probe_verdict { PROBE_ACCEPTED, PROBE_REJECTED, PROBE_FAILED } probe_verdict;

/* Whether the compiler accepts `flag` (checking an empty translation unit): accepted
 * (exit 0), rejected (it ran and exited with a failure status), or failed (it could not
 * be run, waited for or finished: an answer nobody may remember). */
static probe_verdict compiler_accepts(const compiler_info *ci, const char *flag)
{
    char *argv[CC_MAX_ARGS + 7];
    int a = command_start(ci, argv);
    argv[a++] = "-fsyntax-only";
    argv[a++] = "-x";
    argv[a++] = "c";
    argv[a++] = (char *)flag;
    argv[a++] = "/dev/null";
    argv[a] = NULL;
    rfi_strbuf out = {0};
    bool trunc = false;
    int ws = 0;
    bool ran = run_program(ci->exec_path, argv, &out, &trunc, &ws) == 0;
    rfi_sb_free(&out);
    if (ran && status_ok(ws))
        return PROBE_ACCEPTED;
    if (ran && ws >= 0 && WIFEXITED(ws) && WEXITSTATUS(ws) != CHILD_EXEC_FAILED)
        return PROBE_REJECTED;
    return PROBE_FAILED;
}

/* Index of `value` among the no-gather flags, n for "none", -1 for anything else (a
 * damaged memo, whose words would reach every compiler command line). */
static int no_gather_choice(const char *value)
{
    size_t n = sizeof no_gather_flags / sizeof no_gather_flags[0];
    for (size_t i = 0; i < n; i++)
        if (!strcmp(value, no_gather_flags[i]))
            return (int)i;
    return strcmp(value, "none") ? -1 : (int)n;
}

/* ci->no_gather: from the memo when this binary was asked before (and the memo holds
 * one of the answers), else by trying each candidate (and memoising the answer: the
 * flag, or "none"). */
static void find_no_gather_flag(compiler_info *ci, const char *resolved)
{
    char memo[96];
    char *value = NULL;
    ci->no_gather[0] = '\0';
    /* "gather2": the answers memoised under "gather" came from a list that
     * put a flag too weak for AVX-512 tunings first */
    bool named = memo_name("gather2", ci, resolved, memo, sizeof memo);
    if (named && rfi_disk_cache_memo_get(memo, &value)) {
        int choice = no_gather_choice(value);
        int n_flags = (int)(sizeof no_gather_flags / sizeof no_gather_flags[0]);
        if (choice >= 0)
            snprintf(ci->no_gather, sizeof ci->no_gather, "%s",
                     choice < n_flags ? no_gather_flags[choice] : "");
        rfi_free(value);
        if (choice >= 0)
            return;
    }
    size_t n = sizeof no_gather_flags / sizeof no_gather_flags[0];
    bool answered = true; /* every probe ran to an answer: remember it */
    /* a probe that could not run or finish (a hung compiler waits out RF_CC_TIMEOUT)
     * ends the probing: the next would wait as long, and the compile will say why */
    for (size_t i = 0; i < n && !ci->no_gather[0] && answered; i++) {
        probe_verdict v = compiler_accepts(ci, no_gather_flags[i]);
        if (v == PROBE_ACCEPTED)
            snprintf(ci->no_gather, sizeof ci->no_gather, "%s", no_gather_flags[i]);
        answered = answered && v != PROBE_FAILED;
    }
    /* "none" after a probe that could not run would drop the flag for good, and gcc 12's
     * gathers miscompile: only a complete answer is kept */
    if (named && (ci->no_gather[0] || answered))
        rfi_disk_cache_memo_put(memo, ci->no_gather[0] ? ci->no_gather : "none");
}
#else
static void find_no_gather_flag(compiler_info *ci, const char *resolved)
{
    (void)resolved;
    ci->no_gather[0] = '\0'; /* no gathers to avoid */
}
#endif

static rf_status build_identity(const char *cc, compiler_info *ci, char **context)
{
    rf_status st = split_compiler(cc, ci);
    if (st == RF_OK)
        st = find_program(ci->name, ci->exec_path, sizeof ci->exec_path);
    if (st != RF_OK)
        return st;
    char resolved[PATH_MAX];
    if (!realpath(ci->exec_path, resolved))
        snprintf(resolved, sizeof resolved, "%s", ci->exec_path);
    char version[512];
    if ((st = compiler_version_memo(ci, resolved, version, sizeof version)) != RF_OK)
        return st;
    find_no_gather_flag(ci, resolved);
    rfi_strbuf sb = {0};
    rfi_sb_printf(&sb, "compiler=%s\n", resolved);
    for (int i = 0; i < ci->n_args; i++) /* a wrapper's compiler, or flags of $CC */
        rfi_sb_printf(&sb, "%s%s", i ? " " : "compiler_args=", ci->args[i]);
    rfi_sb_printf(&sb, "%scompiler_version=%s\nflags=", ci->n_args ? "\n" : "", version);
    for (size_t i = 0; i < N_COMPILE_FLAGS; i++)
        rfi_sb_printf(&sb, "%s ", compile_flags[i]);
    if (ci->no_gather[0])
        rfi_sb_printf(&sb, "%s ", ci->no_gather);
    rfi_sb_printf(&sb, "-lm\nabi=%d\ncpu=", RF_MODULE_ABI);
    cpu_features(&sb);
    if (sb.failed) {
        rfi_sb_free(&sb);
        return rfi_error(RF_E_NOMEM, "compiler identity: out of memory");
    }
    *context = sb.data;
    return RF_OK;
}

static void ident_before_fork(void) { pthread_mutex_lock(&ident_lock); }
static void ident_after_fork_in_parent(void) { pthread_mutex_unlock(&ident_lock); }

static void ident_after_fork_in_child(void)
{
    ident_building = false;
    pthread_cond_init(&ident_built, NULL);
    pthread_mutex_unlock(&ident_lock);
}

static void watch_forks(void)
{
    pthread_atfork(ident_before_fork, ident_after_fork_in_parent, ident_after_fork_in_child);
}

/* The compiler for the current $CC and a copy of its context (caller frees). */
static rf_status compiler_lookup(compiler_info *ci, char **context)
{
    const char *cc = getenv("CC");
    if (!cc || !*cc)
        cc = "cc";
    uint64_t h = compiler_env_hash(cc);
    pthread_once(&ident_fork_once, watch_forks);
    rf_status st = RF_OK;
    pthread_mutex_lock(&ident_lock);
    while (!ident_valid || ident_env_hash != h) {
        if (ident_building) { /* another thread's build: it may be this identity */
            pthread_cond_wait(&ident_built, &ident_lock);
            continue;
        }
        ident_building = true;
        pthread_mutex_unlock(&ident_lock);
        char *ctx = NULL;
        st = build_identity(cc, ci, &ctx);
        pthread_mutex_lock(&ident_lock);
        ident_building = false;
        pthread_cond_broadcast(&ident_built);
        if (st != RF_OK)
            break; /* a waiter for the same $CC tries again, as this call did */
        rfi_free(ident_context);
        ident_info = *ci;
        ident_context = ctx;
        ident_env_hash = h;
        ident_valid = true;
    }
    if (st == RF_OK) {
        *ci = ident_info;
        *context = rfi_strdup(ident_context);
        if (!*context)
            st = rfi_error(RF_E_NOMEM, "compiler identity: out of memory");
    }
    pthread_mutex_unlock(&ident_lock);
    return st;
}

rf_status rfi_cc_context(char **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rfi_cc_context: NULL argument");
    compiler_info *ci = rfi_malloc(sizeof *ci);
    if (!ci)
        return rfi_error(RF_E_NOMEM, "rfi_cc_context: out of memory");
    rf_status st = compiler_lookup(ci, out);
    rfi_free(ci);
    return st;
}

/* ---- Compiling --------------------------------------------------------------------------- */

static rf_status compile_failed(const char *name, char *const argv[], const char *src_path,
                                const char *why, const rfi_strbuf *out, bool truncated)
{
    rfi_strbuf msg = {0};
    rfi_sb_printf(&msg, "compiling module %s failed (%s)\ncommand:", name, why);
    for (int i = 0; argv[i]; i++)
        rfi_sb_printf(&msg, " %s", argv[i]);
    rfi_sb_printf(&msg, "\nsource kept at: %s\ncompiler output:\n", src_path);
    const char *text = out->data ? out->data : "";
    size_t len = strlen(text);
    if (len > MSG_OUTPUT_MAX || truncated)
        rfi_sb_printf(&msg, "%.*s\n[... output truncated]", MSG_OUTPUT_MAX, text);
    else
        rfi_sb_printf(&msg, "%s", text);
    rf_status st = rfi_error(RF_E_COMPILE, "%s", msg.failed ? "compiling a module failed "
                                                              "(out of memory for the message)"
                                                            : msg.data);
    rfi_sb_free(&msg);
    return st;
}

/* The failure of one compiler run (argv, errno when it could not start,
 * else its wait status, and its output). */
static rf_status run_failed(const char *name, char *const argv[], const char *src_path, int err,
                            int ws, const rfi_strbuf *out, bool truncated)
{
    char why[256];
    if (err)
        snprintf(why, sizeof why, "cannot start the compiler: %s", strerror(err));
    else
        describe_status(why, sizeof why, ws);
    return compile_failed(name, argv, src_path, why, out, truncated);
}

/* Runs the compiler with argv to make `output`; an error names the command
 * and quotes its output, also when the compiler exits 0 without writing
 * `output` (a broken wrapper: the cache then failed to read it back). */
static rf_status run_compiler(const compiler_info *ci, char *const argv[], const char *src_path,
                              const char *name, const char *output)
{
    rfi_strbuf out = {0};
    bool truncated = false;
    int ws = 0;
    int err = run_program(ci->exec_path, argv, &out, &truncated, &ws) != 0 ? errno : 0;
    rf_status st = RF_OK;
    struct stat sb;
    if (err || !status_ok(ws))
        st = run_failed(name, argv, src_path, err, ws, &out, truncated);
    else if (stat(output, &sb) != 0 || sb.st_size == 0)
        st = compile_failed(name, argv, src_path, "the compiler exited 0 but wrote no object",
                            &out, truncated);
    rfi_sb_free(&out);
    return st;
}

static rf_status compile_parts(const compiler_info *ci, const char *src_path,
                               const char *out_path, const char *name, int parts);
static int source_parts(const char *src_path);

static rf_status compile_with(const compiler_info *ci, const char *src_path,
                              const char *out_path, const char *name)
{
    int parts = source_parts(src_path);
    if (parts > 1) {
        atomic_fetch_add(&n_compiles, 1);
        return compile_parts(ci, src_path, out_path, name, parts);
    }
    char *argv[CC_MAX_ARGS + N_COMPILE_FLAGS + 7];
    int a = command_start(ci, argv);
    for (size_t i = 0; i < N_COMPILE_FLAGS; i++)
        argv[a++] = (char *)compile_flags[i];
    if (ci->no_gather[0])
        argv[a++] = (char *)ci->no_gather;
    argv[a++] = "-o";
    argv[a++] = (char *)out_path;
    argv[a++] = (char *)src_path;
    argv[a++] = "-lm";
    argv[a] = NULL;
    atomic_fetch_add(&n_compiles, 1);
    return run_compiler(ci, argv, src_path, name, out_path);
}

/* ---- Modules in parts -------------------------------------------------------------------- *
 * A large generated source declares `#define RF_PARTS n` near its top
 * (render_c.c): compiled once per part with -DRF_PART=p, in parallel, and
 * linked, it builds the same module as compiled whole, in less wall time
 * (measured on a ResNet step on 2 cores: 2.8 s whole, 2.0 s in 7 parts). */
#define PARTS_MAX 16
#define PARTS_SCAN 65536 /* bytes of the source searched for RF_PARTS */

/* The number of parts src_path declares (1: none, or unreadable: compile whole). */
static int source_parts(const char *src_path)
{
    FILE *f = fopen(src_path, "re");
    if (!f)
        return 1;
    char *head = rfi_malloc(PARTS_SCAN + 1);
    size_t n = head ? fread(head, 1, PARTS_SCAN, f) : 0;
    fclose(f);
    if (!head)
        return 1;
    head[n] = '\0';
    static const char line[] = "#define RF_PARTS ";
    const char *at = head;
    if (strncmp(head, line, strlen(line)) != 0) {
        at = strstr(head, "\n#define RF_PARTS ");
        at = at ? at + 1 : NULL;
    }
    int parts = at ? atoi(at + strlen(line)) : 1;
    rfi_free(head);
    return parts >= 2 && parts <= PARTS_MAX ? parts : 1;
}

typedef struct part_job {
    const compiler_info *ci;
    char *argv[CC_MAX_ARGS + N_COMPILE_FLAGS + 9];
    /* out_path (the disk cache's temporary name) is at most PATH_MAX + 63 characters and
     * ".part<p>.o" adds at most 9 (p < PARTS_MAX): no two parts' names truncate to one
     * file. A name past PATH_MAX then fails at the compiler, naming it. */
    char define[32], obj[PATH_MAX + 80];
    rfi_strbuf out;
    bool truncated, started;
    int ws;
    int err; /* errno when the compiler could not be started */
} part_job;

static void *compile_part(void *arg)
{
    part_job *j = arg;
    j->err = run_program(j->ci->exec_path, j->argv, &j->out, &j->truncated, &j->ws) != 0 ? errno
                                                                                         : 0;
    return NULL;
}

/* Compiles part p of src_path into j->obj (its argv, without -shared). */
static void part_argv(part_job *j, const compiler_info *ci, const char *src_path,
                      const char *out_path, int p)
{
    j->ci = ci;
    snprintf(j->define, sizeof j->define, "-DRF_PART=%d", p);
    snprintf(j->obj, sizeof j->obj, "%s.part%d.o", out_path, p);
    int a = command_start(ci, j->argv);
    for (size_t i = 0; i < N_COMPILE_FLAGS; i++)
        if (strcmp(compile_flags[i], "-shared") != 0)
            j->argv[a++] = (char *)compile_flags[i];
    if (ci->no_gather[0])
        j->argv[a++] = (char *)ci->no_gather;
    j->argv[a++] = "-c";
    j->argv[a++] = j->define;
    j->argv[a++] = "-o";
    j->argv[a++] = j->obj;
    j->argv[a++] = (char *)src_path;
    j->argv[a] = NULL;
}

/* Compiles the parts in parallel (one thread each, waiting on its compiler),
 * then links them into out_path; the objects are removed either way. */
static rf_status compile_parts(const compiler_info *ci, const char *src_path,
                               const char *out_path, const char *name, int parts)
{
    part_job *jobs = rfi_calloc((size_t)parts, sizeof *jobs);
    pthread_t *threads = rfi_calloc((size_t)parts, sizeof *threads);
    if (!jobs || !threads) {
        rfi_free(jobs);
        rfi_free(threads);
        return rfi_error(RF_E_NOMEM, "compiling module %s: out of memory", name);
    }
    for (int p = 0; p < parts; p++) {
        part_argv(&jobs[p], ci, src_path, out_path, p);
        jobs[p].started = pthread_create(&threads[p], NULL, compile_part, &jobs[p]) == 0;
        if (!jobs[p].started) /* no thread: compile it here */
            compile_part(&jobs[p]);
    }
    rf_status st = RF_OK;
    for (int p = 0; p < parts; p++) {
        if (jobs[p].started)
            pthread_join(threads[p], NULL);
        if (st == RF_OK && (jobs[p].err || !status_ok(jobs[p].ws)))
            st = run_failed(name, jobs[p].argv, src_path, jobs[p].err, jobs[p].ws, &jobs[p].out,
                            jobs[p].truncated);
    }
    if (st == RF_OK) {
        char **argv = rfi_calloc((size_t)parts + CC_MAX_ARGS + 8, sizeof *argv);
        if (!argv) {
            st = rfi_error(RF_E_NOMEM, "compiling module %s: out of memory", name);
        } else {
            int a = command_start(ci, argv);
            argv[a++] = "-shared";
            argv[a++] = "-o";
            argv[a++] = (char *)out_path;
            for (int p = 0; p < parts; p++)
                argv[a++] = jobs[p].obj;
            argv[a++] = "-lm";
            argv[a] = NULL;
            st = run_compiler(ci, argv, src_path, name, out_path);
            rfi_free(argv);
        }
    }
    for (int p = 0; p < parts; p++) {
        unlink(jobs[p].obj);
        rfi_sb_free(&jobs[p].out);
    }
    rfi_free(jobs);
    rfi_free(threads);
    return st;
}

/* ---- Loading through the disk cache ------------------------------------------------------ */

typedef struct load_ctx {
    rfi_module *m;
    const char *name;
    const compiler_info *ci;
} load_ctx;

static rf_status compile_cb(void *ctx, const char *src_path, const char *out_path)
{
    const load_ctx *lc = ctx;
    return compile_with(lc->ci, src_path, out_path, lc->name);
}

static rf_status load_cb(void *ctx, const char *path)
{
    load_ctx *lc = ctx;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        return rfi_error(RF_E_CORRUPT, "module %s: cannot load %s: %s", lc->name, path,
                         e ? e : "unknown error");
    }
    void *sym = dlsym(h, RF_MODULE_ENTRY_NAME);
    if (!sym) {
        dlclose(h);
        return rfi_error(RF_E_CORRUPT, "module %s: %s has no entry point %s", lc->name, path,
                         RF_MODULE_ENTRY_NAME);
    }
    lc->m->handle = h;
    memcpy(&lc->m->entry, &sym, sizeof sym); /* object to function pointer, as POSIX allows */
    return RF_OK;
}

/* The program's source: given, or generated on demand. */
typedef struct source_request {
    const char *given;
    rfi_cc_source_fn gen;
    void *gen_ctx;
} source_request;

static void take_result(rfi_module *m, rfi_disk_cache_result *r)
{
    m->so_path = r->object_path;
    m->src_path = r->source_path;
    r->object_path = r->source_path = NULL;
    memcpy(m->key, r->key, sizeof m->key);
    m->compiled = r->compiled;
    m->cached = r->persistent;
    if (!m->compiled)
        atomic_fetch_add(&n_disk_hits, 1);
}

/* Index first (when there is a description), else the source through the
 * disk cache, recording the description for it. */
static rf_status load_through_cache(const source_request *req, const rfi_disk_cache_index *index,
                                    const char *context, load_ctx *lc)
{
    rfi_disk_cache_ops ops = {compile_cb, load_cb, lc, ".so", ".c"};
    rfi_disk_cache_result r;
    if (index && rfi_disk_cache_find_indexed(index, context, &ops, &r)) {
        take_result(lc->m, &r);
        atomic_fetch_add(&n_index_hits, 1);
        return RF_OK;
    }
    if (lc->m->handle) { /* loaded, then failed on memory: the full path loads again */
        dlclose(lc->m->handle);
        lc->m->handle = NULL;
        lc->m->entry = NULL;
    }
    char *generated = NULL;
    const char *source = req->given;
    if (!source) {
        atomic_fetch_add(&n_sources, 1);
        rf_status st = req->gen(req->gen_ctx, &generated);
        if (st != RF_OK) {
            rfi_free(generated);
            return st;
        }
        source = generated;
    }
    rf_status st = rfi_disk_cache_get_indexed(source, context, index, &ops, &r);
    rfi_free(generated);
    if (st == RF_OK)
        take_result(lc->m, &r);
    return st;
}

static rf_status load_module(const source_request *req, const rfi_disk_cache_index *index,
                             const char *name, rfi_module **out)
{
    *out = NULL;
    name = name ? name : "module";
    compiler_info *ci = rfi_malloc(sizeof *ci);
    rfi_module *m = rfi_calloc(1, sizeof *m);
    char *context = NULL;
    rf_status st = ci && m ? compiler_lookup(ci, &context)
                           : rfi_error(RF_E_NOMEM, "module %s: out of memory", name);
    if (st == RF_OK) {
        load_ctx lc = {m, name, ci};
        st = load_through_cache(req, index, context, &lc);
    }
    rfi_free(context);
    rfi_free(ci);
    if (st != RF_OK) {
        rfi_module_free(m);
        return st;
    }
    *out = m;
    return RF_OK;
}

rf_status rfi_cc_load_module(const char *source, const char *name, rfi_module **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rfi_cc_load_module: NULL out");
    *out = NULL;
    if (!source)
        return rfi_error(RF_E_INVALID, "rfi_cc_load_module: NULL source");
    source_request req = {source, NULL, NULL};
    return load_module(&req, NULL, name, out);
}

rf_status rfi_cc_load_program(const void *desc, size_t desc_len, rfi_cc_source_fn gen,
                              void *gen_ctx, const char *name, rfi_module **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rfi_cc_load_program: NULL out");
    *out = NULL;
    if (!gen)
        return rfi_error(RF_E_INVALID, "rfi_cc_load_program: NULL generator");
    source_request req = {NULL, gen, gen_ctx};
    rfi_disk_cache_index index = {desc, desc ? desc_len : 0};
    return load_module(&req, index.len ? &index : NULL, name, out);
}

/* ---- The build's identity ------------------------------------------------------------- */

typedef struct build_id_search {
    uintptr_t addr;
    char *out;
    size_t n;
    bool found;
} build_id_search;

static bool object_contains(const struct dl_phdr_info *info, uintptr_t addr)
{
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = (uintptr_t)info->dlpi_addr + (uintptr_t)ph->p_vaddr;
        if (ph->p_type == PT_LOAD && addr >= lo && addr - lo < (uintptr_t)ph->p_memsz)
            return true;
    }
    return false;
}

/* The NT_GNU_BUILD_ID note of one PT_NOTE segment, as hex, into s->out. */
static bool note_build_id(const unsigned char *p, size_t size, size_t align, build_id_search *s)
{
    size_t at = 0;
    while (size - at >= sizeof(ElfW(Nhdr))) {
        ElfW(Nhdr) nh;
        memcpy(&nh, p + at, sizeof nh);
        size_t name_at = at + sizeof nh;
        size_t desc_at = name_at + ((nh.n_namesz + align - 1) & ~(align - 1));
        size_t next = desc_at + ((nh.n_descsz + align - 1) & ~(align - 1));
        if (desc_at > size || next > size || next <= at)
            return false;
        if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 &&
            memcmp(p + name_at, "GNU", 4) == 0 && nh.n_descsz > 0 &&
            2 * (size_t)nh.n_descsz < s->n) {
            for (size_t i = 0; i < nh.n_descsz; i++)
                snprintf(s->out + 2 * i, 3, "%02x", p[desc_at + i]);
            return true;
        }
        at = next;
    }
    return false;
}

static int find_build_id(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    build_id_search *s = data;
    if (!object_contains(info, s->addr))
        return 0;
    for (int i = 0; i < info->dlpi_phnum && !s->found; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE)
            continue;
        size_t align = ph->p_align == 8 ? 8 : 4;
        s->found = note_build_id((const unsigned char *)(info->dlpi_addr + ph->p_vaddr),
                                 (size_t)ph->p_filesz, align, s);
    }
    return 1; /* the object holding addr: stop either way */
}

bool rfi_cc_build_id(uintptr_t code_addr, char *out, size_t n)
{
    if (!out || n == 0)
        return false;
    out[0] = '\0';
    build_id_search s = {code_addr, out, n, false};
    dl_iterate_phdr(find_build_id, &s);
    if (!s.found)
        out[0] = '\0';
    return s.found;
}

void rfi_module_free(rfi_module *m)
{
    if (!m)
        return;
    if (m->handle)
        dlclose(m->handle);
    rfi_free(m->so_path);
    rfi_free(m->src_path);
    rfi_free(m);
}

rf_module_entry rfi_module_entry_fn(const rfi_module *m) { return m ? m->entry : NULL; }
