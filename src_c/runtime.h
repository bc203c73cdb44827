/*
 * The runtime shared by the drivers (runtime.c): OpenMP teams and their
 * scratch.  Not part of the kernels, which contain no OpenMP.
 */
#ifndef FASTATTN_RUNTIME_H
#define FASTATTN_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifndef _OPENMP
/* Built without OpenMP: the pragmas are ignored on purpose, and the same code
 * runs serially. */
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#endif

/* The calling thread's number in its team and the team's size (0 and 1
 * outside a team or without OpenMP). */
int fa_thread_num(void);
int fa_num_threads(void);
/* Records the team size for fa_last_threads: each team member calls it;
 * fa_team_none, at each entry point's start, records that none ran yet. */
void fa_record_team(void);
void fa_team_none(void);
/* Threads for a call: the caller's request (> 0) or the OpenMP default, at
 * most fa_thread_cap; one in a child forked with a stale pool (runtime.c). */
int fa_threads_wanted(int requested);
/* Team size: fa_threads_wanted, no more than the work items, and one thread
 * when the work (about one unit a multiply-add) is below FA_TEAM_MIN_WORK,
 * too small to pay for starting a team. */
#define FA_TEAM_MIN_WORK 1.5e5
int fa_team_size(int requested, int64_t items, double work);
/* Scratch aligned to FA_SCRATCH_ALIGN; free with free(raw).  Page-aligned, so
 * that where the kernel's tiles fall among the cache sets, relative to K and V,
 * does not depend on what the heap held before (docs/tuning.md). */
#define FA_SCRATCH_ALIGN 4096
void *fa_scratch_alloc(size_t bytes, void **raw);
/* A team member's start: its own scratch (NULL, and *status = FA_ENOMEM, when
 * it cannot be allocated; free(*raw) in any case), and the team size recorded
 * for fa_last_threads. */
void *fa_team_scratch(size_t bytes, void **raw, int *status);
/* Run body(arg) on a team of nthreads threads, or on the calling thread alone
 * when nthreads is 1: its worksharing loops are then orphaned, so they run
 * serially and their barriers are no-ops (a one-thread parallel region still
 * costs libgomp two futex system calls, a fifth of a small call). */
void fa_run_parallel(void (*body)(void *), void *arg, int nthreads);

#endif /* FASTATTN_RUNTIME_H */
