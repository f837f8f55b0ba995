"""What the agent's CUDA uprobes cost a launch-bound loop, on the CUDA stand-ins (no GPU here).

    sudo .venv/bin/python bench/cuda_launch.py [--seconds 1] [--rounds 5] [--sample-every 1] [--json OUT]

The loop (tests/cuda_standin/probed.c `loop`): zero-length kernels through cudaLaunchKernel as fast as it goes
(the stand-in runtime calls the driver's cuLaunchKernel, as NVIDIA's does: two probed functions a launch, the
inner one told apart and not counted); it counts its own launches and seconds. Columns, run interleaved in
every round (order rotated), medians reported:

  plain            no probes, no CUPTI client
  uprobes          the agent's uprobes (agent/bpf/cuda_probes.c, loaded with the CPU sampler as the agent
                   loads it), attached to the process's libcudart and libcuda as the agent attaches them at
                   capture; every launch walked unless --sample-every N
  CUPTI            our CUPTI library (agent/cupti/) at its defaults, no uprobes
  uprobes + CUPTI  both

A uprobe costs a trap into the kernel per hit whatever the program does; the walk (the table unwinder or
frame pointers, as for a CPU sample) is paid by the 1 in N sampled launches only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.cuda_standin builds the stand-ins; it is not part of the package

from tests.cuda_standin import CudaStandins, build_standins  # noqa: E402

COLUMNS = (
    ("plain", False, False),
    ("uprobes", True, False),
    ("CUPTI", False, True),
    ("uprobes + CUPTI", True, True),
)


class Probes:
    """The CPU sampler with its CUDA probes, attached to a process as the agent does at its capture."""

    def __init__(self, sample_every: int) -> None:
        from fleetprof.agent.process.table import ProcessTable
        from fleetprof.agent.sampler import CpuSampler, SamplerConfig

        self.sampler = CpuSampler(
            SamplerConfig(frequency_hz=19, interval_s=1.0, cuda=True, cuda_launch_sample_every=sample_every)
        )
        assert self.sampler.cuda is not None
        self.probes = self.sampler.cuda
        self.table = ProcessTable(on_capture=self._captured, on_forget=self.probes.forget)
        self.stats: dict[str, int] = {}

    def _captured(self, info) -> None:
        from fleetprof.agent.gpu.cuda_libraries import cuda_libraries

        self.probes.attach(info.pid, cuda_libraries(info, self.probes.known, {}))

    def attach(self, pid: int) -> None:
        self.table.refresh(pid)

    def detach(self, pid: int) -> None:
        self.table.mark_exited(pid)
        self.table.end_window()
        self.table.end_window()
        for k, v in self.sampler.drain().stats.items():
            if k.startswith("cuda") or k.startswith("unwind_walks"):
                self.stats[k] = self.stats.get(k, 0) + v

    def close(self) -> None:
        self.sampler.close()


def run_loop(cuda: CudaStandins, seconds: float, inject: bool, probes: Probes | None) -> float:
    """Launches per second of one loop."""
    proc = subprocess.Popen(
        [str(cuda.probed), "loop", str(seconds)],
        env=cuda.env(inject=inject),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert "ready" in proc.stdout.readline()
    if probes is not None:
        probes.attach(proc.pid)
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, _ = proc.communicate(timeout=seconds * 10 + 60)
    if probes is not None:
        probes.detach(proc.pid)
    if proc.returncode != 0:
        raise RuntimeError(f"probed loop failed ({proc.returncode}): {out}")
    done = json.loads(out.strip().splitlines()[-1])
    return done["launches"] / done["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sample-every", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleetprof-cuda-launch-"))
    cuda = build_standins(work)
    probes = Probes(args.sample_every)
    rates: dict[str, list[float]] = {name: [] for name, _, _ in COLUMNS}
    try:
        for r in range(args.rounds):
            order = COLUMNS[r % len(COLUMNS) :] + COLUMNS[: r % len(COLUMNS)]
            for name, probed, inject in order:
                rates[name].append(run_loop(cuda, args.seconds, inject, probes if probed else None))
            print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:,.0f}/s" for n, _, _ in COLUMNS))
    finally:
        probes.close()
    base = statistics.median(rates["plain"])
    print(
        f"\nlaunch-bound loop, {args.seconds:g} s x {args.rounds} rounds, "
        f"launch stacks 1 in {args.sample_every}"
    )
    print(f"{'column':<18}{'launches/s':>14}{'lost':>9}{'µs/launch':>12}{'added µs':>11}")
    result = {
        "seconds": args.seconds,
        "rounds": args.rounds,
        "sample_every": args.sample_every,
        "columns": {},
    }
    for name, _, _ in COLUMNS:
        med = statistics.median(rates[name])
        added = (1 / med - 1 / base) * 1e6
        print(f"{name:<18}{med:>14,.0f}{1 - med / base:>9.1%}{1e6 / med:>12.3f}{added:>11.3f}")
        result["columns"][name] = {"rates": rates[name], "median": med, "added_us": added}
    print("probe stats over all runs:", probes.stats)
    result["stats"] = probes.stats
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
