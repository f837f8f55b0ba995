"""Where threads blocked and why (collector/query/waits.py), read from stacks the agent recorded on this
machine's kernel (6.18, x86-64; 2026-11-27): a C program with a thread each in read() on a pipe,
nanosleep(), pthread_cond_timedwait(), epoll_wait(), page faults on a file mapping dropped from the page
cache and two spinners sharing one CPU; a Python program in socket.recv() and time.sleep(); and the rest
of the node (kernel threads, pools, shells). Stacks are written "function<module>" for user frames and
"function_[k]" for kernel ones, root first, as captured. The few shapes this machine cannot produce
(arm64's entries, user stacks walked whole through glibc) are marked as built from the kernel's and the
agent's naming."""

from __future__ import annotations

import re

import pytest

from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.query.waits import (
    KERNEL_THREAD,
    NO_FRAME,
    PAGE_FAULT,
    PREEMPTED,
    RUNNING,
    UNKNOWN,
    blocked_where,
    own_frame,
    wait_reason,
)
from fleetprof.collector.render.waits import top_waits

_USER = re.compile(r"(?P<function>.*)<(?P<module><[^<>]*>|[^<>]*)>")


def stack(text: str) -> tuple[FrameKey, ...]:
    frames = []
    for part in text.split(";"):
        if part.endswith("_[k]"):
            frames.append(FrameKey(part[: -len("_[k]")], "[kernel]", True))
        else:
            m = _USER.fullmatch(part)
            assert m, part
            frames.append(FrameKey(m["function"], m["module"]))
    return tuple(frames)


SYSCALL = "entry_SYSCALL_64_after_hwframe_[k];do_syscall_64_[k]"

# (what, stack, the frame ranked, the reason): captured unless the comment says otherwise.
CASES = [
    (
        "read() on a pipe: __x64_sys_read is inlined on this kernel, ksys_read names it; the frame walk "
        "through glibc's read skipped its caller cap_read, so cap_reader is the innermost frame of its own",
        f"start_thread<libc.so.6>;cap_reader<cap>;read<libc.so.6>;{SYSCALL};ksys_read_[k];vfs_read_[k];"
        "anon_pipe_read_[k];schedule_[k];__schedule_[k]",
        "cap_reader",
        "read",
    ),
    (
        "nanosleep(): glibc makes it clock_nanosleep",
        f"start_thread<libc.so.6>;cap_sleeper<cap>;clock_nanosleep@@GLIBC_2.17<libc.so.6>;{SYSCALL};"
        "__x64_sys_clock_nanosleep_[k];common_nsleep_[k];hrtimer_nanosleep_[k];do_nanosleep_[k];schedule_[k];"
        "__schedule_[k]",
        "cap_sleeper",
        "clock_nanosleep",
    ),
    (
        "epoll_wait()",
        f"start_thread<libc.so.6>;cap_epoller<cap>;epoll_wait<libc.so.6>;{SYSCALL};__x64_sys_epoll_wait_[k];"
        "do_epoll_wait_[k];schedule_hrtimeout_range_clock_[k];schedule_[k];__schedule_[k]",
        "cap_epoller",
        "epoll_wait",
    ),
    (
        "a Python condition variable: the innermost Python frame, futex",
        "Thread._bootstrap_inner (threading.py:1045)<threading.py>;_worker (thread.py:81)<thread.py>;"
        f"Condition.wait (threading.py:331)<threading.py>;__futex_abstimed_wait_common<libc.so.6>;{SYSCALL};"
        "__x64_sys_futex_[k];do_futex_[k];futex_wait_[k];__futex_wait_[k];futex_do_wait_[k];schedule_[k];"
        "__schedule_[k]",
        "Condition.wait (threading.py:331)",
        "futex",
    ),
    (
        "Python's socket.recv: recv() is the recvfrom syscall",
        "<module> (<string>:11)<<string>>;wait_for_upstream (<string>:9)<<string>>;recv<libc.so.6>;"
        f"{SYSCALL};__x64_sys_recvfrom_[k];__sys_recvfrom_[k];sock_recvmsg_[k];unix_stream_recvmsg_[k];"
        "unix_stream_read_generic_[k];schedule_timeout_[k];schedule_[k];__schedule_[k]",
        "wait_for_upstream (<string>:9)",
        "recvfrom",
    ),
    (
        "recvmsg: __x64_sys_recvmsg inlined, __sys_recvmsg names it",
        f"recv_fds (socket.py:573)<socket.py>;recvmsg<libc.so.6>;{SYSCALL};__sys_recvmsg_[k];"
        "___sys_recvmsg_[k];____sys_recvmsg_[k];sock_recvmsg_[k];unix_stream_recvmsg_[k];"
        "unix_stream_read_generic_[k];schedule_timeout_[k];schedule_[k];__schedule_[k]",
        "recv_fds (socket.py:573)",
        "recvmsg",
    ),
    (
        "waitpid: kernel_wait4 names it",
        "Popen._wait (subprocess.py:2046)<subprocess.py>;Popen._try_wait (subprocess.py:2004)<subprocess.py>;"
        f"wait4<libc.so.6>;{SYSCALL};kernel_wait4_[k];do_wait_[k];schedule_[k];__schedule_[k]",
        "Popen._try_wait (subprocess.py:2004)",
        "wait4",
    ),
    (
        "a stripped shell in pselect6",
        f"[unknown] (bash+0x32c60)<bash>;pselect<libc.so.6>;{SYSCALL};__x64_sys_pselect6_[k];"
        "do_pselect.constprop.0_[k];core_sys_select_[k];do_select_[k];poll_schedule_timeout.constprop.0_[k];"
        "schedule_hrtimeout_range_clock_[k];schedule_[k];__schedule_[k]",
        "[unknown] (bash+0x32c60)",
        "pselect6",
    ),
    (
        "I/O keeps its syscall: unlinkat waiting on a discard (io_schedule_timeout)",
        f"_rmtree_safe_fd (shutil.py:681)<shutil.py>;unlinkat<libc.so.6>;{SYSCALL};__x64_sys_unlinkat_[k];"
        "do_unlinkat_[k];evict_[k];ext4_evict_inode_[k];ext4_truncate_[k];ext4_ext_truncate_[k];"
        "ext4_ext_remove_space_[k];ext4_free_blocks_[k];blkdev_issue_discard_[k];submit_bio_wait_[k];"
        "wait_for_completion_io_timeout_[k];io_schedule_timeout_[k];schedule_timeout_[k];schedule_[k];"
        "__schedule_[k]",
        "_rmtree_safe_fd (shutil.py:681)",
        "unlinkat",
    ),
    (
        "mmap waiting for the mm's lock: vm_mmap_pgoff names it",
        f"__mmap<libc.so.6>;{SYSCALL};vm_mmap_pgoff_[k];down_write_killable_[k];rwsem_down_write_slowpath_[k];"
        "schedule_preempt_disabled_[k];schedule_[k];__schedule_[k]",
        "__mmap",
        "mmap",
    ),
    (
        "a page read from disk in a fault taken in user space",
        "start_thread<libc.so.6>;cap_faulter<cap>;cap_touch<cap>;asm_exc_page_fault_[k];exc_page_fault_[k];"
        "handle_mm_fault_[k];__handle_mm_fault_[k];do_fault_[k];__do_fault_[k];filemap_fault_[k];"
        "filemap_read_folio_[k];folio_wait_bit_common_[k];io_schedule_[k];schedule_[k];__schedule_[k]",
        "cap_touch",
        PAGE_FAULT,
    ),
    (
        "preempted by the timer tick in user space",
        "start_thread<libc.so.6>;cap_spinner<cap>;cap_spin<cap>;asm_sysvec_apic_timer_interrupt_[k];"
        "irqentry_exit_to_user_mode_[k];schedule_[k];__schedule_[k]",
        "cap_spin",
        PREEMPTED,
    ),
    (
        "preempted by a wake-up's IPI",
        "start_thread<libc.so.6>;cap_spinner<cap>;cap_spin<cap>;asm_sysvec_reschedule_ipi_[k];"
        "irqentry_exit_to_user_mode_[k];schedule_[k];__schedule_[k]",
        "cap_spin",
        PREEMPTED,
    ),
    (
        "preempted on the way out of a page fault that did not sleep",
        "start_thread<libc.so.6>;cap_faulter<cap>;cap_touch<cap>;asm_exc_page_fault_[k];"
        "irqentry_exit_to_user_mode_[k];schedule_[k];__schedule_[k]",
        "cap_touch",
        PREEMPTED,
    ),
    (
        "preempted on the way out of a syscall (read returned; the syscall's frames are gone)",
        f"start_thread<libc.so.6>;cap_reader<cap>;read<libc.so.6>;{SYSCALL};exit_to_user_mode_loop_[k];"
        "schedule_[k];__schedule_[k]",
        "cap_reader",
        PREEMPTED,
    ),
    (
        "preempted inside a long syscall at cond_resched",
        f"start_thread<libc.so.6>;__munmap<libc.so.6>;{SYSCALL};__x64_sys_munmap_[k];__vm_munmap_[k];"
        "do_vmi_munmap_[k];do_vmi_align_munmap_[k];vms_complete_munmap_vmas_[k];vms_clear_ptes.part.0_[k];"
        "unmap_vmas_[k];unmap_page_range_[k];__cond_resched_[k];__schedule_[k]",
        "__munmap",
        PREEMPTED,
    ),
    (
        "Python preempted in the interpreter's C: the Python frame it was running",
        "<module> (<string>:2)<<string>>;<module> (threading.py:1533)<threading.py>;"
        "resize_compact<libpython3.11.so.1.0>;asm_sysvec_apic_timer_interrupt_[k];"
        "irqentry_exit_to_user_mode_[k];schedule_[k];__schedule_[k]",
        "<module> (threading.py:1533)",
        PREEMPTED,
    ),
    (
        "only the C runtime's frames (main was skipped by the frame walk): its innermost one",
        f"__libc_start_call_main<libc.so.6>;clock_nanosleep@@GLIBC_2.17<libc.so.6>;{SYSCALL};"
        "__x64_sys_clock_nanosleep_[k];common_nsleep_[k];hrtimer_nanosleep_[k];do_nanosleep_[k];schedule_[k];"
        "__schedule_[k]",
        "clock_nanosleep@@GLIBC_2.17",
        "clock_nanosleep",
    ),
    (
        "a kernel thread waiting for work",
        "ret_from_fork_asm_[k];ret_from_fork_[k];kthread_[k];worker_thread_[k];schedule_[k];__schedule_[k]",
        "worker_thread",
        KERNEL_THREAD,
    ),
    (
        "a kernel thread in schedule_timeout",
        "ret_from_fork_asm_[k];ret_from_fork_[k];kthread_[k];rcu_gp_kthread_[k];rcu_gp_fqs_loop_[k];"
        "schedule_timeout_[k];schedule_[k];__schedule_[k]",
        "rcu_gp_fqs_loop",
        KERNEL_THREAD,
    ),
    (
        "an exiting process (its user stack gone), preempted",
        f"{SYSCALL};x64_sys_call_[k];__x64_sys_exit_group_[k];do_group_exit_[k];do_exit_[k];task_work_run_[k];"
        "__cond_resched_[k];__schedule_[k]",
        "task_work_run",
        PREEMPTED,
    ),
    # Built, not captured: the stack a table walk gives through glibc's wrapper (issue 29's item 2: the
    # wrapper's caller kept), and a Python thread walked whole, interpreter frames under its Python frame.
    (
        "built: read() walked whole through glibc, its caller kept",
        f"__libc_start_call_main<libc.so.6>;main<loon>;loon_outer<loon>;loon_wait<loon>;read<libc.so.6>;"
        f"{SYSCALL};ksys_read_[k];vfs_read_[k];anon_pipe_read_[k];schedule_[k];__schedule_[k]",
        "loon_wait",
        "read",
    ),
    (
        "built: time.sleep walked whole, the interpreter's C under the Python frame",
        "<module> (job.py:9)<job.py>;nap (job.py:4)<job.py>;time_sleep<python3.11>;pysleep<python3.11>;"
        f"clock_nanosleep@@GLIBC_2.17<libc.so.6>;{SYSCALL};__x64_sys_clock_nanosleep_[k];common_nsleep_[k];"
        "hrtimer_nanosleep_[k];do_nanosleep_[k];schedule_[k];__schedule_[k]",
        "nap (job.py:4)",
        "clock_nanosleep",
    ),
    (
        "built: std::thread::join walked whole, libstdc++'s frame over glibc's",
        "main<app>;run_jobs<app>;std::thread::join()<libstdc++.so.6.0.30>;__pthread_clockjoin_ex<libc.so.6>;"
        f"__futex_abstimed_wait_common<libc.so.6>;{SYSCALL};__x64_sys_futex_[k];do_futex_[k];futex_wait_[k];"
        "__futex_wait_[k];futex_do_wait_[k];schedule_[k];__schedule_[k]",
        "run_jobs",
        "futex",
    ),
    (
        "built from arm64's entry names (el0_svc, invoke_syscall, __arm64_sys_*)",
        "main<app>;wait_input<app>;read<libc.so.6>;el0t_64_sync_[k];el0t_64_sync_handler_[k];el0_svc_[k];"
        "do_el0_svc_[k];el0_svc_common.constprop.0_[k];invoke_syscall_[k];__arm64_sys_read_[k];ksys_read_[k];"
        "vfs_read_[k];pipe_read_[k];schedule_[k];__schedule_[k]",
        "wait_input",
        "read",
    ),
    (
        "built from arm64's return to user space before the generic entry: do_notify_resume",
        "main<app>;spin<app>;el0t_64_irq_[k];el0t_64_irq_handler_[k];el0_interrupt_[k];"
        "do_notify_resume_[k];schedule_[k];__schedule_[k]",
        "spin",
        PREEMPTED,
    ),
    (
        "an exact long wait, its user stack taken at its syscall's return: one [syscall NAME] kernel frame",
        "main<loon>;loon_outer<loon>;loon_long<loon>;clock_nanosleep@@GLIBC_2.17<libc.so.6>;"
        "[syscall clock_nanosleep]_[k]",
        "loon_long",
        "clock_nanosleep",
    ),
]


@pytest.mark.parametrize(("what", "text", "frame", "reason"), CASES, ids=[c[0][:60] for c in CASES])
def test_a_wait_ranks_under_the_threads_own_frame_with_its_reason(
    what: str, text: str, frame: str, reason: str
) -> None:
    st = stack(text)
    assert own_frame(st).function == frame, what
    assert wait_reason(st) == reason, what


def test_a_wall_profiles_cpu_samples_are_running_and_a_wait_without_its_kernel_stack_is_unknown() -> None:
    spin = stack("start_thread<libc.so.6>;cap_spinner<cap>;cap_spin<cap>")
    preempted = stack(CASES[11][1])  # the same function, preempted
    waits = blocked_where({preempted: 30, spin: 2}, running={spin: 50})
    cap_spin = FrameKey("cap_spin", "cap")
    assert waits == {(cap_spin, PREEMPTED): 30, (cap_spin, UNKNOWN): 2, (cap_spin, RUNNING): 50}
    assert own_frame(()) == NO_FRAME


def test_the_ranking_adds_each_stack_once_and_merges_a_python_functions_lines() -> None:
    reader = stack(CASES[0][1])
    preempted = stack(CASES[14][1])  # the same thread, preempted on its way out of read
    py3 = stack(CASES[3][1])
    py7 = stack(CASES[3][1].replace("threading.py:331", "threading.py:327"))
    waits = blocked_where({reader: 700, preempted: 100, py3: 150, py7: 50, (): 5})
    assert sum(waits.values()) == 1005
    cap_reader = FrameKey("cap_reader", "cap")
    assert waits[cap_reader, "read"] == 700 and waits[cap_reader, PREEMPTED] == 100
    rows = top_waits(waits, limit=10)
    assert [(r["function"], r["reason"], r["value"]) for r in rows] == [
        ("cap_reader", "read", 700),
        ("Condition.wait (threading.py)", "futex", 200),
        ("cap_reader", PREEMPTED, 100),
        ("[unknown]", UNKNOWN, 5),
    ]
    assert rows[0]["pct"] == round(100 * 700 / 1005, 2) and rows[1]["lines"] == [327, 331]
    apart = top_waits(waits, limit=10, lines=True)
    assert [(r["function"], r["value"]) for r in apart[1:3]] == [
        ("Condition.wait (threading.py:331)", 150),
        ("cap_reader", 100),
    ]
    assert len(top_waits(waits, limit=2)) == 2
