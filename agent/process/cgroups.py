"""Turn the text of /proc/PID/cgroup into the container and Kubernetes pod a process runs in."""

from __future__ import annotations

import re
from types import MappingProxyType

from fleetprof.agent.model import CgroupIdentity

# One line of /proc/PID/cgroup is "hierarchy-id:controllers:path". The path itself may contain
# colons (containerd's "slice:prefix:name" form), so only the first two colons separate fields.
_LINE = re.compile(r"(\d+):([^:]*):(/.*)")

# containerd with SystemdCgroup=true on cgroup v1 can leave the systemd "slice:prefix:name" triple
# unexpanded in the path; rewriting it to "slice/prefix-name.scope" lets one set of patterns serve both.
_COLON_FORM = re.compile(r"([^/:]+\.slice):([^/:]+):([^/:]+)")

# A pod UID is a UUID, written with '_' instead of '-' by the systemd driver (systemd reserves '-' as
# the slice hierarchy separator). Static pods use a 32-hex config hash as their UID instead.
_UID = (
    r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
    r"|[0-9a-fA-F]{32}"
)

# systemd driver: "kubepods[-qos]-pod<uid>.slice"; any "<root>-" prefix comes from kubelet's --cgroup-root.
_SYSTEMD_POD = re.compile(rf"(?:.+-)?kubepods(?:-(burstable|besteffort))?-pod({_UID})\.slice")
# cgroupfs driver: "pod<uid>", with the QoS class (or nothing, for guaranteed) as the parent directory.
_CGROUPFS_POD = re.compile(rf"pod({_UID})")

# The runtimes generate 64-hex ids; insisting on that keeps unit names such as "docker-builds.scope"
# or "crio-wipe.service" from being mistaken for containers.
_ID = r"[0-9a-f]{64}"
# CRI-O runs one conmon per container in its own scope next to the container's; conmon is not in the
# container, so it must be recognised before the plain "crio-<id>" pattern.
_CONMON = re.compile(rf"crio-conmon-{_ID}(?:\.scope)?")
_PREFIXED_CONTAINER = re.compile(rf"(cri-containerd|crio|docker)-({_ID})(?:\.scope)?")
_BARE_CONTAINER = re.compile(_ID)

_RUNTIME_BY_PREFIX = MappingProxyType({"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"})
_QOS_BY_PARENT = MappingProxyType(
    {"kubepods": "guaranteed", "burstable": "burstable", "besteffort": "besteffort"}
)


def parse_cgroup(text: str) -> CgroupIdentity:
    """Identify the container and pod from the contents of /proc/PID/cgroup; never raises.

    Lines are tried in order of trust: the cgroup v2 ("0::") line, then v1 "name=systemd", then the
    rest in file order. The first line naming a container wins, else the first naming a pod. A process
    no line places in a container or pod is a host process, reported with the most trusted line's path.
    """
    unified: list[str] = []
    named_systemd: list[str] = []
    others: list[str] = []
    for line in text.splitlines():
        match = _LINE.fullmatch(line.strip())
        if match is None:
            continue  # garbage or truncated lines carry no identity; skip rather than fail
        hierarchy, controllers, path = match.groups()
        if hierarchy == "0" and controllers == "":
            unified.append(path)
        elif "name=systemd" in controllers.split(","):
            named_systemd.append(path)
        else:
            others.append(path)
    candidates = unified + named_systemd + others
    if not candidates:
        return CgroupIdentity(path="")

    # Parsed lazily: on v1 the name=systemd line usually settles it before the other dozen lines.
    first_pod: CgroupIdentity | None = None
    for path in candidates:
        identity = parse_cgroup_path(path)
        if identity.container_id:
            return identity
        if first_pod is None and identity.pod_uid:
            first_pod = identity
    return first_pod or CgroupIdentity(path=candidates[0])


def parse_cgroup_path(path: str) -> CgroupIdentity:
    """Identify the container and pod from one cgroup path such as "/kubepods/pod<uid>/<id>"."""
    segments = path.split("/")
    colon_form = _COLON_FORM.fullmatch(segments[-1]) if ":" in segments[-1] else None
    if colon_form is not None:
        parent_slice, prefix, name = colon_form.groups()
        segments[-1:] = [parent_slice, f"{prefix}-{name}.scope"]

    for index, segment in enumerate(segments):
        pod_uid, qos = _pod_of(segment, segments[index - 1] if index else "")
        if pod_uid:
            # The container is the pod's direct child; anything deeper (systemd's "init", nested
            # runtimes) still belongs to it. Under a pod a bare id is a container of unknown runtime.
            child = segments[index + 1] if index + 1 < len(segments) else ""
            container_id, runtime = _container_of(child, bare_runtime="")
            return CgroupIdentity(path, container_id, runtime, pod_uid, qos)

    # Outside Kubernetes take the outermost container: that is the one the node's runtime knows,
    # whatever a docker-in-docker or systemd-in-container setup nests below it.
    for index, segment in enumerate(segments):
        parent = segments[index - 1] if index else ""
        container_id, runtime = _container_of(segment, bare_runtime="docker" if parent == "docker" else None)
        if container_id:
            return CgroupIdentity(path, container_id, runtime)
    return CgroupIdentity(path)


def _pod_of(segment: str, parent: str) -> tuple[str, str]:
    """Return (canonical pod UID, QoS class) if this path segment is a pod's cgroup, else ("", "")."""
    if "pod" not in segment:
        return "", ""  # cheap early out: most segments are nowhere near a pod
    match = _SYSTEMD_POD.fullmatch(segment)
    if match is not None:
        return _canonical_uid(match.group(2)), match.group(1) or "guaranteed"
    match = _CGROUPFS_POD.fullmatch(segment)
    if match is not None:
        return _canonical_uid(match.group(1)), _QOS_BY_PARENT.get(parent, "")
    return "", ""


def _container_of(segment: str, bare_runtime: str | None) -> tuple[str, str]:
    """Return (container id, runtime) if this path segment is a container's cgroup, else ("", "").

    A bare 64-hex segment counts only where the caller knows containers live (bare_runtime is not
    None): under a pod, or under cgroupfs Docker's "/docker". A CRI-O conmon scope yields
    ("", "cri-o"): the runtime is known but the process is not in the container.
    """
    if len(segment) < 64:
        return "", ""  # every form we accept holds a 64-hex id
    if _CONMON.fullmatch(segment):
        return "", "cri-o"
    match = _PREFIXED_CONTAINER.fullmatch(segment)
    if match is not None:
        return match.group(2), _RUNTIME_BY_PREFIX[match.group(1)]
    if bare_runtime is not None and _BARE_CONTAINER.fullmatch(segment):
        return segment, bare_runtime
    return "", ""


def _canonical_uid(raw: str) -> str:
    return raw.replace("_", "-").lower()


def read_cgroup(pid: int, proc_root: str = "/proc") -> CgroupIdentity:
    """Read and parse /proc/PID/cgroup; raises ProcessLookupError if the process does not exist."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"pid must be a positive integer, got {pid!r}")
    path = f"{proc_root}/{pid}/cgroup"
    try:
        # Paths are arbitrary bytes; replacing undecodable ones keeps one odd name from hiding the rest.
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except FileNotFoundError:
        raise ProcessLookupError(
            f"process {pid} not found: {path} does not exist (it may have exited)"
        ) from None
    # A process that exits between open() and read() makes read() fail with ESRCH, which Python
    # already raises as ProcessLookupError.
    return parse_cgroup(text)
