"""Kill -9 the collector (with --data-dir) at random moments while an agent's shipper pushes numbered
batches: after the last restart every sample is there exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from pathlib import Path

from fleetprof.agent.shipper import Shipper
from tests.conftest import free_port
from tests.support.collector_process import kill9, start_collector_process
from tests.support.wire import make_batch


def test_kill_9_at_random_moments_loses_and_doubles_nothing(tmp_path: Path) -> None:
    rng = random.Random(os.getpid())
    grpc_port, http_port = free_port(), free_port()
    proc = start_collector_process(tmp_path, grpc_port, http_port)
    shipper = Shipper(f"127.0.0.1:{grpc_port}", max_batches=1000, backoff_s=(0.05, 0.3))
    shipper.start()
    expected = 0
    kills = 0
    pending_at_kill = []
    try:
        for round_ in range(4):
            # Each batch carries a different number of samples, so a lost or doubled one shows in the total.
            for _ in range(rng.randrange(30, 60)):
                count = rng.randrange(1, 1000)
                shipper.submit(make_batch(0, "durability-agent", count=count))
                expected += count
                time.sleep(rng.uniform(0, 0.02))
            if round_ < 3:
                if round_ == 0:  # a burst, then the kill at once: batches are in flight
                    for _ in range(20):
                        count = rng.randrange(1, 1000)
                        shipper.submit(make_batch(0, "durability-agent", count=count))
                        expected += count
                else:
                    time.sleep(rng.uniform(0, 0.3))
                pending_at_kill.append(shipper.pending())
                kill9(proc)  # at a random moment: mid-stream, mid-flush, or idle
                kills += 1
                proc = start_collector_process(tmp_path, grpc_port, http_port)
        assert shipper.flush(60), f"{shipper.pending()} batches never acknowledged"
        assert shipper.stats.batches_dropped == 0 and shipper.stats.batches_rejected == 0
        kill9(proc)  # even the last acknowledged batches survive without a clean stop
        proc = start_collector_process(tmp_path, grpc_port, http_port)
        q = "query=%7B%7D&since=2h&limit=1"
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/api/v1/top?{q}", timeout=30) as r:
            total = json.loads(r.read())["total"]
        assert kills == 3 and max(pending_at_kill) > 0, pending_at_kill  # a kill hit unacknowledged batches
        assert total == expected
    finally:
        shipper.stop(flush_timeout_s=0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            proc.stderr.close()
