"""Kubernetes attribution end to end: real cgroups, a real workload inside them, real eBPF samples, pod
metadata from a fake API server (real HTTP, real JSON shapes), labels read back from the collector."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    RunningAgent,
    RunningCollector,
    fleetprof,
    own_cgroup,
    samples_of,
    settled_profile,
    start_agent,
    start_collector,
    stop_agent,
    wait_until,
)
from tests.support.cpu_time import CPU_BOUND_TIMEOUT_S
from tests.support.fake_apiserver import FakeApiServer, event, make_pod

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

NODE = "test-node"
V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_HIERARCHY = next(
    (
        p
        for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
        if (p / "cgroup.procs").exists() and (p / "cgroup.controllers").exists()
    ),
    None,
)


def v2_pods_root() -> Path | None:
    """Where the fake pods' v2 cgroups go: below this pytest process's own cgroup, where its agent, scoped
    to it, samples them (the agent reads pod and container from anywhere in the path, as under nested
    Kubernetes); else the hierarchy's root, with a node-wide agent. A node-wide agent samples, describes
    and tables every process of the busy test machine: most of what the cluster's agent cost."""
    return own_cgroup() or V2_HIERARCHY


@dataclass
class Cluster:
    api: FakeApiServer
    collector: RunningCollector
    agent: RunningAgent


@contextlib.contextmanager
def kube_cluster(tmp_path_factory: pytest.TempPathFactory, *agent_args: str) -> Iterator[Cluster]:
    """A fake API server, a collector, and an agent (99 Hz, 1 s windows) that lists and watches its pods
    through a kubeconfig naming the server; `agent_args` added to the agent's."""
    with FakeApiServer() as api:
        kubeconfig = tmp_path_factory.mktemp("kube") / "config"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {api.url}\n"
            "users:\n- name: agent\n  user:\n    token: test-token\n"
            "contexts:\n- name: test\n  context:\n    cluster: fake\n    user: agent\n"
        )
        col = start_collector()
        agent = start_agent(  # scoped to this process's cgroup, where the pods' cgroups are (v2_pods_root)
            f"127.0.0.1:{col.grpc_port}", 99, 1.0, "--kubeconfig", str(kubeconfig), *agent_args
        )
        try:
            wait_until(lambda: api.watches(), 30, "the agent to list and watch pods")
            yield Cluster(api, RunningCollector(col), agent)
        finally:
            stop_agent(agent)
            col.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kube_cluster(
        tmp_path_factory, "--pod-label", "app.kubernetes.io/name=app", "--pod-label", "team"
    ) as running:
        yield running


def make_cgroup(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_cgroups(leaf: Path, up_to: Path) -> None:
    p = leaf
    while p != up_to and p.is_relative_to(up_to):
        try:
            p.rmdir()
        except OSError:
            break
        p = p.parent


def run_in_cgroup(procs_file: Path, argv: list[str]) -> subprocess.Popen:
    """The shell moves itself into the cgroup, then execs the workload: the workload starts inside."""
    script = f'echo $$ > {procs_file} && exec "$@"'
    return subprocess.Popen(["sh", "-c", script, "sh", *argv], stdout=subprocess.DEVNULL)


def trainer_pod(uid: str, cid: str, rv: str) -> dict:
    return make_pod(
        "trainer-7d4b9c6f8-x2x9q",
        uid,
        node=NODE,
        namespace="ml",
        resource_version=rv,
        labels={"app.kubernetes.io/name": "trainer", "pod-template-hash": "7d4b9c6f8", "team": "vision"},
        owner=("ReplicaSet", "trainer-7d4b9c6f8"),
        containers={"main": cid, "sidecar": "f" * 64},
    )


@pytest.mark.skipif(
    not (V1_CPU / "cgroup.procs").exists(), reason="no cgroup v1 cpu hierarchy on this machine"
)
def test_containerd_cgroupfs_v1_process_is_labelled_with_its_pod(cluster: Cluster, workload_bin) -> None:
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    cluster.api.push(event("ADDED", trainer_pod(uid, cid, "201")))
    wait_until(lambda: cluster.agent.value("fleetprof_agent_pods") >= 1, 20, "the pod in the agent's cache")
    leaf = make_cgroup(V1_CPU / "kubepods" / "burstable" / f"pod{uid}" / cid)
    try:
        proc = run_in_cgroup(leaf / "cgroup.procs", [str(workload_bin("two_funcs")), "3", "75"])
        proc.wait(timeout=CPU_BOUND_TIMEOUT_S)
    finally:
        remove_cgroups(leaf, V1_CPU)

    selector = (
        '{namespace="ml", pod="trainer-7d4b9c6f8-x2x9q", container="main", workload_kind="Deployment", '
        f'workload="trainer", app="trainer", team="vision", node="{NODE}", '
        f'pod_uid="{uid}", container_id="{cid}"}}'
    )
    # Settle on everything of the pid (the superset), so no late window can arrive between the queries.
    everything = settled_profile(cluster.collector, f'{{pid="{proc.pid}"}}', cluster.agent)
    stacks = cluster.collector.folded(selector)
    # 3 s of CPU x 99 Hz = ~297 samples; a count varies by <= sqrt(297) = 17, so 150 is 8.6 sigma below.
    assert samples_of(stacks) > 150
    assert any(f.function == "fp_hot_alpha" for st in stacks for f in st)
    pids = cluster.collector.json("/api/v1/labels/pid/values", since="5m")["values"]
    assert str(proc.pid) in pids
    # Every sample of that pid carries the pod: nothing was left as a bare container id.
    assert everything == stacks

    pods = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetprof.cli",
            "pods",
            "--collector",
            cluster.collector.url,
            "--since",
            "5m",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    row = next(ln for ln in pods.splitlines() if "trainer-7d4b9c6f8-x2x9q" in ln)
    assert row.split()[:4] == ["ml", "trainer-7d4b9c6f8-x2x9q", "Deployment/trainer", NODE]
    # Processes outside pods (the agent, the test runner) are grouped by their comm.
    assert any(ln.split()[0].startswith("comm:") for ln in pods.splitlines()[2:])


@pytest.mark.skipif(V2_HIERARCHY is None, reason="no writable cgroup v2 hierarchy on this machine")
def test_crio_systemd_v2_process_is_labelled_once_its_pod_arrives(cluster: Cluster, workload_bin) -> None:
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    root = v2_pods_root()
    assert root is not None
    slice_uid = uid.replace("-", "_")
    leaf = make_cgroup(
        root
        / "kubepods.slice"
        / "kubepods-besteffort.slice"
        / f"kubepods-besteffort-pod{slice_uid}.slice"
        / f"crio-{cid}.scope"
    )
    try:
        proc = run_in_cgroup(leaf / "cgroup.procs", [str(workload_bin("two_funcs")), "6", "50"])
        # The process runs for a while before the API server tells the agent about its pod.
        wait_until(
            lambda: samples_of(cluster.collector.folded(f'{{pod_uid="{uid}"}}')) > 0,
            20,
            "samples of the not-yet-known pod",
        )
        assert samples_of(cluster.collector.folded(f'{{pod_uid="{uid}", pod!=""}}')) == 0
        pod = make_pod(
            "batch-worker",
            uid,
            node=NODE,
            namespace="jobs",
            resource_version="301",
            owner=("Job", "nightly-29071440"),
            containers={"worker": cid},
        )
        cluster.api.push(event("ADDED", pod))
        proc.wait(timeout=CPU_BOUND_TIMEOUT_S)
    finally:
        remove_cgroups(leaf, root)

    # Settle on everything of the pid (the superset), so no late window can arrive between the queries.
    everything = settled_profile(cluster.collector, f'{{pid="{proc.pid}"}}', cluster.agent)
    labelled = cluster.collector.folded(
        '{namespace="jobs", pod="batch-worker", container="worker", '
        'workload_kind="CronJob", workload="nightly"}'
    )
    # Labels come at drain time: only windows drained before the pod reached the agent's cache go without
    # them, about the first second of the workload's 6 s of CPU (75 of 594 samples measured; fewer of its
    # CPU seconds when the CPUs are busy): ~0.87 labelled, sigma = sqrt(0.87 x 0.13 / 594) = 0.014. The
    # 0.5 bound is 26 sigma below; what it can catch is lag, not noise: the pod applied > 3 s late.
    print(f"{samples_of(labelled)} of {samples_of(everything)} samples labelled with the pod")
    assert samples_of(labelled) > 0.5 * samples_of(everything), "labels did not follow the pod's arrival"
    unlabelled = cluster.collector.folded(f'{{pid="{proc.pid}", pod=""}}')
    assert samples_of(unlabelled) + samples_of(labelled) == samples_of(everything)


@pytest.mark.skipif(
    not (V1_CPU / "cgroup.procs").exists(), reason="no cgroup v1 cpu hierarchy on this machine"
)
def test_syscalls_of_a_pod_are_counted_under_its_labels(cluster: Cluster, workload_bin) -> None:
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex * 2
    pod = make_pod(
        "api-6f9c8d7b5-k2l3m",
        uid,
        node=NODE,
        namespace="web",
        resource_version="401",
        labels={"app": "api", "pod-template-hash": "6f9c8d7b5"},
        owner=("ReplicaSet", "api-6f9c8d7b5"),
        containers={"server": cid},
    )
    cluster.api.push(event("ADDED", pod))
    wait_until(
        lambda: cluster.agent.value("fleetprof_agent_pods") >= 1,
        20,
        "the pod in the agent's cache",
    )
    calls = 2_345
    leaf = make_cgroup(V1_CPU / "kubepods" / "besteffort" / f"pod{uid}" / cid)
    try:
        # Batches of 1,000 calls 150 ms apart: the process lives ~0.3 s on ~2 ms of CPU, most often between
        # two drains (1 s apart) and never sampled on CPU: the syscall tracer's events alone tell the agent
        # to read its cgroup while it lives. (30 ms apart, ~60 ms of life: a fresh-clone run's agent read it
        # too late once, among the BPF tests beside the rest of the suite on 2 CPUs.)
        proc = run_in_cgroup(leaf / "cgroup.procs", [str(workload_bin("getppid_n")), str(calls), "150"])
        proc.wait(timeout=60)
    finally:
        remove_cgroups(leaf, V1_CPU)

    def counted() -> dict | None:
        rows = cluster.collector.json(
            "/api/v1/syscalls", query='{pod="api-6f9c8d7b5-k2l3m"}', since="5m", by="namespace,pod,syscall"
        )["syscalls"]
        got = {r["labels"]["syscall"]: r for r in rows}
        # The pid first runs `sh`, which may call getppid itself before it execs the workload.
        return got if calls <= got.get("getppid", {}).get("count", 0) <= calls + 2 else None

    def seen() -> str:
        """What the collector counted of getppid, by pod (an empty pod: calls the agent could not place)."""
        rows = cluster.collector.json("/api/v1/syscalls", since="5m", by="pod,syscall")["syscalls"]
        by_pod = {r["labels"].get("pod", ""): r["count"] for r in rows if r["labels"]["syscall"] == "getppid"}
        return f"{calls} getppid calls under the pod's labels; getppid by pod: {by_pod}"

    rows = wait_until(counted, 30, seen)
    assert rows["getppid"]["labels"]["namespace"] == "web"
    # All of them: none were left under the bare pid without the pod.
    bare = cluster.collector.json("/api/v1/syscalls", query=f'{{pid="{proc.pid}", pod=""}}', since="5m")
    assert bare["total_count"] == 0


def test_host_processes_stay_host_processes(cluster: Cluster, workload_bin) -> None:
    proc = subprocess.Popen([str(workload_bin("two_funcs")), "2", "50"], stdout=subprocess.DEVNULL)
    proc.wait(timeout=CPU_BOUND_TIMEOUT_S)
    stacks = settled_profile(cluster.collector, f'{{pid="{proc.pid}"}}', cluster.agent)
    assert samples_of(stacks) > 0
    for label in ("pod", "namespace", "container", "pod_uid", "container_id"):
        assert cluster.collector.folded(f'{{pid="{proc.pid}", {label}!=""}}') == {}, label


def test_agent_refuses_a_bad_pod_label_flag() -> None:
    r = fleetprof("agent", "--pod-label", "app=pod", timeout=30)
    assert r.returncode == 2
    assert "'pod' is a label fleetprof sets itself" in r.stderr
    assert "Traceback" not in r.stderr
