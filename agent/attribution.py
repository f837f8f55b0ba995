"""Labels for a process: its cgroup identity joined with Kubernetes pod metadata, as of this drain."""

from __future__ import annotations

from typing import Protocol

from fleetprof.agent.process.table import ProcessInfo


class PodSource(Protocol):
    """What attribution needs from the pod metadata cache (agent/kube/pods.py PodCache)."""

    def lookup(self, uid: str):  # PodMeta | None
        ...


class Attributor:
    """Computes labels at encode time, not at capture time: a process that started before its pod reached
    the cache is labelled from the first drain after the pod is known."""

    def __init__(self, pods: PodSource | None = None):
        self._pods = pods

    def labels(self, proc: ProcessInfo) -> dict[str, str]:
        cg = proc.cgroup
        out: dict[str, str] = {}
        if cg.container_id:
            out["container_id"] = cg.container_id
        if not cg.pod_uid:
            return out
        out["pod_uid"] = cg.pod_uid
        meta = self._pods.lookup(cg.pod_uid) if self._pods is not None else None
        if meta is None:
            return out
        out["namespace"] = meta.namespace
        out["pod"] = meta.name
        if meta.workload:
            out["workload_kind"] = meta.workload_kind
            out["workload"] = meta.workload
        if cg.container_id:
            name = meta.containers.get(cg.container_id)
            if name:
                out["container"] = name
        for k, v in meta.labels.items():
            out.setdefault(k, v)
        return out
