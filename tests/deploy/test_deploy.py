"""deploy/: the Kubernetes manifests, the images and the Grafana dashboards, checked against the real thing.

Manifests are validated offline against the Kubernetes JSON schemas (kubernetes-validate, strict: unknown
fields fail). ServiceMonitor is a prometheus-operator CRD, which those schemas lack: it is validated
against SERVICE_MONITOR_SCHEMA in tests/support/manifests.py, written from the CRD's documented fields
(monitoring.coreos.com/v1 ServiceMonitorSpec, Endpoint, RelabelConfig, NamespaceSelector), closed to
unknown fields like the rest. Flags in the manifests are checked against `fleetprof agent --help` /
`fleetprof collector --help`, and every metric name in the dashboards' PromQL against the /metrics of a
real collector fed real batches over gRPC and of a real agent process object. The dashboards' flame graph
panels query the collector as Grafana's Pyroscope data source: their label selectors, variables replaced
as Grafana replaces them, are parsed by the collector's parser and sent to a real collector as that data
source sends them. The manifests hold no token: they reference Secrets that deploy/README.md's
`kubectl create secret` commands make, which is checked name by name and key by key.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf.message import Message
from prometheus_client.parser import text_string_to_metric_families

from fleetprof._proto.pyroscope import querier_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.model.selector import Selector
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.serve.pyroscope import PROFILE_TYPES
from tests.conftest import RunningCollector, free_port, http_get
from tests.support.manifests import (
    DEPLOY,
    K8S_VERSIONS,
    MANIFESTS,
    assert_file_flags_are_mounted,
    assert_flags_accepted,
    cli_flags,
    flags_used,
    manifest_objects,
    readme_secrets,
    secret_sources,
    validate_object,
)
from tests.support.wire import BatchBuilder, hist, make_batch, push, with_syscalls

DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))


def _find(kind: str, name: str | None = None) -> dict:
    return next(o for o in manifest_objects() if o["kind"] == kind and name in (None, o["metadata"]["name"]))


# ---- schema validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path.name} is empty"
    for obj in docs:
        validate_object(obj, version)


def test_the_validation_catches_mistakes() -> None:
    """The checks above can fail: a misspelled field, a wrong type, a ServiceMonitor typo."""
    ds = _find("DaemonSet")
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(pytest.fail.Exception, match="hostPid"):
        validate_object(bad, K8S_VERSIONS[-1])
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7472"
    with pytest.raises(pytest.fail.Exception):
        validate_object(bad, K8S_VERSIONS[-1])
    sm = json.loads(json.dumps(_find("ServiceMonitor", "fleetprof-collector")))
    sm["spec"]["endpoints"][0]["honourLabels"] = True
    with pytest.raises(pytest.fail.Exception, match="honourLabels"):
        validate_object(sm, K8S_VERSIONS[-1])
    sm = json.loads(json.dumps(_find("ServiceMonitor", "fleetprof-collector")))
    sm["spec"]["endpoints"][0]["authorization"]["credentials"]["secret"] = "fleetprof-api-token"
    with pytest.raises(pytest.fail.Exception, match="secret"):
        validate_object(sm, K8S_VERSIONS[-1])


# ---- what the issue asks of each object --------------------------------------------------------------


def test_agent_daemonset_is_least_privilege_with_a_documented_fallback() -> None:
    ds = _find("DaemonSet", "fleetprof-agent")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert pod["hostPID"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    required = {"BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH"}
    assert required <= set(sc["capabilities"]["add"])
    assert "NET_ADMIN" not in sc["capabilities"]["add"]
    text = (DEPLOY / "kubernetes" / "30-agent.yaml").read_text()
    assert "privileged: true" in text, "the privileged fallback must be documented next to the DaemonSet"


def test_agent_daemonset_mounts_env_tolerations_priority_and_probes() -> None:
    ds = _find("DaemonSet", "fleetprof-agent")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {m["name"]: m for m in c["volumeMounts"]}
    for path in (
        "/sys/kernel/debug",
        "/sys/kernel/tracing",
        "/sys/fs/cgroup",
        "/sys/fs/bpf",
        "/lib/modules",
        "/usr/src",
        "/proc",
        "/var/lib/kubelet/pod-resources",
    ):
        names = [n for n, p in host_paths.items() if p == path]
        assert names and names[0] in mounted, f"host {path} is not mounted"
    for ro in ("/lib/modules", "/usr/src", "/proc", "/sys/fs/cgroup"):
        name = next(n for n, p in host_paths.items() if p == ro)
        assert mounted[name].get("readOnly") is True, f"{ro} should be read-only"
    socket = next(a for a in c["args"] if a.startswith("--pod-resources-socket="))
    assert socket.split("=", 1)[1].startswith(mounted["pod-resources"]["mountPath"] + "/")
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert any(t.get("key") == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    assert pod["priorityClassName"] == "system-node-critical"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert _mebibytes(limits["memory"]) >= 220, "below ~220 Mi BCC's compile at start gets OOM-killed"
    assert _mebibytes(requests["memory"]) <= _mebibytes(limits["memory"]) and "cpu" in requests
    port = c["ports"][0]
    http = next(a for a in c["args"] if a.startswith("--http="))
    assert http == f"--http=0.0.0.0:{port['containerPort']}"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}


def _mebibytes(q: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", q)
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1 / 2**20)


def test_collector_is_a_non_root_statefulset_with_its_store_on_a_claim() -> None:
    sts = _find("StatefulSet", "fleetprof-collector")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    data_dir = next(a for a in c["args"] if a.startswith("--data-dir=")).split("=", 1)[1]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in c["volumeMounts"]
    assert sts["spec"]["serviceName"] in {
        o["metadata"]["name"] for o in manifest_objects() if o["kind"] == "Service"
    }
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_services_route_to_the_ports_the_processes_listen_on() -> None:
    sts = _find("StatefulSet", "fleetprof-collector")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    listen = {
        a.split("=")[0]: int(a.rsplit(":", 1)[1]) for a in c["args"] if a.startswith(("--grpc=", "--http="))
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert listen == {"--grpc": ports["grpc"], "--http": ports["http"]}
    svc = _find("Service", "fleetprof-collector")
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 7470, "http": 7471}
    ds = _find("DaemonSet", "fleetprof-agent")
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    target = next(a for a in agent["args"] if a.startswith("--collector=")).split("=", 1)[1]
    host, port = target.rsplit(":", 1)
    assert host == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")


def test_rbac_lets_the_agent_only_read_pods() -> None:
    role = _find("ClusterRole", "fleetprof-agent")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = _find("ClusterRoleBinding", "fleetprof-agent")
    ds = _find("DaemonSet", "fleetprof-agent")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": ds["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": "fleetprof",
        }
    ]
    collector_sa = _find("ServiceAccount", "fleetprof-collector")
    assert collector_sa["automountServiceAccountToken"] is False


def test_service_monitors_scrape_each_target_once_and_keep_pod_labels() -> None:
    services = [o for o in manifest_objects() if o["kind"] == "Service"]
    for sm in (o for o in manifest_objects() if o["kind"] == "ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if sel.items() <= s["metadata"].get("labels", {}).items()]
        assert len(matched) == 1, (
            f"{sm['metadata']['name']} selects {[s['metadata']['name'] for s in matched]}"
        )
        ports = {p["name"] for p in matched[0]["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    collector = _find("ServiceMonitor", "fleetprof-collector")
    assert collector["spec"]["endpoints"][0]["honorLabels"] is True
    agent = _find("ServiceMonitor", "fleetprof-agent")
    relabel = agent["spec"]["endpoints"][0]["relabelings"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in relabel


def test_tokens_come_from_secrets_the_readme_creates_not_from_the_manifests() -> None:
    """No Secret in the manifests (a token there would be every cluster's); the Secrets they reference are
    exactly those deploy/README.md's `kubectl create secret` commands make, keys included."""
    assert not [o for o in manifest_objects() if o["kind"] == "Secret"]
    made = readme_secrets()
    assert made == {"fleetprof-ingest-token": {"token"}, "fleetprof-api-token": {"token"}}
    referenced: dict[str, set[str]] = {}
    for w in (_find("StatefulSet"), _find("DaemonSet")):
        for src in secret_sources(w):
            referenced.setdefault(src["name"], set()).update(i["key"] for i in src["items"])
    creds = _find("ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]["authorization"][
        "credentials"
    ]
    referenced.setdefault(creds["name"], set()).add(creds["key"])
    assert referenced == made


def test_collector_and_agent_read_their_tokens_from_mounted_secrets() -> None:
    sts, ds = _find("StatefulSet", "fleetprof-collector"), _find("DaemonSet", "fleetprof-agent")
    assert assert_file_flags_are_mounted(sts, {}) == {
        "--auth-token-file": ("fleetprof-ingest-token", "token"),
        "--api-token-file": ("fleetprof-api-token", "token"),
    }
    assert assert_file_flags_are_mounted(ds, {}) == {"--auth-token-file": ("fleetprof-ingest-token", "token")}
    # The agent's pod references the ingest token's Secret alone: its node cannot read the API token.
    assert {s["name"] for s in secret_sources(ds)} == {"fleetprof-ingest-token"}
    sm = _find("ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    assert sm["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "fleetprof-api-token", "key": "token"},
    }
    assert "authorization" not in _find("ServiceMonitor", "fleetprof-agent")["spec"]["endpoints"][0]


def test_network_policies_select_real_pods_and_open_the_listening_ports() -> None:
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in manifest_objects()
        if "template" in o.get("spec", {})
    }
    for np in (o for o in manifest_objects() if o["kind"] == "NetworkPolicy"):
        sel = np["spec"]["podSelector"]["matchLabels"]
        target = pods[np["metadata"]["name"]]
        assert sel.items() <= target["metadata"]["labels"].items()
        listening = {p["containerPort"] for p in target["spec"]["containers"][0]["ports"]}
        opened = {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]}
        assert opened == listening
    grpc_rule = _find("NetworkPolicy", "fleetprof-collector")["spec"]["ingress"][0]
    agent_labels = pods["fleetprof-agent"]["metadata"]["labels"]
    assert grpc_rule["ports"] == [{"protocol": "TCP", "port": 7470}]
    assert grpc_rule["from"][0]["podSelector"]["matchLabels"].items() <= agent_labels.items()


# ---- flags against the CLI ---------------------------------------------------------------------------


def test_help_parsing_finds_the_known_flags() -> None:
    assert {"--collector", "--http", "--node", "--frequency", "--interval"} <= cli_flags("agent")
    assert {"--grpc", "--http", "--retention"} <= cli_flags("collector")
    assert "--grpc" not in cli_flags("agent")


@pytest.mark.parametrize("kind", ["DaemonSet", "StatefulSet"])
def test_manifest_flags_are_accepted_by_the_cli(kind: str) -> None:
    assert_flags_accepted(_find(kind))


@pytest.mark.parametrize("name", ["agent", "collector"])
def test_dockerfiles_build_the_documented_images(name: str) -> None:
    text = (DEPLOY / f"Dockerfile.{name}").read_text()
    # Debian-based: FROM the BASE argument, which is Debian's image unless scripts/images.sh names its own
    # build of it (for an architecture other than the building machine's); fleetprof's own pure-Python files
    # are installed by a stage on the building machine's platform, so no step of theirs runs emulated.
    assert re.search(r"^ARG BASE=debian:\S+$", text, re.M)
    assert re.search(r"^FROM --platform=\$TARGETPLATFORM \$\{BASE\}$", text, re.M)
    assert re.search(r"^FROM --platform=\$BUILDPLATFORM \$\{BUILD_BASE\} AS package$", text, re.M)
    assert re.search(r"^COPY --from=package /out/ /opt/fleetprof/$", text, re.M)
    assert not re.search(r"amd64|x86_64|arm64|aarch64", text), "a Dockerfile builds every architecture alike"
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entry == ["fleetprof"] and cmd[0] == name
    unknown = sorted(set(flags_used(cmd)) - cli_flags(name))
    assert not unknown, f"Dockerfile.{name} CMD uses {unknown}"
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", text, re.M)[0].split()}
    workload = _find("DaemonSet" if name == "agent" else "StatefulSet")
    assert exposed == {
        p["containerPort"] for p in workload["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    if name == "agent":
        assert re.search(r"\bpython3-bpfcc\b", text) and re.search(r"\bbpfcc-tools\b", text)
    else:
        user = re.search(r"^USER (\d+)", text, re.M)
        assert user and int(user.group(1)) != 0, "the collector image runs as a numeric non-root user"
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == int(user.group(1))


# ---- Grafana -----------------------------------------------------------------------------------------


PROMETHEUS_DS = {"type": "prometheus", "uid": "${datasource}"}
PYROSCOPE = "grafana-pyroscope-datasource"
# The collector as Grafana's Pyroscope data source, picked by the dashboard's `profiles` variable.
PROFILES_DS = {"type": PYROSCOPE, "uid": "${profiles}"}
OVERVIEW = DEPLOY / "grafana" / "dashboards" / "fleetprof-overview.json"


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = []
    panels = list(dashboard["panels"])
    while panels:
        p = panels.pop()
        panels.extend(p.get("panels", []))
        exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q.strip())
            exprs.append(m.group(1) if m else q)
    return exprs


_PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names
    (inside {} or a by/without/on/ignoring/group_x list), durations or Grafana variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", s):
        if m.group(2) or m.group(1).lower() in _PROMQL_KEYWORDS:
            continue
        names.add(m.group(1))
    return names


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, syscall) (rate(fleetprof_syscall_duration_seconds_bucket"
        '{node=~"$node", syscall!="read"}[$__rate_interval]))) / on (node) group_left(pod) '
        "max without (gpu) (fleetprof_gpu_power_watts offset 5m) > bool 0.9"
    )
    assert promql_metric_names(expr) == {
        "fleetprof_syscall_duration_seconds_bucket",
        "fleetprof_gpu_power_watts",
    }
    assert promql_metric_names('sum(up{job=~"$agent_job"})') == {"up"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboards_are_valid_grafana_json(path: Path) -> None:
    d = json.loads(path.read_text())
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = []
    panels = list(d["panels"])
    while panels:
        p = panels.pop()
        panels.extend(p.get("panels", []))
        ids.append(p["id"])
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"] in (PROMETHEUS_DS, PROFILES_DS), p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    for expr in dashboard_exprs(d):
        for used in re.findall(r"\$(\w+)", expr):
            assert used.startswith("__") or used in variables, f"${used} is not a dashboard variable"
    titles = " ".join(p.get("title", "") for p in d["panels"]).lower()
    for topic in ("cpu by namespace", "cpu by pod", "cpu flame graph", "cpu while the gpus idle", "syscall",
                  "latency", "gpu utilization", "gpu memory", "gpu power", "gpu-idle pods", "agent cpu",
                  "agent memory", "agents up"):  # fmt: skip
        assert topic in titles, f"no panel about {topic!r}"


def test_grafana_provisioning_points_at_the_dashboards() -> None:
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "fleetprof.yaml").read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


def _provisioned_collector_source() -> dict:
    prov = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "fleetprof.yaml").read_text()
    )
    assert prov["apiVersion"] == 1
    (source,) = prov["datasources"]
    return source


def test_grafana_provisions_the_collector_with_the_api_token_from_its_environment() -> None:
    source = _provisioned_collector_source()
    assert source["type"] == "grafana-pyroscope-datasource" and source["access"] == "proxy"
    svc = _find("Service", "fleetprof-collector")
    http = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    assert source["url"] == f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{http}"
    assert source["jsonData"] == {"httpHeaderName1": "Authorization"}
    # Grafana expands ${VAR} in provisioning files from its environment; the token is never in the file.
    assert source["secureJsonData"] == {"httpHeaderValue1": "Bearer ${FLEETPROF_API_TOKEN}"}


# ---- flame graph panels: the collector as Grafana's Pyroscope data source ------------------------------


@dataclass(frozen=True)
class ProfileQuery:
    where: str  # panel title and refId
    panel: dict
    target: dict  # the query model Grafana's Pyroscope data source reads (GrafanaPyroscopeDataQuery)

    @property
    def panel_type(self) -> str:
        return self.panel["type"]


def profile_queries(dashboard: dict) -> list[ProfileQuery]:
    """Every query of the dashboard that goes to a Pyroscope-type data source."""
    out = []
    panels = list(dashboard["panels"])
    while panels:
        p = panels.pop(0)
        panels.extend(p.get("panels", []))
        for t in p.get("targets", []):
            if (t.get("datasource") or p.get("datasource") or {}).get("type") == PYROSCOPE:
                out.append(ProfileQuery(f"panel {p['title']!r} {t['refId']}", p, t))
    return out


_GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)\]\]")


def _regex_escape(value: str) -> str:
    return re.sub(r"[\\^$*+?.()|\[\]{}/]", lambda m: "\\" + m.group(), value)


# Grafana's formats (${var:format}) for a list of selected values; no format is glob.
_FORMATS = {
    "glob": lambda vs: vs[0] if len(vs) == 1 else "{" + ",".join(vs) + "}",
    "pipe": "|".join,
    "regex": lambda vs: (
        _regex_escape(vs[0]) if len(vs) == 1 else "(" + "|".join(map(_regex_escape, vs)) + ")"
    ),
}


def grafana_interpolate(text: str, dashboard: dict, selected: Mapping[str, Sequence[str]] = {}) -> str:
    """`text` with the dashboard's variables replaced as Grafana's template service replaces them in a
    Pyroscope query (its datasource calls templateSrv.replace with no format of its own): a variable not in
    `selected` is "All", which with a custom allValue is that value, unformatted; a selection is formatted
    by the reference's format, glob where it names none (a single value as it is, several as {a,b})."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}

    def value(m: re.Match) -> str:
        name, fmt = m.group(1) or m.group(3) or m.group(4), m.group(2) or "glob"
        if name not in variables:
            raise AssertionError(f"${name} in {text!r} is not a dashboard variable")
        if name not in selected:
            assert variables[name].get("allValue"), f"${name} has no allValue: All would list every value"
            return variables[name]["allValue"]
        if fmt not in _FORMATS:
            raise AssertionError(f"${{{name}:{fmt}}} in {text!r}: format {fmt!r} is not modelled here")
        return _FORMATS[fmt](list(selected[name]))

    return _GRAFANA_VARIABLE.sub(value, text)


def _profile_selector(
    q: ProfileQuery, dashboard: dict, selected: Mapping[str, Sequence[str]] = {}
) -> Selector:
    text = grafana_interpolate(q.target["labelSelector"], dashboard, selected)
    try:
        return parse_selector(text)
    except ValueError as err:
        raise AssertionError(f"{q.where}: the collector refuses {text!r}: {err}") from None


def test_flame_graph_panels_take_the_provisioned_collector_as_their_data_source() -> None:
    d = json.loads(OVERVIEW.read_text())
    (var,) = [v for v in d["templating"]["list"] if v["name"] == PROFILES_DS["uid"][2:-1]]
    # A data source variable over Pyroscope-type sources whose default is the one deploy/grafana provisions.
    assert var["type"] == "datasource" and var["query"] == PYROSCOPE
    assert var["current"]["value"] == _provisioned_collector_source()["uid"] == "fleetprof"
    queries = profile_queries(d)
    assert {q.panel_type for q in queries} == {"flamegraph", "timeseries"}
    for q in queries:
        assert q.panel["datasource"] == q.target["datasource"] == PROFILES_DS, q.where
        assert q.target["profileTypeId"] in PROFILE_TYPES, q.where
        # Grafana's query model (GrafanaPyroscopeDataQuery): profile = SelectMergeStacktraces, a flame
        # graph; metrics = SelectSeries, a time series.
        assert q.target["queryType"] == {"flamegraph": "profile", "timeseries": "metrics"}[q.panel_type]
        assert isinstance(q.target["groupBy"], list) and all(
            re.fullmatch(r"\w+", n) for n in q.target["groupBy"]
        )
        if q.panel_type == "flamegraph":
            assert q.target["groupBy"] == [] and "limit" not in q.target
    flames = [q for q in queries if q.panel_type == "flamegraph"]
    gpu_states = sorted(
        next((m.value for m in _profile_selector(q, d).matchers if m.name == "gpu_state"), "any")
        for q in flames
    )
    assert gpu_states == ["any", "idle"], "one flame graph of all CPU, one of CPU while the GPUs idle"
    series = [q for q in queries if q.panel_type == "timeseries"]
    assert [q.target["groupBy"] for q in series] == [["namespace", "pod"]]


SELECTIONS = {
    "all": {},
    "one namespace, two pods": {"namespace": ["ml"], "pod": ["trainer-0", "trainer-1"]},
    "a node, two namespaces": {"node": ["gpu-node-1"], "namespace": ["ml", "web"]},
}


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_profile_selectors_parse_and_follow_the_dashboard_variables(selection: str) -> None:
    """Each labelSelector, its variables replaced as Grafana replaces them, is one the collector parses, and
    the node, namespace and pod variables each narrow the label of their name."""
    d = json.loads(OVERVIEW.read_text())
    chosen = SELECTIONS[selection]
    for q in profile_queries(d):
        sel = _profile_selector(q, d, chosen)
        idle = any(m.name == "gpu_state" for m in sel.matchers)
        labels = {"node": "gpu-node-1", "namespace": "ml", "pod": "trainer-1", "comm": "python3"}
        labels |= {"gpu_state": "idle"} if idle else {}
        assert sel.matches(labels), f"{q.where}: {sel} misses {labels}"
        for name, other in (("node", "cpu-node-9"), ("namespace", "kube-system"), ("pod", "trainer-10")):
            assert sel.matches(labels | {name: other}) == (name not in chosen), f"{q.where}: {sel}, {name}"
        if idle:
            busy, none = labels | {"gpu_state": "busy"}, {k: v for k, v in labels.items() if k != "gpu_state"}
            assert not sel.matches(busy) and not sel.matches(none), f"{q.where}: {sel}"
        # A process outside any pod counts in the flame graphs when no namespace or pod is chosen, and is
        # never a line of a by-pod series.
        host = {"node": "gpu-node-1", "comm": "systemd"} | ({"gpu_state": "idle"} if idle else {})
        in_flames = q.panel_type == "flamegraph" and not {"namespace", "pod"} & chosen.keys()
        assert sel.matches(host) == in_flames, f"{q.where}: {sel}"


FREQUENCY_HZ = 19
PERIOD_NS = round(1e9 / FREQUENCY_HZ)
# (namespace, pod, comm): (busy, idle, no-GPU) samples, pushed by one agent on gpu-node-1.
PUSHED = {
    ("ml", "trainer-0", "python3"): (30, 10, 0),
    ("ml", "trainer-1", "python3"): (20, 5, 0),
    ("web", "web-0", "nginx"): (0, 0, 15),
    ("", "", "systemd"): (0, 0, 4),
}


@pytest.fixture(scope="module")
def profiled_collector() -> Iterator[RunningCollector]:
    from tests.conftest import start_collector

    col = start_collector()
    b = BatchBuilder(node="gpu-node-1", frequency_hz=FREQUENCY_HZ)
    stack = {
        state: b.stack([("main", "app"), (f"{state}_work", "app")]) for state in ("busy", "idle", "plain")
    }
    for pid, ((ns, pod, comm), counts) in enumerate(PUSHED.items(), start=100):
        labels = {"namespace": ns, "pod": pod, "container": "main"} if pod else {}
        proc = b.process(pid, comm, labels)
        for (state, gpu), n in zip(
            (("busy", pb.GPU_STATE_BUSY), ("idle", pb.GPU_STATE_IDLE), ("plain", pb.GPU_STATE_NONE)),
            counts,
            strict=True,
        ):
            if n:
                b.sample(proc, stack[state], n, gpu)
    running = RunningCollector(col)
    try:
        assert push(running.grpc_target, [b.build()]) == [1]
        yield running
    finally:
        col.stop()


def connect_call(
    base_url: str, method: str, request: Message, response_cls: type[Message], headers: Mapping[str, str] = {}
) -> Message | tuple[int, dict]:
    """One unary call as Grafana's Connect client sends it: POST, an unframed protobuf body. The answer
    decoded, or (status, error JSON)."""
    req = urllib.request.Request(
        f"{base_url}/querier.v1.QuerierService/{method}",
        data=request.SerializeToString(),
        headers={"Content-Type": "application/proto", "Connect-Protocol-Version": "1", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "application/proto"
            return response_cls.FromString(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grafana_request(
    q: ProfileQuery, label_selector: str, start_ms: int, end_ms: int
) -> tuple[str, Message, type[Message]]:
    """The request Grafana's Pyroscope backend makes for a query (pkg/tsdb/grafana-pyroscope-datasource
    query.go): profile -> SelectMergeStacktraces, metrics -> SelectSeries with step max(interval, minStep
    15 s) in seconds."""
    t = q.target
    if t["queryType"] == "profile":
        req = querier_pb2.SelectMergeStacktracesRequest(
            profile_typeID=t["profileTypeId"], label_selector=label_selector, start=start_ms, end=end_ms
        )
        if "maxNodes" in t:
            req.max_nodes = t["maxNodes"]
        return "SelectMergeStacktraces", req, querier_pb2.SelectMergeStacktracesResponse
    req = querier_pb2.SelectSeriesRequest(
        profile_typeID=t["profileTypeId"],
        label_selector=label_selector,
        start=start_ms,
        end=end_ms,
        group_by=t["groupBy"],
        step=15.0,
    )
    if "limit" in t:
        req.limit = t["limit"]
    return "SelectSeries", req, querier_pb2.SelectSeriesResponse


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_profile_panels_draw_from_a_real_collector(
    profiled_collector: RunningCollector, selection: str
) -> None:
    """Each Pyroscope query of the dashboard, sent to a real collector as Grafana's data source sends it
    (the last hour, the variables replaced), is answered 200 with exactly the pushed samples it selects."""
    d = json.loads(OVERVIEW.read_text())
    chosen = SELECTIONS[selection]

    def wanted(ns: str, pod: str, node: str = "gpu-node-1") -> bool:
        return all(v in chosen.get(k, [v]) for k, v in (("node", node), ("namespace", ns), ("pod", pod)))

    end_ms = int(time.time() * 1000) + 60_000
    for q in profile_queries(d):
        text = grafana_interpolate(q.target["labelSelector"], d, chosen)
        method, req, cls = grafana_request(q, text, end_ms - 3_600_000 - 60_000, end_ms)
        got = connect_call(profiled_collector.url, method, req, cls)
        assert isinstance(got, cls), f"{q.where}: {method} {text!r} answered {got}"
        idle = 'gpu_state="idle"' in text
        picked = {k: c for k, c in PUSHED.items() if wanted(*k[:2])}
        if method == "SelectMergeStacktraces":
            samples = sum(c[1] if idle else sum(c) for c in picked.values())
            assert got.flamegraph.total == samples * PERIOD_NS, f"{q.where}: {text}"
            assert got.flamegraph.names[0] == "total"
        else:
            lines = {
                tuple(sorted((pair.name, pair.value) for pair in s.labels)): sum(p.value for p in s.points)
                for s in got.series
            }
            assert lines == {
                (("namespace", ns), ("pod", pod)): sum(c) * PERIOD_NS
                for (ns, pod, _), c in picked.items()
                if pod
            }, f"{q.where}: {text}"


# ---- dashboard metric names against the real exporters -----------------------------------------------

# Series Prometheus itself adds to every target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def _realistic_batches() -> list[pb.Batch]:
    """What an agent on a GPU node sends: pod-labelled CPU samples, syscalls, sampler stats, GPUs."""
    b = make_batch(count=190)
    s = list(b.strings)
    for key, value in (("namespace", "ml"), ("pod", "trainer-0"), ("container", "main"), ("pod_uid", "u-1")):
        s += [key, value]
        b.processes[0].labels.append(pb.Label(name=len(s) - 2, value=len(s) - 1))
    del b.strings[:]
    b.strings.extend(s)
    b.stats.CopyFrom(pb.SamplerStats(samples=190, user_stack_missing=3, stack_table_full=1))
    with_syscalls(
        b, [("read", 1000, 62, 62 * 3_000, hist(b11=60, b20=2)), ("futex", 40, 3, 3 * 10**6, hist(b19=3))]
    )
    strings = list(b.strings)

    def sid(text: str) -> int:
        if text not in strings:
            strings.append(text)
            b.strings.append(text)
        return strings.index(text)

    now = b.end_unix_ns
    samples = [
        pb.GpuSample(
            time_unix_ns=now - (3 - i) * 10**9,
            gpu_utilization_percent=97 - 40 * (i == 2),
            memory_utilization_percent=40,
            memory_used_bytes=30 << 30,
            memory_total_bytes=80 << 30,
            power_milliwatts=350_000,
            energy_millijoules=10**9 + i * 350_000,
            temperature_celsius=61,
            sm_clock_mhz=1980,
        )
        for i in range(3)
    ]
    b.gpu_devices.append(
        pb.GpuDevice(
            index=0,
            uuid=sid("GPU-8a1c"),
            name=sid("NVIDIA H100 80GB HBM3"),
            samples=samples,
            xid_errors=1,
            xid_codes=[79],
            xid_watched=True,
            owner_namespace=sid("ml"),
            owner_pod=sid("trainer-0"),
            owner_container=sid("main"),
        )
    )
    b.gpu_processes.append(
        pb.GpuProcessUsage(
            process=0,
            device=0,
            polls=3,
            state_polls=3,
            idle_polls=1,
            memory_used_bytes=29 << 30,
            sm_utilization_percent=80,
            memory_utilization_percent=35,
        )
    )
    b.gpu_source.CopyFrom(pb.GpuSource(up=True, state=sid("up"), idle_below_percent=5))
    second = pb.Batch()
    second.CopyFrom(b)
    second.sequence = 2
    second.start_unix_ns, second.end_unix_ns = b.end_unix_ns, b.end_unix_ns + 10**9
    return [b, second]


def _exposed(text: str) -> tuple[set[str], dict[str, str]]:
    """Sample names that have at least one series, and each family's type."""
    samples, types = set(), {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        samples.update(s.name for s in fam.samples)
    return samples, types


@pytest.fixture(scope="module")
def collector_exposition() -> str:
    from tests.conftest import start_collector

    col = start_collector()
    try:
        target = f"127.0.0.1:{col.grpc_port}"
        batches = _realistic_batches()
        push(target, batches)
        push(target, batches[:1])  # a resend: counted as a duplicate
        bad = make_batch(seq=1)
        bad.sample_columns.stack[0] = 99
        with pytest.raises(grpc.RpcError):
            push(target, [bad])  # a refused batch: a rejected{reason} series
        return http_get(f"http://127.0.0.1:{col.http_port}/metrics").decode()
    finally:
        col.stop()


@pytest.fixture(scope="module")
def agent_exposition() -> str:
    """The /metrics of a real Agent object over its own HTTP server (no BPF is loaded for this)."""
    from fleetprof.agent.main import Agent, AgentConfig

    port = free_port()
    agent = Agent(
        AgentConfig(http=f"127.0.0.1:{port}", kubernetes=False, pod_resources_socket="/nonexistent")
    )
    agent.http.start()
    try:
        return http_get(f"http://127.0.0.1:{port}/metrics").decode()
    finally:
        agent.http.stop()


def _check_names(names: set[str], samples: set[str], types: dict[str, str]) -> list[str]:
    problems = []
    for name in sorted(names):
        if name in PROMETHEUS_SYNTHETIC:
            continue
        if name not in samples:
            problems.append(f"{name}: not exported")
            continue
        for suffix, kinds in (("_bucket", {"histogram"}), ("_total", {"counter"})):
            family = name.removesuffix(suffix)
            if name.endswith(suffix) and family in types and types[family] not in kinds:
                problems.append(f"{name}: {family} is a {types[family]}, not a {'/'.join(kinds)}")
    return problems


def _dashboard_names(agent: bool) -> set[str]:
    names = set()
    for path in DASHBOARDS:
        for expr in dashboard_exprs(json.loads(path.read_text())):
            names |= promql_metric_names(expr)
    is_agent = {n for n in names if n.startswith(("fleetprof_agent_", "process_"))} - {
        "fleetprof_agent_sampler_events_total"  # the collector's count of what agents report
    }
    return is_agent if agent else names - is_agent


def test_dashboard_collector_metrics_are_exported_by_the_collector(collector_exposition: str) -> None:
    names = _dashboard_names(agent=False)
    assert "fleetprof_syscalls_total" in names and "fleetprof_cpu_seconds_total" in names
    problems = _check_names(names, *_exposed(collector_exposition))
    assert not problems, "dashboard PromQL uses series the collector does not export:\n" + "\n".join(problems)


def test_dashboard_agent_metrics_are_exported_by_the_agent(agent_exposition: str) -> None:
    names = _dashboard_names(agent=True)
    assert "process_cpu_seconds_total" in names and "fleetprof_agent_drain_duration_seconds_bucket" in names
    problems = _check_names(names, *_exposed(agent_exposition))
    assert not problems, "dashboard PromQL uses series the agent does not export:\n" + "\n".join(problems)
