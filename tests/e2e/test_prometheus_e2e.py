"""A real Prometheus (Debian's `prometheus`) scrapes a real collector fed realistic batches over gRPC and a
real agent: the exposition scrapes without errors, the values Prometheus stores are the ones pushed (CPU
seconds per pod, syscall counts and latency buckets, GPU devices and per-pod GPU use), and every PromQL
expression of the Grafana dashboards parses, evaluates and finds data on the real server.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.batch import process_wire_id, stack_wire_id
from tests.conftest import REPO, RunningAgent, start_agent, start_collector, stop_agent
from tests.support.prometheus import (
    Prometheus,
    PrometheusQueryError,
    Target,
    require_prometheus,
    start_prometheus,
    stop_prometheus,
    wait_for,
)
from tests.support.wire import push

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
# Panels on the collector as Grafana's Pyroscope data source: not PromQL. tests/deploy/test_deploy.py sends
# their queries to a real collector as Grafana's data source does.
PYROSCOPE = "grafana-pyroscope-datasource"
COLLECTOR_JOB, AGENT_JOB = "fleetprof-collector", "fleetprof-agent"
NODE = "gpu-node-1"  # the node of the batches pushed here
AGENT_NODE = "test-node"  # conftest's start_agent --node; also the agent target's `node` label
FREQUENCY = 19
BATCHES = 2  # windows pushed per agent; the first is also resent once (a duplicate, not counted)


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    namespace: str  # "" for a host process
    pod: str
    container: str
    samples: int  # per batch
    syscalls: tuple[tuple[str, int, dict[int, int]], ...]  # (name, count, {log2 ns bucket: timed calls})


PROCS = (
    Proc(101, "python3", "ml", "trainer-0", "main", 190,
         (("read", 1000, {11: 60, 20: 2}), ("futex", 40, {19: 2, 35: 1}))),
    Proc(102, "python3", "ml", "trainer-0", "loader", 38, (("read", 200, {13: 12}),)),
    Proc(201, "nginx", "web", "web-0", "nginx", 57,
         (("epoll_wait", 500, {25: 31}), ("write", 300, {12: 19}))),
    Proc(1, "systemd", "", "", "", 19, (("read", 7, {}),)),
)  # fmt: skip


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    utilization: tuple[int, ...]  # percent, one per poll of the window
    memory_used: int
    owner: int  # index into PROCS of the one process using it
    pod_sm_percent: int
    pod_memory: int
    idle_polls: int  # of POLLS


MODEL = "NVIDIA H100 80GB HBM3"
POLLS = 3
GPUS = (
    Gpu(0, "GPU-8a1c2f3e-5b7d-4c1e-9f00-1a2b3c4d5e6f", (90, 80, 70), 30 << 30, 0, 80, 29 << 30, 1),
    Gpu(1, "GPU-51d0b7aa-0c3e-4d2f-8e11-6f5e4d3c2b1a", (2, 1, 0), 2 << 30, 2, 1, 2 << 30, 3),
)


def _timed_ns(hist: dict[int, int]) -> int:
    return sum(n * 3 * (1 << i) // 2 for i, n in hist.items())  # each call at its bucket's middle


def _energy_mj(seq: int, poll: int) -> int:
    return 10**9 + (seq * POLLS + poll) * 350_000


def fleet_batch(seq: int, agent_id: str, end_ns: int) -> pb.Batch:
    """One 1 s window of a GPU node: PROCS' samples and syscalls, GPUS with their pods' use."""
    strings: dict[str, int] = {"": 0}

    def sid(text: str) -> int:
        return strings.setdefault(text, len(strings))

    b = pb.Batch(
        agent=pb.AgentIdentity(node=NODE, agent_id=agent_id, boot_time_unix_ns=1),
        sequence=seq,
        start_unix_ns=end_ns - 10**9,
        end_unix_ns=end_ns,
        frequency_hz=FREQUENCY,
        syscall_latency_sample_every=16,
    )
    python = sid("/usr/bin/python3")
    b.stacks.append(
        pb.Stack(functions=[sid("main"), sid("train_step")], modules=[python, python], kernel_start=2)
    )
    b.stack_ids.append(stack_wire_id(["main", "train_step"], ["/usr/bin/python3"] * 2, 2))
    for i, p in enumerate(PROCS):
        labels = [("namespace", p.namespace), ("pod", p.pod), ("container", p.container)] if p.pod else []
        labels += [("container_id", f"cid-{p.pid}"), ("pod_uid", f"uid-{p.pod}")] if p.pod else []
        b.processes.append(
            pb.Process(
                pid=p.pid, comm=sid(p.comm), labels=[pb.Label(name=sid(k), value=sid(v)) for k, v in labels]
            )
        )
        b.process_ids.append(process_wire_id(p.pid, 0, p.comm, "", sorted(labels)))
        b.sample_columns.process.append(i)
        b.sample_columns.stack.append(0)
        b.sample_columns.count.append(p.samples)
        for name, count, hist in p.syscalls:
            log2 = [0] * 40
            for bucket, n in hist.items():
                log2[bucket] = n
            b.syscalls.append(
                pb.SyscallStats(
                    process=i,
                    syscall=sid(name),
                    count=count,
                    timed=sum(hist.values()),
                    timed_ns=_timed_ns(hist),
                    latency_log2_ns=log2,
                )
            )
    b.stats.CopyFrom(pb.SamplerStats(samples=sum(p.samples for p in PROCS), user_stack_missing=3))
    for g in GPUS:
        owner = PROCS[g.owner]
        samples = [
            pb.GpuSample(
                time_unix_ns=end_ns - (POLLS - poll) * 10**9 // POLLS,
                gpu_utilization_percent=util,
                memory_utilization_percent=40,
                memory_used_bytes=g.memory_used,
                memory_total_bytes=80 << 30,
                power_milliwatts=350_000,
                energy_millijoules=_energy_mj(seq, poll),
                temperature_celsius=61,
                sm_clock_mhz=1980,
            )
            for poll, util in enumerate(g.utilization)
        ]
        b.gpu_devices.append(
            pb.GpuDevice(
                index=g.index,
                uuid=sid(g.uuid),
                name=sid(MODEL),
                samples=samples,
                xid_errors=1 if g.index == 0 else 0,
                xid_codes=[79] if g.index == 0 else [],
                xid_watched=True,
                owner_namespace=sid(owner.namespace),
                owner_pod=sid(owner.pod),
                owner_container=sid(owner.container),
            )
        )
        b.gpu_processes.append(
            pb.GpuProcessUsage(
                process=g.owner,
                device=g.index,
                polls=POLLS,
                state_polls=POLLS,
                idle_polls=g.idle_polls,
                memory_used_bytes=g.pod_memory,
                sm_utilization_percent=g.pod_sm_percent,
                memory_utilization_percent=35,
            )
        )
    b.gpu_source.CopyFrom(pb.GpuSource(up=True, state=sid("up"), idle_below_percent=5))
    b.strings.extend(strings)  # dicts keep insertion order: the ids sid() handed out
    return b


# ---- the fleet: collector + agent + Prometheus scraping both -----------------------------------------


@dataclass
class Fleet:
    prom: Prometheus
    agent: RunningAgent


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_prometheus()
    with contextlib.ExitStack() as cleanup:
        col = start_collector()
        cleanup.callback(col.stop)
        grpc_target = f"127.0.0.1:{col.grpc_port}"
        agent_id, now = uuid.uuid4().hex, time.time_ns()
        batches = [fleet_batch(seq, agent_id, now - (BATCHES - seq) * 10**9) for seq in range(1, BATCHES + 1)]
        push(grpc_target, batches[:1])
        bad = fleet_batch(1, uuid.uuid4().hex, now)
        bad.sample_columns.stack[0] = 7
        with pytest.raises(grpc.RpcError):
            push(grpc_target, [bad])  # refused: gives fleetprof_ingest_rejected_batches_total a reason
        agent = start_agent(grpc_target, 99, 1.0)
        cleanup.callback(stop_agent, agent)
        prom = start_prometheus(
            [
                Target(COLLECTOR_JOB, f"127.0.0.1:{col.http_port}", honor_labels=True),
                # The agent ServiceMonitor's relabeling gives each agent target its node's name.
                Target(AGENT_JOB, f"127.0.0.1:{agent.http_port}", labels={"node": AGENT_NODE}),
            ],
            tmp_path_factory.mktemp("prometheus"),
        )
        cleanup.callback(stop_prometheus, prom)
        # The first window is scraped before the rest arrive, so rate() and increase() see them arrive.
        wait_for(prom, f'up{{job="{COLLECTOR_JOB}"}} == 1')
        push(grpc_target, batches[1:])
        push(grpc_target, batches[:1])  # an agent's resend after a lost ack: dropped as a duplicate
        pushed_at = time.time()
        wait_for(prom, f'timestamp(up{{job="{COLLECTOR_JOB}"}}) > {pushed_at + 0.05:.3f}')
        wait_for(prom, 'up{job="prometheus"} == 1')
        # The real agent has drained, shipped to the collector and been scraped at least twice.
        wait_for(prom, f'count_over_time(up{{job="{AGENT_JOB}"}}[1m]) >= 2')
        wait_for(prom, f'increase(fleetprof_agent_batches_acked_total{{job="{AGENT_JOB}"}}[1m]) > 0')
        wait_for(prom, f'fleetprof_cpu_seconds_total{{node="{AGENT_NODE}"}} > 0')
        yield Fleet(prom, agent)


def test_prometheus_is_installed() -> None:
    """Fails, never skips, where the binary is missing: CI must not pass without these tests."""
    require_prometheus()


# ---- the scrape itself -------------------------------------------------------------------------------


def test_prometheus_scrapes_collector_and_agent_without_errors(fleet: Fleet) -> None:
    prom = fleet.prom
    targets = prom.api("targets", state="active")["activeTargets"]
    assert {t["labels"]["job"] for t in targets} == {COLLECTOR_JOB, AGENT_JOB, "prometheus"}
    for t in targets:
        assert (t["health"], t["lastError"]) == ("up", ""), t["labels"]["job"]
    for job in (COLLECTOR_JOB, AGENT_JOB):
        assert prom.value(f'up{{job="{job}"}}') == 1
        assert prom.value(f'scrape_samples_scraped{{job="{job}"}}') > 0
    # Duplicate series in an exposition are dropped by Prometheus as duplicate timestamps, not refused.
    for counter in (
        "prometheus_target_scrapes_sample_duplicate_timestamp_total",
        "prometheus_target_scrapes_sample_out_of_order_total",
        "prometheus_target_scrapes_sample_out_of_bounds_total",
        "prometheus_target_scrapes_exceeded_sample_limit_total",
    ):
        assert prom.value(counter) == 0, counter


def test_honor_labels_keeps_the_collectors_pod_labels(fleet: Fleet) -> None:
    prom = fleet.prom
    assert prom.query('{exported_namespace=~".+"} or {exported_pod=~".+"} or {exported_node=~".+"}') == []
    series = prom.query('fleetprof_cpu_seconds_total{pod="web-0"}')
    assert [s["metric"] for s in series] == [
        {
            "__name__": "fleetprof_cpu_seconds_total",
            "job": COLLECTOR_JOB,
            "instance": series[0]["metric"]["instance"],
            "node": NODE,
            "namespace": "web",
            "pod": "web-0",
            "container": "nginx",
        }
    ]


# ---- values: what was pushed is what Prometheus holds ------------------------------------------------


def test_cpu_seconds_per_pod_are_samples_over_frequency(fleet: Fleet) -> None:
    expected: dict[str, float] = {}
    for p in PROCS:
        expected[p.pod] = expected.get(p.pod, 0.0) + BATCHES * p.samples / FREQUENCY
    got = fleet.prom.values_by(f'sum by (pod) (fleetprof_cpu_seconds_total{{node="{NODE}"}})', "pod")
    assert got == expected  # {"trainer-0": 24.0, "web-0": 6.0, "": 2.0}: the resend counted once
    main = f'fleetprof_cpu_seconds_total{{node="{NODE}", pod="trainer-0", container="main"}}'
    assert fleet.prom.value(main) == BATCHES * PROCS[0].samples / FREQUENCY


def test_syscall_counts_per_pod_match_the_pushed_counts(fleet: Fleet) -> None:
    by_pod: dict[str, int] = {}
    by_pod_syscall: dict[str, int] = {}
    for p in PROCS:
        for name, count, _ in p.syscalls:
            by_pod[p.pod] = by_pod.get(p.pod, 0) + BATCHES * count
            key = f"{p.pod}/{name}"
            by_pod_syscall[key] = by_pod_syscall.get(key, 0) + BATCHES * count
    prom = fleet.prom
    assert prom.values_by(f'sum by (pod) (fleetprof_syscalls_total{{node="{NODE}"}})', "pod") == by_pod
    got = {
        f"{r['metric'].get('pod', '')}/{r['metric']['syscall']}": float(r["value"][1])
        for r in prom.query(f'sum by (pod, syscall) (fleetprof_syscalls_total{{node="{NODE}"}})')
    }
    assert got == by_pod_syscall


def _pushed_histogram(pod: str, syscall: str) -> tuple[dict[int, int], int]:
    """The pushed log2 histogram of a pod's syscall (all its containers, all windows), and timed_ns."""
    hist: dict[int, int] = {}
    timed_ns = 0
    for p in PROCS:
        for name, _, h in p.syscalls:
            if (p.pod, name) == (pod, syscall):
                timed_ns += BATCHES * _timed_ns(h)
                for bucket, n in h.items():
                    hist[bucket] = hist.get(bucket, 0) + BATCHES * n
    return hist, timed_ns


@pytest.mark.parametrize("pod, syscall", [("trainer-0", "read"), ("trainer-0", "futex"), ("web-0", "write")])
def test_syscall_latency_buckets_are_the_pushed_log2_histogram(fleet: Fleet, pod: str, syscall: str) -> None:
    """Cumulative, `le` in seconds, +Inf = every timed call: a call in log2 bucket [2^i, 2^(i+1)) ns is
    under every bound >= 2^(i+1) ns (futex's 2^35 ns one is past the largest bound: +Inf only)."""
    hist, timed_ns = _pushed_histogram(pod, syscall)
    timed = sum(hist.values())
    sel = f'node="{NODE}", pod="{pod}", syscall="{syscall}"'
    buckets = fleet.prom.values_by(f"sum by (le) (fleetprof_syscall_duration_seconds_bucket{{{sel}}})", "le")
    assert buckets.pop("+Inf") == timed
    bounds = sorted(buckets, key=float)
    assert [float(b) for b in bounds] == pytest.approx([2.0**k / 1e9 for k in range(10, 36, 2)], rel=1e-6)
    for le in bounds:
        le_ns = round(float(le) * 1e9)
        assert buckets[le] == sum(n for i, n in hist.items() if 1 << (i + 1) <= le_ns), f"le={le}"
    assert fleet.prom.value(f"sum(fleetprof_syscall_duration_seconds_count{{{sel}}})") == timed
    assert fleet.prom.value(f"sum(fleetprof_syscall_duration_seconds_sum{{{sel}}})") == pytest.approx(
        timed_ns / 1e9, rel=1e-9
    )
    # Prometheus's own median lies in the bucket that holds the pushed median call.
    p50 = fleet.prom.value(
        f"histogram_quantile(0.5, sum by (le) (fleetprof_syscall_duration_seconds_bucket{{{sel}}}))"
    )
    seen = 0
    for i in sorted(hist):
        seen += hist[i]
        if seen >= timed / 2:
            break
    seconds = [float(b) for b in bounds]
    upper = min(s for s in seconds if round(s * 1e9) >= 1 << (i + 1))
    lower = max([s for s in seconds if s < upper], default=0.0)
    assert lower <= p50 <= upper, (p50, lower, upper)


def test_gpu_device_series_carry_their_identity_and_the_pushed_values(fleet: Fleet) -> None:
    prom = fleet.prom
    last_energy_j = _energy_mj(BATCHES, POLLS - 1) / 1000
    for g in GPUS:
        labels = {"node": NODE, "gpu": str(g.index), "uuid": g.uuid, "model": MODEL}
        expected = {
            "fleetprof_gpu_utilization_ratio": sum(g.utilization) / len(g.utilization) / 100,
            "fleetprof_gpu_memory_utilization_ratio": 0.4,
            "fleetprof_gpu_memory_used_bytes": g.memory_used,
            "fleetprof_gpu_memory_total_bytes": 80 << 30,
            "fleetprof_gpu_power_watts": 350.0,
            "fleetprof_gpu_temperature_celsius": 61,
            "fleetprof_gpu_sm_clock_hertz": 1.98e9,
            "fleetprof_gpu_energy_joules_total": last_energy_j,
            "fleetprof_gpu_xid_errors_total": BATCHES if g.index == 0 else 0,
        }
        for name, value in expected.items():
            (series,) = prom.query(f'{name}{{node="{NODE}", gpu="{g.index}"}}')
            assert {k: series["metric"].get(k) for k in labels} == labels, name
            assert float(series["value"][1]) == pytest.approx(value, rel=1e-9), name
    assert prom.value(f'fleetprof_gpu_source_up{{node="{NODE}"}}') == 1


def test_pod_gpu_series_name_the_pod_using_each_gpu(fleet: Fleet) -> None:
    prom = fleet.prom
    for g in GPUS:
        owner = PROCS[g.owner]
        labels = {"node": NODE, "namespace": owner.namespace, "pod": owner.pod, "container": owner.container}
        expected = {
            "fleetprof_pod_gpu_utilization_ratio": g.pod_sm_percent / 100,
            "fleetprof_pod_gpu_memory_used_bytes": g.pod_memory,
            "fleetprof_pod_gpu_idle_ratio": g.idle_polls / POLLS,
        }
        for name, value in expected.items():
            (series,) = prom.query(f'{name}{{node="{NODE}", gpu="{g.index}"}}')
            assert {k: series["metric"].get(k) for k in labels} == labels, name
            assert float(series["value"][1]) == pytest.approx(value, rel=1e-9), name


def test_the_real_agents_metrics_reach_prometheus(fleet: Fleet) -> None:
    prom = fleet.prom
    sel = f'job="{AGENT_JOB}", node="{AGENT_NODE}"'
    assert prom.value(f"fleetprof_agent_frequency_hertz{{{sel}}}") == fleet.agent.frequency
    assert prom.value(f"fleetprof_agent_drains_total{{{sel}}}") > 0
    assert prom.value(f"fleetprof_agent_samples_total{{{sel}}}") > 0
    assert prom.value(f"process_resident_memory_bytes{{{sel}}}") > 0
    assert prom.value(f"fleetprof_agent_drain_duration_seconds_count{{{sel}}}") > 0
    # What it sampled went through the collector into a per-node CPU series.
    assert prom.value(f'sum(fleetprof_cpu_seconds_total{{node="{AGENT_NODE}"}})') > 0


# ---- the dashboards' PromQL against the real server --------------------------------------------------

GRAFANA_DURATIONS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "__auto": "1m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


@dataclass(frozen=True)
class DashboardQuery:
    where: str  # dashboard file, panel title and refId, or the variable's name
    expr: str  # PromQL with Grafana's variables replaced
    variable_label: str | None = None  # for label_values(QUERY, LABEL): the label the variable lists


def _substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variables as "All" would set them: regex variables to their allValue (or .*)."""

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in GRAFANA_DURATIONS:
            return GRAFANA_DURATIONS[name]
        if name not in values:
            raise AssertionError(f"${name} in {expr!r} is not a Grafana built-in or a dashboard variable")
        return values[name]

    return _VARIABLE.sub(value, expr)


def dashboard_queries(path: Path) -> list[DashboardQuery]:
    d = json.loads(path.read_text())
    variables = d.get("templating", {}).get("list", [])
    values = {v["name"]: v.get("allValue") or ".*" for v in variables}
    out = []
    panels = list(d["panels"])
    while panels:
        p = panels.pop(0)
        panels.extend(p.get("panels", []))
        for t in p.get("targets", []):
            if (t.get("datasource") or p.get("datasource") or {}).get("type") == PYROSCOPE:
                continue
            if t.get("expr"):
                where = f"{path.name}: panel {p.get('title')!r} {t.get('refId', '')}"
                out.append(DashboardQuery(where, _substitute(t["expr"], values)))
    for v in variables:
        if v.get("type") != "query":
            continue
        q = (v["query"]["query"] if isinstance(v["query"], dict) else v["query"]).strip()
        where = f"{path.name}: variable ${v['name']}"
        # label_values() and query_result() are Grafana's, not PromQL: what Grafana asks Prometheus instead.
        if m := re.fullmatch(r"label_values\((.*),\s*(\w+)\s*\)", q, re.S):
            out.append(DashboardQuery(where, _substitute(f"group by ({m[2]}) ({m[1]})", values), m[2]))
        elif m := re.fullmatch(r"label_values\(\s*(\w+)\s*\)", q):
            out.append(DashboardQuery(where, f'group by ({m[1]}) ({{{m[1]}=~".+"}})', m[1]))
        elif m := re.fullmatch(r"query_result\((.*)\)", q, re.S):
            out.append(DashboardQuery(where, _substitute(m[1], values)))
        else:
            out.append(DashboardQuery(where, _substitute(q, values)))
    return out


QUERIES = [q for path in DASHBOARDS for q in dashboard_queries(path)]


def test_the_dashboards_have_queries_to_check() -> None:
    assert DASHBOARDS and len(QUERIES) >= 20
    assert not [q for q in QUERIES if "$" in q.expr or "[[" in q.expr]
    # The flame graph panels' queries are the collector's (labelSelector, no PromQL) and are left out here.
    assert not [q for q in QUERIES if "flame graph" in q.where.lower() or "gpus idle" in q.where.lower()]


def test_the_real_server_refuses_what_grafana_would_refuse(fleet: Fleet) -> None:
    """The check below can fail: a missing parenthesis, a variable left in, a wrong function."""
    for bad in (
        "sum by (pod) (rate(fleetprof_cpu_seconds_total[1m])",
        'fleetprof_cpu_seconds_total{node=~"$node"}[$__rate_interval]',
        "histogram_quantile(sum(fleetprof_syscall_duration_seconds_bucket))",
    ):
        with pytest.raises(PrometheusQueryError):
            fleet.prom.query(bad)


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.where)
def test_dashboard_expression_is_valid_promql(fleet: Fleet, q: DashboardQuery) -> None:
    try:
        fleet.prom.query(q.expr)
    except PrometheusQueryError as err:
        pytest.fail(f"{q.where}: Prometheus refuses {q.expr!r}: {err}")


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.where)
def test_dashboard_expression_finds_data_from_a_real_fleet(fleet: Fleet, q: DashboardQuery) -> None:
    """Against a collector with pods, syscalls and GPUs and a real agent, no panel or variable is empty:
    an expression that is valid but matches nothing (a wrong label, a renamed series) fails here."""
    result = fleet.prom.query(q.expr)
    assert result, f"{q.where}: {q.expr!r} returns no series"
    if q.variable_label:
        listed = {r["metric"].get(q.variable_label, "") for r in result} - {""}
        assert listed, f"{q.where}: no series of {q.expr!r} has a {q.variable_label} label"
    values = [float(r["value"][1]) for r in result]
    assert not all(math.isnan(v) for v in values) or "histogram_quantile" in q.expr, q.expr
