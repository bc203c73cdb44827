/*
 * The runtime under every driver: the OpenMP team (its size, its members'
 * scratch, the cap on threads), what the build is (fa_build_info), the fork
 * handlers that keep a child's threads, and Ctrl-C for long calls.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* dladdr */
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "runtime.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(_OPENMP) && (defined(__linux__) || defined(__APPLE__))
#include <dlfcn.h>
#define FA_HAVE_DLADDR 1
#endif
#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
#include <pthread.h>
#define FA_HAVE_ATFORK 1
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <signal.h>
#define FA_HAVE_SIGACTION 1
#endif
#ifndef FA_BUILD_CFLAGS
#define FA_BUILD_CFLAGS "unknown"
#endif

/* The team size of the calling thread's last call (diagnostics, tests): 0
 * until a team runs, so that a call with no work reports 0. */
static _Thread_local int last_team = 0;
int fa_last_threads(void) { return last_team; }
void fa_team_none(void) { last_team = 0; }
void fa_record_team(void)
{
    if (fa_thread_num() == 0) last_team = fa_num_threads();
}

int fa_thread_num(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

int fa_num_threads(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

const char *fa_build_info(void)
{
    static char info[512];
    if (!info[0]) {
#if defined(__clang__)
        const char *cc = "clang " __clang_version__;
#elif defined(__GNUC__)
        const char *cc = "gcc " __VERSION__;
#else
        const char *cc = "unknown compiler";
#endif
#ifdef _OPENMP
        snprintf(info, sizeof info, "%s; flags: %s; OpenMP %d", cc, FA_BUILD_CFLAGS, _OPENMP);
#else
        snprintf(info, sizeof info, "%s; flags: %s; no OpenMP", cc, FA_BUILD_CFLAGS);
#endif
    }
    return info;
}

const char *fa_openmp_library(void)
{
#ifdef FA_HAVE_DLADDR
    Dl_info di;
    if (dladdr((void *)&omp_get_max_threads, &di) && di.dli_fname) return di.dli_fname;
    return "unknown";
#elif defined(_OPENMP)
    return "unknown";
#else
    return "none";
#endif
}

int fa_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------
 * fork.  GNU libgomp cannot run a team in a child forked from a thread that
 * had started one: the child's team waits for the parent's pool threads,
 * which fork did not copy, and never returns.  Any library on the same
 * libgomp can have started that pool (PyTorch's bundled libgomp shares its
 * soname with the system's), so fa_init, at import, registers fork handlers:
 * before the fork, omp_pause_resource_all frees the forking thread's pool
 * (the parent's next team starts new threads; the child starts its own); where
 * that cannot be done (a libgomp before GCC 9, a fork from inside a team) the
 * child runs every call on its calling thread.  LLVM's and Intel's runtimes
 * restart their pools after fork (they have __kmpc_fork_call): with them
 * nothing is registered.
 * ------------------------------------------------------------------------- */
static volatile int fork_serial = 0; /* 1: a child whose parent's pool may be stale; one thread */

int fa_fork_serial(void) { return fork_serial; }

#ifdef FA_HAVE_ATFORK
typedef int (*pause_all_fn)(int);
static pause_all_fn pause_all = NULL; /* libgomp's omp_pause_resource_all, or NULL */
static volatile int pool_freed = 0;   /* the last fork's prepare handler freed the pool */
/* The forking thread's ICVs, set again after the fork in parent and child, so
 * that a threadpoolctl limit or omp_set_num_threads outlives a fork whatever
 * the runtime keeps when its pool is freed (GNU libgomp 12 keeps them). */
static int saved_threads, saved_dynamic, saved_levels;

static void before_fork(void)
{
    saved_threads = omp_get_max_threads();
    saved_dynamic = omp_get_dynamic();
    saved_levels = omp_get_max_active_levels();
    pool_freed = pause_all && pause_all(1 /* omp_pause_soft */) == 0;
}

static void restore_icvs(void)
{
    omp_set_num_threads(saved_threads);
    omp_set_dynamic(saved_dynamic);
    omp_set_max_active_levels(saved_levels);
}

static void after_fork_parent(void)
{
    if (pool_freed) restore_icvs();
}

static void after_fork_child(void)
{
    if (pool_freed)
        restore_icvs();
    else
        fork_serial = 1;
}

static void register_fork_handlers(void)
{
#ifdef FA_HAVE_DLADDR
    void *h = dlopen(fa_openmp_library(), RTLD_LAZY | RTLD_NOLOAD); /* NULL for "unknown" */
    const int restarts = h && dlsym(h, "__kmpc_fork_call");
    if (h && !restarts) pause_all = (pause_all_fn)dlsym(h, "omp_pause_resource_all");
    if (h) dlclose(h); /* the extension links the runtime: it stays loaded */
    if (restarts) return;
#endif
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
#endif

void fa_init(void)
{
#ifdef FA_HAVE_ATFORK
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handlers);
#endif
}

/* ---------------------------------------------------------------------------
 * Ctrl-C.  Python runs its SIGINT handler only when the call returns to it, so
 * a long call installs, for its duration, a handler that sets stop_flag (which
 * the drivers and kernels read between items and key tiles) and then calls the
 * handler it replaced, so that Python still sees the signal and raises
 * KeyboardInterrupt once the call has stopped.
 * ------------------------------------------------------------------------- */
#ifdef FA_HAVE_SIGACTION
static volatile int stop_flag = 0;
static struct sigaction replaced;

/* The replaced handler first, so that Python has recorded the signal before
 * the call sees the flag and returns to it. */
static void on_sigint(int sig, siginfo_t *info, void *ctx)
{
    if (replaced.sa_flags & SA_SIGINFO) {
        if (replaced.sa_sigaction) replaced.sa_sigaction(sig, info, ctx);
    } else if (replaced.sa_handler != SIG_DFL && replaced.sa_handler != SIG_IGN) {
        replaced.sa_handler(sig);
    }
    stop_flag = 1;
}
#endif

const volatile int *fa_interrupt_begin(void)
{
#ifdef FA_HAVE_SIGACTION
    struct sigaction now, mine;
    if (sigaction(SIGINT, NULL, &now) != 0) return NULL;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigint) { /* still ours (a child forked */
        stop_flag = 0;                                                     /* mid-call): keep its chain */
        return &stop_flag;
    }
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN)) return NULL;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigint;
    mine.sa_flags = SA_SIGINFO | (now.sa_flags & SA_ONSTACK);
    sigemptyset(&mine.sa_mask);
    stop_flag = 0;
    replaced = now;
    if (sigaction(SIGINT, &mine, NULL) != 0) return NULL;
    return &stop_flag;
#else
    return NULL;
#endif
}

void fa_interrupt_end(void)
{
#ifdef FA_HAVE_SIGACTION
    sigaction(SIGINT, &replaced, NULL);
#endif
}

/* The largest team fastattn starts: a runtime asked for far more threads than
 * CPUs overflows its stack setting them up (libgomp allocates their start
 * data on the caller's stack) or exits the process when it cannot create
 * them, and threads beyond the CPUs only share them.  Four a CPU (at least
 * 8, so that the tests can run teams larger than a small machine's), at most
 * FA_THREADS_MAX and the runtime's thread limit. */
int fa_thread_cap(void)
{
#ifdef _OPENMP
    static int cap = 0;
    if (!cap) {
        int n = 4 * omp_get_num_procs();
        if (n < 8) n = 8;
        if (n > FA_THREADS_MAX) n = FA_THREADS_MAX;
        if (n > omp_get_thread_limit()) n = omp_get_thread_limit();
        cap = n < 1 ? 1 : n;
    }
    return cap;
#else
    return 1;
#endif
}

int fa_max_threads(void)
{
#ifdef _OPENMP
    if (fork_serial) return 1;
    const int n = omp_get_max_threads();
    return n < fa_thread_cap() ? n : fa_thread_cap();
#else
    return 1;
#endif
}

int fa_threads_wanted(int requested)
{
    if (requested <= 0 || fork_serial) return fa_max_threads();
    return requested < fa_thread_cap() ? requested : fa_thread_cap();
}

int fa_team_size(int requested, int64_t items, double work)
{
    int n = fa_threads_wanted(requested);
    if ((int64_t)n > items) n = (int)items;
    if (work < FA_TEAM_MIN_WORK) n = 1;
    return n < 1 ? 1 : n;
}

void *fa_scratch_alloc(size_t bytes, void **raw)
{
    *raw = malloc(bytes + FA_SCRATCH_ALIGN);
    if (!*raw) return NULL;
    return (void *)(((uintptr_t)*raw + FA_SCRATCH_ALIGN - 1) & ~(uintptr_t)(FA_SCRATCH_ALIGN - 1));
}

void *fa_team_scratch(size_t bytes, void **raw, int *status)
{
    void *scratch = fa_scratch_alloc(bytes, raw);
    fa_record_team();
    if (!scratch) {
#pragma omp atomic write
        *status = FA_ENOMEM;
    }
    return scratch;
}

void fa_run_parallel(void (*body)(void *), void *arg, int nthreads)
{
    if (nthreads <= 1) {
        body(arg);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    body(arg);
}
