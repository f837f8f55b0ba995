"""GPU → pod: which container holds which GPU, from the kubelet's PodResources v1 gRPC API on the node."""

from __future__ import annotations

import logging
import math
import os
import stat

import grpc

from fleetprof._proto.kubelet import podresources_v1_pb2 as pb
from fleetprof._proto.kubelet import podresources_v1_pb2_grpc as pb_grpc
from fleetprof.agent.model import DeviceAssignment

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# "nvidia.com/gpu" also matches the device plugin's renamed shared resource "nvidia.com/gpu.shared".
GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")
# The NVIDIA device plugin advertises each time-sliced replica of a GPU as "<uuid>::<replica>".
REPLICA_SEPARATOR = "::"
# A List() answer grows with pods x containers; a busy node outgrows gRPC's 4 MiB default.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class PodResourcesError(Exception):
    """The kubelet's PodResources API could not be asked or did not answer."""


class PodResourcesClient:
    """One node's kubelet PodResources API over its unix socket; each call is one List()."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.PodResourcesListerStub | None = None

    def available(self) -> bool:
        """The kubelet's socket exists (the agent pod has /var/lib/kubelet/pod-resources mounted)."""
        try:
            return stat.S_ISSOCK(os.stat(self.socket_path).st_mode)
        except OSError:
            return False

    def list_devices(
        self, resource_prefixes: tuple[str, ...] = GPU_RESOURCE_PREFIXES
    ) -> list[DeviceAssignment]:
        """Every device whose resource name starts with one of `resource_prefixes`, with its holder."""
        if not self.available():
            raise PodResourcesError(
                f"kubelet PodResources socket {self.socket_path} does not exist or is not a socket: "
                "mount the host's /var/lib/kubelet/pod-resources into the agent pod"
            )
        try:
            response = self._lister().List(pb.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            raise PodResourcesError(
                f"kubelet PodResources List() on {self.socket_path} failed: "
                f"{code.name if code else 'error'}: {details}"
            ) from e
        return [
            DeviceAssignment(
                namespace=pod.namespace,
                pod=pod.name,
                container=container.name,
                resource=devices.resource_name,
                device_id=device_id.split(REPLICA_SEPARATOR, 1)[0],
            )
            for pod in response.pod_resources
            for container in pod.containers
            for devices in container.devices
            if devices.resource_name.startswith(resource_prefixes)
            for device_id in devices.device_ids
        ]

    def gpus_by_uuid(self) -> dict[str, DeviceAssignment]:
        """GPU/MIG UUID → the one container holding it. A GPU time-sliced between several containers
        has no single owner and is left out rather than credited to one of them at random."""
        owners: dict[str, DeviceAssignment] = {}
        shared: set[str] = set()
        for a in self.list_devices(GPU_RESOURCE_PREFIXES):
            held = owners.get(a.device_id)
            if held is not None and (held.namespace, held.pod, held.container) != (
                a.namespace,
                a.pod,
                a.container,
            ):
                shared.add(a.device_id)
            owners.setdefault(a.device_id, a)
        for uuid in shared:
            del owners[uuid]
        return owners

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def _lister(self) -> pb_grpc.PodResourcesListerStub:
        # One channel for the client's life: gRPC reconnects by itself when the kubelet restarts.
        if self._stub is None:
            self._channel = grpc.insecure_channel(
                "unix://" + os.path.abspath(self.socket_path),
                options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)],
            )
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
        return self._stub


class GpuOwners:
    """GPU UUID → owning container, refreshed from the kubelet when the caller's loop asks and the answer
    is older than `refresh_s`. Off (and said so once) on a node without the kubelet socket; on errors it
    keeps the last good answer and backs off, doubling up to `max_backoff_s`."""

    def __init__(
        self, client: PodResourcesClient, refresh_s: float = 30.0, max_backoff_s: float = 300.0
    ) -> None:
        self._client = client
        self._refresh_s = refresh_s
        self._max_backoff_s = max_backoff_s
        self._owners: dict[str, DeviceAssignment] = {}
        self._next_at = -math.inf
        self._failures = 0
        self._said_absent = False
        self.enabled = False  # the socket was there at the last refresh

    def refresh_if_stale(self, now: float) -> None:
        """Ask the kubelet again if `now` (monotonic seconds) is past the next refresh time."""
        if now < self._next_at:
            return
        if not self._client.available():
            # Checked again each interval: the socket appears once the kubelet (re)starts.
            if not self._said_absent:
                log.info(
                    "no kubelet PodResources socket at %s: GPU → pod attribution is off",
                    self._client.socket_path,
                )
                self._said_absent = True
            self.enabled = False
            self._owners = {}
            self._next_at = now + self._refresh_s
            return
        self.enabled = True
        self._said_absent = False  # should it vanish again, say so again (once)
        try:
            owners = self._client.gpus_by_uuid()
        except PodResourcesError as e:
            self._failures += 1
            backoff = min(self._refresh_s * 2**self._failures, self._max_backoff_s)
            if self._failures == 1:
                log.warning("%s; keeping the last GPU → pod map, retrying with backoff", e)
            else:
                log.debug("still failing (%d in a row, next try in %.0fs): %s", self._failures, backoff, e)
            self._next_at = now + backoff
            return
        if self._failures:
            log.info("kubelet PodResources answers again after %d failed tries", self._failures)
        self._failures = 0
        self._owners = owners
        self._next_at = now + self._refresh_s

    def owner(self, uuid: str) -> DeviceAssignment | None:
        return self._owners.get(uuid)
