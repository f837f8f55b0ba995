"""The Helm chart: values against values.schema.json, every rendered object against the Kubernetes schemas.

Rendering: with a `helm` binary on PATH the tests run the real `helm lint` and `helm template`. Helm is
not installable on this machine kind (Debian has no package; PyPI's helm-package ships macOS/Windows
binaries only; helm-sdkpy needs Python >= 3.12 and has no client-only template action; npm has none), so
the chart is also rendered by `render_chart` (tests/support/gotemplate.py): an interpreter for exactly the
subset of Go text/template + Sprig the chart's templates use. It raises on any construct or function it does
not know, so a template that strays outside the subset fails here instead of being rendered wrongly. Helm's
`lookup` is modelled: `render_chart(cluster=[...])` is `helm upgrade` against those objects, without it
`helm template` (lookup finds nothing).

Tokens and TLS are checked as wiring (each flag's file comes from a mounted Secret the render or the
values account for) and then run: a real collector started with the StatefulSet's args on the files the
kubelet would write, taking an agent, Prometheus and Grafana configured as the render configures them.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from google.protobuf.message import Message

from fleetprof._proto.pyroscope import querier_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.agent.shipper import Shipper
from fleetprof.auth import TokenFile
from fleetprof.cli.parser import build_parser
from fleetprof.tls import ClientTls, ClientTlsConfig
from tests.conftest import REPO, free_port, stop_process, wait_until
from tests.deploy.test_deploy import PROFILES_DS, grafana_interpolate, grafana_request, profile_queries
from tests.support.certs import Ca
from tests.support.gotemplate import (
    CHART,
    Renderer,
    TemplateError,
    all_objects,
    chart_values,
    parse,
    render_chart,
    render_notes,
)
from tests.support.manifests import (
    DEPLOY,
    K8S_VERSIONS,
    TLS_SECRET_KEYS,
    assert_file_flags_are_mounted,
    assert_flags_accepted,
    manifest_objects,
    readme_secrets,
    secret_sources,
    validate_object,
)
from tests.support.wire import BatchBuilder, make_batch


def test_values_yaml_validates_against_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart_values())


_ISSUER = {"enabled": True, "issuerRef": {"name": "fleet-ca"}}


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"agent": {"frequency": 0}}, "frequency"),
        ({"agent": {"frequncy": 19}}, "frequncy"),
        ({"agent": {"syscallLatencySample": "16"}}, "syscallLatencySample"),
        ({"agent": {"debuginfod": {"urls": ["debuginfod.debian.net"]}}}, "agent.debuginfod.urls"),
        ({"agent": {"debuginfod": {"cacheSize": "1 GB"}}}, "agent.debuginfod.cacheSize"),
        ({"collector": {"retention": "forever"}}, "retention"),
        ({"clickhouse": {"enabled": True}}, "clickhouse.url"),  # ClickHouse needs its URL
        ({"clickhouse": {"enabled": True, "url": "http://ch:8123/db"}}, "clickhouse.url"),
        ({"collector": {"replicas": 0}}, "collector.replicas"),
        ({"collector": {"persistence": {"accessModes": ["ReadWriteSometimes"]}}}, "accessModes"),
        ({"auth": {"enabled": "yes"}}, "auth.enabled"),
        ({"auth": {"apiToken": {"key": ""}}}, "auth.apiToken.key"),
        ({"auth": {"ingestToken": {"existingSecret": "My_Secret"}}}, "auth.ingestToken.existingSecret"),
        # TLS needs a certificate from somewhere, and cert-manager an issuer
        ({"tls": {"enabled": True}}, "tls.existingSecret"),
        ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "tls.certManager.issuerRef.name"),
        (
            {
                "tls": {
                    "enabled": True,
                    "certManager": {**_ISSUER, "issuerRef": {"name": "x", "kind": "Issuers"}},
                }
            },
            "tls.certManager.issuerRef.kind",
        ),
        (
            {"tls": {"enabled": True, "existingSecret": "t", "certManager": _ISSUER}},
            "tls.certManager.enabled",
        ),
        ({"tls": {"certManager": _ISSUER}}, "tls.certManager.enabled"),  # without tls.enabled: refused
        ({"tls": {"mutual": {"enabled": True}}}, "tls.mutual.enabled"),
        # mutual TLS without cert-manager: the agents' certificate must be given
        (
            {"tls": {"enabled": True, "existingSecret": "t", "mutual": {"enabled": True}}},
            "tls.mutual.existingSecret",
        ),
        ({"tls": {"enabled": True, "existingSecret": "t", "serverName": "Not A Name"}}, "tls.serverName"),
        (
            {"tls": {"enabled": True, "certManager": {**_ISSUER, "duration": "90d"}}},
            "tls.certManager.duration",
        ),
        ({"grafana": {"datasource": {"url": "collector:7471"}}}, "grafana.datasource.url"),
        ({"grafana": {"datasource": {"tlsCA": "x"}}}, "tlsCA"),
    ],
)
def test_the_schema_refuses_bad_values(bad: dict, where: str) -> None:
    """Each bad value is refused with an error that names it (Helm prints every error, as here)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(chart_values(bad)))
    assert errors, f"{bad} was accepted"
    said = [".".join(map(str, e.absolute_path)) + ": " + e.message for e in errors]
    assert any(where in line for line in said), said


def test_every_values_key_is_documented() -> None:
    """values.yaml explains its keys: each top-level block and each leaf that is not self-evident has a
    comment above it or in its block."""
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    commented = sum(1 for line in lines if line.strip().startswith("#"))
    assert commented >= 30
    for top in chart_values():
        i = next(n for n, line in enumerate(lines) if line.startswith(f"{top}:"))
        window = lines[max(0, i - 3) : i + 4]
        assert any("#" in w for w in window), f"values.yaml: {top} has no comment near it"


def test_the_renderer_follows_go_template_semantics() -> None:
    """The interpreter itself: trim markers, pipelines, with/range/else, include, and refusing the unknown."""
    tree = parse('a {{- " b" -}} c{{ if .x }}X{{ else }}Y{{ end }}{{ range .l }}[{{ . }}]{{ end }}')
    assert Renderer({}).render(tree, {"x": 0, "l": [1, "z"]}, {}) == "a bcY[1][z]"
    tree = parse('{{ with .m }}{{ .k | quote }}{{ end }}{{ printf "%s-%v" "p" 7 | trunc 3 }}')
    assert Renderer({}).render(tree, {"m": {"k": "v"}}, {}) == '"v"p-7'
    tree = parse('{{ define "d" }}n={{ .n }}{{ end }}{{ include "d" . | nindent 2 }}')
    defines = {n[1]: n[2] for n in tree if isinstance(n, list)}
    assert Renderer(defines).render(tree, {"n": 3}, {}) == "\n  n=3"
    with pytest.raises(TemplateError, match="tpl"):
        Renderer({}).render(parse('{{ tpl "x" . }}'), {}, {})
    # `=` assigns the variable of the enclosing block; `:=` in a block declares a new one there.
    tree = parse("{{ $a := 1 }}{{ $b := 1 }}{{ if true }}{{ $a = 2 }}{{ $b := 3 }}{{ end }}{{ $a }}{{ $b }}")
    assert Renderer({}).render(tree, {}, {}) == "21"
    # A function name as an argument is called (`default dict`); and/or return an operand, as Go's do.
    tree = parse('{{ get (.m | default dict) "k" | default "none" }} {{ and 1 0 }} {{ or 0 "" "x" }}')
    assert Renderer({}).render(tree, {"m": None}, {}) == "none 0 x"
    # lookup finds what `cluster` holds, else an empty map (what `helm template` sees).
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s", "namespace": "n"},
        "data": {"k": "dg=="},
    }
    tree = parse(
        '{{ $s := lookup "v1" "Secret" "n" "s" | default dict }}'
        '[{{ get (get $s "data" | default dict) "k" | b64dec }}]'
    )
    assert Renderer({}, [secret]).render(tree, {}, {}) == "[v]"
    assert Renderer({}).render(tree, {}, {}) == "[]"
    tokens = {Renderer({}).render(parse("{{ randAlphaNum 48 }}"), {}, {}) for _ in range(3)}
    assert len(tokens) == 3 and all(re.fullmatch(r"[A-Za-z0-9]{48}", t) for t in tokens)


@pytest.fixture(scope="module")
def default_render() -> dict[str, list[dict]]:
    return render_chart()


ARCH_WORDS = re.compile(r"kubernetes\.io/arch|amd64|x86_64|arm64|aarch64")


def test_manifests_and_chart_deploy_unchanged_on_mixed_architecture_clusters(
    default_render: dict[str, list[dict]],
) -> None:
    """Nothing selects or names an architecture: the agent's DaemonSet lands on x86-64 and arm64 nodes
    alike, each pulling its own architecture of the one image name (a manifest list, deploy/README.md)."""
    for objects in (manifest_objects(), list(all_objects(default_render))):
        for obj in objects:
            text = json.dumps(obj)
            found = ARCH_WORDS.search(text)
            assert not found, f"{obj['kind']} {obj['metadata']['name']} names {found.group()}"
    agent = next(o for o in all_objects(default_render) if o["kind"] == "DaemonSet")
    pod = agent["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "affinity" not in pod


def test_default_render_has_the_issue_objects(default_render: dict[str, list[dict]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in all_objects(default_render))
    assert kinds == [
        ("ClusterRole", "fleetprof-agent"),
        ("ClusterRoleBinding", "fleetprof-agent"),
        ("DaemonSet", "fleetprof-agent"),
        ("NetworkPolicy", "fleetprof-agent"),
        ("NetworkPolicy", "fleetprof-collector"),
        ("Secret", "fleetprof-api-token"),
        ("Secret", "fleetprof-ingest-token"),
        ("Service", "fleetprof-agent"),
        ("Service", "fleetprof-collector"),
        ("Service", "fleetprof-collector-headless"),
        ("ServiceAccount", "fleetprof-agent"),
        ("ServiceAccount", "fleetprof-collector"),
        ("ServiceMonitor", "fleetprof-agent"),
        ("ServiceMonitor", "fleetprof-collector"),
        ("StatefulSet", "fleetprof-collector"),
    ]


_HELM_ONLY_LABELS = {
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
}


def _without_helm_labels(obj: Any, key: str = "") -> Any:
    if isinstance(obj, dict):
        drop = _HELM_ONLY_LABELS if key in ("labels", "matchLabels", "selector") else set()
        return {k: _without_helm_labels(v, k) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [_without_helm_labels(v) for v in obj]
    return obj


def _generated_secrets(objects: list[dict]) -> dict[str, dict]:
    """The token Secrets the chart generates: name -> object."""
    return {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "Secret"
        and o["metadata"].get("annotations", {}).get("helm.sh/resource-policy") == "keep"
    }


def test_the_chart_renders_the_same_objects_as_the_plain_manifests() -> None:
    """Equal but for the token Secrets: the chart generates them; plain manifests cannot draw random values
    (one token in a manifest would be everyone's), so deploy/README.md has the command that makes them —
    the same names and keys."""
    objects = all_objects(render_chart({"namespace": {"create": True}}))
    generated = _generated_secrets(objects)
    chart = {
        (o["kind"], o["metadata"]["name"]): _without_helm_labels(o)
        for o in objects
        if o["metadata"]["name"] not in generated or o["kind"] != "Secret"
    }
    plain = {(o["kind"], o["metadata"]["name"]): _without_helm_labels(o) for o in manifest_objects()}
    assert sorted(chart) == sorted(plain)
    for key, obj in plain.items():
        assert chart[key] == obj, f"{key} differs between helm/ and deploy/kubernetes/"
    assert {name: set(o["data"]) for name, o in generated.items()} == readme_secrets()


VARIANTS = {
    "defaults": {},
    "ClickHouse, three collectors, a password Secret": {
        "clickhouse": {
            "enabled": True,
            "url": "clickhouse://fleetprof@clickhouse-fleet.ch.svc:9000/fleetprof?cluster=fleet",
            "passwordSecret": {"name": "clickhouse-fleetprof"},
        },
        "collector": {"replicas": 3},
    },
    "privileged, no persistence, no monitoring": {
        "agent": {"privileged": True},
        "collector": {"persistence": {"enabled": False}},
        "serviceMonitor": {"enabled": False},
        "networkPolicy": {"enabled": False},
    },
    "every agent flag": {
        "agent": {
            "syscalls": True,
            "syscallLatencySample": "1/64",
            "kubernetes": False,
            "podLabels": ["team", "app.kubernetes.io/name=app"],
            "collectorAddress": "collector.example:7470",
            "debuginfod": {"urls": ["https://debuginfod.debian.net", "http://debuginfod.infra:8002"]},
        },
        "collector": {"persistence": {"storageClassName": "fast"}},
        "grafana": {"dashboards": {"enabled": True}},
        "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
    },
    "syscalls off, another release name": {"agent": {"syscalls": False}, "fullnameOverride": "prof"},
    "tls from an existing Secret": {
        "tls": {"enabled": True, "existingSecret": "collector-cert"},
        "grafana": {"datasource": {"enabled": True, "namespace": "monitoring"}},
    },
    "tls by cert-manager, mutual, a Grafana data source": {
        "tls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "fleet-ca", "kind": "ClusterIssuer"}},
            "mutual": {"enabled": True},
        },
        "grafana": {
            "datasource": {
                "enabled": True,
                "namespace": "monitoring",
                "tlsCACert": "$__file{/etc/grafana/fleetprof/ca.crt}",
            }
        },
    },
    "the user's Secrets for tokens and certificates, mutual": {
        "auth": {
            "ingestToken": {"existingSecret": "fleet-ingest", "key": "ingest"},
            "apiToken": {"existingSecret": "fleet-api", "key": "api"},
        },
        "tls": {
            "enabled": True,
            "existingSecret": "collector-cert",
            "serverName": "profiles.example.internal",
            "mutual": {"enabled": True, "existingSecret": "agent-cert"},
        },
        "grafana": {"datasource": {"enabled": True}},
    },
    "auth off": {"auth": {"enabled": False}, "grafana": {"datasource": {"enabled": True}}},
    "the CUPTI library on every node": {
        "agent": {"cupti": {"enabled": True, "hostPath": "/opt/gpu/fleetprof"}}
    },
    "tls by cert-manager, each agent with its node's kubelet certificate": {
        "tls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "fleet-ca", "kind": "ClusterIssuer"}},
            "mutual": {"enabled": True, "nodeCertificates": "kubelet"},
        },
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rendered_object_is_valid_kubernetes(variant: str) -> None:
    objects = all_objects(render_chart(VARIANTS[variant]))
    assert objects
    for obj in objects:
        for version in K8S_VERSIONS:
            validate_object(obj, version)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_flags_are_accepted_by_the_cli(variant: str) -> None:
    objects = all_objects(render_chart(VARIANTS[variant]))
    workloads = [o for o in objects if o["kind"] in ("DaemonSet", "StatefulSet", "Deployment")]
    assert len(workloads) == 2
    for w in workloads:
        assert_flags_accepted(w)


def test_with_clickhouse_the_collectors_are_a_deployment_that_reaches_clickhouse_only() -> None:
    objects = all_objects(render_chart(VARIANTS["ClickHouse, three collectors, a password Secret"]))
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Deployment", "fleetprof-collector") in kinds
    assert ("StatefulSet", "fleetprof-collector") not in kinds
    assert ("Service", "fleetprof-collector-headless") not in kinds
    dep = next(o for o in objects if o["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--clickhouse=clickhouse://fleetprof@clickhouse-fleet.ch.svc:9000/fleetprof?cluster=fleet" in args
    assert "--clickhouse-password-file=/etc/fleetprof/clickhouse/password" in args
    assert not any(a.startswith("--data-dir") for a in args)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "data" not in volumes and "volumeClaimTemplates" not in dep["spec"]
    assert volumes["clickhouse"]["secret"]["secretName"] == "clickhouse-fleetprof"
    policy = next(
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("collector")
    )
    ports = {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert ports == {("TCP", 9000), ("TCP", 9440), ("UDP", 53), ("TCP", 53)}


def test_values_reach_the_objects() -> None:
    objs = all_objects(render_chart(VARIANTS["every agent flag"]))
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--syscalls" in args and "--no-kubernetes" in args
    assert "--syscall-latency-sample=1/64" in args
    assert [a for a in args if a.startswith("--pod-label=")] == [
        "--pod-label=team",
        "--pod-label=app.kubernetes.io/name=app",
    ]
    assert "--collector=collector.example:7470" in args
    assert [a for a in args if a.startswith("--debuginfod")] == [
        "--debuginfod-url=https://debuginfod.debian.net",
        "--debuginfod-url=http://debuginfod.infra:8002",
        "--debuginfod-cache=/var/cache/fleetprof/debuginfod",
        "--debuginfod-cache-size=1G",
    ]
    pod = ds["spec"]["template"]["spec"]
    assert {"name": "debuginfod-cache", "mountPath": "/var/cache/fleetprof/debuginfod"} in pod["containers"][
        0
    ]["volumeMounts"]
    assert {
        "name": "debuginfod-cache",
        "hostPath": {"path": "/var/cache/fleetprof/debuginfod", "type": "DirectoryOrCreate"},
    } in pod["volumes"]
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    dashboard = json.loads(cm["data"]["fleetprof-overview.json"])
    assert dashboard["uid"] == "fleetprof-overview"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast"

    privileged = all_objects(render_chart(VARIANTS["privileged, no persistence, no monitoring"]))
    ds = next(o for o in privileged if o["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["containers"][0]["securityContext"] == {"privileged": True}
    sts = next(o for o in privileged if o["kind"] == "StatefulSet")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]
    assert not [o for o in privileged if o["kind"] in ("ServiceMonitor", "NetworkPolicy")]

    off = all_objects(render_chart(VARIANTS["syscalls off, another release name"]))
    ds = next(o for o in off if o["kind"] == "DaemonSet")
    assert ds["metadata"]["name"] == "prof-agent"
    assert "--no-syscalls" in ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        "--collector=prof-collector.fleetprof.svc:7470"
        in ds["spec"]["template"]["spec"]["containers"][0]["args"]
    )


# ---- tokens and TLS ----------------------------------------------------------------------------------


def _find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    return next(o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"]))


def _secret_keys(objects: list[dict]) -> dict[str, set[str]]:
    """What each rendered Secret or Certificate will hold: name -> keys."""
    keys = {
        o["metadata"]["name"]: set(o.get("data", {})) | set(o.get("stringData", {}))
        for o in objects
        if o["kind"] == "Secret"
    }
    keys |= {o["spec"]["secretName"]: set(TLS_SECRET_KEYS) for o in objects if o["kind"] == "Certificate"}
    return keys


def _datasource(objects: list[dict]) -> dict:
    (ds,) = yaml.safe_load(
        _find(objects, "Secret", "fleetprof-grafana-datasource")["stringData"]["fleetprof-datasource.yaml"]
    )["datasources"]
    return ds


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_token_and_certificate_flag_names_a_file_of_a_mounted_secret(variant: str) -> None:
    """The wiring: each --*-token-file / --tls-* path is a file of a Secret volume mounted whole and
    read-only, and each Secret a pod mounts is one the chart renders, one cert-manager writes from a
    rendered Certificate, or one the values name as the user's own."""
    values = chart_values(VARIANTS[variant])
    objects = all_objects(render_chart(VARIANTS[variant]))
    keys = _secret_keys(objects)
    users = {
        values["auth"]["ingestToken"]["existingSecret"],
        values["auth"]["apiToken"]["existingSecret"],
        values["tls"]["existingSecret"],
        values["tls"]["mutual"]["existingSecret"],
        values["clickhouse"]["passwordSecret"]["name"],
    } - {""}
    for w in (o for o in objects if o["kind"] in ("DaemonSet", "StatefulSet", "Deployment")):
        for src in secret_sources(w):
            assert src["name"] in keys or src["name"] in users, (
                f"{w['metadata']['name']} mounts an unknown Secret {src['name']}"
            )
            if src["name"] in keys and src["items"]:
                assert {i["key"] for i in src["items"]} <= keys[src["name"]]
        assert_file_flags_are_mounted(w, keys)


def test_default_render_protects_ingest_and_http_with_generated_tokens(
    default_render: dict[str, list[dict]],
) -> None:
    objects = all_objects(default_render)
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    collector = assert_file_flags_are_mounted(sts, _secret_keys(objects))
    agent = assert_file_flags_are_mounted(ds, _secret_keys(objects))
    assert collector == {
        "--auth-token-file": ("fleetprof-ingest-token", "token"),
        "--api-token-file": ("fleetprof-api-token", "token"),
    }
    assert agent == {"--auth-token-file": ("fleetprof-ingest-token", "token")}
    # The agent pod references no Secret but the ingest token's: its node cannot read the API token.
    assert [s["name"] for s in secret_sources(ds)] == ["fleetprof-ingest-token"]
    for name in ("fleetprof-ingest-token", "fleetprof-api-token"):
        secret = _find(objects, "Secret", name)
        assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert re.fullmatch(r"[A-Za-z0-9]{48}", base64.b64decode(secret["data"]["token"]).decode())
    tokens = {
        _find(objects, "Secret", n)["data"]["token"]
        for n in ("fleetprof-ingest-token", "fleetprof-api-token")
    }
    assert len(tokens) == 2, "the ingest and API tokens must differ"
    sm = _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    assert sm["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "fleetprof-api-token", "key": "token"},
    }
    assert "scheme" not in sm and "tlsConfig" not in sm
    agent_sm = _find(objects, "ServiceMonitor", "fleetprof-agent")["spec"]["endpoints"][0]
    assert "authorization" not in agent_sm, "the agents' /metrics is not behind the token"


def test_generated_tokens_stay_the_same_across_upgrades() -> None:
    """`helm upgrade` looks the Secrets up and keeps their tokens; without them (`helm template`, a first
    install) each render draws new ones. The Grafana data source carries the API token in force."""
    overrides = {"grafana": {"datasource": {"enabled": True}}}
    first = all_objects(render_chart(overrides))
    secrets = [o for o in first if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-token")]
    assert len(secrets) == 2
    upgraded = all_objects(render_chart(overrides, cluster=secrets))
    fresh = all_objects(render_chart(overrides))
    for s in secrets:
        name = s["metadata"]["name"]
        assert _find(upgraded, "Secret", name)["data"] == s["data"]
        assert _find(fresh, "Secret", name)["data"] != s["data"]
    for objects in (first, upgraded, fresh):
        api = base64.b64decode(_find(objects, "Secret", "fleetprof-api-token")["data"]["token"]).decode()
        assert _datasource(objects)["secureJsonData"]["httpHeaderValue1"] == f"Bearer {api}"
    # A Secret of the same name in another namespace is not taken.
    other = json.loads(json.dumps(secrets))
    for s in other:
        s["metadata"]["namespace"] = "elsewhere"
    moved = all_objects(render_chart(overrides, cluster=other))
    assert all(_find(moved, "Secret", s["metadata"]["name"])["data"] != s["data"] for s in secrets)


def test_tls_from_an_existing_secret_reaches_agents_probes_and_prometheus() -> None:
    objects = all_objects(render_chart(VARIANTS["tls from an existing Secret"]))
    assert not [o for o in objects if o["kind"] == "Certificate"]
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert assert_file_flags_are_mounted(sts, _secret_keys(objects)) == {
        "--auth-token-file": ("fleetprof-ingest-token", "token"),
        "--api-token-file": ("fleetprof-api-token", "token"),
        "--tls-cert": ("collector-cert", "tls.crt"),
        "--tls-key": ("collector-cert", "tls.key"),
    }
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}
    (a,) = ds["spec"]["template"]["spec"]["containers"]
    assert "--tls-server-name=fleetprof-collector.fleetprof.svc" in a["args"]
    assert "--collector=fleetprof-collector.fleetprof.svc:7470" in a["args"]
    assert assert_file_flags_are_mounted(ds, _secret_keys(objects)) == {
        "--auth-token-file": ("fleetprof-ingest-token", "token"),
        "--tls-ca": ("collector-cert", "ca.crt"),
    }
    # Without mutual TLS the agent takes ca.crt alone from the collector's Secret.
    (tls,) = [s for s in secret_sources(ds) if s["name"] == "collector-cert"]
    assert tls["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    sm = _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    assert sm["scheme"] == "https"
    assert sm["tlsConfig"] == {
        "ca": {"secret": {"name": "collector-cert", "key": "ca.crt"}},
        "serverName": "fleetprof-collector.fleetprof.svc",
    }
    assert sm["authorization"]["credentials"] == {"name": "fleetprof-api-token", "key": "token"}
    ds_source = _datasource(objects)
    assert ds_source["url"] == "https://fleetprof-collector.fleetprof.svc:7471"
    assert "tlsAuthWithCACert" not in ds_source["jsonData"], "no CA given: Grafana's own roots"
    assert "serverName" not in ds_source["jsonData"], "the URL's host is the name agents check"


def test_cert_manager_issues_the_collector_and_agent_certificates() -> None:
    objects = all_objects(render_chart(VARIANTS["tls by cert-manager, mutual, a Grafana data source"]))
    server = _find(objects, "Certificate", "fleetprof-collector")["spec"]
    client = _find(objects, "Certificate", "fleetprof-agent")["spec"]
    svc = "fleetprof-collector"
    assert server["dnsNames"] == [
        svc,
        f"{svc}.fleetprof",
        f"{svc}.fleetprof.svc",
        f"{svc}.fleetprof.svc.cluster.local",
        "localhost",
    ]
    assert "server auth" in server["usages"] and "client auth" not in server["usages"]
    assert "client auth" in client["usages"] and "server auth" not in client["usages"]
    for spec in (server, client):
        assert spec["issuerRef"] == {"name": "fleet-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    # The Certificate schema catches mistakes (validate_object ran on these in the variant tests).
    bad = json.loads(json.dumps(_find(objects, "Certificate", "fleetprof-collector")))
    bad["spec"]["usages"] = ["server-auth"]
    with pytest.raises(pytest.fail.Exception, match="server-auth"):
        validate_object(bad, K8S_VERSIONS[-1])
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    keys = _secret_keys(objects)
    collector = assert_file_flags_are_mounted(sts, keys)
    agent = assert_file_flags_are_mounted(ds, keys)
    assert collector["--tls-cert"] == (server["secretName"], "tls.crt")
    assert collector["--tls-client-ca"] == (server["secretName"], "ca.crt")
    assert agent["--tls-cert"] == (client["secretName"], "tls.crt")
    assert agent["--tls-key"] == (client["secretName"], "tls.key")
    assert agent["--tls-ca"] == (client["secretName"], "ca.crt")
    # With mutual TLS the agents never reference the collector's Secret (its private key).
    assert server["secretName"] not in {s["name"] for s in secret_sources(ds)}
    (a,) = ds["spec"]["template"]["spec"]["containers"]
    server_name = next(x for x in a["args"] if x.startswith("--tls-server-name=")).split("=", 1)[1]
    assert server_name in server["dnsNames"]
    sm = _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    assert sm["tlsConfig"]["serverName"] == server_name
    assert sm["tlsConfig"]["ca"] == {"secret": {"name": server["secretName"], "key": "ca.crt"}}
    source = _datasource(objects)
    assert source["jsonData"]["tlsAuthWithCACert"] is True
    assert source["secureJsonData"]["tlsCACert"] == "$__file{/etc/grafana/fleetprof/ca.crt}"


def test_shared_agent_certificates_bind_no_node_and_kubelet_certificates_do() -> None:
    """One certificate for every agent names no node: the collector is told so (--node-binding=none). With
    nodeCertificates=kubelet each agent presents its node's kubelet client certificate from the host, the
    collector trusts the cluster CA for them and binds each batch to the node its certificate names."""
    shared = all_objects(render_chart(VARIANTS["tls by cert-manager, mutual, a Grafana data source"]))
    assert (
        "--node-binding=none"
        in _find(shared, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    objects = all_objects(
        render_chart(VARIANTS["tls by cert-manager, each agent with its node's kubelet certificate"])
    )
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Certificate"] == ["fleetprof-collector"]
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    assert not [a for a in sts["spec"]["template"]["spec"]["containers"][0]["args"] if "node-binding" in a]
    keys = _secret_keys(objects)
    assert assert_file_flags_are_mounted(sts, keys)["--tls-client-ca"] == (
        "ConfigMap kube-root-ca.crt",
        "ca.crt",
    )
    agent = assert_file_flags_are_mounted(ds, keys)
    pki = ("hostPath /var/lib/kubelet/pki", "kubelet-client-current.pem")
    assert agent["--tls-cert"] == agent["--tls-key"] == pki
    assert agent["--tls-ca"] == ("fleetprof-collector-tls", "ca.crt")
    # The agents take ca.crt alone from the collector's Secret, never its key.
    (src,) = [s for s in secret_sources(ds) if s["name"] == "fleetprof-collector-tls"]
    assert src["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_agents_with_kubelet_certificates_write_as_their_own_node_only(tmp_path: Path) -> None:
    """The kubelet-certificate render, run: the collector with the StatefulSet's args (kube-root-ca.crt's
    CA as client CA), an agent configured by the DaemonSet's args reading its node's kubelet-client PEM
    (certificate and key in one file, CN system:node:NODE) from the host directory. Its own node is
    stored; another node's name is refused."""
    objects = all_objects(
        render_chart(VARIANTS["tls by cert-manager, each agent with its node's kubelet certificate"])
    )
    issuer, cluster = Ca(tmp_path, "issuer"), Ca(tmp_path, "cluster")
    secrets = _cluster_secrets(objects, issuer)
    grpc_port, http_port = free_port(), free_port()
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    args = _kubelet(sts, secrets, tmp_path / "collector")
    ca_file = tmp_path / "collector" / "etc/fleetprof/kubelet-ca/ca.crt"
    ca_file.parent.mkdir(parents=True)
    ca_file.write_bytes(cluster.cert.read_bytes())  # kube-root-ca.crt's ca.crt
    args = [
        {
            "--grpc": f"--grpc=127.0.0.1:{grpc_port}",
            "--http": f"--http=127.0.0.1:{http_port}",
            "--data-dir": f"--data-dir={tmp_path / 'data'}",
        }.get(a.split("=", 1)[0], a)
        for a in args
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetprof.cli", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: _answers_https(proc, http_port), 60, "the collector")
        pair = cluster.client("kubelet", name="system:node:gpu-node-3")
        pki = tmp_path / "agent" / "etc/fleetprof/kubelet-pki"
        pki.mkdir(parents=True)
        (pki / "kubelet-client-current.pem").write_bytes(pair.cert.read_bytes() + pair.key.read_bytes())
        agent = build_parser().parse_args(_kubelet(ds, secrets, tmp_path / "agent"))
        token = TokenFile(agent.auth_token_file)
        tls = ClientTls(ClientTlsConfig(agent.tls_ca, agent.tls_cert, agent.tls_key, agent.tls_server_name))
        for node, stored in (("gpu-node-3", True), ("gpu-node-4", False)):
            shipper = Shipper(f"127.0.0.1:{grpc_port}", backoff_s=(0.05, 0.2), tls=tls, tokens=token)
            shipper.start()
            try:
                shipper.submit(make_batch(node=node, count=5))
                if stored:
                    assert shipper.flush(20), f"not acknowledged: {shipper.stats}"
                else:
                    wait_until(lambda s=shipper: s.stats.batches_rejected == 1, 20, "the refusal")
            finally:
                shipper.stop(flush_timeout_s=0)
        api_token = secrets["fleetprof-api-token"]["token"].decode()
        ca_pem = secrets["fleetprof-collector-tls"]["ca.crt"]
        server_name = agent.tls_server_name
        status, body = _https(http_port, "/api/v1/top?by=node&since=1h", ca_pem, server_name, api_token)
        assert status == 200
        assert [g["labels"]["node"] for g in json.loads(body)["groups"]] == ["gpu-node-3"]
    finally:
        stop_process(proc, 30)
        proc.stderr.close()


def _answers_https(proc: subprocess.Popen, port: int) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the collector exited: {proc.stderr.read().decode()[-2000:]}")
    try:
        return _https(port, "/healthz", None, "ignored")[0] == 200
    except OSError:
        return False


def test_the_users_own_secrets_are_mounted_and_nothing_is_generated() -> None:
    objects = all_objects(render_chart(VARIANTS["the user's Secrets for tokens and certificates, mutual"]))
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == [
        "fleetprof-grafana-datasource"
    ]
    assert not [o for o in objects if o["kind"] == "Certificate"]
    sts, ds = _find(objects, "StatefulSet"), _find(objects, "DaemonSet")
    assert assert_file_flags_are_mounted(sts, {}) == {
        "--auth-token-file": ("fleet-ingest", "ingest"),
        "--api-token-file": ("fleet-api", "api"),
        "--tls-cert": ("collector-cert", "tls.crt"),
        "--tls-key": ("collector-cert", "tls.key"),
        "--tls-client-ca": ("collector-cert", "ca.crt"),
    }
    assert assert_file_flags_are_mounted(ds, {}) == {
        "--auth-token-file": ("fleet-ingest", "ingest"),
        "--tls-ca": ("agent-cert", "ca.crt"),
        "--tls-cert": ("agent-cert", "tls.crt"),
        "--tls-key": ("agent-cert", "tls.key"),
    }
    assert (
        "--tls-server-name=profiles.example.internal"
        in ds["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    sm = _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    assert sm["authorization"]["credentials"] == {"name": "fleet-api", "key": "api"}
    assert sm["tlsConfig"]["serverName"] == "profiles.example.internal"
    # The chart does not know the user's token: Grafana expands it from its environment.
    source = _datasource(objects)
    assert source["secureJsonData"]["httpHeaderValue1"] == "Bearer ${FLEETPROF_API_TOKEN}"
    # Grafana checks the certificate against the name agents and Prometheus check, not the URL's host.
    assert source["url"] == "https://fleetprof-collector.fleetprof.svc:7471"
    assert source["jsonData"]["serverName"] == "profiles.example.internal"


def test_auth_off_renders_no_token_anywhere() -> None:
    objects = all_objects(render_chart(VARIANTS["auth off"]))
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == [
        "fleetprof-grafana-datasource"
    ]
    for w in (o for o in objects if o["kind"] in ("DaemonSet", "StatefulSet", "Deployment")):
        assert not secret_sources(w)
        assert not [a for a in w["spec"]["template"]["spec"]["containers"][0]["args"] if "token" in a]
    assert (
        "authorization" not in _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
    )
    source = _datasource(objects)
    assert "jsonData" not in source and "secureJsonData" not in source
    assert source["url"] == "http://fleetprof-collector.fleetprof.svc:7471"


def test_the_grafana_data_source_is_the_one_deploy_grafana_provisions() -> None:
    """The chart's data source for the sidecar, in Grafana's namespace, is deploy/grafana's provisioning
    file when the chart does not know the token either (the user's Secret): both have Grafana expand
    ${FLEETPROF_API_TOKEN} from its environment."""
    overrides = {
        "auth": {"apiToken": {"existingSecret": "fleetprof-api-token"}},
        "grafana": {"datasource": {"enabled": True, "namespace": "monitoring"}},
    }
    secret = _find(all_objects(render_chart(overrides)), "Secret", "fleetprof-grafana-datasource")
    assert secret["metadata"]["namespace"] == "monitoring"
    assert secret["metadata"]["labels"]["grafana_datasource"] == "1"
    assert "annotations" not in secret["metadata"], "derived from the token Secret: not kept on uninstall"
    chart = yaml.safe_load(secret["stringData"]["fleetprof-datasource.yaml"])
    plain = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "fleetprof.yaml").read_text()
    )
    assert chart == plain
    (source,) = plain["datasources"]
    assert source["type"] == "grafana-pyroscope-datasource"
    assert source["jsonData"]["httpHeaderName1"] == "Authorization"
    # The dashboard the chart ships takes its flame graphs from this uid (its `profiles` variable's default).
    dashboard = json.loads((CHART / "dashboards" / "fleetprof-overview.json").read_text())
    (profiles,) = [v for v in dashboard["templating"]["list"] if f"${{{v['name']}}}" == PROFILES_DS["uid"]]
    assert profiles["current"]["value"] == source["uid"] == chart_values()["grafana"]["datasource"]["uid"]
    assert profile_queries(dashboard)


def _install_cupti(objects: list[dict]) -> dict | None:
    ds = _find(objects, "DaemonSet")
    return next(iter(ds["spec"]["template"]["spec"].get("initContainers", [])), None)


def test_the_cupti_library_is_put_on_the_node_only_when_asked() -> None:
    """Off by default: the agent's pod is as before. On: an init container of the agent image puts the
    library into a hostPath directory; the notes print what a workload adds to load it from there."""
    default = all_objects(render_chart({}))
    assert _install_cupti(default) is None
    volumes = _find(default, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert "cupti" not in {v["name"] for v in volumes}
    assert "CUDA_INJECTION64_PATH" not in render_notes()

    values = VARIANTS["the CUPTI library on every node"]
    objects = all_objects(render_chart(values))
    init = _install_cupti(objects)
    assert (
        init is not None
        and init["image"]
        == "fleetprof/agent:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    )
    assert init["volumeMounts"] == [{"name": "cupti", "mountPath": "/host-cupti"}]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    volumes = _find(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "cupti",
        "hostPath": {"path": "/opt/gpu/fleetprof", "type": "DirectoryOrCreate"},
    } in volumes

    notes = render_notes(values)
    lines = notes.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip() == "env:")
    last = next(i for i, line in enumerate(lines) if "then see" in line)
    snippet = textwrap.dedent("\n".join(lines[first:last]))
    container, pod = (
        yaml.safe_load(snippet[: snippet.index("volumes:")]),
        yaml.safe_load(snippet[snippet.index("volumes:") :]),
    )
    (env,), (mount,), (volume,) = container["env"], container["volumeMounts"], pod["volumes"]
    assert env["name"] == "CUDA_INJECTION64_PATH"
    assert env["value"] == mount["mountPath"] + "/libfleetprof_cupti.so" and mount["readOnly"]
    assert mount["name"] == volume["name"] and volume["hostPath"] == {
        "path": "/opt/gpu/fleetprof",
        "type": "Directory",
    }
    quiet = {"agent": {"cupti": {"enabled": True, "printOptIn": False}}}
    assert "CUDA_INJECTION64_PATH" not in render_notes(quiet)


def test_the_install_command_renames_a_new_library_into_place_and_never_fails_the_pod(tmp_path: Path) -> None:
    """The init container's own shell command, run here with the node directory and the image's file
    moved under tmp_path: the library lands as a new file (a process that maps the old one keeps its
    pages), and an image without it says so and exits 0 (the agent starts all the same)."""
    init = _install_cupti(all_objects(render_chart(VARIANTS["the CUPTI library on every node"])))
    assert init is not None
    script = init["command"][2]
    image_lib, node = tmp_path / "image" / "libfleetprof_cupti.so", tmp_path / "node"
    image_lib.parent.mkdir()
    node.mkdir()
    script = script.replace("/opt/fleetprof/lib/libfleetprof_cupti.so", str(image_lib)).replace(
        "/host-cupti", str(node)
    )
    image_lib.write_bytes(b"\x7fELF version 1")
    assert subprocess.run(["sh", "-c", script], capture_output=True, text=True).returncode == 0
    installed = node / "libfleetprof_cupti.so"
    first = installed.stat()
    assert installed.read_bytes() == b"\x7fELF version 1" and first.st_mode & 0o777 == 0o755
    with installed.open("rb") as mapped:  # a workload holding the old library
        image_lib.write_bytes(b"\x7fELF version 2")
        assert subprocess.run(["sh", "-c", script], capture_output=True, text=True).returncode == 0
        assert mapped.read() == b"\x7fELF version 1"  # its file is untouched
    assert installed.read_bytes() == b"\x7fELF version 2" and installed.stat().st_ino != first.st_ino
    assert sorted(p.name for p in node.iterdir()) == ["libfleetprof_cupti.so"]
    image_lib.unlink()
    missing = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert (
        missing.returncode == 0 and "is not in this image: no CUPTI library put on the node" in missing.stderr
    )


def test_notes_tell_how_to_get_the_token_and_the_ca() -> None:
    notes = render_notes()
    secret = re.search(r"kubectl -n fleetprof get secret (\S+) -o jsonpath='\{\.data\.(\S+?)\}'", notes)
    assert secret and secret.groups() == ("fleetprof-api-token", "token")
    assert "--token-file fleetprof-api-token" in notes and "--ca" not in notes
    assert "kubectl -n fleetprof delete secret fleetprof-ingest-token fleetprof-api-token" in notes
    notes = render_notes(VARIANTS["tls by cert-manager, mutual, a Grafana data source"])
    top = "top --collector https://localhost:7471 --token-file fleetprof-api-token --ca fleetprof-ca.crt"
    assert top in notes
    assert "get secret fleetprof-collector-tls -o jsonpath='{.data.ca\\.crt}'" in notes
    notes = render_notes({"auth": {"apiToken": {"existingSecret": "fleet-api", "key": "api.token"}}})
    assert "get secret fleet-api -o jsonpath='{.data.api\\.token}'" in notes
    assert "delete secret fleetprof-ingest-token\n" in notes
    assert "Auth:         off" in render_notes({"auth": {"enabled": False}})


# ---- the rendered wiring, run: a real collector as the StatefulSet starts it ---------------------------


def _cluster_secrets(objects: list[dict], ca: Ca) -> dict[str, dict[str, bytes]]:
    """Every Secret's content as the cluster would hold it: the rendered ones decoded, and for each
    Certificate what cert-manager would write, issued by `ca` for the Certificate's names and usage."""
    out = {
        o["metadata"]["name"]: {k: base64.b64decode(v) for k, v in o.get("data", {}).items()}
        for o in objects
        if o["kind"] == "Secret"
    }
    for cert in (o for o in objects if o["kind"] == "Certificate"):
        spec = cert["spec"]
        stem = cert["metadata"]["name"]
        pair = (
            ca.server(stem, dns=tuple(spec["dnsNames"]))
            if "server auth" in spec["usages"]
            else ca.client(stem)
        )
        out[spec["secretName"]] = {
            "tls.crt": pair.cert.read_bytes(),
            "tls.key": pair.key.read_bytes(),
            "ca.crt": ca.cert.read_bytes(),
        }
    return out


def _kubelet(workload: dict, secrets: dict[str, dict[str, bytes]], root: Path) -> list[str]:
    """What the kubelet does for the workload's Secret volumes, under `root`: each file where the container
    mounts it. Returns the container's args with /etc/fleetprof paths moved under `root`."""
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for src in secret_sources(workload):
        data = secrets[src["name"]]
        for item in src["items"] or [{"key": k, "path": k} for k in data]:
            path = root / mounts[src["volume"]].lstrip("/") / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[item["key"]])
    return [a.replace("=/etc/fleetprof/", f"={root}/etc/fleetprof/") for a in c["args"]]


def _https(
    port: int, path: str, ca: bytes | None, server_name: str, token: str | None = None
) -> tuple[int, bytes]:
    """GET https://127.0.0.1:PORT/PATH checking the certificate against `server_name` (what Prometheus'
    tlsConfig.serverName and the agents' --tls-server-name do); ca None: no verification (a kubelet probe)."""
    if ca is None:
        ctx = ssl._create_unverified_context()  # the kubelet's HTTPS probes do not verify
    else:
        ctx = ssl.create_default_context(cadata=ca.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as sock:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.sock = sock
            conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
            resp = conn.getresponse()
            return resp.status, resp.read()


def _grafana_call(
    port: int, source: dict, ca: bytes, method: str, request: Message, response_cls: type[Message]
) -> Message | int:
    """A Connect call to 127.0.0.1:PORT as Grafana makes it with the provisioned data source `source`: its
    header, its CA, checking the certificate against jsonData.serverName or else the URL's host. The
    answer decoded, or the HTTP status."""
    json_data, secure = source.get("jsonData", {}), source.get("secureJsonData", {})
    server_name = json_data.get("serverName") or urllib.parse.urlsplit(source["url"]).hostname
    headers = {"Content-Type": "application/proto", "Connect-Protocol-Version": "1"}
    if "httpHeaderName1" in json_data and "httpHeaderValue1" in secure:
        headers[json_data["httpHeaderName1"]] = secure["httpHeaderValue1"]
    ctx = ssl.create_default_context(cadata=ca.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as sock:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.sock = sock
            path = urllib.parse.urlsplit(source["url"]).path + f"/querier.v1.QuerierService/{method}"
            conn.request("POST", path, body=request.SerializeToString(), headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            return response_cls.FromString(body) if resp.status == 200 else resp.status


def test_a_collector_started_as_the_chart_says_takes_agents_prometheus_and_grafana(tmp_path: Path) -> None:
    """The cert-manager + mutual TLS + tokens render, run: Secret files written where the pods mount them,
    certificates issued for the Certificates' names, the real `fleetprof collector` started with the
    StatefulSet's args. The probe's HTTPS /healthz answers without a token; Prometheus, as the
    ServiceMonitor configures it, scrapes /metrics; an agent configured by the DaemonSet's args is
    stored; Grafana's data source, as rendered (URL, CA, header), reads the API and answers the dashboard's
    flame graph and series queries."""
    objects = all_objects(render_chart(VARIANTS["tls by cert-manager, mutual, a Grafana data source"]))
    secrets = _cluster_secrets(objects, Ca(tmp_path, "cluster"))
    grpc_port, http_port = free_port(), free_port()
    args = _kubelet(_find(objects, "StatefulSet"), secrets, tmp_path / "collector")
    args = [
        {
            "--grpc": f"--grpc=127.0.0.1:{grpc_port}",
            "--http": f"--http=127.0.0.1:{http_port}",
            "--data-dir": f"--data-dir={tmp_path / 'data'}",
        }.get(a.split("=", 1)[0], a)
        for a in args
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetprof.cli", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        sts = _find(objects, "StatefulSet")
        probe = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        assert probe["scheme"] == "HTTPS"

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the collector exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                return _https(http_port, probe["path"], None, "ignored")[0] == 200
            except OSError:
                return False

        wait_until(ready, 60, "the collector to answer its readiness probe")

        endpoint = _find(objects, "ServiceMonitor", "fleetprof-collector")["spec"]["endpoints"][0]
        ca_ref, creds = endpoint["tlsConfig"]["ca"]["secret"], endpoint["authorization"]["credentials"]
        ca_pem = secrets[ca_ref["name"]][ca_ref["key"]]
        server_name = endpoint["tlsConfig"]["serverName"]
        api_token = secrets[creds["name"]][creds["key"]].decode()
        status, body = _https(http_port, endpoint["path"], ca_pem, server_name, api_token)
        assert status == 200 and b"fleetprof_" in body
        assert _https(http_port, endpoint["path"], ca_pem, server_name)[0] == 401

        agent_args = build_parser().parse_args(
            _kubelet(_find(objects, "DaemonSet"), secrets, tmp_path / "agent")
        )
        assert agent_args.tls_server_name == server_name
        shipper = Shipper(
            f"127.0.0.1:{grpc_port}",
            backoff_s=(0.05, 0.2),
            tls=ClientTls(
                ClientTlsConfig(
                    agent_args.tls_ca, agent_args.tls_cert, agent_args.tls_key, agent_args.tls_server_name
                )
            ),
            tokens=TokenFile(agent_args.auth_token_file),
        )
        # Besides, samples of a pod whose GPU idled for some of them, for the dashboard's profile panels.
        pod_batch = BatchBuilder(node="chart-node")
        trainer = pod_batch.process(7, "python3", {"namespace": "ml", "pod": "trainer-0"})
        pod_batch.sample(trainer, pod_batch.stack([("main", "app"), ("train", "app")]), 12, pb.GPU_STATE_BUSY)
        pod_batch.sample(trainer, pod_batch.stack([("main", "app"), ("load", "app")]), 3, pb.GPU_STATE_IDLE)
        shipper.start()
        try:
            shipper.submit(make_batch(node="chart-node", count=5))
            shipper.submit(pod_batch.build())
            assert shipper.flush(20), f"not acknowledged: {shipper.stats}"
        finally:
            shipper.stop()

        source = _datasource(objects)
        assert source["url"] == f"https://{server_name}:7471"
        header = {source["jsonData"]["httpHeaderName1"]: source["secureJsonData"]["httpHeaderValue1"]}
        assert header["Authorization"] == f"Bearer {api_token}"
        status, body = _https(http_port, "/api/v1/top?by=node&since=1h", ca_pem, server_name, api_token)
        assert status == 200
        assert [g["labels"]["node"] for g in json.loads(body)["groups"]] == ["chart-node"]

        # The dashboard's flame graphs and series ("All" selected), through the data source as provisioned:
        # the render's CA and token; without the token, refused.
        dashboard = json.loads((CHART / "dashboards" / "fleetprof-overview.json").read_text())
        end_ms = int(time.time() * 1000) + 60_000
        period_ns = round(1e9 / 19)
        for q in profile_queries(dashboard):
            text = grafana_interpolate(q.target["labelSelector"], dashboard)
            method, req, cls = grafana_request(q, text, end_ms - 3_660_000, end_ms)
            got = _grafana_call(http_port, source, ca_pem, method, req, cls)
            assert isinstance(got, cls), f"{q.where}: {method} answered {got}"
            if isinstance(got, querier_pb2.SelectMergeStacktracesResponse):
                samples = 3 if 'gpu_state="idle"' in text else 5 + 12 + 3
                assert got.flamegraph.total == samples * period_ns, q.where
            else:
                assert [{p.name: p.value for p in s.labels} for s in got.series] == [
                    {"namespace": "ml", "pod": "trainer-0"}
                ]
        anonymous = {k: v for k, v in source.items() if k != "secureJsonData"}
        method, req, cls = grafana_request(q, text, end_ms - 3_660_000, end_ms)
        assert _grafana_call(http_port, anonymous, ca_pem, method, req, cls) == 401
    finally:
        stop_process(proc, 30)
        proc.stderr.close()


def test_the_chart_ships_the_same_dashboards_as_deploy_grafana() -> None:
    shipped = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    source = sorted(p.name for p in (REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert shipped == source
    for name in source:
        assert (CHART / "dashboards" / name).read_bytes() == (
            REPO / "deploy" / "grafana" / "dashboards" / name
        ).read_bytes(), (
            f"helm/fleetprof/dashboards/{name} is out of date: copy it from deploy/grafana/dashboards"
        )


# ---- the real helm, where there is one ---------------------------------------------------------------

HELM = shutil.which("helm")
needs_helm = pytest.mark.skipif(
    HELM is None,
    reason="no `helm` binary on PATH (not installable here from Debian, PyPI or npm); the chart is rendered "
    "by the Go-template interpreter in tests/support/gotemplate.py instead — see deploy/README.md to run "
    "helm lint/template",
)


@needs_helm
def test_helm_lint_passes() -> None:
    r = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_template_output_is_valid_and_matches_the_interpreter(variant: str, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VARIANTS[variant]))
    r = subprocess.run(
        [HELM, "template", "fleetprof", str(CHART), "-n", "fleetprof", "-f", str(values)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    objects = [d for d in yaml.safe_load_all(r.stdout) if d]
    for obj in objects:
        for version in K8S_VERSIONS:
            validate_object(obj, version)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    ours = all_objects(render_chart(VARIANTS[variant]))
    assert sorted(map(_without_tokens, objects), key=key) == sorted(map(_without_tokens, ours), key=key)


def _without_tokens(obj: dict) -> dict:
    """The object with generated tokens blanked: each render draws new ones."""
    obj = json.loads(json.dumps(obj))
    if (
        obj["kind"] == "Secret"
        and obj["metadata"].get("annotations", {}).get("helm.sh/resource-policy") == "keep"
    ):
        obj["data"] = dict.fromkeys(obj["data"], "")
    for name, text in obj.get("stringData", {}).items():
        obj["stringData"][name] = re.sub(r"Bearer [A-Za-z0-9]{48}\b", "Bearer TOKEN", text)
    return obj
