"""What each `fleetprof` subcommand does: run the collector, the agent or the demo, or query a collector."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetprof.cli.parser import (
    DEFAULT_AGENT_HTTP,
    DEFAULT_COLLECTOR_HTTP,
    DIFF_FORMATS,
    FLAME_FORMATS,
    extensions,
    format_of,
)
from fleetprof.cli.tables import (
    format_cuda,
    format_diff,
    format_gpus,
    format_groups,
    format_pods,
    format_syscalls,
    format_top,
)
from fleetprof.client import Credentials, QueryError, fetch, fetch_json

POD_GROUP = ("namespace", "pod", "workload_kind", "workload", "node")


def _credentials(args: argparse.Namespace) -> Credentials:
    """--ca, and the API token from --token-file or $FLEETPROF_TOKEN."""
    token = os.environ.get("FLEETPROF_TOKEN") or None
    if args.token_file:
        from fleetprof.auth import TokenFile, TokenFileError

        try:
            token = TokenFile(args.token_file).current()
        except TokenFileError as err:
            raise QueryError(str(err)) from None
    return Credentials(ca=args.ca, token=token)


def _range_params(args: argparse.Namespace) -> dict[str, str | None]:
    since = args.since
    if since is None and args.from_ is None:
        since = "5m"
    params = {"query": args.query, "since": since, "from": args.from_, "until": args.until, "gpu": args.gpu}
    if getattr(args, "type", "cpu") != "cpu":
        params["type"] = args.type
    if getattr(args, "threads", None):
        params["threads"] = args.threads
    return params


def _warn(command: str, data: dict) -> dict:
    """Print the collector's warnings about a query (a label no series has, a selector that matched
    nothing) to stderr, where they do not mix with the table; returns `data`."""
    for warning in data.get("warnings") or ():
        print(f"fleetprof {command}: warning: {warning}", file=sys.stderr)
    return data


def cmd_collector(args: argparse.Namespace) -> int:
    from fleetprof.collector.main import Collector, CollectorConfig, tune_gc
    from fleetprof.httpserve import HttpLimits

    tune_gc()
    try:
        col = Collector(
            CollectorConfig(
                grpc=args.grpc,
                http=args.http,
                retention_s=args.retention,
                data_dir=args.data_dir,
                clickhouse=args.clickhouse,
                clickhouse_password_file=args.clickhouse_password_file,
                wal_fsync=args.wal_fsync,
                flush_s=args.flush_interval,
                max_clock_skew_s=args.max_clock_skew,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_client_ca=args.tls_client_ca,
                auth_token_file=args.auth_token_file,
                api_token_file=args.api_token_file,
                node_binding=args.node_binding,
                max_series_per_node=args.max_series_per_node,
                max_label_values=args.max_label_values,
                max_series_total=args.max_series_total,
                http_limits=HttpLimits(
                    max_connections=args.http_max_connections,
                    max_per_address=args.http_max_per_address,
                    request_deadline_s=args.http_request_deadline,
                ),
            )
        )
    # ValueError: TLS or token files that cannot be used, a ClickHouse that cannot be (named in the message)
    except (OSError, ValueError) as err:
        print(f"fleetprof collector: {err}", file=sys.stderr)
        return 1
    col.start()
    scheme = "https" if col.protections.tls else "http"
    print(f"fleetprof collector: gRPC {args.grpc}, UI and API {scheme}://{args.http}/", flush=True)
    _wait_for_signal(col.stop)
    col.wait()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from fleetprof.agent.kernel import BpfUnavailable
    from fleetprof.agent.main import Agent, AgentConfig

    try:
        tls = _client_tls(args)
        debuginfod = _debuginfod(args)
    except ValueError as err:
        print(f"fleetprof agent: {err}", file=sys.stderr)
        return 1
    config = AgentConfig(
        collector=args.collector.removeprefix("https://"),
        http=args.http,
        frequency_hz=args.frequency,
        interval_s=args.interval,
        node=args.node,
        include_idle=args.include_idle,
        scope=args.cgroup,
        kubeconfig=args.kubeconfig,
        kubernetes=not args.no_kubernetes,
        pod_labels=tuple(args.pod_label),
        pod_resources_socket=args.pod_resources_socket,
        syscalls=args.syscalls,
        syscall_latency_sample_every=args.syscall_latency_sample,
        syscall_latency_duty=args.syscall_latency_duty,
        python=args.python,
        unwind=args.unwind,
        unsymbolized=args.unsymbolized,
        debuginfod=debuginfod,
        **{
            k: v
            for k, v in (
                ("off_cpu", args.off_cpu),
                ("offcpu_sample_every", args.off_cpu_sample),
                ("offcpu_min_block_us", args.off_cpu_min_block),
                ("offcpu_exact_us", None if args.off_cpu_exact_ms is None else args.off_cpu_exact_ms * 1000),
                ("cuda_launch_sample_every", args.cuda_launch_sample),
            )
            if v is not None
        },
        gpu=args.gpu,
        cupti=args.cupti,
        cuda_probes=args.cuda_probes,
        gpu_interval_s=args.gpu_interval,
        tls=tls,
        auth_token_file=args.auth_token_file,
        metrics_token_file=args.metrics_token_file,
    )
    from fleetprof.agent.kernel import missing_prerequisite
    from fleetprof.agent.kube.config import KubeConfigError

    problem = missing_prerequisite()  # before anything else: one sentence, nothing logged ahead of it
    if problem:
        print(f"fleetprof agent: {problem}", file=sys.stderr)
        return 1
    try:
        agent = Agent(config)  # ValueError: also TLS or token files that cannot be used
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


def _debuginfod(args: argparse.Namespace):  # agent.symbols.debuginfod.DebuginfodConfig | None (lazily)
    """The debuginfod servers from --debuginfod-url, else $DEBUGINFOD_URLS (ValueError names a bad one)."""
    from fleetprof.agent.symbols.debuginfod import DEFAULT_MAX_ANSWER_BYTES, DebuginfodConfig, parse_urls

    if args.no_debuginfod:
        return None
    try:
        urls = tuple(args.debuginfod_url or ()) or parse_urls(os.environ.get("DEBUGINFOD_URLS", ""))
    except ValueError as err:
        raise ValueError(f"$DEBUGINFOD_URLS: {err}") from None
    if not urls:
        return None
    return DebuginfodConfig(
        urls,
        cache_dir=args.debuginfod_cache,
        max_cache_bytes=args.debuginfod_cache_size,
        max_answer_bytes=min(args.debuginfod_cache_size, DEFAULT_MAX_ANSWER_BYTES),
        timeout_s=args.debuginfod_timeout,
    )


def _client_tls(args: argparse.Namespace):  # fleetprof.tls.ClientTlsConfig, imported lazily
    """TLS to the collector when any TLS flag is given or --collector is an https:// URL (no --tls-ca: the
    system's CAs)."""
    by_url = args.collector.startswith("https://")
    if not (by_url or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return None
    from fleetprof.tls import ClientTlsConfig

    return ClientTlsConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def _wait_for_signal(on_stop) -> None:
    signal.signal(signal.SIGTERM, lambda *_: on_stop())
    signal.signal(signal.SIGINT, lambda *_: on_stop())


def cmd_top(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit)}
    if args.by:
        by = params | {"by": args.by}
        print(format_groups(_warn("top", fetch_json(args.collector, "/api/v1/top", by, _credentials(args)))))
        return 0
    # CPU samples and the CUDA types hold no waits; --sort total ranks frames
    by_frame = args.by_frame or args.type in ("cpu", "cuda_launch", "gpu") or args.sort != "self"
    params |= {"sort": args.sort, "lines": "1" if args.lines else None}
    params |= {"rank": "frame" if by_frame else "blocked"}
    data = fetch_json(args.collector, "/api/v1/top", params, _credentials(args))
    print(format_top(_warn("top", data)))
    return 0


def cmd_pods(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit), "by": ",".join(POD_GROUP)}
    print(format_pods(_warn("pods", fetch_json(args.collector, "/api/v1/top", params, _credentials(args)))))
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    params = _range_params(args) | {"limit": str(args.limit), "functions": str(args.functions)}
    params.pop("gpu")
    print(format_gpus(fetch_json(args.collector, "/api/v1/gpus", params, _credentials(args))))
    return 0


def cmd_syscalls(args: argparse.Namespace) -> int:
    base = _range_params(args) | {"by": args.by, "limit": str(args.limit)}
    by_time = fetch_json(args.collector, "/api/v1/syscalls", base | {"sort": "time"}, _credentials(args))
    by_count = fetch_json(args.collector, "/api/v1/syscalls", base | {"sort": "count"}, _credentials(args))
    print(format_syscalls(by_time, "time"))
    print()
    print(format_syscalls(by_count, "count"))
    return 0


def cmd_cuda(args: argparse.Namespace) -> int:
    base = _range_params(args) | {"by": args.by, "limit": str(args.limit)}
    by_time = fetch_json(args.collector, "/api/v1/cuda", base | {"sort": "time"}, _credentials(args))
    by_count = fetch_json(args.collector, "/api/v1/cuda", base | {"sort": "count"}, _credentials(args))
    print(format_cuda(by_time, "time"))
    print()
    print(format_cuda(by_count, "count"))
    return 0


def _output_format(command: str, output: str | None, formats: dict[str, str], default: str) -> str | None:
    """The format `output`'s extension names (`default` without a file); None, said on stderr, if none."""
    if not output:
        return default
    fmt = format_of(output, formats)
    if fmt is None:
        print(
            f"fleetprof {command}: cannot tell the format of {output!r}: use one of {extensions(formats)}",
            file=sys.stderr,
        )
    return fmt


def _write(output: str, fmt: str, body: bytes) -> None:
    Path(output).write_bytes(body)
    print(f"wrote {output} ({fmt}, {len(body)} bytes)")


def cmd_flame(args: argparse.Namespace) -> int:
    fmt = _output_format("flame", args.output, FLAME_FORMATS, "folded")
    if fmt is None:
        return 2
    params = _range_params(args) | {"format": fmt}
    if args.max_nodes:
        params["max_nodes"] = str(args.max_nodes)
    body = fetch(args.collector, "/api/v1/profile", params, credentials=_credentials(args))
    if args.output:
        _write(args.output, fmt, body)
    else:
        sys.stdout.write(body.decode())
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    fmt = _output_format("diff", args.output, DIFF_FORMATS, "json")
    if fmt is None:
        return 2
    second_range = any(v is not None for v in (args.since2, args.from2, args.until2))
    if not second_range and args.query2 in (None, args.query):
        print(
            "fleetprof diff: nothing to compare the baseline with: give a second selector (--query2 SELECTOR)"
            " or a second time range (--since2 DURATION, or --from2 TIME --until2 TIME); the baseline is"
            " --query with --since or --from/--until",
            file=sys.stderr,
        )
        return 2
    params = _range_params(args) | {
        "query2": args.query2,
        "since2": args.since2,
        "from2": args.from2,
        "until2": args.until2,
        "format": fmt,
        "sort": args.sort,
        "limit": str(args.limit),
        "lines": "1" if args.lines else None,
    }
    if args.max_nodes:
        params["max_nodes"] = str(args.max_nodes)
    body = fetch(args.collector, "/api/v1/diff", params, credentials=_credentials(args))
    if args.output:
        _write(args.output, fmt, body)
    else:
        print(format_diff(_warn("diff", json.loads(body))))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Collector and agent as child processes of this one; Ctrl-C stops the agent, which sends its last
    window, then the collector."""
    exe = [sys.executable, "-m", "fleetprof.cli"]
    collector = _demo_child(exe + ["collector"])
    time.sleep(1.0)
    if collector.poll() is not None:
        print("fleetprof demo: the collector did not start (see above)", file=sys.stderr)
        return 1
    agent = _demo_child(exe + ["agent", "--frequency", str(args.frequency), "--interval", str(args.interval)])
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
    # One at a time, the agent first: it drains its last window and waits (up to 5 s) for the collector
    # to acknowledge what it has sent, so nothing is left unacknowledged.
    for p, timeout_s in ((agent, 30), (collector, 15)):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    print("fleetprof demo: stopped")
    return rc


def _demo_child(argv: list[str]) -> subprocess.Popen:
    """A child in a process group of its own: Ctrl-C at the terminal signals the whole foreground group,
    and the collector would stop while the agent still sends ("collector unreachable", "1 unacknowledged
    at exit"). The demo alone gets it and stops its children in order; they die with it if it is killed."""
    from fleetprof.procname import die_with_parent

    return subprocess.Popen(argv, process_group=0, preexec_fn=die_with_parent)


COMMANDS = {
    "collector": cmd_collector,
    "agent": cmd_agent,
    "demo": cmd_demo,
    "top": cmd_top,
    "pods": cmd_pods,
    "syscalls": cmd_syscalls,
    "cuda": cmd_cuda,
    "gpus": cmd_gpus,
    "flame": cmd_flame,
    "diff": cmd_diff,
}
