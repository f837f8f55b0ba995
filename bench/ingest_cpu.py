"""Ingest's CPU per batch in process, without gRPC: where the durable collector's time goes at N% new stacks.

    .venv/bin/python bench/ingest_cpu.py [--batches 500] [--new-stacks 0.05] [--flush-every 250]
        [--memory | --clickhouse] [--profile FILE]

An IngestService over a DurableStore (or, with --memory, a MemoryStore) in this process, fed collector.py's
batches as bytes: each of 8 agents sends the 6 templates once (the store's first flush then writes their
definitions, as the bench's warm-up does), then `--batches` batches in which `--new-stacks` of the stacks
are new, a flush every `--flush-every`. Prints process CPU per batch (DuckDB's threads included), split
into ingest (parse, checks, decode, WAL, hot tier, pending chunk) and flush. One thread, so no GIL
hand-offs and no gRPC: compare it with collector.py's rows of the same store to see what those cost.

With --clickhouse the store is the ClickHouse store on a server this script starts on loopback (Debian's
clickhouse-server, as collector.py's ClickHouse rows): a batch is stored when its group's insert returns, so
the agents' batches go in from one thread per agent, as gRPC's workers would, and the CPU is this
process's (the server's own is collector.py's "ClickHouse CPU" column).
"""

from __future__ import annotations

import argparse
import cProfile
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# bench/collector.py's batches (it puts the repository on sys.path, after bench/, for what follows)
from collector import WINDOW, churned, make_templates
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.service import IngestService
from fleetprof.collector.model.ids import ContentIds
from fleetprof.collector.store.durable import DurableStore, content_key
from fleetprof.collector.store.memory import MemoryStore
from tests.support.clickhouse_servers import ClickHouse, scratch

AGENTS = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--new-stacks", type=float, default=0.05)
    ap.add_argument("--flush-every", type=int, default=250)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--memory", action="store_true", help="the in-memory store instead of --data-dir's")
    kind.add_argument("--clickhouse", action="store_true", help="the ClickHouse store (a server on loopback)")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the measured batches into FILE")
    ap.add_argument(
        "--stack-messages", action="store_true", help="stacks as Stack messages (older agents), not packed"
    )
    ap.add_argument("--no-frame-ids", action="store_true", help="packed stacks without the frames' ids")
    args = ap.parse_args()
    templates = make_templates(6, 3000, 300, packed=not args.stack_messages, frame_ids=not args.no_frame_ids)
    rng = random.Random(5)
    sequences = [0] * AGENTS

    def payload(agent: int, template: pb.Batch, churn: float) -> bytes:
        b = churned(template, rng, churn)  # as collector.py's agents
        sequences[agent] += 1
        now = time.time_ns()
        b.agent.node, b.agent.agent_id, b.sequence = f"node-{agent}", f"agent-{agent}", sequences[agent]
        b.start_unix_ns, b.end_unix_ns = now - WINDOW * 10**9, now
        return b.SerializeToString()

    directory = Path(tempfile.mkdtemp(prefix="fleetprof-bench-ingest-"))
    server = None
    try:
        ids = ContentIds(content_key(directory))
        if args.clickhouse:
            from fleetprof.collector.store.clickhouse import open_clickhouse, parse_url

            server = ClickHouse(scratch("bench-ingest-clickhouse")).start()
            store = open_clickhouse(parse_url(f"{server.url}/bench"), retention_s=7 * 86400)
            ids = store.ids
        elif args.memory:
            store = MemoryStore()
        else:
            store = DurableStore(directory, decode=Decoder(ids).decode_payload, ids=ids, background=False)
        service = IngestService(store, ids=ids)
        flush = getattr(store, "flush", lambda: None)
        for agent in range(AGENTS):
            for t in templates:
                p = payload(agent, t, 0.0)
                service.ingest(service.parse(p), p)
        flush()
        payloads = [payload(k % AGENTS, rng.choice(templates), args.new_stacks) for k in range(args.batches)]
        flush_s = 0.0
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        start = time.process_time()
        if args.clickhouse:  # each agent's batches in order on a thread of its own, as gRPC's workers
            with ThreadPoolExecutor(AGENTS) as pool:
                list(
                    pool.map(
                        lambda a: [service.ingest(service.parse(p), p) for p in payloads[a::AGENTS]],
                        range(AGENTS),
                    )
                )
        else:
            for k, p in enumerate(payloads):
                service.ingest(service.parse(p), p)
                if k % args.flush_every == args.flush_every - 1 or k == len(payloads) - 1:
                    f0 = time.process_time()
                    flush()
                    flush_s += time.process_time() - f0
        total_s = time.process_time() - start
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        n = len(payloads)
        print(
            f"{'memory' if args.memory else 'clickhouse' if args.clickhouse else 'durable'}, "
            f"{100 * args.new_stacks:g}% new stacks, {n} batches: "
            f"{1000 * total_s / n:.2f} ms CPU per batch = ingest {1000 * (total_s - flush_s) / n:.2f} "
            f"+ flush {1000 * flush_s / n:.2f}"
        )
        if hasattr(store, "close"):
            store.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
