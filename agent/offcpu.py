"""Off-CPU time in user space: the pending switch-outs the sampler reads at each drain, the stack bodies of
waits that cross drains, and which threads were idle in a window.

The BPF half is the sched_switch section of agent/bpf/cpu_sampler.c; agent/sampler.py drains it and calls
what is here. Nothing here touches BPF.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Hashable, Iterable

# Defaults, from bench/offcpu.py on this machine kind (2 vCPUs, kernel 6.18); the table is in bench/README.md
# ("Off-CPU recording"), the reasoning in docs/offcpu.md.
DEFAULT_OFFCPU_SAMPLE_EVERY = 8
DEFAULT_OFFCPU_MIN_BLOCK_US = 0
# Waits at or above this are recorded exactly, once, at their length, whatever the 1-in-N sampling (issue 29:
# one 35 s wait had a 7-in-8 chance to vanish, and counted 8x when kept). 10 ms: longer than a scheduler
# time slice and a page fault, shorter than what someone on call asks about; bench/offcpu.py has its cost.
DEFAULT_OFFCPU_EXACT_US = 10_000

# A thread is idle in a window when it ran less than this share of the time it was on CPU or waiting, as
# its sampled waits measure both (each recorded wait brings the run that ended in it). Pools of threads
# that wait for work (a worker waking every 100 ms for 10 us: 0.01%) fall far below; threads that work
# and wait (a loader reading then decoding, a loop launching GPU kernels then syncing: 5-90%) far above.
# Wall views leave idle threads' waits out by default (collector: threads=active), off-CPU views keep them.
ACTIVE_SHARE = 0.01

# struct offcpu_start (cpu_sampler.c), read whole at each drain: sample_key (tgid tid cgroup_id user kernel
# python gpu_slot comm), then ns ran_ns set runnable.
START_LAYOUT = struct.Struct("=IIQQQQQ16sQQII")
START_TGID, START_USER, START_KERNEL, START_PYTHON = 0, 3, 4, 5  # fields of START_LAYOUT.unpack()

# Stack ids below cpu_sampler.c's STACK_RESERVED (0: no stack, 1: lost, 2: not taken, 0x400 + nr: a
# syscall) name no body.
_FIRST_BODY_ID = 0x800

Pending = list[tuple[int, tuple]]
"""(tid, START_LAYOUT fields) of every sampled switch-out still waiting for its thread to run again."""


def idle_threads(waits: Iterable[tuple[Hashable, int, int]], stolen_ns: int = 0) -> set:
    """The threads that were idle in a window, from its off-CPU rows as (thread, waited ns, ran ns); the
    sampler names a thread by (tgid, tid), not by tid alone: with Linux's default pid_max of 32,768 a node
    that churns threads reuses a tid within seconds, and a busy thread that died early in a window made a
    pool thread born later in it with its tid look active (an idle pool's second of naps in a wall view,
    beside a test that creates thousands of threads). `stolen_ns`:
    the most time one CPU spent in the window on other than its current task (StolenTime), which BPF's
    switch-to-switch clock counts as the task's run: taken off each thread's run before it is judged."""
    waited: dict[Hashable, int] = {}
    ran: dict[Hashable, int] = {}
    for tid, ns, ran_ns in waits:
        waited[tid] = waited.get(tid, 0) + ns
        ran[tid] = ran.get(tid, 0) + ran_ns
    return {tid for tid, ns in waited.items() if ran[tid] - stolen_ns < ACTIVE_SHARE * (ran[tid] + ns)}


# /proc/stat's per-CPU fields after the name: user nice system idle iowait irq softirq steal ...
_IRQ, _SOFTIRQ, _STEAL = 5, 6, 7


class StolenTime:
    """The most time one CPU spent, since the last call, on what runs in its current task's name without
    being that task: interrupts' (irq and softirq: this kernel has no IRQ_TIME_ACCOUNTING, so the scheduler
    counts them as the task's run too) and, with `steal`, the hypervisor's (a VM's vCPU descheduled). An
    idle pool thread that woke for 10 us while its CPU was taken for 20 ms read as active, and its naps
    stood in a wall view (tests/e2e/test_offcpu_e2e.py). A thread runs on one CPU at a time, so the busiest
    CPU's share bounds what one thread's runs took in. Steal only where BPF times runs by the clock: the
    scheduler's own count (cpu_sampler.c run_ending) leaves it out exactly, while /proc/stat accounts it at
    ticks and late (on an idle vCPU the tick stops): 60 ms in a 30 s window in which the scheduler left
    out 490 ms of runs, in stints of 1-48 ms (a BPF probe beside a CI run, 2026-11-29)."""

    def __init__(self, path: str = "/proc/stat", steal: bool = True) -> None:
        self._path = path
        self._steal = steal
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def _read(self) -> dict[str, int]:
        """Ticks per CPU (cpu0, cpu1, ...) of irq + softirq (+ steal); {} where /proc/stat cannot be read."""
        try:
            with open(self._path, encoding="ascii") as f:
                lines = f.read().splitlines()
        except OSError:
            return {}
        out = {}
        for line in lines:
            if line.startswith("cpu") and not line.startswith("cpu "):
                name, *fields = line.split()
                if len(fields) > _STEAL:
                    steal = int(fields[_STEAL]) if self._steal else 0
                    out[name] = int(fields[_IRQ]) + int(fields[_SOFTIRQ]) + steal
        return out

    def take_ns(self) -> int:
        now = self._read()
        ticks = max((now[c] - self._last.get(c, now[c]) for c in now), default=0)
        self._last = now
        return max(0, ticks) * 1_000_000_000 // self._hz


class StackCarry:
    """Stack bodies of off-CPU waits still in progress, kept from the drain that emptied them until the
    drain in which the wait is recorded.

    A sampled switch-out stores its stacks in the map set being written then; the wait is recorded when the
    thread runs again, maybe many windows later, in the set being written *then*. drain() reads the pending
    switch-outs (P) after the flip's grace and before it empties the old set. A wait that switched out in
    window j and ends in window w:
      * w = j: stacks and wait in the same set;
      * w = j+1, ended before P_j was read: its stacks were still in set j, and BPF copied them into the
        current set (cpu_sampler.c carry_stack);
      * otherwise it is in P_j (and in every P up to P_(w-2)): its bodies are kept here from drain j on,
        while a P of this drain or of the one before names them (the wait may end between the flip and
        the read of P_(w-1), and BPF cannot copy then when the sets alias: j and w two windows apart).
    So no off-CPU row misses its stacks, and memory is bounded by the waits in progress.
    """

    def __init__(self) -> None:
        self._native: dict[int, tuple] = {}
        self._python: dict[int, tuple] = {}
        self._named_before: tuple[set[int], set[int]] = (set(), set())  # ids of the previous drain's P

    def fill(self, rows: Iterable, stacks: dict, python_stacks: dict) -> int:
        """Add to this drain's stacks the carried bodies its off-CPU rows (with user_stack, kernel_stack and
        python_stack ids) need; returns how many ids were found nowhere: none by design (a body BPF could
        not copy over comes as STACK_LOST, counted apart), so any is a defect the metric shows."""
        missing = 0
        for row in rows:
            for sid, drained, carried in (
                (row.user_stack, stacks, self._native),
                (row.kernel_stack, stacks, self._native),
                (row.python_stack, python_stacks, self._python),
            ):
                if sid < _FIRST_BODY_ID or sid in drained:
                    continue
                body = carried.get(sid)
                if body is None:
                    missing += 1
                else:
                    drained[sid] = body
        return missing

    def keep(self, pending: Pending, stacks: dict, python_stacks: dict) -> None:
        """Keep the bodies that this drain's or the previous drain's pending switch-outs name. (A wait that
        switched out after the flip names bodies not drained yet: a later drain has them.)"""
        native_ids = {sid for _, start in pending for sid in (start[START_USER], start[START_KERNEL])}
        python_ids = {start[START_PYTHON] for _, start in pending}
        before_native, before_python = self._named_before
        self._named_before = (native_ids, python_ids)
        self._native = _bodies(native_ids | before_native, stacks, self._native)
        self._python = _bodies(python_ids | before_python, python_stacks, self._python)


def _bodies(ids: set[int], drained: dict, carried: dict) -> dict:
    found = {}
    for sid in ids:
        body = drained.get(sid, carried.get(sid))
        if body is not None:
            found[sid] = body
    return found
