"""Text tables for the query commands: the collector's JSON answers as aligned columns."""

from __future__ import annotations

import time


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], align: str) -> list[str]:
    """Aligned text rows; align has one letter per column, "l" (left) or "r" (right)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = (c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True))
        out.append("  ".join(cells).rstrip())
    return out


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def _seconds_text(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if v >= scale:
            return f"{v / scale:.1f}{unit}"
    return f"{v * 1e9:.0f}ns"


def _where(fn: dict) -> str:
    """A function row's module slot: "[module]", and for a kernel frame "[kernel]" (the agent's kernel
    modules read "[kernel]" or "[kernel] nvidia" already): kernel frames are marked here, not by the
    folded format's "_[k]" on the name."""
    module = fn.get("module") or ""
    if fn.get("kernel"):
        where = module if module.startswith("[kernel]") else f"[kernel] {module}".rstrip()
    else:
        where = f"[{module}]" if module else ""
    return f"  {where}" if where else ""


NO_DATA = "no samples in this range (is an agent running and pointed at this collector?)"
NO_MATCH = (
    "the selector matched nothing in this range (the range holds other data: see `fleetprof top --by comm`)"
)


def nothing_text(data: dict) -> str:
    """Why an answer holds nothing, by its "empty_reason": the selector matched nothing, or the range
    holds no data at all."""
    return NO_MATCH if data.get("empty_reason") == "no_match" else NO_DATA


def format_top(data: dict) -> str:
    total = data["total"]
    freq = data.get("frequency_hz")

    def clock(t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t))

    span = f"{clock(data['from'])}–{clock(data['until'])}"
    ns = data.get("unit") == "nanoseconds"
    if ns:  # off-CPU or wall time: values are nanoseconds
        lines = [f"{data['query']}  {span}  {_seconds_text(total / 1e9)} of {data['type']} time"]
        if data.get("rank") == "blocked":
            lines[0] += ", by where threads blocked in their own code (--by-frame: by frame)"
    else:
        cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
        lines = [f"{data['query']}  {span}  {total} samples{cpu}"]
    if not total:
        lines.append(nothing_text(data))
        return "\n".join(lines)

    def amount(v: int) -> str:
        return _seconds_text(v / 1e9) if ns else str(v)

    if data.get("rank") == "blocked":  # off-CPU or wall time by where threads blocked, and why
        rows = [
            (f"{fn['pct']:.1f}%", amount(fn["value"]), fn["reason"], f"{fn['function']}{_where(fn)}")
            for fn in data["functions"]
        ]
        return "\n".join(lines + _table(("SHARE", "TIME", "REASON", "WHERE IT BLOCKED"), rows, align="rrll"))
    lines.append(f"{'SELF%':>7} {'SELF':>8} {'TOTAL%':>7} {'TOTAL':>8}  FUNCTION")
    for fn in data["functions"]:
        lines.append(
            f"{fn['self_pct']:6.1f}% {amount(fn['self']):>8} {fn['total_pct']:6.1f}% "
            f"{amount(fn['total']):>8}  {fn['function']}{_where(fn)}"
        )
    return "\n".join(lines)


def format_groups(data: dict) -> str:
    """/api/v1/top?by=… as a table: one row per label-value group, heaviest first."""
    total, freq, by = data["total"], data.get("frequency_hz"), data["by"]
    if data.get("unit") == "nanoseconds":
        kind = data["type"]
        lines = [f"{data['query']}  by {','.join(by)}  {_seconds_text(total / 1e9)} of {kind} time"]
        header = (*[b.upper() for b in by], f"{kind.upper()}%", f"{kind.upper()}_S")
        amount: tuple = ()
    else:
        cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
        lines = [f"{data['query']}  by {','.join(by)}  {total} samples{cpu}"]
        header = (*[b.upper() for b in by], "CPU%", "CPU_S", "SAMPLES")
        amount = ("samples",)
    if not total:
        lines.append(nothing_text(data))
        return "\n".join(lines)
    rows = [
        (
            *[g["labels"][b] or "-" for b in by],
            f"{g['pct']:.1f}%",
            f"{g['seconds']:.1f}" if g.get("seconds") is not None else "-",
            *[str(g[a]) for a in amount],
        )
        for g in data["groups"]
    ]
    return "\n".join(lines + _table(header, rows, align="l" * len(by) + "r" * (2 + len(amount))))


def format_pods(data: dict) -> str:
    total, freq = data["total"], data.get("frequency_hz")
    cpu = f", {total / freq:.1f} s of CPU at {freq} Hz" if freq else ""
    lines = [f"{data['query']}  {total} samples{cpu}"]
    if not total:
        lines.append(nothing_text(data))
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
        if not (p or {}).get("idle_wall_seconds"):
            continue
        waits = p.get("idle_wall_top_waits")
        if waits is not None:  # where its threads ran or blocked, and why
            for f in waits:
                lines.append(
                    f"    {f['pct']:5.1f}% of its wall time while idle: {f['function']} ({f['reason']})"
                )
        else:  # a collector from before the ranking of waits: by frame
            for f in p.get("idle_wall_top_functions", []):
                lines.append(
                    f"    {f['self_pct']:5.1f}% of its wall time while idle (run or wait): {f['function']}"
                )
    return "\n".join(lines)


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
        rows.append(
            (
                f"{fn[f'baseline_{kind}_pct']:.2f}%",
                f"{fn[f'comparison_{kind}_pct']:.2f}%",
                f"{fn[f'{kind}_delta_pct']:+.2f}",
                f"{fn[f'{other}_delta_pct']:+.2f}",
                fn["function"] + _where(fn),
            )
        )
    return "\n".join(lines + _table(header, rows, align="rrrrl"))
