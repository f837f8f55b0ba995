"""The images as deploy/ ships them: scripts/images.sh builds deploy/Dockerfile.agent and .collector (on a
locally built debian:bookworm-slim), then both run with the manifests' settings and profile a host process.

The collector runs as the StatefulSet runs it (its non-root user, read-only root, no capabilities); the
agent as the DaemonSet runs it (hostPID, root with the listed capabilities only, seccomp/AppArmor
unconfined, read-only root, the host's debugfs, tracefs, cgroup, bpffs, /lib/modules and /usr/src).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, http_get, require_bpf, wait_until
from tests.support.containers import (
    RUNTIME_FLAGS,
    Container,
    _security_flags,
    container_from_manifest,
    host_capabilities,
    require_podman,
    workload_spec,
)
from tests.support.gotemplate import all_objects, render_chart
from tests.support.installed import WORKLOAD, HttpCollector, assert_hot_function_leads, profile_hot_workload

# The BPF phase, its file on one worker: its containers load BPF programs (the agent's), and no other test
# file uses podman, whose image store and containers are the machine's.
pytestmark = [pytest.mark.slow, pytest.mark.bpf]

COLLECTOR_UID = 10001  # the Dockerfile's USER; the StatefulSet's runAsUser and fsGroup must match it
NODE = "images-test-node"
# The slow steps of both Dockerfiles: packages, Python dependencies, the package stage's build backend,
# and the agent's CUPTI library stage (which fetches NVIDIA's wheels).
INSTALLS = r" RUN .*(apt-get install|-r (build-)?requirements\.txt|scripts/build_cupti\.sh --out)"


@pytest.fixture(scope="module")
def images_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """scripts/images.sh: fast when podman has the base and the layers (a cold run debootstraps); its
    build_images() answer."""
    require_podman()
    run = build_images(tmp_path_factory.mktemp("images") / "build.log")
    assert run["rc"] == 0, f"scripts/images.sh failed:\n{run['stderr']}\n{run['log'][-4000:]}"
    return run


@pytest.fixture(scope="module")
def images(images_run: dict) -> dict[str, str]:
    """The images the manifests name, once built."""
    return {
        "agent": workload_spec("DaemonSet", "fleetprof-agent")["containers"][0]["image"],
        "collector": workload_spec("StatefulSet", "fleetprof-collector")["containers"][0]["image"],
    }


def build_images(log: Path) -> dict:
    """One run of scripts/images.sh (this machine's architecture): its exit status, stderr and log."""
    built = subprocess.run(
        ["bash", "scripts/images.sh"], cwd=REPO, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "IMAGES_LOG": str(log)},
    )  # fmt: skip
    return {"rc": built.returncode, "stderr": built.stderr, "log": log.read_text() if log.exists() else ""}


def install_steps(log: str) -> list[tuple[str, str]]:
    """The slow steps (INSTALLS) of a build log, each with the line that follows it."""
    lines = log.splitlines()
    # A multi-stage build prefixes its steps with the stage: "[1/2] STEP 3/8: ...".
    steps = [i for i, ln in enumerate(lines) if re.match(r"(\[\d+/\d+\] )?STEP ", ln)]
    return [(lines[i], lines[i + 1]) for i in steps if re.search(INSTALLS, lines[i])]


def all_cached(log: str) -> bool:
    return all(after.startswith("--> Using cache") for _, after in install_steps(log))


def test_images_are_built_from_the_deploy_dockerfiles_as_the_manifests_name_them(images: dict) -> None:
    for component, image in images.items():
        out = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{json .Config}}", image],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, f"{image} (named in the {component} manifest) is not built: {out.stderr}"
        config = json.loads(out.stdout)
        assert config["Entrypoint"] == ["fleetprof"] and config["Cmd"][0] == component
        assert not any(e.startswith("PIP_CERT=") for e in config.get("Env", [])), "a build argument leaked"


# The two Secrets deploy/README.md has the user create, with tokens of this run.
SECRETS = {
    "fleetprof-ingest-token": {"token": secrets.token_hex(32).encode()},
    "fleetprof-api-token": {"token": secrets.token_hex(32).encode()},
}


@pytest.fixture(scope="module")
def collector(images: dict) -> Iterator[tuple[Container, HttpCollector, int]]:
    grpc, http = free_port(), free_port()
    c = container_from_manifest(
        "StatefulSet", "fleetprof-collector",
        args={"--grpc": f"127.0.0.1:{grpc}", "--http": f"127.0.0.1:{http}"}, env={}, secrets=SECRETS,
    )  # fmt: skip
    try:
        c.start()
        col = HttpCollector(f"http://127.0.0.1:{http}", SECRETS["fleetprof-api-token"]["token"].decode())

        def up() -> bool:
            c.alive()
            return col.healthy()

        wait_until(up, 120, f"the collector container {c.name} to serve /healthz", every=0.5)
        yield c, col, grpc
    finally:
        c.remove()


@pytest.fixture(scope="module")
def agent(collector: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Container, int]]:
    require_bpf()
    _, _, grpc = collector
    http = free_port()
    # The kubelet's PodResources directory does not exist off a Kubernetes node (the agent logs that GPU
    # → pod attribution is off); an empty directory of the test's stands in for it.
    pod_resources = tmp_path_factory.mktemp("pod-resources")
    a = container_from_manifest(
        "DaemonSet", "fleetprof-agent",
        args={"--collector": f"127.0.0.1:{grpc}", "--http": f"127.0.0.1:{http}"},
        env={"NODE_NAME": NODE},
        host_dirs={"/var/lib/kubelet/pod-resources": pod_resources}, secrets=SECRETS,
    )  # fmt: skip
    try:
        a.start()

        def up() -> bool:
            a.alive()
            try:
                health = json.loads(http_get(f"http://127.0.0.1:{http}/healthz", timeout=2))
            except OSError:
                return False
            return health["collector_connected"]

        # BCC compiles the BPF programs at start; the agent connects at its first batch (--interval).
        wait_until(up, 180, f"the agent container {a.name} to load BPF and reach the collector", every=1)
        yield a, http
    finally:
        a.remove()


def test_collector_container_runs_as_its_non_root_user_and_writes_its_store(
    images: dict, collector: tuple
) -> None:
    c, _, _ = collector
    assert c.exec("id", "-u") == str(COLLECTOR_UID) and c.exec("id", "-g") == str(COLLECTOR_UID)
    # The image alone, without the manifest's runAsUser, runs as that user too.
    alone = subprocess.run(
        ["podman", "run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
         "nproc=4096:4096", "--network", "none", "--entrypoint", "id", images["collector"], "-u"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert alone.stdout.strip() == str(COLLECTOR_UID), alone.stderr
    assert c.exec("stat", "-c", "%u", "/var/lib/fleetprof/wal") == str(COLLECTOR_UID)
    assert c.inspect("{{.HostConfig.ReadonlyRootfs}}") == "true"
    assert c.inspect("{{.EffectiveCaps}}") in ("[]", "<no value>")


@pytest.mark.bpf
def test_agent_container_runs_with_the_daemonsets_privileges_only(agent: tuple) -> None:
    a, _ = agent
    spec = workload_spec("DaemonSet", "fleetprof-agent")["containers"][0]["securityContext"]
    if spec.get("privileged"):
        assert a.inspect("{{.HostConfig.Privileged}}") == "true"
        return
    assert a.inspect("{{.HostConfig.Privileged}}") == "false"
    caps = {c.removeprefix("CAP_") for c in a.inspect("{{.EffectiveCaps}}").strip("[]").split()}
    wanted = set(spec["capabilities"]["add"])
    # Exactly the listed ones, less those this machine's own bounding set lacks: SYS_RESOURCE on the
    # development VMs, which the agent does without on kernels >= 5.11 (BPF maps are charged to memcg).
    assert caps == wanted & host_capabilities(), (
        f"missing {sorted(wanted - caps)}, extra {sorted(caps - wanted)}"
    )
    assert a.inspect("{{.HostConfig.PidMode}}") == "host"
    assert a.exec("id", "-u") == "0"


@pytest.mark.bpf
def test_agent_container_profiles_a_host_workload_under_its_pid(
    agent: tuple, collector: tuple, workload_bin
) -> None:
    a, _ = agent
    c, col, _ = collector

    def alive() -> None:
        a.alive()
        c.alive()

    # At the DaemonSet's --interval (10 s) the hot function shows after one or two batches.
    pid, stacks = profile_hot_workload(col, workload_bin(WORKLOAD), timeout=180, alive=alive)
    assert_hot_function_leads(col, pid, stacks)
    by_node = col.json("/api/v1/top", query=f'{{pid="{pid}"}}', by="node", since="10m")["groups"]
    assert [g["labels"]["node"] for g in by_node] == [NODE]


def test_images_sh_reuses_the_base_and_the_layers(images_run: dict, tmp_path: Path) -> None:
    """A second run neither debootstraps nor installs packages again: the base image and the apt and pip
    layers come from podman's store (only a change to fleetprof's own code rebuilds its last layer). Under
    `make test` the fixture's run is that second run (the Makefile built the images as the suite started);
    where it built them itself, a run after it is."""
    again = images_run
    if not all_cached(again["log"]):
        again = build_images(tmp_path / "rebuild.log")
    assert again["rc"] == 0, again["stderr"]
    assert "base docker.io/library/debian:bookworm-slim present" in again["stderr"]
    installs = install_steps(again["log"])
    # In each image: apt-get and the dependencies, the package stage's apt-get and build backend; and the
    # agent's CUPTI stage's apt-get and build.
    assert len(installs) == 10, again["log"]
    for step, after in installs:
        assert after.startswith("--> Using cache"), f"rebuilt: {step}"


FOREIGN = {"amd64": "arm64", "arm64": "amd64"}


def test_the_other_architectures_images_run_its_python_with_bcc_and_fleetprof(images: dict) -> None:
    """`make images` also builds the other architecture (arm64 here), through qemu-user: its first build
    (base by debootstrap, apt and pip under emulation) takes ~20 min, too long for every test run. So it is
    built here only once its base is in podman's store (after one `make images`); then its layers are
    cached, `make test` rebuilds it before the tests start, and a code change only reruns the Dockerfiles'
    package stage, natively. Its Python runs through qemu-user."""
    native = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    arch = FOREIGN[native]
    base = f"localhost/fleetprof/debian-base:bookworm-slim-{arch}"
    if subprocess.run(["podman", "image", "exists", base]).returncode != 0:
        pytest.skip(f"no {arch} base in podman's store: `make images` builds it once (then this test runs)")
    built = subprocess.run(
        ["bash", "scripts/images.sh", arch], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    assert built.returncode == 0, built.stderr
    machine = {"amd64": "x86_64", "arm64": "aarch64"}[arch]
    checks = {
        "agent": "import platform, bcc, fleetprof.agent.main; print(platform.machine(), bcc.BPF.__name__)",
        "collector": "import platform, duckdb, re2, fleetprof.collector.main; print(platform.machine())",
    }
    for component, code in checks.items():
        image = f"{images[component]}-{arch}"  # fleetprof/agent:0.1.0-arm64
        inspected = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Architecture}}", image],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert inspected.stdout.strip() == arch, (image, inspected.stdout, inspected.stderr)
        ran = subprocess.run(
            ["podman", "run", "--rm", "--platform", f"linux/{arch}", "--runtime", "runc", "--ulimit",
             "nofile=1024:1024", "--ulimit", "nproc=4096:4096", "--network", "none",
             "--entrypoint", "/opt/fleetprof/bin/python", image, "-c", code],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert ran.returncode == 0, f"{image}: {ran.stderr[-2000:]}"
        assert ran.stdout.split()[0] == machine, ran.stdout


def test_the_charts_install_cupti_init_container_puts_the_agent_images_library_on_the_node(
    images: dict, tmp_path: Path
) -> None:
    """The chart with agent.cupti.enabled, its init container run as rendered (its command and security
    context) on the agent image: the node directory gets the library the image built, which loads and
    exports the entry point the CUDA driver calls (InitializeInjection)."""
    objects = all_objects(render_chart({"agent": {"cupti": {"enabled": True}}}))
    pod = next(o for o in objects if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == images["agent"]
    node = tmp_path / "cupti"
    node.mkdir()  # the kubelet makes it (DirectoryOrCreate)
    command = init["command"]
    run = subprocess.run(
        ["podman", "run", "--rm", *RUNTIME_FLAGS, *_security_flags(pod, init), "-v", f"{node}:/host-cupti",
         "--entrypoint", command[0], init["image"], *command[1:]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in node.iterdir()) == ["libfleetprof_cupti.so"] and not run.stderr
    lib = node / "libfleetprof_cupti.so"
    loads = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r}).InitializeInjection"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert loads.returncode == 0, loads.stderr
