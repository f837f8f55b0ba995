"""Pod metadata from the Kubernetes API: config loading, Pod JSON → PodMeta, the cache, and list+watch."""

from __future__ import annotations

import base64
import logging
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetprof.agent.kube.client import KubeClient
from fleetprof.agent.kube.config import (
    KubeConfig,
    KubeConfigError,
    in_cluster_config,
    kubeconfig_config,
    load_config,
)
from fleetprof.agent.kube.pods import (
    DEFAULT_POD_LABELS,
    PodCache,
    PodMeta,
    parse_label_map,
    pod_meta,
    workload_of,
)
from fleetprof.agent.kube.watcher import PodWatcher
from tests.support.fake_apiserver import (
    FakeApiServer,
    bookmark,
    container_id,
    event,
    expired,
    make_pod,
    status_object,
)

WEB_UID = "0b7f6a6e-3f0c-4c1e-9d7e-2f5a8c1b4d10"
DB_UID = "5c2d9e1a-8b3f-4a6c-b7d2-1e9f0a3c5b21"
EXPORTER_UID = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c32"
BATCH_UID = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e043"
REMOTE_UID = "77777777-7777-4777-8777-777777777777"


def web(rv: str = "100", app_id: int = 1, previous: dict[str, str] | None = None) -> dict:
    return make_pod(
        "web-7d4b9c6f5d-x2x9k",
        WEB_UID,
        resource_version=rv,
        labels={"app.kubernetes.io/name": "web", "app": "web-legacy", "pod-template-hash": "7d4b9c6f5d"},
        owner=("ReplicaSet", "web-7d4b9c6f5d"),
        containers={"app": container_id(app_id), "envoy": container_id(2)},
        init_containers={"migrate": container_id(3)},
        previous=previous,
    )


DB = make_pod(
    "db-0",
    DB_UID,
    labels={"app": "postgres", "controller-revision-hash": "db-5c9f8d7b6", "team": "data"},
    owner=("StatefulSet", "db"),
    containers={"postgres": container_id(4)},
)
EXPORTER = make_pod(
    "node-exporter-5x8wq",
    EXPORTER_UID,
    labels={"app.kubernetes.io/name": "node-exporter", "controller-revision-hash": "6b9f7c5d4"},
    owner=("DaemonSet", "node-exporter"),
    containers={"node-exporter": container_id(5)},
)
BATCH = make_pod(
    "nightly-28512345-8k2jx",
    BATCH_UID,
    owner=("Job", "nightly-28512345"),
    containers={"report": container_id(6)},
    phase="Pending",
)
REMOTE = make_pod("web-7d4b9c6f5d-r3m0t", REMOTE_UID, node="node-b", owner=("ReplicaSet", "web-7d4b9c6f5d"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def eventually(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Wait for `predicate` (a few ms here); the timeout only ends a wait that will never succeed, so it is
    generous (at 3 s it was a speed limit on a machine busy with other work)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def watching(config: KubeConfig, cache: PodCache, **kwargs: object) -> Iterator[PodWatcher]:
    watcher = PodWatcher(
        config, "node-a", cache, backoff=(0.01, 0.05), timeout_s=5, jitter=lambda: 1.0, **kwargs
    )
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop()
        assert not watcher._thread.is_alive(), "stop() must end the watcher thread"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cache(clock: FakeClock) -> PodCache:
    return PodCache(keep_deleted_s=60.0, clock=clock)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([web(), DB, EXPORTER, REMOTE], resource_version="100", page_size=2) as s:
        yield s


@pytest.fixture
def synced(server: FakeApiServer, cache: PodCache) -> Iterator[PodWatcher]:
    """A watcher that has listed and has its first watch open."""
    with watching(KubeConfig(server=server.url, token="tok-1"), cache) as watcher:
        eventually(lambda: server.watches(), "the first watch request")
        yield watcher


# ---------------------------------------------------------------- list and watch


def test_list_filters_by_node_authenticates_and_follows_pages(server, cache, synced):
    first, second = server.lists()
    assert first.path == "/api/v1/pods"
    assert first.params == {"fieldSelector": "spec.nodeName=node-a", "limit": "500"}
    assert "fieldSelector=spec.nodeName%3Dnode-a" in first.query
    assert first.headers["Authorization"] == "Bearer tok-1"
    assert second.params == {"fieldSelector": "spec.nodeName=node-a", "limit": "500", "continue": "2"}
    assert synced.synced() and synced.stats.lists == 1 and synced.stats.relists == 0

    (watch,) = server.watches()
    assert watch.params == {
        "fieldSelector": "spec.nodeName=node-a",
        "watch": "true",
        "resourceVersion": "100",
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "5",
    }
    assert watch.headers["Authorization"] == "Bearer tok-1"


def test_cache_after_list_holds_this_nodes_pods_with_workload_containers_and_labels(server, cache, synced):
    assert len(cache) == 3
    assert cache.lookup(REMOTE_UID) is None
    assert cache.lookup(WEB_UID) == PodMeta(
        uid=WEB_UID,
        namespace="default",
        name="web-7d4b9c6f5d-x2x9k",
        node="node-a",
        workload_kind="Deployment",
        workload="web",
        containers={container_id(1): "app", container_id(2): "envoy", container_id(3): "migrate"},
        labels={"app": "web"},  # app.kubernetes.io/name wins over app for the same target
        phase="Running",
    )
    db = cache.lookup(DB_UID)
    assert (db.workload_kind, db.workload, db.labels) == ("StatefulSet", "db", {"app": "postgres"})
    assert cache.container_name(DB_UID, f"containerd://{container_id(4)}") == "postgres"
    assert cache.container_name(DB_UID, container_id(4)) == "postgres"
    assert cache.container_name(DB_UID, container_id(99)) == ""
    assert cache.container_name(REMOTE_UID, container_id(4)) == ""


def test_modified_event_after_a_restart_maps_the_new_container_id(server, cache, synced):
    server.push(event("MODIFIED", web(rv="120", app_id=11, previous={"app": container_id(1)})))
    eventually(lambda: cache.container_name(WEB_UID, container_id(11)) == "app", "the new container id")
    # Samples of the previous instance still drain for a moment after the restart.
    assert cache.container_name(WEB_UID, container_id(1)) == "app"
    assert synced.stats.events == 1


def test_added_pod_appears_and_deleted_pod_is_kept_then_evicted(server, cache, synced, clock):
    server.push(event("ADDED", {**BATCH, "metadata": {**BATCH["metadata"], "resourceVersion": "130"}}))
    eventually(lambda: cache.lookup(BATCH_UID) is not None, "the added pod")
    assert (cache.lookup(BATCH_UID).workload_kind, cache.lookup(BATCH_UID).workload) == ("CronJob", "nightly")

    server.push(event("DELETED", {**DB, "metadata": {**DB["metadata"], "resourceVersion": "131"}}))
    eventually(lambda: cache.stats()["deleted_kept"] == 1, "the deletion")
    clock.now += 59
    assert cache.lookup(DB_UID).name == "db-0", "late samples of a just-deleted pod keep their labels"
    clock.now += 2
    assert cache.lookup(DB_UID) is None
    assert cache.stats() == {"pods": 3, "deleted_kept": 0, "evicted": 1, "updates": 5}


def test_bookmark_advances_the_resource_version_of_the_next_watch(server, cache, synced):
    server.push(bookmark("250"))
    server.end_watch()  # the server's timeoutSeconds ran out
    eventually(lambda: len(server.watches()) == 2, "the next watch")
    assert server.watches()[1].params["resourceVersion"] == "250"
    assert len(server.lists()) == 2, "a watch that ends is resumed, not relisted (2 = the first list's pages)"
    assert (synced.stats.bookmarks, synced.stats.watch_restarts, synced.stats.errors) == (1, 1, 0)


def test_expired_error_event_relists_and_the_cache_converges(server, cache, synced, clock):
    # While the watch was behind, web restarted, db went away and a job started; no events told us.
    server.set_pods([web(rv="290", app_id=11), EXPORTER, BATCH, REMOTE], resource_version="300")
    server.push(expired("100", "300"))
    eventually(lambda: len(server.watches()) == 2, "the watch after the relist")

    assert len(server.lists()) == 4  # two pages, twice
    assert server.watches()[1].params["resourceVersion"] == "300"
    assert synced.stats.relists == 1
    assert cache.container_name(WEB_UID, container_id(11)) == "app"
    assert cache.lookup(BATCH_UID) is not None
    assert cache.lookup(DB_UID) is not None, "missing from the relist: treated as deleted, so kept a while"
    clock.now += 61
    assert cache.lookup(DB_UID) is None
    assert len(cache) == 3


def test_http_410_on_the_watch_request_relists(cache):
    with FakeApiServer([web(), DB], resource_version="100") as server:
        server.fail_next_watch(410, "Expired", "too old resource version: 100 (300)")
        with watching(KubeConfig(server=server.url, token="tok-1"), cache) as watcher:
            eventually(lambda: len(server.watches()) == 2, "a watch after the relist")
            assert len(server.lists()) == 2
            assert watcher.stats.relists == 1 and watcher.stats.errors == 0


def test_dropped_watch_resumes_from_the_last_resource_version_without_relisting(server, cache, synced):
    server.push(event("MODIFIED", web(rv="120", app_id=11)))
    eventually(lambda: cache.container_name(WEB_UID, container_id(11)), "the modification")
    server.drop_watch()  # cut in the middle of an event: that half event must not count
    eventually(lambda: len(server.watches()) == 2, "the watch after the drop")
    assert server.watches()[1].params["resourceVersion"] == "120"
    assert len(server.lists()) == 2  # the first list's two pages only
    assert synced.stats.errors == 0 and synced.stats.events == 1


def test_other_error_event_rewatches_from_the_same_version_after_backoff(server, cache, synced):
    server.push(event("ERROR", status_object(500, "InternalError", "etcd leader changed")))
    eventually(lambda: len(server.watches()) == 2, "the watch after the error")
    assert server.watches()[1].params["resourceVersion"] == "100"
    assert len(server.lists()) == 2
    assert synced.stats.errors == 1


def test_401_rereads_the_rotated_token_file(tmp_path, cache):
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    with FakeApiServer([web()], accept_tokens={"new-token"}) as server:
        server.on_unauthorized = lambda: token_file.write_text("new-token\n")  # the kubelet rotated it
        with watching(KubeConfig(server=server.url, token_file=str(token_file)), cache) as watcher:
            eventually(watcher.synced, "the list with the new token")
            eventually(lambda: server.watches(), "the watch")
        auth = [r.headers["Authorization"] for r in server.requests]
        assert auth[:2] == ["Bearer old-token", "Bearer new-token"]
        assert set(auth[2:]) == {"Bearer new-token"}
        assert watcher.stats.errors == 0


def test_unreachable_server_backs_off_logs_once_and_stops_promptly(cache, caplog):
    with FakeApiServer() as gone:
        url = gone.url
    caplog.set_level(logging.DEBUG, logger="fleetprof.agent.kube")
    with watching(KubeConfig(server=url, token="t"), cache) as watcher:
        eventually(lambda: watcher.stats.errors >= 3, "several failed attempts")
        assert not watcher.synced()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "retrying with backoff" in warnings[0].getMessage()


# ---------------------------------------------------------------- Pod JSON → PodMeta


def _owned(name: str, owner: tuple[str, str] | None, labels: dict[str, str] | None = None) -> dict:
    return make_pod(name, WEB_UID, labels=labels, owner=owner)


HASH = {"pod-template-hash": "7d4b9c6f5d"}


@pytest.mark.parametrize(
    "pod, expected",
    [
        (_owned("web-7d4b9c6f5d-x2x9k", ("ReplicaSet", "web-7d4b9c6f5d"), HASH), ("Deployment", "web")),
        (_owned("api-v2-x2x9k", ("ReplicaSet", "api-v2")), ("ReplicaSet", "api-v2")),
        (_owned("api-v2-x2x9k", ("ReplicaSet", "api-v2"), HASH), ("ReplicaSet", "api-v2")),
        (_owned("db-0", ("StatefulSet", "db")), ("StatefulSet", "db")),
        (_owned("node-exporter-5x8wq", ("DaemonSet", "node-exporter")), ("DaemonSet", "node-exporter")),
        (_owned("migrate-2-abcde", ("Job", "migrate-2")), ("Job", "migrate-2")),
        (_owned("nightly-manual-7k2-abcde", ("Job", "nightly-manual-7k2")), ("Job", "nightly-manual-7k2")),
        (_owned("nightly-28512345-8k2jx", ("Job", "nightly-28512345")), ("CronJob", "nightly")),
        (_owned("debug-shell", None), ("Pod", "debug-shell")),
        (_owned("kube-apiserver-node-a", ("Node", "node-a")), ("StaticPod", "kube-apiserver")),
        (_owned("trainer-0", ("TFJob", "trainer")), ("TFJob", "trainer")),
    ],
    ids=["deployment", "replicaset-without-hash", "replicaset-hash-mismatch", "statefulset", "daemonset",
         "job-short-suffix", "job-manual", "cronjob", "bare-pod", "static-pod", "custom-owner"],
)  # fmt: skip
def test_workload_of(pod, expected):
    assert workload_of(pod) == expected


def test_owner_reference_that_is_not_the_controller_is_ignored():
    pod = _owned("x-1", ("ReplicaSet", "x"))
    pod["metadata"]["ownerReferences"][0]["controller"] = False
    assert workload_of(pod) == ("Pod", "x-1")


def test_cri_o_and_docker_ids_lose_their_runtime_prefix():
    pod = make_pod("p", WEB_UID, containers={"a": container_id(1)})
    pod["status"]["containerStatuses"][0]["containerID"] = f"cri-o://{container_id(7)}"
    pod["status"]["ephemeralContainerStatuses"] = [
        {"name": "debugger", "containerID": f"docker://{container_id(8)}"}
    ]
    pod["status"]["initContainerStatuses"] = [{"name": "waiting", "containerID": ""}]  # not started yet
    assert pod_meta(pod).containers == {container_id(7): "a", container_id(8): "debugger"}


def test_selected_labels_follow_the_label_map_in_order():
    pod = make_pod("p", WEB_UID, labels={"app": "legacy", "team": "checkout", "version": "1.2"})
    assert pod_meta(pod).labels == {"app": "legacy"}
    assert pod_meta(pod, DEFAULT_POD_LABELS | parse_label_map(["team=owner"])).labels == {
        "app": "legacy",
        "owner": "checkout",
    }


def test_parse_label_map_accepts_renames_and_bare_names():
    assert parse_label_map(["app.kubernetes.io/name=service", "team", " example.com/tier = tier "]) == {
        "app.kubernetes.io/name": "service",
        "team": "team",
        "example.com/tier": "tier",
    }
    assert parse_label_map([]) == {}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("app.kubernetes.io/name", "rename it: app.kubernetes.io/name=<name>"),
        ("team=pod", "fleetprof sets itself"),
        ("team=container_id", "fleetprof sets itself"),
        ("team=__name__", "fleetprof sets itself"),
        ("team=1team", "not a valid label name"),
        ("team=owner-team", "not a valid label name"),
        ("=owner", "not a Kubernetes label key"),
        ("bad key=owner", "not a Kubernetes label key"),
    ],
)
def test_parse_label_map_refuses_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_label_map([spec])


def test_parse_label_map_refuses_a_key_given_twice():
    with pytest.raises(ValueError, match="given twice"):
        parse_label_map(["team=a", "team=b"])


# ---------------------------------------------------------------- configuration


def test_in_cluster_config_reads_the_service_account(tmp_path):
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_config(env, str(tmp_path)) == KubeConfig(
        server="https://10.96.0.1:443",
        token="sa-token",
        token_file=str(tmp_path / "token"),
        ca_file=str(tmp_path / "ca.crt"),
    )
    env6 = {"KUBERNETES_SERVICE_HOST": "fd00:10:96::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_config(env6, str(tmp_path)).server == "https://[fd00:10:96::1]:443"


def test_in_cluster_config_explains_what_is_missing(tmp_path):
    with pytest.raises(KubeConfigError, match="not running inside a Kubernetes pod"):
        in_cluster_config({}, str(tmp_path))
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeConfigError, match="automountServiceAccountToken"):
        in_cluster_config(env, str(tmp_path))


def _kubeconfig(path: Path, user: dict, cluster: dict | None = None, extra_context: bool = True) -> str:
    import yaml

    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "prod",
        "clusters": [
            {"name": "staging", "cluster": {"server": "https://staging.example.com"}},
            {"name": "prod", "cluster": cluster or {"server": "https://prod.example.com:6443"}},
        ],
        "contexts": [
            {"name": "staging", "context": {"cluster": "staging", "user": "someone"}},
            {"name": "prod", "context": {"cluster": "prod", "user": "agent", "namespace": "fleetprof"}},
        ],
        "users": [{"name": "someone", "user": {"token": "staging-token"}}, {"name": "agent", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_kubeconfig_current_context_with_token_and_relative_files(tmp_path):
    (tmp_path / "ca.pem").write_text("ca")
    (tmp_path / "tok").write_text("file-token\n")
    cluster = {"server": "https://prod.example.com:6443/", "certificate-authority": "ca.pem"}
    path = _kubeconfig(tmp_path / "config", {"tokenFile": "tok"}, cluster)
    assert kubeconfig_config(path) == KubeConfig(
        server="https://prod.example.com:6443",
        token="file-token",
        token_file=str(tmp_path / "tok"),
        ca_file=str(tmp_path / "ca.pem"),
    )
    assert kubeconfig_config(path, context="staging").token == "staging-token"


def test_kubeconfig_inline_data_and_insecure_flag(tmp_path):
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    cluster = {
        "server": "https://10.0.0.1",
        "certificate-authority-data": b64("CA PEM"),
        "insecure-skip-tls-verify": True,
    }
    user = {"client-certificate-data": b64("CERT PEM"), "client-key-data": b64("KEY PEM")}
    config = kubeconfig_config(_kubeconfig(tmp_path / "config", user, cluster))
    assert (config.ca_data, config.client_cert_data, config.client_key_data) == (
        b"CA PEM",
        b"CERT PEM",
        b"KEY PEM",
    )
    assert config.insecure_skip_verify and config.token is None


def test_kubeconfig_refuses_credential_plugins_and_unknown_contexts(tmp_path):
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "aws"}}
    path = _kubeconfig(tmp_path / "config", exec_user)
    with pytest.raises(KubeConfigError, match="exec credential plugin, which fleetprof does not run"):
        kubeconfig_config(path)
    with pytest.raises(KubeConfigError, match="no context named 'dev'"):
        kubeconfig_config(path, context="dev")


def test_load_config_prefers_explicit_then_in_cluster_then_kubeconfig(tmp_path):
    path = _kubeconfig(tmp_path / "config", {"token": "kc-token"})
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "KUBECONFIG": path}
    assert load_config(path, env=in_pod, sa_dir=str(sa)).token == "kc-token"
    assert load_config(env=in_pod, sa_dir=str(sa)).token == "sa-token"
    assert load_config(env={"KUBECONFIG": path, "HOME": str(tmp_path)}, sa_dir=str(sa)).token == "kc-token"
    with pytest.raises(KubeConfigError, match="no Kubernetes API configuration found: not running inside"):
        load_config(env={"HOME": str(tmp_path)}, sa_dir=str(sa))


# ---------------------------------------------------------------- TLS, end to end


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, *"-keyout ca.key -out ca.crt -days 2 -subj /CN=fake-cluster-ca".split())
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN=fleetprof-{who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.crt")  # fmt: skip
    return d


def test_tls_with_inline_ca_and_client_certificate_from_a_kubeconfig(pki, tmp_path, cache):
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki / "server.crt", pki / "server.key")
    tls.verify_mode = ssl.CERT_REQUIRED  # the API server authenticates the client certificate
    tls.load_verify_locations(pki / "ca.crt")
    b64 = lambda p: base64.b64encode((pki / p).read_bytes()).decode()  # noqa: E731
    with FakeApiServer([web()], tls=tls) as server:
        cluster = {"server": server.url, "certificate-authority-data": b64("ca.crt")}
        user = {"client-certificate-data": b64("client.crt"), "client-key-data": b64("client.key")}
        config = kubeconfig_config(_kubeconfig(tmp_path / "config", user, cluster))
        with watching(config, cache) as watcher:
            eventually(watcher.synced, "a list over TLS")
        assert cache.lookup(WEB_UID).workload == "web"
        assert "Authorization" not in server.requests[0].headers
        leftovers = list(Path(tempfile.gettempdir()).glob("fleetprof-kube-*"))
        assert not leftovers, "inline key material is not left on disk"

        # Without the cluster CA the server's certificate is not trusted.
        untrusted = KubeConfig(server=server.url, client_cert_file=str(pki / "client.crt"),
                               client_key_file=str(pki / "client.key"))  # fmt: skip
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            KubeClient(untrusted).get_json("/api/v1/pods", {"fieldSelector": "spec.nodeName=node-a"})
