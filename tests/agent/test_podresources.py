"""GPU → pod via the kubelet PodResources API, against a fake kubelet: a real gRPC server on a unix socket."""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fleetprof._proto.kubelet import podresources_v1_pb2 as pb
from fleetprof._proto.kubelet import podresources_v1_pb2_grpc as pb_grpc
from fleetprof.agent.kube.podresources import GpuOwners, PodResourcesClient, PodResourcesError
from fleetprof.agent.model import DeviceAssignment

GPU_A = "GPU-8a1d6c2e-3f4b-4a5c-9d6e-7f8091a2b3c4"
GPU_B = "GPU-1b2c3d4e-5f60-4718-8293-a4b5c6d7e8f9"
GPU_C = "GPU-0f1e2d3c-4b5a-4697-8877-665544332211"
MIG_A = "MIG-5e6f7a8b-9c0d-5e1f-a2b3-c4d5e6f7a8b9"


def numa(*ids: int) -> pb.TopologyInfo:
    return pb.TopologyInfo(nodes=[pb.NUMANode(ID=i) for i in ids])


def node_pods() -> list[pb.PodResources]:
    """What a kubelet on a GPU node reports: device-plugin GPUs, a MIG slice, a non-GPU device, and
    containers (and a pod) that hold no devices at all."""
    return [
        pb.PodResources(
            name="trainer-0",
            namespace="ml",
            containers=[
                pb.ContainerResources(
                    name="trainer",
                    devices=[
                        pb.ContainerDevices(
                            resource_name="nvidia.com/gpu", device_ids=[GPU_A, GPU_B], topology=numa(0)
                        ),
                        pb.ContainerDevices(
                            resource_name="example.com/foo", device_ids=["foo-3"], topology=numa(0)
                        ),
                    ],
                    cpu_ids=[4, 5, 6, 7],
                    memory=[pb.ContainerMemory(memory_type="memory", size=8 << 30, topology=numa(0))],
                ),
                pb.ContainerResources(name="log-shipper"),
            ],
        ),
        pb.PodResources(
            name="notebook-7f9c",
            namespace="research",
            containers=[
                pb.ContainerResources(
                    name="jupyter",
                    devices=[pb.ContainerDevices(resource_name="nvidia.com/mig-1g.10gb", device_ids=[MIG_A])],
                ),
            ],
        ),
        pb.PodResources(
            name="coredns-5d78c9869d-x2x4q",
            namespace="kube-system",
            containers=[pb.ContainerResources(name="coredns")],
        ),
    ]


class FakeKubelet(pb_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.pods = node_pods()
        self.fail: grpc.StatusCode | None = None
        self.calls = 0

    def List(
        self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        self.calls += 1
        if self.fail is not None:
            context.abort(self.fail, "fake kubelet: pod resources not ready")
        return pb.ListPodResourcesResponse(pod_resources=self.pods)


class MethodRecorder(grpc.ServerInterceptor):
    """Records the method path each call arrived on, as the kubelet's server would route it."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self.methods.append(handler_call_details.method)
        return continuation(handler_call_details)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Not tmp_path: a unix socket path must fit in 108 bytes and pytest's test-named paths can exceed it.
    d = Path(tempfile.mkdtemp(prefix="kubelet-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[tuple[FakeKubelet, MethodRecorder, str]]:
    path = str(sock_dir / "kubelet.sock")
    fake, recorder = FakeKubelet(), MethodRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[recorder])
    pb_grpc.add_PodResourcesListerServicer_to_server(fake, server)
    server.add_insecure_port("unix://" + path)
    server.start()
    yield fake, recorder, path
    server.stop(None)


@pytest.fixture
def client(kubelet: tuple[FakeKubelet, MethodRecorder, str]) -> Iterator[PodResourcesClient]:
    c = PodResourcesClient(kubelet[2], timeout_s=2.0)
    yield c
    c.close()


def test_list_devices_returns_gpu_and_mig_devices_and_skips_other_resources(
    client: PodResourcesClient,
) -> None:
    assert client.available()
    assert client.list_devices() == [
        DeviceAssignment("ml", "trainer-0", "trainer", "nvidia.com/gpu", GPU_A),
        DeviceAssignment("ml", "trainer-0", "trainer", "nvidia.com/gpu", GPU_B),
        DeviceAssignment("research", "notebook-7f9c", "jupyter", "nvidia.com/mig-1g.10gb", MIG_A),
    ]


def test_list_devices_takes_other_resource_prefixes(client: PodResourcesClient) -> None:
    assert client.list_devices(("example.com/",)) == [
        DeviceAssignment("ml", "trainer-0", "trainer", "example.com/foo", "foo-3")
    ]


def test_gpus_by_uuid_maps_each_gpu_and_mig_uuid_to_its_container(client: PodResourcesClient) -> None:
    owners = client.gpus_by_uuid()
    assert set(owners) == {GPU_A, GPU_B, MIG_A}
    assert (owners[GPU_B].namespace, owners[GPU_B].pod, owners[GPU_B].container) == (
        "ml",
        "trainer-0",
        "trainer",
    )
    assert owners[MIG_A].pod == "notebook-7f9c"
    assert owners[MIG_A].resource == "nvidia.com/mig-1g.10gb"


def test_client_calls_the_kubelet_method_path_v1_PodResourcesLister_List(
    kubelet: tuple[FakeKubelet, MethodRecorder, str], client: PodResourcesClient
) -> None:
    client.list_devices()
    assert kubelet[1].methods == ["/v1.PodResourcesLister/List"]


def test_time_sliced_replicas_name_the_gpu_and_a_gpu_shared_by_two_pods_has_no_owner(
    kubelet: tuple[FakeKubelet, MethodRecorder, str], client: PodResourcesClient
) -> None:
    fake = kubelet[0]
    fake.pods = [
        pb.PodResources(
            name=f"infer-{i}",
            namespace="serving",
            containers=[
                pb.ContainerResources(
                    name="server",
                    devices=[
                        pb.ContainerDevices(
                            resource_name="nvidia.com/gpu.shared", device_ids=[f"{GPU_A}::{i}"]
                        )
                    ],
                )
            ],
        )
        for i in range(2)
    ] + [
        pb.PodResources(
            name="solo",
            namespace="serving",
            containers=[
                pb.ContainerResources(
                    name="server",
                    devices=[
                        pb.ContainerDevices(resource_name="nvidia.com/gpu.shared", device_ids=[f"{GPU_C}::3"])
                    ],
                )
            ],
        )
    ]
    assert [a.device_id for a in client.list_devices()] == [GPU_A, GPU_A, GPU_C]
    assert list(client.gpus_by_uuid()) == [GPU_C]


def test_list_devices_says_what_failed_when_the_kubelet_errs(
    kubelet: tuple[FakeKubelet, MethodRecorder, str], client: PodResourcesClient
) -> None:
    kubelet[0].fail = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(
        PodResourcesError, match=r"List\(\) on .*kubelet\.sock failed: UNAVAILABLE: fake kubelet"
    ):
        client.list_devices()


def test_list_devices_fails_clearly_on_a_stale_socket_nobody_listens_on(sock_dir: Path) -> None:
    path = str(sock_dir / "kubelet.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # left behind, as by a kubelet that died
    c = PodResourcesClient(path, timeout_s=2.0)
    try:
        assert c.available()
        with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
            c.list_devices()
    finally:
        c.close()


def test_list_devices_without_the_socket_says_to_mount_it(sock_dir: Path) -> None:
    c = PodResourcesClient(str(sock_dir / "absent.sock"))
    assert not c.available()
    with pytest.raises(PodResourcesError, match="mount the host's /var/lib/kubelet/pod-resources"):
        c.list_devices()


def test_gpu_owners_without_the_socket_is_off_and_says_so_once(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    owners = GpuOwners(PodResourcesClient(str(sock_dir / "absent.sock")), refresh_s=10)
    with caplog.at_level(logging.DEBUG, logger="fleetprof.agent.kube.podresources"):
        for now in range(0, 100, 5):
            owners.refresh_if_stale(float(now))
    assert not owners.enabled
    assert owners.owner(GPU_A) is None
    assert len(caplog.records) == 1
    assert "GPU → pod attribution is off" in caplog.records[0].getMessage()
    assert "absent.sock" in caplog.records[0].getMessage()


def test_gpu_owners_asks_again_only_when_stale(
    kubelet: tuple[FakeKubelet, MethodRecorder, str], client: PodResourcesClient
) -> None:
    fake = kubelet[0]
    owners = GpuOwners(client, refresh_s=30)
    owners.refresh_if_stale(100.0)
    owners.refresh_if_stale(129.0)
    assert fake.calls == 1
    assert owners.enabled
    assert owners.owner(GPU_A) == DeviceAssignment("ml", "trainer-0", "trainer", "nvidia.com/gpu", GPU_A)
    assert owners.owner("GPU-not-on-this-node") is None
    fake.pods = fake.pods[1:]  # the trainer finished
    owners.refresh_if_stale(130.0)
    assert fake.calls == 2
    assert owners.owner(GPU_A) is None
    assert owners.owner(MIG_A) is not None


def test_gpu_owners_keeps_the_last_good_answer_through_errors_backs_off_and_recovers(
    kubelet: tuple[FakeKubelet, MethodRecorder, str],
    client: PodResourcesClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = kubelet[0]
    owners = GpuOwners(client, refresh_s=10, max_backoff_s=40)
    owners.refresh_if_stale(0.0)
    assert owners.owner(GPU_A) is not None

    fake.fail = grpc.StatusCode.INTERNAL
    with caplog.at_level(logging.WARNING, logger="fleetprof.agent.kube.podresources"):
        owners.refresh_if_stale(10.0)  # fails: next try in 20 s
        owners.refresh_if_stale(29.0)  # backing off: not asked
        owners.refresh_if_stale(30.0)  # fails again: next try in 40 s (the cap)
        owners.refresh_if_stale(69.0)
    assert fake.calls == 3
    assert owners.enabled
    assert owners.owner(GPU_A).pod == "trainer-0"  # the last good answer stands
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    fake.fail = None
    fake.pods = fake.pods[1:]
    owners.refresh_if_stale(70.0)
    assert fake.calls == 4
    assert owners.owner(GPU_A) is None
    assert owners.owner(MIG_A).container == "jupyter"
    owners.refresh_if_stale(79.0)  # back on the normal interval
    assert fake.calls == 4
