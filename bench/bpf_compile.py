"""What loading the CPU sampler's BPF costs (BCC's clang compile, then the verifier): CPU seconds of one
CpuSampler start, as shipped against variants of the same source, alternated in one sitting; medians:
  - "unrolled hash loop": the `#pragma clang loop unroll(disable)` before the stack hash's loop removed
    (clang then inlines 127 copies into each program that stores a stack);
  - "kernel's bpf_perf_event.h": the perf_event context from uapi/linux/bpf_perf_event.h, as the source
    took it until 2026-11-28, instead of its own declaration (on x86-64 the header pulls in the kernel's
    asm/ptrace.h tree).
Every agent start and every test sampler pays it, and an emulated arm64 guest pays it 10-25x slower.

usage: sudo python bench/bpf_compile.py [--rounds 5] [--off-cpu] [--cuda]
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetprof.agent import sampler as sampler_module  # noqa: E402
from fleetprof.agent.sampler import CpuSampler, SamplerConfig  # noqa: E402

HASH_LOOP = "#pragma clang loop unroll(disable)\n    for (int i = 0; i < MAX_DEPTH; i++) {"
OWN_CONTEXT = re.compile(r"\n// A perf_event program's context.*?\n};\n", re.S)
KERNEL_CONTEXT = "\n#include <uapi/linux/bpf_perf_event.h>\n"


def unrolled(text: str) -> str:
    return text.replace(HASH_LOOP, "for (int i = 0; i < MAX_DEPTH; i++) {")


def kernel_header(text: str) -> str:
    return OWN_CONTEXT.sub(lambda _: KERNEL_CONTEXT, text, count=1)


VARIANTS = {"unrolled hash loop": unrolled, "kernel's bpf_perf_event.h": kernel_header}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_start(config: SamplerConfig, source: Path) -> float:
    """CPU seconds of one CpuSampler start (compile, verify, attach) from `source`."""
    shipped = sampler_module.BPF_SOURCE
    sampler_module.BPF_SOURCE = source
    try:
        t0 = cpu_s()
        s = CpuSampler(config)
        spent = cpu_s() - t0
        s.close()
        return spent
    finally:
        sampler_module.BPF_SOURCE = shipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--off-cpu", action="store_true", help="with the off-CPU programs (the agent's default)")
    ap.add_argument("--cuda", action="store_true", help="with the CUDA probes (the agent's default)")
    args = ap.parse_args()
    shipped = sampler_module.BPF_SOURCE
    text = shipped.read_text()
    sources = {"shipped": shipped}
    for name, change in VARIANTS.items():
        changed = change(text)
        if changed == text:
            print(f"the shipped source has nothing for variant {name!r} to change", file=sys.stderr)
            return 1
        # Beside the original, so that its #include "..." lines find the same headers.
        path = shipped.with_name(f".bench_{len(sources)}_cpu_sampler.c")
        path.write_text(changed)
        sources[name] = path
    config = SamplerConfig(off_cpu=args.off_cpu, cuda=args.cuda)
    times: dict[str, list[float]] = {name: [] for name in sources}
    try:
        for _ in range(args.rounds):
            for name, path in sources.items():
                times[name].append(one_start(config, path))
    finally:
        for name, path in sources.items():
            if name != "shipped":
                path.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    on = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in (("off-CPU", args.off_cpu), ("CUDA", args.cuda)))
    print(f"CPU seconds per sampler start, median of {args.rounds} ({on}):")
    for name, values in times.items():
        ratio = "" if name == "shipped" else f"   shipped / this: {med['shipped'] / med[name]:.2f}x"
        print(f"  {name:28s} {med[name]:.2f}{ratio}   (all: {', '.join(f'{t:.2f}' for t in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
