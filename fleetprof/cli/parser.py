"""The `fleetprof` command line: every subcommand's flags and the value types that check them."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

DEFAULT_COLLECTOR_GRPC = "127.0.0.1:7470"
DEFAULT_COLLECTOR_HTTP = "127.0.0.1:7471"
DEFAULT_AGENT_HTTP = "127.0.0.1:7472"
# The query commands' collector when --collector is not given (a URL or HOST:PORT, as --collector takes).
COLLECTOR_ENV = "FLEETPROF_COLLECTOR"
# Flags whose value may start with "-" ("--since -5m", "--from -1h"): argparse would read such a value as
# a flag of its own, so `dash_values` glues it on first ("--since=-5m").
DASH_VALUE_FLAGS = frozenset(("--since", "--since2", "--from", "--from2", "--until", "--until2"))
_DASH_VALUE = re.compile(r"-\d")
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


def extensions(formats: dict[str, str]) -> str:
    """The extensions a format table accepts, for help text and error messages."""
    return ", ".join(formats)


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


def _microseconds(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of microseconds, got {text!r}") from None
    if not 0 <= v <= 10_000_000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 10000000 microseconds, got {v}")
    return v


def _exact_ms(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of milliseconds, got {text!r}") from None
    if not 0 <= v <= 3_600_000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600000 milliseconds, got {v}")
    return v


def _frequency(text: str) -> int:
    v = _positive_int(text)
    if v > 1000:
        raise argparse.ArgumentTypeError(f"{v} Hz is above the 1000 Hz limit (the default is 19 Hz)")
    return v


def _cgroup_scope(text: str) -> object:
    from fleetprof.agent.scope import ScopeError, cgroup_scope

    try:
        return cgroup_scope(text)
    except ScopeError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--cgroup {text}: ")) from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.5 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.5 and 3600 seconds, got {v:g}")
    return v


def _bytes(text: str) -> int:
    """A size in bytes, with an optional K, M or G (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    number, unit = text.strip().upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        v = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {text!r}") from None
    if v < 1 << 20:
        raise argparse.ArgumentTypeError(f"must be at least 1M, got {text!r}")
    return v


def _debuginfod_url(text: str) -> str:
    from fleetprof.agent.symbols.debuginfod import parse_urls

    try:
        (url,) = parse_urls(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return url


def _hostport(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text if host else f"127.0.0.1:{port}"


def _grpc_target(text: str) -> str:
    """HOST:PORT, or a URL as the query commands take it: http://HOST:PORT (plaintext, read as HOST:PORT),
    https://HOST:PORT (kept so: TLS). A path has no meaning for gRPC and is refused."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        return _hostport(text)
    if scheme.lower() not in ("http", "https") or "/" in rest.rstrip("/"):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT, http://HOST:PORT or https://HOST:PORT, got {text!r}"
        )
    hostport = _hostport(rest.rstrip("/"))
    return f"https://{hostport}" if scheme.lower() == "https" else hostport


def _sample_fraction(text: str) -> int:
    from fleetprof.agent.syscalls import parse_sample_fraction

    try:
        return parse_sample_fraction(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _latency_duty(text: str):  # agent.syscalls.LatencyDuty, imported lazily
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


def _seconds_or_duration(text: str) -> float:
    from fleetprof.collector.query.timerange import TimeRangeError, parse_duration

    try:
        v = parse_duration(text)
    except TimeRangeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if v < 15 * 60:
        raise argparse.ArgumentTypeError(f"must be at least 15m, got {text}")
    return v


class _HelpWithDefaults(argparse.HelpFormatter):
    """--help shows each flag's default, unless its help text already says it or there is none to show
    (argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" and "(default: False)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default in (None, False, True, argparse.SUPPRESS)
            or default == []
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _collector_url(text: str) -> str:
    """The collector's HTTP API: a URL (http://HOST:PORT, https://HOST:PORT, with a path prefix behind a
    proxy) or HOST:PORT (then http://), as the agent's --collector is given."""
    value = text.strip().rstrip("/")
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme.lower() not in ("http", "https") or not rest or rest.startswith("/"):
            raise argparse.ArgumentTypeError(
                f"expected http://HOST:PORT, https://HOST:PORT or HOST:PORT, got {text!r}"
            )
        return f"{scheme.lower()}://{rest}"
    host, colon, port = value.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535 or "/" in value:
        raise argparse.ArgumentTypeError(
            f"expected http://HOST:PORT, https://HOST:PORT or HOST:PORT, got {text!r}"
        )
    return f"http://{host or '127.0.0.1'}:{port}"


def _since(text: str) -> str:
    """A window's length; "-5m" reads as "5m" (the last five minutes), as people write it."""
    return text[1:] if _DASH_VALUE.match(text) else text


def _time(text: str) -> str:
    """A time as the API reads it; "-1h" reads as "now-1h"."""
    return f"now{text}" if _DASH_VALUE.match(text) else text


def dash_values(argv: list[str]) -> list[str]:
    """argv with "--since -5m" written as "--since=-5m" (for each flag of DASH_VALUE_FLAGS followed by a
    value that starts with a dash and a digit), which argparse reads as the flag's value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg in DASH_VALUE_FLAGS and i + 1 < len(argv) and _DASH_VALUE.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _add_query_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--collector",
        type=_collector_url,
        default=os.environ.get(COLLECTOR_ENV) or f"http://{DEFAULT_COLLECTOR_HTTP}",
        metavar="URL",
        help=f"the collector's HTTP API: http(s)://HOST:PORT or HOST:PORT (default: ${COLLECTOR_ENV} when"
        f" set, else http://{DEFAULT_COLLECTOR_HTTP})",
    )
    p.add_argument(
        "--ca", default=None, metavar="FILE", help="CA certificate(s) to verify an https:// collector with"
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="API token sent as `Authorization: Bearer` (default: $FLEETPROF_TOKEN when set)",
    )
    p.add_argument(
        "--query",
        default="{}",
        metavar="SELECTOR",
        help='label selector, e.g. \'{namespace="ml", comm=~"python.*"}\' (default: {}, everything)',
    )
    p.add_argument(
        "--since",
        type=_since,
        default=None,
        metavar="DURATION",
        help="window ending now (or at --until), e.g. 5m, 1h, -5m (default 5m)",
    )
    p.add_argument(
        "--from",
        dest="from_",
        type=_time,
        default=None,
        metavar="TIME",
        help="start: unix seconds, RFC 3339, now-15m or -15m",
    )
    p.add_argument(
        "--until",
        type=_time,
        default=None,
        metavar="TIME",
        help="end: unix seconds, RFC 3339, now-5m or -5m (default now)",
    )
    p.add_argument(
        "--gpu",
        choices=("idle", "busy"),
        default=None,
        help="only CPU samples taken while the process's GPUs were idle (busy)",
    )


def _add_type_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--type",
        choices=("cpu", "offcpu", "wall", "cuda_launch", "gpu"),
        default="cpu",
        help="what to count: cpu (CPU samples), offcpu (nanoseconds threads spent switched out, by the stack "
        "they left with), wall (both in nanoseconds: CPU samples x period plus off-CPU time), cuda_launch "
        "(CUDA kernel launches by the stack that launched them, the kernel as the leaf), gpu (nanoseconds "
        "of GPU kernel time by launching stack; needs the CUPTI library in the workload). Folded output "
        "of offcpu, wall and gpu counts nanoseconds",
    )
    p.add_argument(
        "--threads",
        choices=("active", "all"),
        default=None,
        help="whose off-CPU time offcpu and wall count: all threads, or active ones (those that ran at least "
        "1%% of the time they ran or waited in a window; idle pools left out). Default: all for offcpu, "
        "active for wall",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetprof", description="Always-on eBPF fleet profiler", formatter_class=_HelpWithDefaults
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_parser(name: str, **kwargs: object) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_HelpWithDefaults, **kwargs)

    c = add_parser("collector", help="run the collector (gRPC ingest, store, HTTP API and UI)")
    c.add_argument(
        "--grpc",
        type=_hostport,
        default=DEFAULT_COLLECTOR_GRPC,
        metavar="HOST:PORT",
        help="gRPC listen address",
    )
    c.add_argument(
        "--http",
        type=_hostport,
        default=DEFAULT_COLLECTOR_HTTP,
        metavar="HOST:PORT",
        help="HTTP listen address",
    )
    c.add_argument(
        "--retention",
        type=_seconds_or_duration,
        default=None,
        metavar="DURATION",
        help="how long data is kept, e.g. 36h, 7d (>= 15m; default 1h in memory, 7d with --data-dir or "
        "--clickhouse)",
    )
    where = c.add_mutually_exclusive_group()
    where.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="keep profiles on disk here (DuckDB + write-ahead log); without it, in memory only",
    )
    where.add_argument(
        "--clickhouse",
        default=None,
        metavar="URL",
        help="keep profiles in ClickHouse, shared by every collector given the same URL: "
        "clickhouse://[user[:password]@]host[:port][,host[:port]...]/database"
        "[?cluster=NAME&quorum=N&secure=1&ca=FILE] (see docs/clickhouse.md)",
    )
    c.add_argument(
        "--clickhouse-password-file",
        default=None,
        metavar="FILE",
        help="the ClickHouse user's password (one line), instead of one in the --clickhouse URL",
    )
    c.add_argument(
        "--wal-fsync",
        action="store_true",
        help="fsync every batch before acknowledging it (survives power loss, not only a crash)",
    )
    c.add_argument(
        "--flush-interval",
        metavar="SECONDS",
        type=_seconds,
        default=10.0,
        help="seconds between moves of logged batches into the database (with --data-dir; default 10)",
    )
    c.add_argument(
        "--max-clock-skew",
        metavar="SECONDS",
        type=_seconds,
        default=300.0,
        help="refuse batches whose window ends more than this many seconds ahead of the collector's clock"
        " (default 300)",
    )
    c.add_argument(
        "--tls-cert", default=None, metavar="FILE", help="serve gRPC and HTTP over TLS: certificate"
    )
    c.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert")
    c.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="FILE",
        help="mutual TLS: agents must present a client certificate signed by this CA",
    )
    c.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help="agents must send `authorization: Bearer TOKEN` with a token from this file (one per line;"
        " read again when it changes)",
    )
    c.add_argument(
        "--api-token-file",
        default=None,
        metavar="FILE",
        help="every HTTP endpoint but /healthz needs `Authorization: Bearer TOKEN` (or Basic, the token as"
        " password) with a token from this file (one per line; read again when it changes)",
    )
    c.add_argument(
        "--http-max-connections",
        type=int,
        default=512,
        metavar="N",
        help="open HTTP connections, all clients together; past it the one that waited longest for its"
        " request is closed (default 512)",
    )
    c.add_argument(
        "--http-max-per-address",
        type=int,
        default=64,
        metavar="N",
        help="open HTTP connections from one client address, more get a 503 at once (default 64; raise it"
        " behind a proxy that sends every client's requests from one address)",
    )
    c.add_argument(
        "--http-request-deadline",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="an HTTP request (TLS handshake, headers and body) must arrive whole within S seconds of its"
        " first byte, else 408 (default 10)",
    )
    c.add_argument(
        "--node-binding",
        choices=("certificate", "none"),
        default="certificate",
        help="with --tls-client-ca: `certificate` (default) refuses a batch whose node the agent's client"
        " certificate does not name (its CN, kubelet's system:node:NAME, or a DNS name); `none` for one"
        " certificate shared by every agent",
    )
    c.add_argument(
        "--max-series-per-node",
        type=int,
        default=20_000,
        metavar="N",
        help="refuse a node's batch that would give it more than N process label sets within an hour"
        " (default 20000)",
    )
    c.add_argument(
        "--max-label-values",
        type=int,
        default=5_000,
        metavar="N",
        help="refuse a node's batch that would give one of its labels (pod, container, ...) more than N"
        " distinct values within an hour (default 5000)",
    )
    c.add_argument(
        "--max-series-total",
        type=int,
        default=250_000,
        metavar="N",
        help="refuse batches that would make all nodes together hold more than N label sets (default 250000:"
        " ~800 nodes of 300 processes; raise it, and the collector's memory, for more)",
    )

    a = add_parser("agent", help="run the node agent (needs root: loads eBPF programs)")
    a.add_argument(
        "--collector",
        type=_grpc_target,
        default=DEFAULT_COLLECTOR_GRPC,
        metavar="HOST:PORT",
        help="the collector's gRPC address: HOST:PORT, or http://HOST:PORT, or https://HOST:PORT (TLS, with"
        " the system's CAs unless --tls-ca)",
    )
    a.add_argument(
        "--http",
        type=_hostport,
        default=DEFAULT_AGENT_HTTP,
        metavar="HOST:PORT",
        help="/metrics and /healthz address",
    )
    a.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="connect to the collector over TLS, trusting this CA"
    )
    a.add_argument(
        "--tls-cert", default=None, metavar="FILE", help="client certificate for mutual TLS (with --tls-key)"
    )
    a.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert")
    a.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="the name to check the collector's certificate against (default: the --collector host)",
    )
    a.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help="send `authorization: Bearer TOKEN`, the file's first line (read again when it changes)",
    )
    a.add_argument(
        "--metrics-token-file",
        default=None,
        metavar="FILE",
        help="/metrics needs `Authorization: Bearer TOKEN` with a token from this file (/healthz stays open)",
    )
    a.add_argument(
        "--frequency", type=_frequency, default=19, metavar="HZ", help="CPU samples per second per CPU"
    )
    a.add_argument(
        "--interval", type=_seconds, default=10.0, metavar="SECONDS", help="seconds between drains/batches"
    )
    a.add_argument(
        "--node", default="", metavar="NAME", help="node name (default $NODE_NAME or the hostname)"
    )
    a.add_argument("--include-idle", action="store_true", help="also sample the idle task")
    a.add_argument(
        "--cgroup",
        type=_cgroup_scope,
        default=None,
        metavar="PATH",
        help="profile only the tasks of this cgroup (v2) and its descendants, e.g. a systemd slice "
        "(default: every task of the node)",
    )
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
        "--off-cpu",
        dest="off_cpu",
        action="store_true",
        default=None,
        help="record off-CPU time on sched:sched_switch: where threads wait, by stack (default on; "
        "costs measured in bench/offcpu.py)",
    )
    a.add_argument("--no-off-cpu", dest="off_cpu", action="store_false", help="do not record off-CPU time")
    a.add_argument(
        "--off-cpu-sample",
        type=_positive_int,
        default=None,
        metavar="N",
        help="record one context switch in N, its time scaled by N (default: the measured one)",
    )
    a.add_argument(
        "--off-cpu-min-block",
        type=_microseconds,
        default=None,
        metavar="US",
        help="drop waits shorter than US microseconds (default: the measured one)",
    )
    a.add_argument(
        "--off-cpu-exact-ms",
        type=_exact_ms,
        default=None,
        metavar="MS",
        help="record every wait of MS milliseconds or more exactly, once, with its stack, whatever the"
        " sampling; 0: off (default: 10)",
    )
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
        "--unwind",
        choices=("eh_frame", "fp"),
        default="eh_frame",
        help="how user stacks are walked: eh_frame (by the files' call-frame information, for code built "
        "without frame pointers; frame pointers where a file has none) or fp (frame pointers only)",
    )
    a.add_argument(
        "--unsymbolized",
        choices=("module", "address"),
        default="module",
        help="code of a file without symbols (stripped, no debug file found): one frame per file, named "
        "after it (module), or one per address, [unknown] (FILE+0xOFFSET), to look up by hand (address)",
    )
    a.add_argument(
        "--debuginfod-url",
        type=_debuginfod_url,
        action="append",
        default=None,
        metavar="URL",
        help="a debuginfod server to ask for the debug files of stripped binaries (repeatable; default: "
        "$DEBUGINFOD_URLS, space-separated; neither: none asked)",
    )
    a.add_argument(
        "--no-debuginfod",
        action="store_true",
        help="ask no debuginfod server, whatever $DEBUGINFOD_URLS says",
    )
    a.add_argument(
        "--debuginfod-cache",
        default="/var/cache/fleetprof/debuginfod",
        metavar="DIR",
        help="where debug files from debuginfod are kept",
    )
    a.add_argument(
        "--debuginfod-cache-size",
        type=_bytes,
        default=1 << 30,
        metavar="SIZE",
        help="the most the debuginfod cache holds, e.g. 512M or 2G (least recently used out first; "
        "default 1G)",
    )
    a.add_argument(
        "--debuginfod-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="the longest one answer from a debuginfod server may take",
    )
    a.add_argument(
        "--kubeconfig",
        default=None,
        metavar="FILE",
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
        metavar="PATH",
        help="kubelet PodResources socket, for GPU → pod ownership (absent: feature off)",
    )
    a.add_argument("--gpu", dest="gpu", action="store_true", default=True, help="poll GPUs (NVML; default)")
    a.add_argument("--no-gpu", dest="gpu", action="store_false", help="do not poll GPUs")
    a.add_argument(
        "--no-cupti",
        dest="cupti",
        action="store_false",
        help="do not read the GPU activity of processes that load fleetprof's CUPTI library",
    )
    a.add_argument(
        "--no-cuda-probes",
        dest="cuda_probes",
        action="store_false",
        help="no uprobes on the CUDA runtime, driver and NCCL (kernel launches, CUDA call latency)",
    )
    a.add_argument(
        "--cuda-launch-sample",
        type=int,
        default=None,
        metavar="N",
        help="walk the stack of 1 CUDA kernel launch in N (every launch is counted; default 8)",
    )
    a.add_argument(
        "--gpu-interval",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between NVML polls (0.5-3600)",
    )

    d = add_parser("demo", help="collector + agent on this machine, then a first `top`")
    d.add_argument(
        "--frequency",
        type=_frequency,
        default=19,
        metavar="HZ",
        help="the agent's CPU samples per second per CPU",
    )
    d.add_argument(
        "--interval",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="the agent's seconds between batches",
    )
    d.add_argument(
        "--warmup", type=_seconds, default=15.0, metavar="SECONDS", help="seconds before the first top"
    )

    t = add_parser("top", help="hottest functions (self and total), or label groups with --by")
    _add_query_args(t)
    _add_type_arg(t)
    t.add_argument("--limit", type=_positive_int, default=20, metavar="N", help="rows to print")
    t.add_argument(
        "--sort",
        choices=("self", "total"),
        default="self",
        help="rank functions by self or total samples (offcpu and wall: total ranks by frame)",
    )
    t.add_argument(
        "--by-frame",
        action="store_true",
        help="offcpu and wall: rank functions by frame (self and total), as for cpu, instead of by where each"
        " thread blocked in its own code and why (read, futex, page fault, preempted, ...)",
    )
    t.add_argument(
        "--lines",
        action="store_true",
        help="a row per Python source line (default: one per function, its lines merged)",
    )
    t.add_argument(
        "--by",
        default=None,
        metavar="LABEL[,LABEL]",
        help="rank label groups instead, e.g. pod or node (by pod, a process outside any pod counts as"
        " comm:NAME)",
    )

    pods = add_parser("pods", help="pods by CPU share for a selection")
    _add_query_args(pods)
    pods.add_argument("--limit", type=_positive_int, default=30, metavar="N", help="pods to print")

    sc = add_parser("syscalls", help="top syscalls by time and by count for a selection")
    _add_query_args(sc)
    sc.add_argument(
        "--by", default="syscall", help="group by these labels (e.g. pod,syscall; default syscall)"
    )
    sc.add_argument(
        "--limit", type=_positive_int, default=15, metavar="N", help="rows to print in each table"
    )

    cu = add_parser(
        "cuda", help="top CUDA API calls (synchronize, copies, allocations, NCCL) by time and count"
    )
    _add_query_args(cu)
    cu.add_argument(
        "--by", default="namespace,pod,call", help="group by these labels (call is the CUDA function's name)"
    )
    cu.add_argument(
        "--limit", type=_positive_int, default=15, metavar="N", help="rows to print in each table"
    )

    f = add_parser(
        "flame",
        help="write a flame graph or profile (.svg .html .pb.gz .speedscope.json .json .folded) "
        "or print folded stacks",
    )
    _add_query_args(f)
    _add_type_arg(f)
    f.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="file to write; the extension picks the format: "
        + extensions(FLAME_FORMATS)
        + " (default: folded stacks on stdout)",
    )
    f.add_argument(
        "--max-nodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="merge the tail beyond N frames (default: the collector's, 2048)",
    )
    f.add_argument(
        "--gpu-idle",
        dest="gpu",
        action="store_const",
        const="idle",
        help="the CPU time spent while the processes' GPUs sat idle (same as --gpu idle)",
    )

    g = add_parser(
        "gpus", help="per pod: GPU utilization, memory, idle fraction, and the CPU's top functions while idle"
    )
    _add_query_args(g)
    g.add_argument("--limit", type=_positive_int, default=30, metavar="N", help="pods to print")
    g.add_argument("--functions", type=_positive_int, default=3, help="top idle-time functions per pod")

    df = add_parser(
        "diff",
        help="compare two selections (two time ranges or two selectors): per-function share deltas",
        description="The baseline is --query/--since/--from/--until; the comparison is --query2/--since2/"
        "--from2/--until2, each defaulting to the baseline's (so give a second selector or a second range).",
    )
    _add_query_args(df)
    _add_type_arg(df)
    df.add_argument(
        "--query2", default=None, metavar="SELECTOR", help="comparison selector (default: --query)"
    )
    df.add_argument(
        "--since2",
        type=_since,
        default=None,
        metavar="DURATION",
        help="comparison window ending at --until2 (default: the baseline's range)",
    )
    df.add_argument("--from2", type=_time, default=None, metavar="TIME", help="comparison start")
    df.add_argument("--until2", type=_time, default=None, metavar="TIME", help="comparison end (default now)")
    df.add_argument(
        "--sort", choices=("self", "total"), default="self", help="order by |delta| of self or total"
    )
    df.add_argument("--limit", type=_positive_int, default=20, metavar="N", help="functions to print")
    df.add_argument(
        "--lines",
        action="store_true",
        help="a row per Python source line (default: one per function, its lines merged; the flame graph"
        " keeps lines)",
    )
    df.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="write a file instead: .svg (red/blue diff flame graph), .grafana.json (Grafana's diff frame), "
        ".json (the table)",
    )
    df.add_argument(
        "--max-nodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="merge the tail beyond N frames (default: the collector's, 2048)",
    )
    return parser
