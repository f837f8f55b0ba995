"""Kernel struct offsets from the running kernel's BTF: a real BPF program reads a thread's scheduler counts
at them, and the kernel's own /proc count brackets what it read. (This machine's kernel headers are
Debian's, not the running kernel's: offsets from them were wrong for task_struct here.)"""

from __future__ import annotations

import ctypes as ct
import os
import threading
import time

import pytest

from fleetprof.agent.kernel_btf import field_offsets
from fleetprof.agent.sampler import task_run_offsets
from tests.conftest import require_bpf

pytestmark = [pytest.mark.bpf]

RUNS = 1024  # the thread's waits recorded: three naps, and whatever it waits for besides (the GIL)

PROGRAM = r"""
struct run { u64 sum; u64 prev; };
BPF_ARRAY(runs, struct run, RUNS);
BPF_ARRAY(count, u32, 1);
TRACEPOINT_PROBE(sched, sched_switch) {
    if (args->prev_pid != TARGET || args->prev_state == 0)
        return 0;   // its waits only: preemptions of its burns on a busy machine are many
    u32 zero = 0;
    u32 *n = count.lookup(&zero);
    if (!n)
        return 0;
    u32 i = *n;
    struct run *r = runs.lookup(&i);
    if (!r)
        return 0;
    u64 task = bpf_get_current_task();
    bpf_probe_read_kernel(&r->sum, 8, (void *)(task + SUM_OFF));
    bpf_probe_read_kernel(&r->prev, 8, (void *)(task + PREV_OFF));
    *n = i + 1;
    return 0;
}
"""


def _schedstat_ns() -> int:
    """The calling thread's se.sum_exec_runtime as the kernel reports it (first field of schedstat)."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def test_a_threads_run_is_read_at_the_offsets_btf_gives() -> None:
    """Every wait (a switch-out not runnable) of a thread that burns and naps three times: the sum read at
    the offset grows, each nap's lies between the thread's own /proc reads just before and after it, and
    each switch-in's prev_sum_exec_runtime (set when the scheduler picks it) is at least the sum at the
    wait before it (equal unless a preemption came between) and at most its own."""
    require_bpf()
    from bcc import BPF

    offsets = task_run_offsets()  # the ones the sampler compiles in
    assert offsets is not None, "no BTF for task_struct here"
    reads: dict[str, object] = {"naps": []}
    ready, go = threading.Event(), threading.Event()

    def thread() -> None:
        reads["tid"] = threading.get_native_id()
        ready.set()
        go.wait()
        for _ in range(3):
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass
            before = _schedstat_ns()
            time.sleep(0.01)
            reads["naps"].append((before, _schedstat_ns()))

    t = threading.Thread(target=thread)
    t.start()
    ready.wait()
    bpf = BPF(
        text=PROGRAM,
        cflags=[
            f"-DTARGET={reads['tid']}",
            f"-DSUM_OFF={offsets[0]}",
            f"-DPREV_OFF={offsets[1]}",
            f"-DRUNS={RUNS}",
        ],
    )
    try:
        go.set()
        t.join()
        n = bpf["count"][ct.c_int(0)].value
        runs = [(bpf["runs"][ct.c_int(i)].sum, bpf["runs"][ct.c_int(i)].prev) for i in range(min(n, RUNS))]
    finally:
        bpf.cleanup()
    assert len(runs) >= 3, runs  # three naps at least
    sums = [s for s, _ in runs]
    assert sums == sorted(sums), runs
    # Each nap's switch-out, between the thread's own reads around it (tens of us apart).
    for before, after in reads["naps"]:
        assert any(before <= s <= after for s in sums), (before, after, runs)
    for (sum_before, _), (sum_now, prev_now) in zip(runs, runs[1:], strict=False):
        assert sum_before <= prev_now <= sum_now, runs


def test_members_are_found_through_anonymous_unions_and_missing_ones_are_none() -> None:
    """struct page's `mapping` sits in anonymous unions and structs after `flags` and `lru` (8 + 16 bytes on
    a 64-bit kernel); a member or struct the kernel lacks gives None, not a guess."""
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        pytest.skip("no kernel BTF")
    assert field_offsets("page", "mapping") == (24,)
    assert field_offsets("task_struct", "se.no_such_member") is None
    assert field_offsets("no_such_struct", "a") is None
