"""Pod metadata for this node's samples: Pod JSON → PodMeta (workload, containers, labels), cached by UID."""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# Pod labels exported as sample labels by default. Only these two: they name the application, have
# few values per cluster, and one of them is set on nearly every workload (the recommended
# app.kubernetes.io/name, else the older "app"). Per-pod-unique labels would multiply series.
DEFAULT_POD_LABELS: Mapping[str, str] = MappingProxyType({"app.kubernetes.io/name": "app", "app": "app"})

# Label names the profiler sets itself; a pod label renamed onto one of them would overwrite it.
RESERVED_LABELS = frozenset(
    {
        "node",
        "namespace",
        "pod",
        "container",
        "workload",
        "workload_kind",
        "comm",
        "pid",
        "container_id",
        "pod_uid",
        "gpu_state",
    }
)
_TARGET = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# A Kubernetes label key: optional DNS-subdomain prefix and "/", then a name of up to 63 characters.
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}")

# The CronJob controller names each Job "<cronjob>-<scheduled time in minutes since the epoch>".
# Minutes since the epoch have had 8 digits since 1989 (and will until 2160): asking for at least 8
# keeps a hand-made "migrate-2" Job a Job.
_CRONJOB_JOB = re.compile(r"(.+)-(\d{8,})")


@dataclass(frozen=True)
class PodMeta:
    uid: str
    namespace: str
    name: str
    node: str
    workload_kind: str  # Deployment, StatefulSet, DaemonSet, Job, CronJob, ReplicaSet, StaticPod, Pod, ...
    workload: str
    containers: Mapping[str, str]  # container id (bare 64-hex) -> container name, incl. init/ephemeral
    labels: Mapping[str, str]  # selected pod labels under their target names
    phase: str


def parse_label_map(specs: Sequence[str]) -> dict[str, str]:
    """Pod-label flags ("app.kubernetes.io/name=service", "team") → {pod label key: sample label name}.

    Several keys may share a target: the first one a pod carries wins (flag order).
    """
    mapping: dict[str, str] = {}
    for spec in specs:
        source, sep, target = spec.strip().partition("=")
        source, target = source.strip(), (target.strip() if sep else source.strip())
        if not source or not _LABEL_KEY.fullmatch(source):
            raise ValueError(f"pod label {spec!r}: {source!r} is not a Kubernetes label key")
        if not _TARGET.fullmatch(target):
            hint = "" if sep else f"; rename it: {source}=<name>"
            raise ValueError(
                f"pod label {spec!r}: {target!r} is not a valid label name ([a-zA-Z_][a-zA-Z0-9_]*){hint}"
            )
        if target in RESERVED_LABELS or target.startswith("__"):
            raise ValueError(f"pod label {spec!r}: {target!r} is a label fleetprof sets itself; rename it")
        if source in mapping:
            raise ValueError(f"pod label {source!r} is given twice")
        mapping[source] = target
    return mapping


def workload_of(pod: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, name) of the workload that owns a pod, from its controller ownerReference.

    The pod only names its direct owner; the two levels above are inferred from names, as
    `kubectl` users read them:
    - ReplicaSet "<deployment>-<pod-template-hash>" → Deployment, using the pod's pod-template-hash
      label to strip exactly that suffix; without the label (a bare ReplicaSet) it stays ReplicaSet.
    - Job "<cronjob>-<8+ digits>" → CronJob (the CronJob controller's scheduled-time suffix).
    - Node (a kubelet static pod's mirror) → StaticPod named without the "-<node>" suffix, so that
      "kube-proxy-node7" on every node is one workload "kube-proxy".
    No controller owner → ("Pod", pod name). Other kinds are returned as they are.
    """
    meta = pod.get("metadata") or {}
    name = meta.get("name", "")
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner is None:
        return "Pod", name
    kind, owner_name = owner.get("kind", ""), owner.get("name", "")
    if kind == "ReplicaSet":
        template_hash = (meta.get("labels") or {}).get("pod-template-hash")
        suffix = f"-{template_hash}"
        if template_hash and owner_name.endswith(suffix) and len(owner_name) > len(suffix):
            return "Deployment", owner_name[: -len(suffix)]
    elif kind == "Job":
        match = _CRONJOB_JOB.fullmatch(owner_name)
        if match:
            return "CronJob", match.group(1)
    elif kind == "Node":
        suffix = f"-{owner_name}"
        base = name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else name
        return "StaticPod", base
    return kind, owner_name


def container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """Every container id the pod's status names → container name (init, regular, ephemeral).

    The id of a container's previous instance (lastState.terminated) is kept too: after a restart,
    samples of the old process still drain for a moment and should keep their container name.
    """
    status = pod.get("status") or {}
    ids: dict[str, str] = {}
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for cs in status.get(key) or []:
            name = cs.get("name", "")
            previous = ((cs.get("lastState") or {}).get("terminated") or {}).get("containerID")
            for raw in (previous, cs.get("containerID")):
                cid = strip_runtime(raw or "")
                if cid:
                    ids[cid] = name
    return ids


def strip_runtime(container_id: str) -> str:
    """'containerd://<id>' (or cri-o://, docker://) → '<id>'; a bare id is returned as it is."""
    return container_id.rpartition("://")[2].strip().lower()


def pod_meta(pod: Mapping[str, Any], label_map: Mapping[str, str] = DEFAULT_POD_LABELS) -> PodMeta:
    meta = pod.get("metadata") or {}
    pod_labels = meta.get("labels") or {}
    labels: dict[str, str] = {}
    for source, target in label_map.items():
        if target not in labels and source in pod_labels:
            labels[target] = str(pod_labels[source])
    kind, workload = workload_of(pod)
    return PodMeta(
        uid=meta.get("uid", ""),
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        node=(pod.get("spec") or {}).get("nodeName", ""),
        workload_kind=kind,
        workload=workload,
        containers=MappingProxyType(container_ids(pod)),
        labels=MappingProxyType(labels),
        phase=(pod.get("status") or {}).get("phase", ""),
    )


class PodCache:
    """The pods of this node by UID, kept current by a watcher and read by the sample resolver.

    A deleted pod stays for `keep_deleted_s`: its last samples are drained after the API server has
    already reported it gone, and they should still carry its name. Eviction happens lazily on
    writes and lookups; deletion order is eviction order because the delay is the same for all.
    """

    def __init__(
        self,
        label_map: Mapping[str, str] = DEFAULT_POD_LABELS,
        keep_deleted_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._label_map = dict(label_map)
        self._keep_deleted_s = keep_deleted_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, PodMeta] = {}
        self._deleted: OrderedDict[str, float] = OrderedDict()  # uid -> time it is evicted
        self._evicted = 0
        self._updates = 0

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event: ADDED and MODIFIED store the pod, DELETED starts its grace period."""
        meta = pod_meta(pod, self._label_map)
        if not meta.uid:
            return
        with self._lock:
            self._evict()
            self._updates += 1
            self._pods[meta.uid] = meta
            if event_type == "DELETED":
                self._mark_deleted(meta.uid)
            else:
                self._deleted.pop(meta.uid, None)

    def replace_all(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full list: store every pod in it; the ones no longer listed are treated as deleted."""
        metas = [m for m in (pod_meta(p, self._label_map) for p in pods) if m.uid]
        with self._lock:
            self._evict()
            listed = {m.uid for m in metas}
            for uid in self._pods.keys() - listed:
                if uid not in self._deleted:
                    self._mark_deleted(uid)
            for m in metas:
                self._pods[m.uid] = m
                self._deleted.pop(m.uid, None)
            self._updates += len(metas)

    def lookup(self, uid: str) -> PodMeta | None:
        with self._lock:
            if self._deleted:
                self._evict()
            return self._pods.get(uid)

    def container_name(self, uid: str, container_id: str) -> str:
        """The name of a container of a pod ('' when either is unknown); ids with or without runtime://."""
        meta = self.lookup(uid)
        if meta is None:
            return ""
        return meta.containers.get(strip_runtime(container_id), "")

    def __len__(self) -> int:
        """Pods a lookup can return: live ones and those deleted less than keep_deleted_s ago."""
        with self._lock:
            self._evict()
            return len(self._pods)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._evict()
            return {
                "pods": len(self._pods) - len(self._deleted),
                "deleted_kept": len(self._deleted),
                "evicted": self._evicted,
                "updates": self._updates,
            }

    def _mark_deleted(self, uid: str) -> None:
        self._deleted.pop(uid, None)
        self._deleted[uid] = self._clock() + self._keep_deleted_s

    def _evict(self) -> None:
        now = self._clock()
        while self._deleted:
            uid, deadline = next(iter(self._deleted.items()))
            if deadline > now:
                break
            del self._deleted[uid]
            del self._pods[uid]
            self._evicted += 1
