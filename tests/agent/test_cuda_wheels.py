"""NVIDIA's real libraries from their PyPI wheels, here without a GPU: libcudart.so.13 loads and its
cudaLaunchKernel is called (and fails at once: no driver), uprobes on it see each call with its host stub;
libcupti.so.13 exports every function our library looks up; and with NVIDIA's CUPTI but no NVIDIA driver
our library steps aside and the workload runs."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from fleetprof.agent.gpu.cupti_ring import MARKER_SYMBOL, RING_SYMBOL
from fleetprof.agent.symbols.elf import SHT_DYNSYM, ElfFile
from fleetprof.agent.symbols.maps import read_maps
from tests.conftest import require_bpf
from tests.cuda_standin import REPO, CudaStandins, build_standins, real_libcudart, real_libcupti, run_held

CUDA_ERROR_INSUFFICIENT_DRIVER = 35


def dynamic_symbols(path: Path) -> dict[str, tuple[int, int, int]]:
    """Defined dynamic symbols: name -> (value, size, type)."""
    import struct

    out = {}
    with ElfFile(str(path)) as elf:
        for sec in elf.sections:
            if sec.type != SHT_DYNSYM:
                continue
            data, strings = elf.section_data(sec), elf.section_data(elf.sections[sec.link])
            for off in range(0, len(data) - len(data) % 24, 24):
                name, info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
                if shndx:
                    out[strings[name : strings.index(b"\0", name)].decode()] = (value, size, info & 0xF)
    return out


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> CudaStandins:
    return build_standins(tmp_path_factory.mktemp("cuda"))


def test_real_libcudart_loads_without_a_gpu_and_its_launches_fail_at_once(cuda: CudaStandins) -> None:
    cudart = real_libcudart()
    assert "cudaLaunchKernel" in dynamic_symbols(cudart)
    env = cuda.env(inject=False)
    del env["LD_LIBRARY_PATH"]  # NVIDIA's runtime alone: no driver of any kind
    argv = [str(cuda.cudart_real), str(cudart), "1000"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {
        "calls": 1000,
        "error": CUDA_ERROR_INSUFFICIENT_DRIVER,
        "error_name": "cudaErrorInsufficientDriver",
    }


@pytest.mark.bpf
def test_uprobes_on_real_cudaLaunchKernel_see_every_call_and_its_host_stub(cuda: CudaStandins) -> None:
    require_bpf()
    from bcc import BPF

    program = r"""
    #include <uapi/linux/ptrace.h>
    BPF_HASH(stubs, u64, u64, 64);
    int on_launch(struct pt_regs *ctx) {
        u64 stub = PT_REGS_PARM1(ctx), zero = 0, *n = stubs.lookup_or_try_init(&stub, &zero);
        if (n) __sync_fetch_and_add(n, 1);
        return 0;
    }
    """
    cudart = real_libcudart()
    bpf = BPF(text=program.encode())
    env = cuda.env(inject=False, HOLD="1")
    del env["LD_LIBRARY_PATH"]
    try:
        bpf.attach_uprobe(name=bytes(cudart), sym=b"cudaLaunchKernel", fn_name=b"on_launch")
        proc = subprocess.Popen([str(cuda.cudart_real), str(cudart), "2000"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == '{"holding":true}'
        # Where the program's host stub is in this process: its symbol plus the executable's load bias.
        stub_value = dynamic_or_static_symbol(cuda.cudart_real, "fleetprof_test_kernel_stub")
        exe = [m for m in read_maps(proc.pid) if m.path == str(cuda.cudart_real)]
        stub = min(m.start for m in exe if m.offset == 0) + stub_value
        proc.stdin.write("\n")
        proc.stdin.close()
        result = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0 and result["calls"] == 2000
        deadline = time.monotonic() + 10
        while {k.value: v.value for k, v in bpf[b"stubs"].items()} != {stub: 2000}:
            assert time.monotonic() < deadline, {k.value: v.value for k, v in bpf[b"stubs"].items()}
            time.sleep(0.05)
    finally:
        bpf.cleanup()


def dynamic_or_static_symbol(path: Path, name: str) -> int:
    out = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    (value,) = [int(line.split()[0], 16) for line in out.splitlines() if line.endswith(f" {name}")]
    return value


def test_real_libcupti_exports_every_function_our_library_looks_up() -> None:
    source = (REPO / "agent" / "cupti" / "fleetprof_cupti.c").read_text()
    wanted = set(re.findall(r"FP_SYM\(\w+, (cupti\w+)\)", source))
    assert len(wanted) >= 10
    exported = dynamic_symbols(real_libcupti())
    assert wanted <= set(exported), wanted - set(exported)


def test_our_library_exports_the_injection_entry_the_marker_and_the_ring_only(cuda: CudaStandins) -> None:
    symbols = dynamic_symbols(cuda.library)
    ours = {n for n in symbols if n in ("InitializeInjection", MARKER_SYMBOL, RING_SYMBOL) or "fp_" in n}
    assert ours == {"InitializeInjection", MARKER_SYMBOL, RING_SYMBOL}
    stt_func, stt_object = 2, 1
    assert symbols["InitializeInjection"][2] == symbols[MARKER_SYMBOL][2] == stt_func
    assert symbols[RING_SYMBOL][2] == stt_object and symbols[RING_SYMBOL][1] == 4096 + 65536 * 64 + (1 << 20)
    # The marker starts with a 5-byte NOP, where Linux can turn a uprobe into a call instead of a trap.
    with ElfFile(str(cuda.library)) as elf:
        text = elf.section(".text")
        at = symbols[MARKER_SYMBOL][0] - text.addr + text.offset
        assert elf.read(at, 5) == bytes.fromhex("0f1f440000")
    # No CUPTI or CUDA library is needed to load it: the process's own libcupti is found at run time.
    with ElfFile(str(cuda.library)) as elf:
        dynstr = elf.section_data(elf.section(".dynstr"))
    assert b"libcupti" not in dynstr and b"libcuda" not in dynstr


def test_with_nvidias_cupti_and_no_nvidia_driver_the_library_steps_aside(cuda: CudaStandins) -> None:
    run = run_held(cuda, ["phases", "0.3", "5"], FLEETPROF_CUPTI_LIBRARY=str(real_libcupti()))
    assert run.returncode == 0 and run.logged("done")
    header = run.header
    assert header.state == "cupti_error" and header.cupti_path == str(real_libcupti())
    assert header.state_message.startswith("cuptiSubscribe: ") and header.write_seq == 0
