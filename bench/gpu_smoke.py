"""Real-GPU smoke check of GPU-idle profiles: a PyTorch training loop starved by a slow data loader.

Run as root on a machine with an NVIDIA GPU, a driver and PyTorch with CUDA (`pip install torch`):

    .venv/bin/python bench/gpu_smoke.py [--seconds 60] [--phase 1.0]

It starts a collector and an agent (GPU polling at 0.5 s), runs the training loop for --seconds, then asks
the collector for the loop's profiles while its GPU was idle and while it was busy: CPU (where it ran) and
wall (where its working threads' time went, running or waiting). The loop alternates --phase seconds of
CPU-side loading (`slow_collate`, the GPU idle) with --phase seconds of training steps: NVML's utilization
is an average over its own sample period (1/6 to 1 s), so a phase shorter than that never reads idle. What
to see: `slow_collate` on top of the idle-time CPU profile and far less of it in the busy-time one. Exits 2
with a sentence when there is no GPU or no PyTorch.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

from common import free_port

REPO = Path(__file__).resolve().parent.parent

TRAINER = textwrap.dedent(
    """
    import sys, time, torch

    def slow_collate(seconds):  # the data loader's CPU-side work: Python, GPU idle meanwhile
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            [sum(i * i % 7 for i in range(20_000)) for _ in range(4)]

    def train_step(model, opt, x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()

    def train(model, opt, x, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(5):
                train_step(model, opt, x)
            torch.cuda.synchronize()

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 4096, device="cuda")
    seconds, phase = float(sys.argv[1]), float(sys.argv[2])
    end = time.time() + seconds
    while time.time() < end:
        slow_collate(phase)
        train(model, opt, x, phase)
    """
)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--phase", type=float, default=1.0, help="seconds of loading, then of training")
    args = parser.parse_args()
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True
    )
    if probe.returncode != 0:
        sys.stderr.write("bench/gpu_smoke.py: needs PyTorch with a CUDA GPU (torch.cuda.is_available())\n")
        return 2
    grpc_port, http_port, agent_port = free_port(), free_port(), free_port()
    cli = [sys.executable, "-m", "fleetprof.cli"]
    col = subprocess.Popen([*cli, "collector", "--grpc", f"127.0.0.1:{grpc_port}", "--http",
                            f"127.0.0.1:{http_port}"], cwd=REPO)  # fmt: skip
    agent = subprocess.Popen([*cli, "agent", "--collector", f"127.0.0.1:{grpc_port}", "--http",
                              f"127.0.0.1:{agent_port}", "--interval", "5", "--gpu-interval", "0.5"],
                             cwd=REPO)  # fmt: skip
    try:
        time.sleep(15)  # BPF compile and load, first GPU polls
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(args.seconds), str(args.phase)])
        trainer.wait()
        time.sleep(12)  # the last windows reach the collector
        base = f"http://127.0.0.1:{http_port}/api/v1"
        sel = {"query": f'{{pid="{trainer.pid}"}}', "since": "10m", "limit": 8}
        for kind, sort in (("cpu", "self"), ("wall", "total")):
            for state in ("idle", "busy"):
                q = {**sel, "gpu": state, "type": kind, "sort": sort}
                top = get_json(f"{base}/top?" + urllib.parse.urlencode(q))
                amount = f"{top['total']} samples" if kind == "cpu" else f"{top['total'] / 1e9:.2f} s"
                print(f"\n{kind} while the GPU was {state}: {amount} (by {sort})")
                for f in top["functions"]:
                    print(f"  {f['self_pct']:5.1f}% self  {f['total_pct']:5.1f}% total  {f['function']}")
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as r:
            gpu_lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("fleetprof_gpu_")]
        print("\n" + "\n".join(gpu_lines[:30]))
        return 0
    finally:
        for p in (agent, col):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
