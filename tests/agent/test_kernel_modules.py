"""Kernel symbols follow the kernel: a module loaded (or unloaded) after the agent started is symbolized from
the next drain on. This machine's kernel has no loadable modules (no /proc/modules: Firecracker's kernel is
built without them), so the test writes a /proc/modules and a /proc/kallsyms of its own, in the real shape
(a GPU node's nvidia.ko among them), and changes them as a module load would; the resolver, symbolizer and
module watch are the agent's own."""

from __future__ import annotations

import os
from pathlib import Path

from fleetprof.agent.model import STACK_NONE, Drain, SampleCount
from fleetprof.agent.process.table import ProcessTable
from fleetprof.agent.resolver import Resolver
from fleetprof.agent.symbols.modules import ModuleWatch, read_modules
from fleetprof.agent.symbols.symbolizer import Symbolizer

CORE = """\
ffffffff81000000 T _stext
ffffffff81000000 T startup_64
ffffffff81001000 T do_syscall_64
ffffffff81001400 t __x64_sys_ioctl
ffffffff81001800 T entry_SYSCALL_64_after_hwframe
ffffffff82000000 T _etext
ffffffff82600000 D jiffies
"""
NVME = """\
ffffffffc0370000 t nvme_queue_rq\t[nvme]
ffffffffc0370800 t nvme_irq\t[nvme]
ffffffffc0374000 d __this_module\t[nvme]
ffffffffc0320000 T nvme_complete_rq\t[nvme_core]
ffffffffc0330000 d __this_module\t[nvme_core]
"""
NVIDIA = """\
ffffffffc1400000 t nvidia_ioctl\t[nvidia]
ffffffffc1400900 t nv_kthread_q_run\t[nvidia]
ffffffffc1402000 d nv_global_lock\t[nvidia]
"""
MODULES = """\
nvme 57344 2 - Live 0xffffffffc0370000
nvme_core 204800 3 nvme, Live 0xffffffffc0320000
"""
NVIDIA_LINE = "nvidia 56823808 {refs} - {state} 0xffffffffc1400000 (POE)\n"

IOCTL = 0xFFFFFFFFC1400123  # inside nvidia_ioctl, once the module is there
STACK = (IOCTL, 0xFFFFFFFF81001410, 0xFFFFFFFF81001010, 0xFFFFFFFF81001810)  # leaf first, as BPF stores it


def drain() -> Drain:
    """One window: a sample of this process in the kernel, in an ioctl into the nvidia module."""
    row = SampleCount(os.getpid(), os.getpid(), 0, "trainer", STACK_NONE, 7, 3)
    return Drain(0, 1, [row], {7: STACK})


def kernel_frames(resolver: Resolver) -> tuple[list[str], int]:
    """The sample's kernel frames, root first, and the window's reload count."""
    window = resolver.resolve(drain())
    (sample,) = window.samples
    frames = [f"{f.function} {f.module}" for f in sample.frames[sample.kernel_start :]]
    return frames, window.stats["kernel_symbol_reloads"]


def test_a_module_loaded_after_the_start_is_symbolized_from_the_next_drain(tmp_path: Path) -> None:
    modules, kallsyms = tmp_path / "modules", tmp_path / "kallsyms"
    modules.write_text(MODULES)
    kallsyms.write_text(CORE + NVME)
    symbolizer = Symbolizer(kallsyms_path=str(kallsyms))
    resolver = Resolver(ProcessTable(), symbolizer, modules=ModuleWatch(str(modules)))
    symbolizer.load_kernel_symbols()  # as the agent: the module list is read first, kallsyms at start()

    frames, reloads = kernel_frames(resolver)
    assert frames[-1] == f"[unknown] ([kernel]+0x{IOCTL:x}) [kernel]", frames
    assert frames[:3] == [
        "entry_SYSCALL_64_after_hwframe [kernel]",
        "do_syscall_64 [kernel]",
        "__x64_sys_ioctl [kernel]",
    ]
    assert reloads == 0

    # The driver container loads nvidia.ko: first "Loading" (its symbols may not be final), then "Live".
    modules.write_text(MODULES + NVIDIA_LINE.format(refs=0, state="Loading"))
    kallsyms.write_text(CORE + NVME + NVIDIA)
    frames, reloads = kernel_frames(resolver)
    assert reloads == 0 and frames[-1].startswith("[unknown]"), frames
    modules.write_text(MODULES + NVIDIA_LINE.format(refs=0, state="Live"))
    frames, reloads = kernel_frames(resolver)
    assert reloads == 1
    assert frames[-1] == "nvidia_ioctl [kernel] nvidia", frames

    # Used: reference counts move at every open and close. Not a change of the module list.
    modules.write_text(MODULES.replace(" 2 - ", " 3 - ") + NVIDIA_LINE.format(refs=19, state="Live"))
    frames, reloads = kernel_frames(resolver)
    assert reloads == 0 and frames[-1] == "nvidia_ioctl [kernel] nvidia"

    # Unloaded: its addresses are nobody's again (the next module loaded there will be named afresh).
    modules.write_text(MODULES)
    kallsyms.write_text(CORE + NVME)
    frames, reloads = kernel_frames(resolver)
    assert reloads == 1 and frames[-1].startswith("[unknown]"), frames


def test_the_module_list_in_its_real_shape(tmp_path: Path) -> None:
    """Names, sizes and load addresses of live modules; dependencies, taints and states as the kernel
    prints them (kernel/module/procfs.c m_show)."""
    path = tmp_path / "modules"
    path.write_text(
        MODULES + NVIDIA_LINE.format(refs=19, state="Live") + "nvidia_uvm 1531904 0 - Unloading 0x0\n"
    )
    assert read_modules(str(path)) == {
        (b"nvme", b"57344", b"0xffffffffc0370000"),
        (b"nvme_core", b"204800", b"0xffffffffc0320000"),
        (b"nvidia", b"56823808", b"0xffffffffc1400000"),
    }


def test_a_kernel_without_loadable_modules_never_reloads(tmp_path: Path) -> None:
    watch = ModuleWatch(str(tmp_path / "no-such-file"))  # like this machine's /proc/modules
    assert read_modules(str(tmp_path / "no-such-file")) is None
    assert not watch.changed() and not watch.changed()
