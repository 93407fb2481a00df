/* The scheduling probe's user-space slot free (probes/sched.py, SchedProbe._release).
 *
 * Why native: the slot table of probes/sched_bpf.c (`slot_task`, one task pointer per slot,
 * 0 when free) is a BPF array map mmapped into user space, which the BPF programs change on
 * every CPU meanwhile. Python can read and write the mapped words but not compare-and-swap
 * them: a check (`slot_task[i] == task`) followed by a store lets the BPF side free the slot
 * between the two (an exiting thread's last switch), and both sides then count it freed;
 * the `live` count drifts below the slots held. Here the free is one `lock cmpxchg`, the
 * instruction the BPF side's __sync_val_compare_and_swap is JITed to, on the same word, so
 * exactly one side frees (and counts) each claim.
 *
 * The row's tid (struct thread_t in sched_bpf.c: u32 ev_type at 0, u32 tid at 4, so the
 * two make the row's first 64-bit word) is compared and cleared with a compare-and-swap of
 * that word too, the way the BPF side does it (bcc's default BPF target has no 32-bit
 * atomics): a new owner that claimed the slot after the free rewrites that word, and its
 * tid is then never cleared.
 */
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

/* rl_sched_abi()'s value: the argument list of rl_sched_free that probes/sched.py passes */
#define RL_SCHED_ABI 1

EXPORT int64_t rl_sched_abi(void) { return RL_SCHED_ABI; }

static uint32_t tid_of(uint64_t word) { return (uint32_t)(word >> 32); }

/* For each i < n: free slot slots[i] (0 <= slots[i] < nslots, else skipped) when it holds
 * task tasks[i] for thread tids[i]:
 *   1. its row's first word must carry tid tids[i]: otherwise the slot was freed meanwhile
 *      (the BPF side clears the tid right after its own free) and perhaps claimed again,
 *      even by a new task at the same address (task_structs are reused at once), whose row
 *      starts with tid 0 and then its own tid; it is left alone;
 *   2. slot_task[slot]: compare-and-swap tasks[i] -> 0; only a success frees the slot;
 *   3. then the row's tid: compare-and-swap (ev_type, tids[i]) -> (ev_type, 0), so that a
 *      thread claiming the slot between 2 and 3 keeps its tid.
 * freed[i] = 1 where this call freed the slot, else 0. Returns the number freed.
 * rows: the mmapped `threads` array, row_bytes apart, each 8-byte aligned. */
EXPORT int64_t rl_sched_free(uint64_t *slot_task, uint8_t *rows, int64_t row_bytes, int64_t nslots,
                             const int64_t *slots, const uint64_t *tasks, const uint32_t *tids,
                             int64_t n, uint8_t *freed) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        freed[i] = 0;
        int64_t s = slots[i];
        if (s < 0 || s >= nslots || tasks[i] == 0 || tids[i] == 0)
            continue;
        uint64_t *head = (uint64_t *)(rows + s * row_bytes);
        if (tid_of(__atomic_load_n(head, __ATOMIC_SEQ_CST)) != tids[i])
            continue;
        uint64_t expected = tasks[i];
        if (!__atomic_compare_exchange_n(&slot_task[s], &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            continue;
        uint64_t w = __atomic_load_n(head, __ATOMIC_SEQ_CST);
        if (tid_of(w) == tids[i])
            /* a failure here: a new owner rewrote the word meanwhile; its tid stays */
            __atomic_compare_exchange_n(head, &w, w & 0xffffffffULL, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        freed[i] = 1;
        count++;
    }
    return count;
}
