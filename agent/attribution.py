"""Labels for a process: its cgroup identity joined with Kubernetes pod metadata, as of this drain."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from fleetprof.agent.model import Labels, ProcessInfo


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

    def by_process(self, processes: Iterable[ProcessInfo]) -> dict[tuple[int, int], Labels]:
        """(pid, start_ticks) -> labels sorted by name (Window.labels), for each process; the first of
        several with one key decides (as the batch keeps the first)."""
        out: dict[tuple[int, int], Labels] = {}
        for p in processes:
            key = (p.pid, p.start_ticks)
            if key not in out:
                out[key] = tuple(sorted(self.labels(p).items()))
        return out
