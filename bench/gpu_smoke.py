"""Real-GPU smoke check of GPU-idle profiles: a PyTorch training loop starved by a slow data loader.

Run as root on a machine with an NVIDIA GPU, a driver and PyTorch with CUDA (`pip install torch`):

    .venv/bin/python bench/gpu_smoke.py [--seconds 60]

It starts a collector and an agent (GPU polling at 0.5 s), runs the training loop for --seconds, then asks
the collector for the loop's CPU profile while its GPU was idle and while it was busy, and prints the top
functions of each and the GPU idle fraction. What to see: `slow_collate` (the loader's Python work) on top of
the idle-time profile, and far less of it in the busy-time profile. Exits 2 with a sentence when there is no
GPU or no PyTorch. Not run yet on a GPU (no GPU machine was lent to the session that wrote it).
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

    def slow_collate(n):  # the data loader's CPU-side work: Python, GPU idle meanwhile
        return [sum(i * i % 7 for i in range(20_000)) for _ in range(n)]

    def train_step(model, opt, x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 4096, device="cuda")
    end = time.time() + float(sys.argv[1])
    while time.time() < end:
        slow_collate(8)
        for _ in range(20):
            train_step(model, opt, x)
    """
)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
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
        subprocess.run([sys.executable, "-c", TRAINER, str(args.seconds)], check=False)
        time.sleep(12)  # the last windows reach the collector
        base = f"http://127.0.0.1:{http_port}/api/v1"
        sel = {"query": '{comm=~"python.*"}', "since": "10m"}
        for state in ("idle", "busy"):
            top = get_json(f"{base}/top?" + urllib.parse.urlencode({**sel, "gpu": state, "limit": 8}))
            print(f"\nCPU while the GPU was {state}: {top['total']} samples")
            for f in top["functions"]:
                print(f"  {f['self_pct']:5.1f}% self  {f['total_pct']:5.1f}% total  {f['function']}")
        gpus = get_json(f"{base}/gpus?" + urllib.parse.urlencode({"since": "10m"}))
        print("\n" + json.dumps(gpus["pods"], indent=1)[:2000])
        return 0
    finally:
        for p in (agent, col):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
