"""The Helm chart: values against values.schema.json, every rendered object against the Kubernetes schemas.

Rendering: with a `helm` binary on PATH the tests run the real `helm lint` and `helm template`. Helm is
not installable on this machine kind (Debian has no package; PyPI's helm-package ships macOS/Windows
binaries only; helm-sdkpy needs Python >= 3.12 and has no client-only template action; npm has none), so
the chart is also rendered by `render_chart` (tests/gotemplate.py): an interpreter for exactly the subset
of Go text/template + Sprig the chart's templates use. It raises on any construct or function it does not
know, so a template that strays outside the subset fails here instead of being rendered wrongly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO
from tests.gotemplate import CHART, Renderer, TemplateError, all_objects, chart_values, parse, render_chart
from tests.manifests import K8S_VERSIONS, assert_flags_accepted, manifest_objects, validate_object


def test_values_yaml_validates_against_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart_values())


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"agent": {"frequency": 0}}, "frequency"),
        ({"agent": {"frequncy": 19}}, "frequncy"),
        ({"agent": {"syscallLatencySample": "16"}}, "syscallLatencySample"),
        ({"collector": {"retention": "forever"}}, "retention"),
        ({"collector": {"persistence": {"accessModes": ["ReadWriteSometimes"]}}}, "accessModes"),
    ],
)
def test_the_schema_refuses_bad_values(bad: dict, where: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError) as info:
        jsonschema.validate(chart_values(bad), schema)
    assert where in str(info.value)


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
    with pytest.raises(TemplateError, match="lookup"):
        Renderer({}).render(parse('{{ lookup "v1" "Pod" "" "" }}'), {}, {})


@pytest.fixture(scope="module")
def default_render() -> dict[str, list[dict]]:
    return render_chart()


def test_default_render_has_the_issue_objects(default_render: dict[str, list[dict]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in all_objects(default_render))
    assert kinds == [
        ("ClusterRole", "fleetprof-agent"),
        ("ClusterRoleBinding", "fleetprof-agent"),
        ("DaemonSet", "fleetprof-agent"),
        ("NetworkPolicy", "fleetprof-agent"),
        ("NetworkPolicy", "fleetprof-collector"),
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


def test_the_chart_renders_the_same_objects_as_the_plain_manifests() -> None:
    chart = {
        (o["kind"], o["metadata"]["name"]): _without_helm_labels(o)
        for o in all_objects(render_chart({"namespace": {"create": True}}))
    }
    plain = {(o["kind"], o["metadata"]["name"]): _without_helm_labels(o) for o in manifest_objects()}
    assert sorted(chart) == sorted(plain)
    for key, obj in plain.items():
        assert chart[key] == obj, f"{key} differs between helm/ and deploy/kubernetes/"


VARIANTS = {
    "defaults": {},
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
        },
        "collector": {"persistence": {"storageClassName": "fast"}},
        "grafana": {"dashboards": {"enabled": True}},
        "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
    },
    "syscalls off, another release name": {"agent": {"syscalls": False}, "fullnameOverride": "prof"},
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
    workloads = [o for o in objects if o["kind"] in ("DaemonSet", "StatefulSet")]
    assert len(workloads) == 2
    for w in workloads:
        assert_flags_accepted(w)


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
    "by the Go-template interpreter in tests/gotemplate.py instead — see deploy/README.md to run helm "
    "lint/template",
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
    assert sorted(objects, key=key) == sorted(all_objects(render_chart(VARIANTS[variant])), key=key)
