"""Runs our images with podman as deploy/kubernetes/ runs them: a pod spec's securityContext, volumes, env,
command and resource limits turned into `podman run` flags, so the test follows the manifests as they change.

Only the subset of the pod spec our manifests use is understood; anything else fails loudly rather than
being dropped. Networking is the exception: both containers share the host's network on free 127.0.0.1
ports (a pod network needs a cluster), so the listen and collector addresses in the args are replaced.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

MANIFESTS = REPO / "deploy" / "kubernetes"
# crun, podman's default runtime, fails on this machine kind ("cgroups in hybrid mode not supported",
# setrlimit EPERM); runc works with rlimits below the host's own (REFERENCE.md, "Containers on this
# machine kind"). scripts/images.sh builds with the same flags.
RUNTIME_FLAGS = ["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]
_QUANTITY = re.compile(r"^(\d+)(Mi|Gi)?$")
_UNDERSTOOD_SECURITY = {
    "privileged", "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "capabilities",
    "seccompProfile", "appArmorProfile", "allowPrivilegeEscalation", "fsGroup",
}  # fmt: skip


# Capability numbers 0..40 (include/uapi/linux/capability.h), to read /proc/self/status.
CAPABILITIES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE"
).split()


def host_capabilities() -> set[str]:
    """The capabilities this process may pass on (its bounding set): a container cannot get more, and
    podman leaves out, without an error, any --cap-add beyond them."""
    with open("/proc/self/status") as f:
        bounding = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapBnd:"))
    return {name for bit, name in enumerate(CAPABILITIES) if bounding >> bit & 1}


def require_podman() -> None:
    """Fail in CI (scripts/setup.sh --test installs podman, so its absence is a broken setup); skip, saying
    why, on a developer's machine that has not run the setup."""
    problem = None
    if not shutil.which("podman"):
        problem = "podman is not installed"
    elif os.geteuid() != 0:
        problem = "the image tests run rootful podman and a BPF agent: run them as root"
    if problem:
        message = f"{problem} (scripts/setup.sh --test installs podman, runc and debootstrap)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)


def workload_spec(kind: str, name: str) -> dict:
    """The pod template's spec of the named workload in deploy/kubernetes/."""
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc["spec"]["template"]["spec"]
    raise AssertionError(f"no {kind} {name} in {MANIFESTS}")


def _memory(quantity: str) -> str:
    m = _QUANTITY.match(quantity)
    assert m, f"memory quantity {quantity!r} is not one this helper reads (N, NMi, NGi)"
    return f"{m.group(1)}{ {'Mi': 'm', 'Gi': 'g', None: 'b'}[m.group(2)] }"


def _security_flags(pod: dict, container: dict) -> list[str]:
    sc = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    unknown = set(sc) - _UNDERSTOOD_SECURITY
    assert not unknown, f"securityContext fields this helper does not translate: {sorted(unknown)}"
    flags: list[str] = []
    if sc.get("privileged"):
        flags.append("--privileged")
    if sc.get("runAsNonRoot") and "runAsUser" in sc:
        assert sc["runAsUser"] != 0, "runAsNonRoot with runAsUser 0 cannot start"
    if "runAsUser" in sc:
        flags += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities", {})
    flags += [f"--cap-drop={c}" for c in caps.get("drop", [])]
    flags += [f"--cap-add={c}" for c in caps.get("add", [])]
    for key, opt in (("seccompProfile", "seccomp"), ("appArmorProfile", "apparmor")):
        kind = sc.get(key, {}).get("type")
        if kind == "Unconfined":
            flags += ["--security-opt", f"{opt}=unconfined"]
        else:
            assert kind in (None, "RuntimeDefault"), f"{key} {kind} is not translated"
    return flags


def _secret_dir(pod: dict, vol: dict, secrets: dict[str, dict[str, bytes]]) -> Path:
    """What the kubelet mounts for a `secret` or `projected` (secrets only) volume: each item's key written
    at its path, with the volume's mode, owned by root and the pod's fsGroup."""
    if "secret" in vol:
        sources = [{"secret": {"name": vol["secret"]["secretName"], **vol["secret"]}}]
        mode = vol["secret"].get("defaultMode", 0o644)
    else:
        sources, mode = vol["projected"]["sources"], vol["projected"].get("defaultMode", 0o644)
        assert all("secret" in src for src in sources), f"volume {vol['name']}: only secrets are projected"
    group = pod.get("securityContext", {}).get("fsGroup", 0)
    directory = Path(tempfile.mkdtemp(prefix=f"fleetprof-test-{vol['name']}-"))
    directory.chmod(0o755)
    for src in sources:
        name = src["secret"]["name"]
        assert name in secrets, f"volume {vol['name']} needs Secret {name}: give it in `secrets`"
        items = src["secret"].get("items") or [{"key": k, "path": k} for k in secrets[name]]
        for item in items:
            path = directory / item["path"]
            path.write_bytes(secrets[name][item["key"]])
            os.chown(path, 0, group)
            path.chmod(item.get("mode", mode))
    return directory


def _volume_flags(
    pod: dict,
    container: dict,
    host_dirs: dict[str, Path],
    secrets: dict[str, dict[str, bytes]],
    scratch: list[Path],
) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    flags: list[str] = []
    for mount in container.get("volumeMounts", []):
        vol = volumes.get(mount["name"])
        target = mount["mountPath"]
        if vol is None:  # a StatefulSet's volumeClaimTemplate: the image's VOLUME gives it a fresh volume
            continue
        if "emptyDir" in vol:
            flags += ["--tmpfs", target]
        elif "hostPath" in vol:
            host = vol["hostPath"]["path"]
            # DirectoryOrCreate paths the host lacks (the kubelet's): a directory of the test's instead
            # of creating one in the host's /var/lib.
            source = str(host_dirs.get(host, host))
            assert Path(source).exists(), f"host path {source} of volume {vol['name']} does not exist"
            opts = ["ro"] if mount.get("readOnly") else ["rw"]
            if mount.get("mountPropagation") == "HostToContainer":
                opts.append("rslave")
            flags += ["-v", f"{source}:{target}:{','.join(opts)}"]
        elif "secret" in vol or "projected" in vol:
            assert mount.get("readOnly"), f"secret volume {vol['name']} must be mounted read-only"
            assert "subPath" not in mount, f"volume {vol['name']}: a subPath mount never sees a rotation"
            source = _secret_dir(pod, vol, secrets)
            scratch.append(source)
            flags += ["-v", f"{source}:{target}:ro"]
        else:
            raise AssertionError(f"volume {vol['name']}: only hostPath, emptyDir and secrets are translated")
    return flags


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@dataclass
class Container:
    name: str
    flags: list[str]
    image: str
    command: list[str]
    scratch: list[Path] = field(default_factory=list)  # the Secret volumes' files: removed with it

    def start(self) -> None:
        # No --rm: on failure the logs are still there to read; remove() cleans up.
        cmd = ["podman", "run", "-d", "--name", self.name, *RUNTIME_FLAGS, *self.flags, self.image]
        cmd += self.command
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"podman run {self.name} failed:\n{out.stderr}\ncommand: {cmd}"

    def running(self) -> bool:
        out = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Running}}", self.name],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return out.stdout.strip() == "true"

    def logs(self, tail: int = 40) -> str:
        out = subprocess.run(
            ["podman", "logs", "--tail", str(tail), self.name], capture_output=True, text=True, timeout=60
        )
        return out.stdout + out.stderr

    def alive(self) -> None:
        if not self.running():
            raise AssertionError(f"container {self.name} stopped; its last output:\n{self.logs()}")

    def exec(self, *args: str) -> str:
        out = subprocess.run(["podman", "exec", self.name, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"podman exec {self.name} {args}: {out.stderr}"
        return out.stdout.strip()

    def inspect(self, template: str) -> str:
        out = subprocess.run(
            ["podman", "inspect", "--format", template, self.name], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def remove(self) -> None:
        """SIGTERM with 30 s to exit (Kubernetes' default grace period), then remove it and its anonymous
        volumes, SIGKILLing what is left. (`podman stop`/`rm --time` took ~10 s more with --pid host.)"""
        subprocess.run(["podman", "kill", "--signal", "TERM", self.name], capture_output=True, timeout=60)
        try:
            subprocess.run(["podman", "wait", self.name], capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass
        rm = ["podman", "rm", "--force", "--volumes", "--time", "0", self.name]
        subprocess.run(rm, capture_output=True, timeout=120)
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)


def container_from_manifest(
    kind: str,
    name: str,
    *,
    args: dict[str, str],
    env: dict[str, str],
    host_dirs: dict[str, Path] | None = None,
    secrets: dict[str, dict[str, bytes]] | None = None,
) -> Container:
    """The manifest's only container as a podman container on the host's network and pid namespace (when the
    pod has hostPID). `args` replaces --FLAG=VALUE arguments (addresses); `env` gives fieldRef variables;
    `secrets` the Secrets its volumes name ({name: {key: bytes}})."""
    pod = workload_spec(kind, name)
    (container,) = pod["containers"]
    values = {**env}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        else:
            assert var["name"] in env, f"env {var['name']} comes from {var['valueFrom']}: give it in `env`"
    flags = ["--network", "host"]
    if pod.get("hostPID"):
        flags += ["--pid", "host"]
    flags += _security_flags(pod, container)
    scratch: list[Path] = []
    flags += _volume_flags(pod, container, host_dirs or {}, secrets or {}, scratch)
    flags += [f"--env={k}={v}" for k, v in values.items()]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        flags += ["--memory", _memory(limits["memory"])]
    if "cpu" in limits:
        flags += ["--cpus", str(limits["cpu"])]
    if container.get("command"):
        assert len(container["command"]) == 1, "only a one-word command maps onto --entrypoint"
        flags += ["--entrypoint", container["command"][0]]
    command = []
    for arg in container.get("args", []):
        flag = arg.split("=", 1)[0]
        command.append(f"{flag}={args[flag]}" if flag in args else _expand(arg, values))
    missing = set(args) - {a.split("=", 1)[0] for a in container.get("args", [])}
    assert not missing, f"{kind} {name} has no {sorted(missing)} argument to replace"
    unique = f"fleetprof-test-{name}-{uuid.uuid4().hex[:8]}"
    return Container(unique, flags, container["image"], command, scratch)
