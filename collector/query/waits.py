"""Where threads blocked, and why: off-CPU and wall stacks ranked by the thread's own code and a reason.

An off-CPU stack always ends in the scheduler (the agent records it at sched:sched_switch, inside
`__schedule`), so ranking its leaf says "__schedule" for every wait. What an on-call engineer needs is the
function of theirs that waited and what it waited for. Each stack is read here, in one place, as:

- **the frame**: the innermost frame of the thread's own code. For a thread running Python, its innermost
  Python frame (the native frames under it are the interpreter's, or a library's, way of doing what that
  line asked). Otherwise the innermost user frame outside the C runtime (glibc/musl, the dynamic loader,
  the vDSO, and libstdc++/libc++'s layers over them), through whose syscall wrappers nearly every wait
  passes: a thread in `read()` ranks under the function that called `read`. Where that caller is not in
  the stack (walked by frame pointer through a wrapper that keeps none, the wrapper's caller is skipped:
  docs/offcpu.md), the next one up is the innermost frame outside the runtime, and so the one ranked. A
  stack of runtime frames alone ranks its innermost one; a kernel thread (no user frames), its innermost
  kernel function outside the scheduler (`worker_thread`). Why not the first frame with a name: a
  wrapper's frame always has one (`read`), and it says what the reason says already.
- **the reason**, from its kernel frames, as this kernel (6.18, x86-64; arm64's syscall entries too) names
  them (tests/collector/test_waits.py holds the stacks the agent recorded, by shape):
  - `preempted`: the thread was runnable, switched out to let another run: the scheduler entered from a
    preemption point (`preempt_schedule*`, `__cond_resched`) or on the way back to user space
    (`irqentry_exit_to_user_mode` after an interrupt or fault, `exit_to_user_mode_loop` after a syscall).
  - the syscall's name (`read`, `clock_nanosleep`, `futex`, `epoll_wait`, ...): from the outermost frame
    that names it: the arch's entry (`__x64_sys_read`, `__arm64_sys_read`), else an inner helper where the
    entry is inlined (`ksys_read` on this kernel, `__sys_recvmsg`, `kernel_wait4`, `do_futex`). Waits on
    I/O keep their syscall (`io_schedule` under `read` is `read`).
  - `page fault`: a fault taken in user space that slept (a page read from disk: `filemap_fault` ...
    `io_schedule`).
  - `kernel thread`: a kernel thread waiting for work.
  - `running`: a wall profile's CPU samples (read apart from its waits, before the two merge).
  - `unknown`: a wait whose kernel stack was lost (no scheduler frame), or that no rule reads.
The full kernel stack stays in the flame graph; this is a ranking."""

from __future__ import annotations

import os
import re

from fleetprof.collector.model.profile import PYTHON_LINE, UNNAMED_PYTHON_MODULE, FrameKey, Stack, Stacks

PREEMPTED = "preempted"
PAGE_FAULT = "page fault"
KERNEL_THREAD = "kernel thread"
RUNNING = "running"
UNKNOWN = "unknown"
NO_FRAME = FrameKey("[unknown]")  # a stack with no frames at all (folded text's name for it too)

# The frames the scheduler itself adds under the one that chose to wait.
_SCHEDULER = re.compile(
    r"_*(schedule|io_schedule)(_\w+)?|__?cond_resched|preempt_schedule\w*|__wait_for_common"
)
# Preemption points: the scheduler entered here means the thread was runnable (`__schedule`'s caller).
_PREEMPTION_POINTS = frozenset(
    ("preempt_schedule", "preempt_schedule_common", "preempt_schedule_irq", "preempt_schedule_notrace")
    + ("__cond_resched", "_cond_resched", "__preempt_schedule", "__preempt_schedule_notrace")
)
# The way back to user space calls schedule() only when the thread is to give up the CPU (need_resched):
# after an interrupt or a fault (`irqentry_exit_to_user_mode`), after a syscall (`exit_to_user_mode_loop`,
# `syscall_exit_to_user_mode` where the loop is inlined), or on return to preemptible kernel code.
_PREEMPTING_CALLERS = frozenset(
    (
        "irqentry_exit_to_user_mode",
        "exit_to_user_mode_loop",
        "exit_to_user_mode_prepare",
        "syscall_exit_to_user_mode",
        "irqentry_exit",
        "raw_irqentry_exit_cond_resched",
        "irqentry_exit_cond_resched",
        "dynamic_irqentry_exit_cond_resched",
        # arm64 before the generic entry code: its return to user space (by the kernel's source; arm64
        # nodes are not profiled with kernel stacks here yet)
        "do_notify_resume",
    )
)
# A syscall's arch entry (`__x64_sys_read`, `__arm64_sys_read`, `__ia32_compat_sys_x`, ...) and the generic
# names it expands to (`__se_sys_x`, `__do_sys_x`).
# The one kernel frame of a long wait whose stack the agent took when its syscall returned: the kernel
# stack is gone by then, and the frame names the syscall (agent/resolver.py, `[syscall read]`).
_TAKEN_AT_RETURN = re.compile(r"\[syscall (\w+)\]")
_SYSCALL_ENTRY = re.compile(r"__(?:x64|ia32|x32|arm64|riscv|s390x|powerpc|se|do)_(?:compat_)?sys_(\w+)")
# Inner helpers that name their syscall where the entry is inlined into the dispatcher (`x64_sys_call`):
# `ksys_read` (read, write, pread64, ...), `__sys_recvmsg` (the socket calls), and a few more by name.
_SYSCALL_HELPER = re.compile(r"(?:ksys|__sys)_(\w+)")
_SYSCALL_BY_HELPER = {
    "kernel_wait4": "wait4",
    "kernel_waitid": "waitid",
    "do_epoll_wait": "epoll_wait",
    "do_epoll_pwait": "epoll_pwait",
    "do_sys_poll": "poll",
    "core_sys_select": "select",
    "do_nanosleep": "nanosleep",
    "vm_mmap_pgoff": "mmap",
    "do_futex": "futex",
    "futex_wait": "futex",
    "futex_wait_multiple": "futex",
    "futex_lock_pi": "futex",
}
# Helpers whose name says more than the syscall's (ksys_fadvise64_64 is fadvise64).
_SYSCALL_RENAMED = {"fadvise64_64": "fadvise64"}
_PAGE_FAULT = frozenset(("asm_exc_page_fault", "exc_page_fault", "do_user_addr_fault", "handle_mm_fault"))
_KERNEL_THREAD = frozenset(("kthread", "ret_from_fork"))

# The C runtime: the libraries through which a program makes its syscalls (glibc, musl, the dynamic loader,
# the vDSO), and the C++ runtime's thin layers over them (std::thread::join, std::condition_variable::wait
# live in libstdc++.so or libc++.so). By file name, as modules are named (the mapped file's base name).
_RUNTIME = re.compile(
    r"(?:libc|libpthread|libdl|librt|libresolv|libstdc\+\+|libc\+\+)(?:[-.].*)?\.so(?:\.[\d.]+)?"
    r"|libc\.musl-.*|ld-linux.*|ld64\.so.*|ld-musl-.*|\[vdso\]|linux-vdso.*"
)


def _method(frame: FrameKey) -> str:
    # Kernel symbols of local functions carry GCC's clone suffixes: do_epoll_pwait.part.0.
    return frame.function.split(".", 1)[0]


def is_python(frame: FrameKey) -> bool:
    """A frame of Python code: named "qualname (file.py:LINE)" with its file as its module, or a code
    object the agent could not name."""
    if frame.kernel:
        return False
    if frame.module == UNNAMED_PYTHON_MODULE:
        return True
    if not frame.function.endswith(")"):
        return False
    match = PYTHON_LINE.fullmatch(frame.function)
    return match is not None and match["file"] == os.path.basename(frame.module)


def is_runtime(frame: FrameKey) -> bool:
    """A frame of the C runtime: glibc or musl, the dynamic loader, the vDSO."""
    return not frame.kernel and _RUNTIME.fullmatch(os.path.basename(frame.module)) is not None


def own_frame(stack: Stack) -> FrameKey:
    """The innermost frame of the thread's own code (see the module's docstring); NO_FRAME for an empty
    stack."""
    return _Reader().own(stack)


def _syscall(frame: FrameKey) -> str | None:
    name = _method(frame)
    match = _SYSCALL_ENTRY.fullmatch(name) or _SYSCALL_HELPER.fullmatch(name)
    if match is not None:
        return _SYSCALL_RENAMED.get(match[1], match[1])
    return _SYSCALL_BY_HELPER.get(name)


def _preempted(kernel: list[str]) -> bool:
    """The scheduler was entered at a preemption point, or by the way back to user space: the caller of
    the innermost `__schedule`, or the caller of the `schedule()` above it."""
    at = len(kernel) - 1
    while at >= 0 and kernel[at] not in ("__schedule", "schedule"):
        at -= 1  # sched_switch fires in __schedule, so it is the leaf; this is in case it is not
    if at >= 0 and kernel[at] == "__schedule":
        at -= 1
    if at >= 0 and kernel[at] in _PREEMPTION_POINTS:
        return True
    if at >= 0 and kernel[at] == "schedule":
        at -= 1
    return at >= 0 and kernel[at] in _PREEMPTING_CALLERS


def wait_reason(stack: Stack) -> str:
    """Why the thread of `stack`, a recorded wait, was off the CPU (see the module's docstring)."""
    at = _first_kernel(stack)
    return _reason(stack[at:], at > 0)


def _first_kernel(stack: Stack) -> int:
    """Where the kernel frames start (they are the leaf end of a stack); len(stack) when there are none."""
    for i in range(len(stack) - 1, -1, -1):
        if not stack[i].kernel:
            return i + 1
    return 0


def _reason(tail: Stack, has_user: bool) -> str:
    """wait_reason() of a stack whose kernel frames are `tail` (and which has user frames before them)."""
    kernel = [_method(f) for f in tail if f.kernel]
    if len(kernel) == 1 and (taken := _TAKEN_AT_RETURN.fullmatch(kernel[0])) is not None:
        return taken[1]  # an exact long wait taken at its syscall's return (agent/resolver.py)
    if "__schedule" not in kernel and "schedule" not in kernel:
        return UNKNOWN  # its kernel stack was lost
    if _preempted(kernel):
        return PREEMPTED
    for frame in tail:  # root first: the outermost frame that says, says it for the whole wait
        if not frame.kernel:
            continue
        if _method(frame) in _PAGE_FAULT:
            return PAGE_FAULT
        name = _syscall(frame)
        if name is not None:
            return name
    if _KERNEL_THREAD.intersection(kernel) and not has_user:
        return KERNEL_THREAD
    return UNKNOWN


_PYTHON, _RUNTIME_FRAME, _OTHER = 0, 1, 2


class _Reader:
    """Reads the stacks of one ranking, each distinct frame and kernel half once: a profile's stacks share
    most of theirs (bench/top_waits.py)."""

    def __init__(self) -> None:
        self._kinds: dict[FrameKey, int] = {}
        self._reasons: dict[tuple[Stack, bool], str] = {}

    def _kind(self, frame: FrameKey) -> int:
        kind = self._kinds.get(frame)
        if kind is None:
            kind = _PYTHON if is_python(frame) else _RUNTIME_FRAME if is_runtime(frame) else _OTHER
            self._kinds[frame] = kind
        return kind

    def own(self, stack: Stack, user_end: int | None = None) -> FrameKey:
        """own_frame(); `user_end`: where the stack's kernel frames start, when known."""
        end = _first_kernel(stack) if user_end is None else user_end
        innermost_other = None
        for i in range(end - 1, -1, -1):
            frame = stack[i]
            if frame.kernel:
                continue
            kind = self._kind(frame)
            if kind == _PYTHON:
                return frame
            if kind == _OTHER and innermost_other is None:
                innermost_other = frame
        if innermost_other is not None:
            return innermost_other
        for i in range(end - 1, -1, -1):
            if not stack[i].kernel:
                return stack[i]  # runtime frames alone: the innermost
        for frame in reversed(stack):
            if _SCHEDULER.fullmatch(_method(frame)) is None:
                return frame
        return stack[-1] if stack else NO_FRAME

    def reason(self, stack: Stack, user_end: int) -> str:
        key = (stack[user_end:], user_end > 0)
        reason = self._reasons.get(key)
        if reason is None:
            reason = self._reasons[key] = _reason(*key)
        return reason


Waits = dict[tuple[FrameKey, str], int]
"""(the thread's own frame, the reason) -> value (nanoseconds, for the off-CPU and wall types)."""


def blocked_where(waits: Stacks, running: Stacks | None = None) -> Waits:
    """The value of off-CPU stacks (`waits`) by where the threads blocked in their own code and why; a wall
    view's CPU samples (`running`, in the same unit) rank by their own frame as `running`. Each stack
    counts once, so the values add up to the profile's total."""
    reader = _Reader()
    out: Waits = {}
    for stacks, running_now in ((waits, False), (running or {}, True)):
        for stack, value in stacks.items():
            if value <= 0:
                continue
            end = _first_kernel(stack)
            key = (reader.own(stack, end), RUNNING if running_now else reader.reason(stack, end))
            out[key] = out.get(key, 0) + value
    return out
