"""What loading the CPU sampler's BPF costs (BCC's clang compile, then the verifier): CPU seconds of one
CpuSampler start, as shipped against a baseline of the same source with the stack hash's loop unrolled (the
`#pragma clang loop unroll(disable)` before it removed: clang then inlines 127 copies into each program that
stores a stack), alternated in one sitting; medians. Every agent start and every test sampler pays it, and
an emulated arm64 guest pays it 20-40x slower.

usage: sudo python bench/bpf_compile.py [--rounds 5] [--off-cpu]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetprof.agent import sampler as sampler_module  # noqa: E402
from fleetprof.agent.sampler import CpuSampler, SamplerConfig  # noqa: E402

HASH_LOOP = "#pragma clang loop unroll(disable)\n    for (int i = 0; i < MAX_DEPTH; i++) {"


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
    args = ap.parse_args()
    shipped = sampler_module.BPF_SOURCE
    text = shipped.read_text()
    if HASH_LOOP not in text:
        print("the shipped source's stack hash loop is not where this bench expects it", file=sys.stderr)
        return 1
    # Beside the original, so that its #include "..." lines find the same headers.
    unrolled = shipped.with_name(".bench_unrolled_cpu_sampler.c")
    unrolled.write_text(text.replace(HASH_LOOP, "for (int i = 0; i < MAX_DEPTH; i++) {"))
    config = SamplerConfig(off_cpu=args.off_cpu)
    times: dict[str, list[float]] = {"shipped": [], "unrolled": []}
    try:
        for _ in range(args.rounds):
            times["shipped"].append(one_start(config, shipped))
            times["unrolled"].append(one_start(config, unrolled))
    finally:
        unrolled.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"CPU seconds per sampler start, median of {args.rounds} (off-CPU {'on' if args.off_cpu else 'off'}):"
    )
    print(f"  shipped  {med['shipped']:.2f}   (all: {', '.join(f'{t:.2f}' for t in times['shipped'])})")
    print(f"  unrolled {med['unrolled']:.2f}   (all: {', '.join(f'{t:.2f}' for t in times['unrolled'])})")
    print(f"  shipped / unrolled: {med['shipped'] / med['unrolled']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
