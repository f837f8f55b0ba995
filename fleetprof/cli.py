"""The `fleetprof` command: collector, agent, demo, and the query commands top and flame."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetprof.client import QueryError, fetch, fetch_json

DEFAULT_COLLECTOR_GRPC = "127.0.0.1:7470"
DEFAULT_COLLECTOR_HTTP = "127.0.0.1:7471"
DEFAULT_AGENT_HTTP = "127.0.0.1:7472"
# Longest suffix first: ".speedscope.json" must not be read as ".json".
FLAME_FORMATS = {
    ".speedscope.json": "speedscope",
    ".grafana.json": "grafana",
    ".pb.gz": "pprof",
    ".pprof": "pprof",
    ".svg": "svg",
    ".html": "html",
    ".folded": "folded",
    ".txt": "folded",
    ".json": "json",
}
DIFF_FORMATS = {".grafana.json": "grafana", ".svg": "svg", ".json": "json"}


def format_of(path: str, formats: dict[str, str]) -> str | None:
    """The output format a file name asks for by its extension (case-insensitive), or None."""
    name = Path(path).name.lower()
    return next((fmt for ext, fmt in formats.items() if name.endswith(ext)), None)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {v}")
    return v


def _frequency(text: str) -> int:
    v = _positive_int(text)
    if v > 1000:
        raise argparse.ArgumentTypeError(f"{v} Hz is above the 1000 Hz limit (the default is 19 Hz)")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.5 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.5 and 3600 seconds, got {v:g}")
    return v


def _hostport(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text if host else f"127.0.0.1:{port}"


def _sample_fraction(text: str) -> int:
    from fleetprof.agent.syscalls import parse_sample_fraction

    try:
        return parse_sample_fraction(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _latency_duty(text: str):  # noqa: ANN202 - agent.syscalls.LatencyDuty, imported lazily
    from fleetprof.agent.syscalls import parse_latency_duty

    try:
        return parse_latency_duty(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _pod_label(text: str) -> str:
    from fleetprof.agent.kube.pods import parse_label_map

    try:
        parse_label_map([text])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _add_query_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collector", default=f"http://{DEFAULT_COLLECTOR_HTTP}", help="collector HTTP URL")
    p.add_argument(
        "--query", default="{}", help='label selector, e.g. \'{namespace="ml", comm=~"python.*"}\''
    )
    p.add_argument(
        "--since", default=None, help="window ending now (or at --until), e.g. 5m, 1h (default 5m)"
    )
    p.add_argument("--from", dest="from_", default=None, help="start: unix seconds, RFC 3339, or now-15m")
    p.add_argument("--until", default=None, help="end: unix seconds, RFC 3339, or now-5m (default now)")
    p.add_argument(
        "--gpu",
        choices=("idle", "busy"),
        default=None,
        help="only CPU samples taken while the process's GPUs were idle (busy)",
    )


def _range_params(args: argparse.Namespace) -> dict[str, str | None]:
    since = args.since
    if since is None and args.from_ is None:
        since = "5m"
    return {"query": args.query, "since": since, "from": args.from_, "until": args.until, "gpu": args.gpu}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetprof", description="Always-on eBPF fleet profiler")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("collector", help="run the collector (gRPC ingest, store, HTTP API and UI)")
    c.add_argument("--grpc", type=_hostport, default=DEFAULT_COLLECTOR_GRPC, help="gRPC listen address")
    c.add_argument("--http", type=_hostport, default=DEFAULT_COLLECTOR_HTTP, help="HTTP listen address")
    c.add_argument(
        "--retention",
        type=_seconds_or_duration,
        default=None,
        help="how long data is kept, e.g. 36h, 7d (>= 15m; default 1h in memory, 7d with --data-dir)",
    )
    c.add_argument(
        "--data-dir",
        default=None,
        help="keep profiles on disk here (DuckDB + write-ahead log); without it, in memory only",
    )
    c.add_argument(
        "--wal-fsync",
        action="store_true",
        help="fsync every batch before acknowledging it (survives power loss, not only a crash)",
    )
    c.add_argument(
        "--flush-interval",
        type=_seconds,
        default=10.0,
        help="seconds between moves of logged batches into the database (with --data-dir; default 10)",
    )
    c.add_argument(
        "--max-clock-skew",
        type=_seconds,
        default=300.0,
        help="refuse batches whose window ends more than this many seconds ahead of the collector's clock"
        " (default 300)",
    )

    a = sub.add_parser("agent", help="run the node agent (needs root: loads eBPF programs)")
    a.add_argument(
        "--collector", type=_hostport, default=DEFAULT_COLLECTOR_GRPC, help="collector gRPC HOST:PORT"
    )
    a.add_argument("--http", type=_hostport, default=DEFAULT_AGENT_HTTP, help="/metrics and /healthz address")
    a.add_argument(
        "--frequency", type=_frequency, default=19, help="CPU samples per second per CPU (default 19)"
    )
    a.add_argument(
        "--interval", type=_seconds, default=10.0, help="seconds between drains/batches (default 10)"
    )
    a.add_argument("--node", default="", help="node name (default $NODE_NAME or the hostname)")
    a.add_argument("--include-idle", action="store_true", help="also sample the idle task")
    # On by default: counting costs about what bcc syscount costs, and latency is timed only inside
    # duty-cycled windows (measured in bench/syscalls.py; see agent/syscalls.py).
    a.add_argument(
        "--syscalls",
        dest="syscalls",
        action="store_true",
        default=True,
        help="attach the syscall tracepoints: per-pod syscall counts and latency (default on)",
    )
    a.add_argument("--no-syscalls", dest="syscalls", action="store_false", help="do not trace syscalls")
    a.add_argument(
        "--syscall-latency-sample",
        type=_sample_fraction,
        default=None,
        metavar="1/N",
        help="inside timing windows, time one syscall in N (a power of two; 0 counts only; default 1/16)",
    )
    a.add_argument(
        "--syscall-latency-duty",
        type=_latency_duty,
        default=None,
        metavar="W/P",
        help="timing windows of W seconds every P seconds (default 1/10; 1/1 times all the time)",
    )
    a.add_argument(
        "--python",
        dest="python",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Python-aware stacks: show CPython 3.11-3.13 functions in place of the interpreter (default on)",
    )
    a.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig for pod metadata (default: in-cluster service account, else $KUBECONFIG, else off)",
    )
    a.add_argument("--no-kubernetes", action="store_true", help="do not ask the API server for pod metadata")
    a.add_argument(
        "--pod-label",
        type=_pod_label,
        action="append",
        default=[],
        metavar="KEY[=NAME]",
        help="pod label to profile as NAME (repeatable; default: app.kubernetes.io/name or app as app)",
    )
    a.add_argument(
        "--pod-resources-socket",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="kubelet PodResources socket, for GPU → pod ownership (absent: feature off)",
    )
    a.add_argument("--gpu", dest="gpu", action="store_true", default=True, help="poll GPUs (NVML; default)")
    a.add_argument("--no-gpu", dest="gpu", action="store_false", help="do not poll GPUs")
    a.add_argument(
        "--gpu-interval", type=_seconds, default=1.0, help="seconds between NVML polls (0.5-3600; default 1)"
    )

    d = sub.add_parser("demo", help="collector + agent on this machine, then a first `top`")
    d.add_argument("--frequency", type=_frequency, default=19)
    d.add_argument("--interval", type=_seconds, default=5.0)
    d.add_argument("--warmup", type=_seconds, default=15.0, help="seconds before the first top")

    t = sub.add_parser("top", help="hottest functions (self and total), or label groups with --by")
    _add_query_args(t)
    t.add_argument("--limit", type=_positive_int, default=20)
    t.add_argument(
        "--sort", choices=("self", "total"), default="self", help="rank functions by self or total samples"
    )
    t.add_argument(
        "--by", default=None, metavar="LABEL[,LABEL]", help="rank label groups instead, e.g. pod or node"
    )

    pods = sub.add_parser("pods", help="pods by CPU share for a selection")
    _add_query_args(pods)
    pods.add_argument("--limit", type=_positive_int, default=30)

    sc = sub.add_parser("syscalls", help="top syscalls by time and by count for a selection")
    _add_query_args(sc)
    sc.add_argument(
        "--by", default="syscall", help="group by these labels (e.g. pod,syscall; default syscall)"
    )
    sc.add_argument("--limit", type=_positive_int, default=15)

    f = sub.add_parser(
        "flame",
        help="write a flame graph or profile (.svg .html .pb.gz .speedscope.json .json .folded) "
        "or print folded stacks",
    )
    _add_query_args(f)
    f.add_argument(
        "-o",
        "--output",
        default=None,
        help="file to write; the extension picks the format: " + _exts(FLAME_FORMATS),
    )
    f.add_argument("--max-nodes", type=_positive_int, default=None, help="merge the tail beyond N frames")
    f.add_argument(
        "--gpu-idle",
        dest="gpu",
        action="store_const",
        const="idle",
        help="the CPU time spent while the processes' GPUs sat idle (same as --gpu idle)",
    )

    g = sub.add_parser(
        "gpus", help="per pod: GPU utilization, memory, idle fraction, and the CPU's top functions while idle"
    )
    _add_query_args(g)
    g.add_argument("--limit", type=_positive_int, default=30)
    g.add_argument("--functions", type=_positive_int, default=3, help="top idle-time functions per pod")

    df = sub.add_parser(
        "diff",
        help="compare two selections (two time ranges or two selectors): per-function share deltas",
        description="The baseline is --query/--since/--from/--until; the comparison is --query2/--since2/"
        "--from2/--until2, each defaulting to the baseline's (so give a second selector or a second range).",
    )
    _add_query_args(df)
    df.add_argument("--query2", default=None, help="comparison selector (default: --query)")
    df.add_argument("--since2", default=None, help="comparison window ending at --until2 (default now)")
    df.add_argument("--from2", default=None, help="comparison start")
    df.add_argument("--until2", default=None, help="comparison end")
    df.add_argument(
        "--sort", choices=("self", "total"), default="self", help="order by |delta| of self or total"
    )
    df.add_argument("--limit", type=_positive_int, default=20)
    df.add_argument(
        "-o",
        "--output",
        default=None,
        help="write a file instead: .svg (red/blue diff flame graph), .grafana.json (Grafana's diff frame), "
        ".json (the table)",
    )
    df.add_argument("--max-nodes", type=_positive_int, default=None, help="merge the tail beyond N frames")
    return parser


def _exts(formats: dict[str, str]) -> str:
    return ", ".join(formats)


def _seconds_or_duration(text: str) -> float:
    from fleetprof.collector.query.timerange import TimeRangeError, parse_duration

    try:
        v = parse_duration(text)
    except TimeRangeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if v < 15 * 60:
        raise argparse.ArgumentTypeError(f"must be at least 15m, got {text}")
    return v


# -- commands ------------------------------------------------------------------------------------
def cmd_collector(args: argparse.Namespace) -> int:
    from fleetprof.collector.main import Collector, CollectorConfig

    try:
        col = Collector(
            CollectorConfig(
                grpc=args.grpc,
                http=args.http,
                retention_s=args.retention,
                data_dir=args.data_dir,
                wal_fsync=args.wal_fsync,
                flush_s=args.flush_interval,
                max_clock_skew_s=args.max_clock_skew,
            )
        )
    except OSError as err:
        print(f"fleetprof collector: {err}", file=sys.stderr)
        return 1
    col.start()
    print(f"fleetprof collector: gRPC {args.grpc}, UI and API http://{args.http}/", flush=True)
    _wait_for_signal(col.stop)
    col.wait()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from fleetprof.agent.kernel import BpfUnavailable
    from fleetprof.agent.main import Agent, AgentConfig

    config = AgentConfig(
        collector=args.collector,
        http=args.http,
        frequency_hz=args.frequency,
        interval_s=args.interval,
        node=args.node,
        include_idle=args.include_idle,
        kubeconfig=args.kubeconfig,
        kubernetes=not args.no_kubernetes,
        pod_labels=tuple(args.pod_label),
        pod_resources_socket=args.pod_resources_socket,
        syscalls=args.syscalls,
        syscall_latency_sample_every=args.syscall_latency_sample,
        syscall_latency_duty=args.syscall_latency_duty,
        python=args.python,
        gpu=args.gpu,
        gpu_interval_s=args.gpu_interval,
    )
    from fleetprof.agent.kernel import missing_prerequisite
    from fleetprof.agent.kube.config import KubeConfigError

    problem = missing_prerequisite()  # before anything else: one sentence, nothing logged ahead of it
    if problem:
        print(f"fleetprof agent: {problem}", file=sys.stderr)
        return 1
    try:
        agent = Agent(config)
    except (OSError, KubeConfigError, ValueError) as err:
        print(f"fleetprof agent: cannot start: {err}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    try:
        agent.run()
    except BpfUnavailable as err:
        print(f"fleetprof agent: {err}", file=sys.stderr)
        return 1
    return 0


def _wait_for_signal(on_stop) -> None:  # noqa: ANN001
    signal.signal(signal.SIGTERM, lambda *_: on_stop())
    signal.signal(signal.SIGINT, lambda *_: on_stop())


def cmd_top(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit)}
    if args.by:
        print(format_groups(fetch_json(args.collector, "/api/v1/top", params | {"by": args.by})))
        return 0
    data = fetch_json(args.collector, "/api/v1/top", params | {"sort": args.sort})
    print(format_top(data))
    return 0


def format_groups(data: dict) -> str:
    """/api/v1/top?by=… as a table: one row per label-value group, heaviest first."""
    total, freq, by = data["total"], data.get("frequency_hz"), data["by"]
    cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
    lines = [f"{data['query']}  by {','.join(by)}  {total} samples{cpu}"]
    if not total:
        lines.append("no samples in this range")
        return "\n".join(lines)
    header = (*[b.upper() for b in by], "CPU%", "CPU_S", "SAMPLES")
    rows = [
        (
            *[g["labels"][b] or "-" for b in by],
            f"{g['pct']:.1f}%",
            f"{g['cpu_seconds']:.1f}" if g.get("cpu_seconds") is not None else "-",
            str(g["samples"]),
        )
        for g in data["groups"]
    ]
    return "\n".join(lines + _table(header, rows, align="l" * len(by) + "rrr"))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], align: str) -> list[str]:
    """Aligned text rows; align has one letter per column, "l" (left) or "r" (right)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = (c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True))
        out.append("  ".join(cells).rstrip())
    return out


def format_top(data: dict) -> str:
    total = data["total"]
    freq = data.get("frequency_hz")

    def clock(t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t))

    span = f"{clock(data['from'])}–{clock(data['until'])}"
    cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
    lines = [f"{data['query']}  {span}  {total} samples{cpu}"]
    if not total:
        lines.append("no samples in this range (is an agent running and pointed at this collector?)")
        return "\n".join(lines)
    lines.append(f"{'SELF%':>7} {'SELF':>8} {'TOTAL%':>7} {'TOTAL':>8}  FUNCTION")
    for fn in data["functions"]:
        name = fn["function"] + ("_[k]" if fn.get("kernel") else "")
        module = f"  [{fn['module']}]" if fn.get("module") else ""
        lines.append(
            f"{fn['self_pct']:6.1f}% {fn['self']:>8} {fn['total_pct']:6.1f}% {fn['total']:>8}  {name}{module}"
        )
    return "\n".join(lines)


POD_GROUP = ("namespace", "pod", "workload_kind", "workload", "node")


def cmd_pods(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit), "by": ",".join(POD_GROUP)}
    print(format_pods(fetch_json(args.collector, "/api/v1/top", params)))
    return 0


def format_pods(data: dict) -> str:
    total, freq = data["total"], data.get("frequency_hz")
    cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
    lines = [f"{data['query']}  {total} samples{cpu}"]
    if not total:
        lines.append("no samples in this range")
        return "\n".join(lines)
    rows = []
    for g in data["groups"]:
        lb = g["labels"]
        workload = f"{lb['workload_kind']}/{lb['workload']}" if lb.get("workload") else ""
        pod = lb["pod"] or "(host processes)"
        secs = f"{g['cpu_seconds']:.1f}" if g.get("cpu_seconds") is not None else "-"
        rows.append((lb["namespace"], pod, workload, lb["node"], f"{g['pct']:.1f}%", secs, str(g["samples"])))
    header = ("NAMESPACE", "POD", "WORKLOAD", "NODE", "CPU%", "CPU_S", "SAMPLES")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = (c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_gpus(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit), "functions": str(args.functions)}
    params.pop("gpu")
    print(format_gpus(fetch_json(args.collector, "/api/v1/gpus", params)))
    return 0


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def format_gpus(data: dict) -> str:
    lines = [f"{data['query']}  GPUs by pod (idle: below the agents' threshold, 5% by default)"]
    if not data["pods"]:
        lines.append("no pods on GPUs in this range")
        return "\n".join(lines)
    header = ("NAMESPACE", "POD", "GPUS", "UTIL", "MEMORY", "IDLE", "CPU WHILE IDLE")
    rows = []
    for p in data["pods"]:
        cpu = p["cpu_samples_gpu_idle"] + p["cpu_samples_gpu_busy"]
        mem = p["memory_used_bytes"]
        rows.append(
            (
                p["namespace"],
                p["pod"],
                ",".join(p["gpus"]),
                _pct(p["utilization_ratio"]),
                "-" if mem is None else f"{mem / 2**30:.1f}GiB",
                _pct(p["idle_ratio"]),
                _pct(p["cpu_samples_gpu_idle"] / cpu) if cpu else "-",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r, p in zip([header, *rows], [None, *data["pods"]], strict=True):
        cells = (c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("  ".join(cells).rstrip())
        for f in (p or {}).get("idle_top_functions", []):
            lines.append(f"    {f['self_pct']:5.1f}% of its CPU while idle: {f['function']}")
    return "\n".join(lines)


def cmd_syscalls(args: argparse.Namespace) -> int:
    base = _range_params(args) | {"by": args.by, "limit": str(args.limit)}
    by_time = fetch_json(args.collector, "/api/v1/syscalls", base | {"sort": "time"})
    by_count = fetch_json(args.collector, "/api/v1/syscalls", base | {"sort": "count"})
    print(format_syscalls(by_time, "time"))
    print()
    print(format_syscalls(by_count, "count"))
    return 0


def _seconds_text(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if v >= scale:
            return f"{v / scale:.1f}{unit}"
    return f"{v * 1e9:.0f}ns"


def format_syscalls(data: dict, sort: str) -> str:
    by = data["by"]
    lines = [f"{data['query']}  top syscalls by {sort}  ({data['total_count']} calls)"]
    if not data["syscalls"]:
        lines.append("no syscalls in this range")
        return "\n".join(lines)
    header = (*[b.upper() for b in by], "CALLS", "CALLS/S", "TIME", "P50", "P99")
    rows = [
        (
            *[r["labels"][b] or "-" for b in by],
            str(r["count"]),
            f"{r['rate_per_second']:.1f}",
            _seconds_text(r["total_seconds"]) if r["timed"] else "-",
            _seconds_text(r["p50_seconds"]),
            _seconds_text(r["p99_seconds"]),
        )
        for r in data["syscalls"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = (
            c.ljust(w) if i < len(by) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _format_or_complain(command: str, output: str, formats: dict[str, str]) -> str | None:
    fmt = format_of(output, formats)
    if fmt is None:
        print(
            f"fleetprof {command}: cannot tell the format of {output!r}: use one of {_exts(formats)}",
            file=sys.stderr,
        )
    return fmt


def _write(output: str, fmt: str, body: bytes) -> None:
    Path(output).write_bytes(body)
    print(f"wrote {output} ({fmt}, {len(body)} bytes)")


def cmd_flame(args: argparse.Namespace) -> int:
    fmt = "folded"
    if args.output:
        fmt = _format_or_complain("flame", args.output, FLAME_FORMATS)
        if fmt is None:
            return 2
    params = _range_params(args) | {"format": fmt}
    if args.max_nodes:
        params["max_nodes"] = str(args.max_nodes)
    body = fetch(args.collector, "/api/v1/profile", params)
    if args.output:
        _write(args.output, fmt, body)
    else:
        sys.stdout.write(body.decode())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    fmt = "json"
    if args.output:
        fmt = _format_or_complain("diff", args.output, DIFF_FORMATS)
        if fmt is None:
            return 2
    params = _range_params(args) | {
        "query2": args.query2,
        "since2": args.since2,
        "from2": args.from2,
        "until2": args.until2,
        "format": fmt,
        "sort": args.sort,
        "limit": str(args.limit),
    }
    if args.max_nodes:
        params["max_nodes"] = str(args.max_nodes)
    body = fetch(args.collector, "/api/v1/diff", params)
    if args.output:
        _write(args.output, fmt, body)
    else:
        print(format_diff(json.loads(body)))
    return 0


def format_diff(data: dict) -> str:
    """/api/v1/diff as a table: per function, its share of each profile and the change, in points."""

    def side(name: str) -> str:
        d = data[name]
        span = f"{time.strftime('%H:%M:%S', time.localtime(d['from']))}–"
        span += time.strftime("%H:%M:%S", time.localtime(d["until"]))
        return f"{name} {d['query']} {span} ({d['total']} samples)"

    lines = [side("baseline"), side("comparison")]
    if not data["functions"]:
        lines.append("no samples in either selection")
        return "\n".join(lines)
    kind = data["sort"]
    other = "total" if kind == "self" else "self"
    header = (f"BASE {kind.upper()}%", f"COMP {kind.upper()}%", "DELTA", f"{other.upper()} DELTA", "FUNCTION")
    rows = []
    for fn in data["functions"]:
        name = fn["function"] + ("_[k]" if fn.get("kernel") else "")
        module = f"  [{fn['module']}]" if fn.get("module") else ""
        rows.append(
            (
                f"{fn[f'baseline_{kind}_pct']:.2f}%",
                f"{fn[f'comparison_{kind}_pct']:.2f}%",
                f"{fn[f'{kind}_delta_pct']:+.2f}",
                f"{fn[f'{other}_delta_pct']:+.2f}",
                name + module,
            )
        )
    return "\n".join(lines + _table(header, rows, align="rrrrl"))


def cmd_demo(args: argparse.Namespace) -> int:
    """Collector and agent as child processes of this one; Ctrl-C stops both."""
    exe = [sys.executable, "-m", "fleetprof.cli"]
    collector = subprocess.Popen(exe + ["collector"])
    time.sleep(1.0)
    if collector.poll() is not None:
        print("fleetprof demo: the collector did not start (see above)", file=sys.stderr)
        return 1
    agent = subprocess.Popen(
        exe + ["agent", "--frequency", str(args.frequency), "--interval", str(args.interval)]
    )
    children = [agent, collector]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    url = f"http://{DEFAULT_COLLECTOR_HTTP}"
    print(
        f"fleetprof demo: UI {url}/   API {url}/api/v1/top   agent metrics http://{DEFAULT_AGENT_HTTP}/metrics"
    )
    print(f"fleetprof demo: first `fleetprof top` in {args.warmup:g} s; Ctrl-C stops both", flush=True)
    first_top_at = time.monotonic() + args.warmup
    give_up_at = first_top_at + 60  # the agent's BPF compile can take a while on a loaded machine
    shown = False
    rc = 0
    while not stopping:
        if any(p.poll() is not None for p in children):
            print("fleetprof demo: a child process exited; stopping", file=sys.stderr)
            rc = 1
            break
        now = time.monotonic()
        if not shown and now >= first_top_at:
            first_top_at = now + 1.0
            try:
                data = fetch_json(url, "/api/v1/top", {"since": "1m", "limit": "15"})
            except QueryError as err:
                data = None
                if now >= give_up_at:
                    shown = True
                    print(f"fleetprof demo: {err}", file=sys.stderr)
            if data is not None and (data["total"] > 0 or now >= give_up_at):
                shown = True
                print(format_top(data), flush=True)
                print(f"\nmore: fleetprof top --since 5m | fleetprof flame -o cpu.svg | {url}/", flush=True)
        time.sleep(0.2)
    for p in children:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in children:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    print("fleetprof demo: stopped")
    return rc


COMMANDS = {
    "collector": cmd_collector,
    "agent": cmd_agent,
    "demo": cmd_demo,
    "top": cmd_top,
    "pods": cmd_pods,
    "syscalls": cmd_syscalls,
    "gpus": cmd_gpus,
    "flame": cmd_flame,
    "diff": cmd_diff,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except QueryError as err:
        print(f"fleetprof {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
