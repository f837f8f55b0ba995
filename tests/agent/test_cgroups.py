"""Tests for agent.process.cgroups: /proc/PID/cgroup text to container and pod identity."""

from __future__ import annotations

import os

import pytest

from fleetprof.agent.model import CgroupIdentity
from fleetprof.agent.process.cgroups import parse_cgroup, parse_cgroup_path, read_cgroup

# Container ids and pod UIDs as real nodes print them.
CONTAINERD_ID = "b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc"
CRIO_ID = "a4d6b686848a610472a2eed3ae20d4d64b6b4819feb9fdfc7fd7854deaf59ef3"
DOCKER_ID = "656959d9ee87a0b131c601ce9d9f8f76b1dda60e8608c503b5979d849cbdc714"

CONTAINERD_SYSTEMD_V2 = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/"
    "cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope\n"
)

CONTAINERD_SYSTEMD_V1 = """\
12:pids:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope
11:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope
10:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope
9:devices:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope
2:rdma:/
1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podf6f2d169_f2ae_4afa_95ed_06ff2ed6b288.slice/cri-containerd-b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc.scope
0::/
"""

CONTAINERD_COLON_FORM_V1 = (
    "11:cpu,cpuacct:/system.slice/containerd.service/"
    "kubepods-besteffort-pod86811ae3_b633_4eb8_a508_e3eae190f6ce.slice:cri-containerd:"
    "b4d6d161c62525d726fa394b27df30e14f8ea5646313ada576b390de70cfc8cc\n"
)

CGROUPFS_V1 = (
    "11:memory:/kubepods/besteffort/poda9c80282-3f6b-4d5b-84d5-a137a6668011/"
    "ed89697807a981b82f6245ac3a13be232c1e13435d52bc3f53060d61babe1997\n"
)

CGROUPFS_V2 = (
    "0::/kubepods/besteffort/pod05e102bf-8744-4942-a241-9b6f07983a53/"
    "f52a212505a606972cf8614c3cb856539e71b77ecae33436c5ac442232fbacf8\n"
)

CRIO_CGROUPFS_V2 = (
    "0::/kubepods/besteffort/pod897277d4-5e6f-4999-a976-b8340e8d075e/"
    "crio-a4d6b686848a610472a2eed3ae20d4d64b6b4819feb9fdfc7fd7854deaf59ef3\n"
)

CRIO_SYSTEMD_V2 = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-podb57320a0_e7eb_4ac8_a791_4c4472796867.slice/"
    "crio-0ecc7949cbaf17e883264ea1055f60b184a7cb264fd759c4a692e1155086fe2d.scope\n"
)

DOCKER_SYSTEMD_V2_IN_CGROUP_NAMESPACE = (
    "0::/../../kubepods-besteffort-pod88f6f4e3_59c0_4ce8_9ecf_391c8b5a60ad.slice/"
    "docker-656959d9ee87a0b131c601ce9d9f8f76b1dda60e8608c503b5979d849cbdc714.scope\n"
)


@pytest.mark.parametrize(
    ("text", "container_id", "runtime", "pod_uid", "qos"),
    [
        pytest.param(
            CONTAINERD_SYSTEMD_V2,
            CONTAINERD_ID,
            "containerd",
            "f6f2d169-f2ae-4afa-95ed-06ff2ed6b288",
            "burstable",
            id="containerd-systemd-v2",
        ),
        pytest.param(
            CONTAINERD_SYSTEMD_V1,
            CONTAINERD_ID,
            "containerd",
            "f6f2d169-f2ae-4afa-95ed-06ff2ed6b288",
            "burstable",
            id="containerd-systemd-v1",
        ),
        pytest.param(
            CONTAINERD_COLON_FORM_V1,
            CONTAINERD_ID,
            "containerd",
            "86811ae3-b633-4eb8-a508-e3eae190f6ce",
            "besteffort",
            id="containerd-colon-form-v1",
        ),
        pytest.param(
            CGROUPFS_V1,
            "ed89697807a981b82f6245ac3a13be232c1e13435d52bc3f53060d61babe1997",
            "",
            "a9c80282-3f6b-4d5b-84d5-a137a6668011",
            "besteffort",
            id="cgroupfs-v1",
        ),
        pytest.param(
            CGROUPFS_V2,
            "f52a212505a606972cf8614c3cb856539e71b77ecae33436c5ac442232fbacf8",
            "",
            "05e102bf-8744-4942-a241-9b6f07983a53",
            "besteffort",
            id="cgroupfs-v2",
        ),
        pytest.param(
            CRIO_CGROUPFS_V2,
            CRIO_ID,
            "cri-o",
            "897277d4-5e6f-4999-a976-b8340e8d075e",
            "besteffort",
            id="crio-cgroupfs-v2",
        ),
        pytest.param(
            CRIO_SYSTEMD_V2,
            "0ecc7949cbaf17e883264ea1055f60b184a7cb264fd759c4a692e1155086fe2d",
            "cri-o",
            "b57320a0-e7eb-4ac8-a791-4c4472796867",
            "burstable",
            id="crio-systemd-v2",
        ),
        pytest.param(
            DOCKER_SYSTEMD_V2_IN_CGROUP_NAMESPACE,
            DOCKER_ID,
            "docker",
            "88f6f4e3-59c0-4ce8-9ecf-391c8b5a60ad",
            "besteffort",
            id="docker-systemd-v2-cgroup-namespace",
        ),
    ],
)
def test_kubernetes_container_lines_yield_container_runtime_pod_and_qos(
    text: str, container_id: str, runtime: str, pod_uid: str, qos: str
) -> None:
    identity = parse_cgroup(text)
    assert (identity.container_id, identity.runtime, identity.pod_uid, identity.qos) == (
        container_id,
        runtime,
        pod_uid,
        qos,
    )


def test_v2_line_path_is_reported_verbatim() -> None:
    assert parse_cgroup(CONTAINERD_SYSTEMD_V2).path == CONTAINERD_SYSTEMD_V2[3:].rstrip("\n")


def test_v1_file_reports_the_name_systemd_path_even_when_cpu_lines_come_first() -> None:
    expected = next(
        line.split(":", 2)[2] for line in CONTAINERD_SYSTEMD_V1.splitlines() if ":name=systemd:" in line
    )
    assert parse_cgroup(CONTAINERD_SYSTEMD_V1).path == expected


def test_colon_form_path_is_reported_as_written_not_as_rewritten() -> None:
    assert parse_cgroup(CONTAINERD_COLON_FORM_V1).path == CONTAINERD_COLON_FORM_V1.split(":", 2)[2].rstrip(
        "\n"
    )


def test_v2_line_wins_over_disagreeing_v1_lines() -> None:
    text = (
        f"1:name=systemd:/kubepods/besteffort/pod05e102bf-8744-4942-a241-9b6f07983a53/{CRIO_ID}\n"
        + CONTAINERD_SYSTEMD_V2
    )
    assert parse_cgroup(text).container_id == CONTAINERD_ID


def test_name_systemd_wins_over_earlier_controller_lines() -> None:
    text = (
        f"4:memory:/docker/{DOCKER_ID}\n"
        f"1:name=systemd:/kubepods/burstable/pod05e102bf-8744-4942-a241-9b6f07983a53/{CONTAINERD_ID}\n"
    )
    assert parse_cgroup(text).container_id == CONTAINERD_ID


def test_hybrid_hierarchy_with_root_v2_line_falls_back_to_v1_container_line() -> None:
    # Hybrid mode: the unified hierarchy is mounted but the runtime only uses the v1 controllers.
    text = f"5:memory:/docker/{DOCKER_ID}\n0::/\n"
    identity = parse_cgroup(text)
    assert (identity.path, identity.container_id, identity.runtime) == (
        f"/docker/{DOCKER_ID}",
        DOCKER_ID,
        "docker",
    )


def test_first_controller_line_with_a_container_is_chosen_when_no_preferred_line_has_one() -> None:
    text = f"7:cpuset:/\n5:memory:/docker/{DOCKER_ID}\n3:pids:/docker/{'1' * 64}\n0::/\n"
    assert parse_cgroup(text).container_id == DOCKER_ID


def test_pod_line_without_container_is_chosen_when_no_line_names_a_container() -> None:
    text = "3:pids:/\n2:memory:/kubepods/burstable/pod05e102bf-8744-4942-a241-9b6f07983a53\n0::/\n"
    identity = parse_cgroup(text)
    assert (identity.pod_uid, identity.container_id) == ("05e102bf-8744-4942-a241-9b6f07983a53", "")


@pytest.mark.parametrize(
    ("path", "pod_uid", "container_id", "runtime"),
    [
        pytest.param(
            f"/kubepods/pod05e102bf-8744-4942-a241-9b6f07983a53/{CONTAINERD_ID}",
            "05e102bf-8744-4942-a241-9b6f07983a53",
            CONTAINERD_ID,
            "",
            id="cgroupfs",
        ),
        pytest.param(
            f"/kubepods.slice/kubepods-pod05e102bf_8744_4942_a241_9b6f07983a53.slice/cri-containerd-{CONTAINERD_ID}.scope",
            "05e102bf-8744-4942-a241-9b6f07983a53",
            CONTAINERD_ID,
            "containerd",
            id="systemd",
        ),
    ],
)
def test_pods_directly_under_kubepods_are_guaranteed(
    path: str, pod_uid: str, container_id: str, runtime: str
) -> None:
    identity = parse_cgroup(f"0::{path}\n")
    assert (identity.pod_uid, identity.container_id, identity.runtime, identity.qos) == (
        pod_uid,
        container_id,
        runtime,
        "guaranteed",
    )


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(f"0::/system.slice/docker-{DOCKER_ID}.scope\n", id="systemd-v2"),
        pytest.param(f"0::/system.slice/docker-{DOCKER_ID}.scope/init\n", id="systemd-v2-init"),
        pytest.param(f"1:name=systemd:/system.slice/docker-{DOCKER_ID}.scope\n", id="systemd-v1"),
        pytest.param(f"0::/docker/{DOCKER_ID}\n", id="cgroupfs-v2"),
        pytest.param(f"4:memory:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n", id="cgroupfs-v1"),
    ],
)
def test_docker_cli_containers_have_container_but_no_pod(text: str) -> None:
    identity = parse_cgroup(text)
    assert (identity.container_id, identity.runtime, identity.pod_uid, identity.qos) == (
        DOCKER_ID,
        "docker",
        "",
        "",
    )


def test_nested_docker_reports_the_outermost_container_the_host_knows() -> None:
    inner = "c" * 64
    assert parse_cgroup(f"0::/docker/{DOCKER_ID}/docker/{inner}\n").container_id == DOCKER_ID


def test_kind_node_seen_from_host_reports_the_pod_inside_the_node_container() -> None:
    # A kind node is a Docker container whose own kubelet prefixes its slices with "kubelet-".
    path = (
        f"/system.slice/docker-{DOCKER_ID}.scope/kubelet.slice/kubelet-kubepods.slice/"
        "kubelet-kubepods-besteffort.slice/"
        "kubelet-kubepods-besteffort-pod88f6f4e3_59c0_4ce8_9ecf_391c8b5a60ad.slice/"
        f"cri-containerd-{CONTAINERD_ID}.scope"
    )
    identity = parse_cgroup(f"0::{path}\n")
    assert (identity.container_id, identity.runtime, identity.pod_uid, identity.qos) == (
        CONTAINERD_ID,
        "containerd",
        "88f6f4e3-59c0-4ce8-9ecf-391c8b5a60ad",
        "besteffort",
    )


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("0::/user.slice/user-1000.slice/session-1.scope\n", id="user-session"),
        pytest.param("0::/init.scope\n", id="init"),
        pytest.param("0::/\n", id="root"),
        pytest.param("0::/system.slice/containerd.service\n", id="containerd-daemon"),
        pytest.param("0::/system.slice/docker.service\n", id="docker-daemon"),
        pytest.param("0::/system.slice/crio-wipe.service\n", id="crio-unit"),
        pytest.param("0::/system.slice/docker-builds.scope\n", id="docker-named-unit"),
        pytest.param(f"0::/{CONTAINERD_ID}\n", id="bare-id-outside-pod-or-docker"),
        pytest.param("0::/kubepods.slice/kubepods-burstable.slice\n", id="qos-slice"),
        pytest.param("0::/kubepods/burstable\n", id="qos-dir"),
        pytest.param("0::/podcast/episodes\n", id="pod-prefixed-name"),
    ],
)
def test_host_processes_have_empty_identity_and_keep_their_path(text: str) -> None:
    path = text[3:].rstrip("\n")
    assert parse_cgroup(text) == CgroupIdentity(path=path)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("\n\n", id="blank-lines"),
        pytest.param("garbage", id="word"),
        pytest.param("::::\n", id="colons"),
        pytest.param("x:cpu:/kubepods/pod05e102bf-8744-4942-a241-9b6f07983a53\n", id="non-numeric-hierarchy"),
        pytest.param("0::relative/path\n", id="relative-path"),
        pytest.param("\x00\xff\ufffd\n", id="binary"),
    ],
)
def test_unparseable_text_yields_host_identity_with_empty_path(text: str) -> None:
    assert parse_cgroup(text) == CgroupIdentity(path="")


def test_garbage_lines_are_skipped_around_a_good_line() -> None:
    text = "nonsense\n12:\n" + CGROUPFS_V2 + "trailing junk ::: here\n"
    assert parse_cgroup(text).pod_uid == "05e102bf-8744-4942-a241-9b6f07983a53"


def test_windows_line_endings_are_tolerated() -> None:
    assert parse_cgroup(CRIO_SYSTEMD_V2.replace("\n", "\r\n")).container_id.startswith("0ecc7949")


def test_crio_conmon_scope_is_the_pod_and_runtime_but_not_the_container() -> None:
    text = (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        "kubepods-burstable-podb57320a0_e7eb_4ac8_a791_4c4472796867.slice/"
        f"crio-conmon-{CRIO_ID}.scope\n"
    )
    identity = parse_cgroup(text)
    assert (identity.container_id, identity.runtime, identity.pod_uid, identity.qos) == (
        "",
        "cri-o",
        "b57320a0-e7eb-4ac8-a791-4c4472796867",
        "burstable",
    )


def test_crio_conmon_cgroupfs_is_not_the_container() -> None:
    text = f"0::/kubepods/besteffort/pod897277d4-5e6f-4999-a976-b8340e8d075e/crio-conmon-{CRIO_ID}\n"
    identity = parse_cgroup(text)
    assert (identity.container_id, identity.runtime) == ("", "cri-o")


@pytest.mark.parametrize(
    ("path", "qos"),
    [
        pytest.param(
            "/kubepods/burstable/pod05e102bf-8744-4942-a241-9b6f07983a53", "burstable", id="cgroupfs"
        ),
        pytest.param(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod05e102bf_8744_4942_a241_9b6f07983a53.slice",
            "besteffort",
            id="systemd",
        ),
        pytest.param("/kubepods/pod05e102bf-8744-4942-a241-9b6f07983a53", "guaranteed", id="guaranteed"),
    ],
)
def test_pod_level_cgroup_has_pod_but_no_container(path: str, qos: str) -> None:
    assert parse_cgroup(f"0::{path}\n") == CgroupIdentity(
        path=path, pod_uid="05e102bf-8744-4942-a241-9b6f07983a53", qos=qos
    )


def test_process_below_the_container_cgroup_still_belongs_to_it() -> None:
    path = f"/kubepods/burstable/pod05e102bf-8744-4942-a241-9b6f07983a53/crio-{CRIO_ID}/init"
    identity = parse_cgroup(f"0::{path}\n")
    assert (identity.container_id, identity.runtime) == (CRIO_ID, "cri-o")


def test_unrecognised_child_of_a_pod_is_not_a_container() -> None:
    identity = parse_cgroup("0::/kubepods/burstable/pod05e102bf-8744-4942-a241-9b6f07983a53/something-else\n")
    assert (identity.pod_uid, identity.container_id, identity.runtime) == (
        "05e102bf-8744-4942-a241-9b6f07983a53",
        "",
        "",
    )


def test_pod_uid_is_lowercased() -> None:
    identity = parse_cgroup("0::/kubepods/besteffort/pod05E102BF-8744-4942-A241-9B6F07983A53\n")
    assert identity.pod_uid == "05e102bf-8744-4942-a241-9b6f07983a53"


def test_static_pod_hash_uid_is_accepted_as_is() -> None:
    # Static pods (kube-apiserver and friends) take a 32-hex config hash as their UID.
    uid = "5f2d0c9e7b1a4c3d8e6f0a1b2c3d4e5f"
    identity = parse_cgroup(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice\n"
    )
    assert (identity.pod_uid, identity.qos) == (uid, "burstable")


def test_cgroupfs_pod_in_cgroup_namespace_has_unknown_qos() -> None:
    identity = parse_cgroup(f"0::/../pod05e102bf-8744-4942-a241-9b6f07983a53/{CONTAINERD_ID}\n")
    assert (identity.pod_uid, identity.container_id, identity.qos) == (
        "05e102bf-8744-4942-a241-9b6f07983a53",
        CONTAINERD_ID,
        "",
    )


def test_kubelet_cgroup_root_prefix_is_accepted_for_systemd_pods() -> None:
    path = (
        "/custom.slice/custom-kubepods.slice/custom-kubepods-burstable.slice/"
        f"custom-kubepods-burstable-pod05e102bf_8744_4942_a241_9b6f07983a53.slice/cri-containerd-{CONTAINERD_ID}.scope"
    )
    identity = parse_cgroup(f"0::{path}\n")
    assert (identity.pod_uid, identity.container_id, identity.qos) == (
        "05e102bf-8744-4942-a241-9b6f07983a53",
        CONTAINERD_ID,
        "burstable",
    )


def test_short_or_uppercase_ids_are_not_taken_for_containers() -> None:
    assert parse_cgroup("0::/system.slice/docker-abc123.scope\n").container_id == ""
    assert parse_cgroup(f"0::/docker/{DOCKER_ID.upper()}\n").container_id == ""


def test_parse_cgroup_path_accepts_a_bare_path() -> None:
    assert parse_cgroup_path(f"/docker/{DOCKER_ID}") == CgroupIdentity(
        path=f"/docker/{DOCKER_ID}", container_id=DOCKER_ID, runtime="docker"
    )


def _write_proc(root: os.PathLike[str] | str, pid: int, text: str) -> None:
    directory = os.path.join(root, str(pid))
    os.makedirs(directory)
    with open(os.path.join(directory, "cgroup"), "w", encoding="utf-8") as file:
        file.write(text)


def test_read_cgroup_reads_the_pid_file_under_proc_root(tmp_path) -> None:
    _write_proc(tmp_path, 4242, CRIO_SYSTEMD_V2)
    identity = read_cgroup(4242, proc_root=str(tmp_path))
    assert (identity.runtime, identity.pod_uid) == ("cri-o", "b57320a0-e7eb-4ac8-a791-4c4472796867")


def test_read_cgroup_of_missing_process_raises_process_lookup_error_naming_pid(tmp_path) -> None:
    with pytest.raises(ProcessLookupError, match=r"process 31337 not found"):
        read_cgroup(31337, proc_root=str(tmp_path))


def test_read_cgroup_tolerates_undecodable_bytes(tmp_path) -> None:
    directory = tmp_path / "7"
    directory.mkdir()
    (directory / "cgroup").write_bytes(b"0::/system.slice/caf\xe9.service\n" + CGROUPFS_V1.encode())
    assert read_cgroup(7, proc_root=str(tmp_path)).pod_uid == "a9c80282-3f6b-4d5b-84d5-a137a6668011"


@pytest.mark.parametrize("pid", [0, -1, True, "12"])
def test_read_cgroup_rejects_non_positive_or_non_int_pid(pid: object, tmp_path) -> None:
    with pytest.raises(ValueError, match="pid must be a positive integer"):
        read_cgroup(pid, proc_root=str(tmp_path))  # type: ignore[arg-type]


@pytest.mark.skipif(not os.path.exists("/proc/self/cgroup"), reason="needs Linux /proc")
def test_read_cgroup_of_this_process_does_not_raise() -> None:
    identity = read_cgroup(os.getpid())
    assert identity.path.startswith("/") or identity.path == ""
