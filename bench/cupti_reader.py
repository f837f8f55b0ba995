"""What the agent's reading of a CUPTI ring costs a drain (agent/gpu/cupti_reader.py), on the CUDA stand-ins.

    .venv/bin/python bench/cupti_reader.py [--seconds 8] [--window 1.0] [--gap-ms 0.1] [--json OUT]

A workload of ours (tests/cuda_standin/launcher.c `phases`) runs train/eval steps of 5-6 kernels with a
short loader pause (`--gap-ms`), so its ring fills with thousands of kernel records a second, at the
library's defaults. Every `--window` seconds, one after the other on this thread, in alternating order:

  poll     a bare RingReader.poll() of the same ring (agent/gpu/cupti_ring.py): the reading alone
  drain    CuptiReaders.drain() for the window: its own poll, the timeline merge (ProcessActivity.add),
           kernel time per name, and the stretch's known/idle time and gaps

Both read the same new records each window. Reported: medians over the windows of thread CPU ms per call,
records per window and µs per record, and drain / poll. Windows before the ring was found and the last one
(the workload ending) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.cuda_standin builds the stand-ins; it is not part of the package

from fleetprof.agent.gpu.cupti_reader import CuptiReaders  # noqa: E402
from fleetprof.agent.gpu.cupti_ring import RingError, RingReader  # noqa: E402
from fleetprof.agent.process.table import read_process  # noqa: E402
from tests.cuda_standin import build_standins  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--gap-ms", type=float, default=0.1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cuda = build_standins(Path(tmp))
        proc = subprocess.Popen(
            [str(cuda.launcher), "phases", str(args.seconds), str(args.gap_ms)],
            env=cuda.env(HOLD="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            rows = measure(proc, args.window, args.seconds)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    report(rows, args)


def measure(proc: subprocess.Popen, window_s: float, seconds: float) -> list[dict]:
    readers = CuptiReaders()
    bare: RingReader | None = None
    rows = []
    window = int(window_s * 1e9)
    t0 = time.monotonic_ns()
    deadline = time.monotonic() + seconds + 2 * window_s
    i = 0
    while time.monotonic() < deadline:
        t1 = t0 + window
        time.sleep(max(0.0, (t1 - time.monotonic_ns()) / 1e9))
        if bare is None:
            try:
                info = read_process(proc.pid)
                readers.on_capture(info)
                bare = RingReader.open(proc.pid)
            except (RingError, ProcessLookupError):
                t0 = t1
                continue
        row = {}
        for which in ("poll", "drain") if i % 2 == 0 else ("drain", "poll"):
            c0 = time.thread_time_ns()
            if which == "poll":
                row["records"] = len(bare.poll().activities)
            else:
                got = readers.drain(t0, t1)
                row["kernels"] = got.kernels
            row[which + "_ns"] = time.thread_time_ns() - c0
        rows.append(row)
        t0, i = t1, i + 1
    return rows[1:-1]  # the first drain opens the ring (its whole content); the last may see the end


def report(rows: list[dict], args: argparse.Namespace) -> None:
    rows = [r for r in rows if r["records"]]
    if not rows:
        print("no windows with records")
        return
    med = {k: statistics.median(r[k] for r in rows) for k in ("records", "poll_ns", "drain_ns")}
    out = {
        "windows": len(rows),
        "records_per_window": med["records"],
        "poll_ms": med["poll_ns"] / 1e6,
        "drain_ms": med["drain_ns"] / 1e6,
        "poll_us_per_record": med["poll_ns"] / 1e3 / med["records"],
        "drain_us_per_record": med["drain_ns"] / 1e3 / med["records"],
        "drain_over_poll": med["drain_ns"] / med["poll_ns"],
        "window_s": args.window,
    }
    n = out["records_per_window"]
    print(f"{out['windows']} windows of {args.window:g} s, median {n:,.0f} records each")
    print("          CPU ms/window   µs/record")
    print(f"poll      {out['poll_ms']:13.2f}   {out['poll_us_per_record']:9.3f}")
    print(f"drain     {out['drain_ms']:13.2f}   {out['drain_us_per_record']:9.3f}")
    print(f"drain / poll: {out['drain_over_poll']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
