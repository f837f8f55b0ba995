"""The Helm chart: values against values.schema.json, every rendered object against the Kubernetes schemas.

Rendering: with a `helm` binary on PATH the tests run the real `helm lint` and `helm template`. Helm is
not installable on this machine kind (Debian has no package; PyPI's helm-package ships macOS/Windows
binaries only; helm-sdkpy needs Python >= 3.12 and has no client-only template action; npm has none), so
the chart is also rendered by `render_chart` below: an interpreter for exactly the subset of Go
text/template + Sprig the chart's templates use. It raises on any construct or function it does not
know, so a template that strays outside the subset fails here instead of being rendered wrongly.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "helm" / "fleetprof"


class TemplateError(Exception):
    pass


# ---- a Go text/template interpreter for the chart's subset -------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+(?:\.\d+)?)|(?P<punct>:=|[()|,])'
    r"|(?P<word>\$?[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*|\$(?:\.[A-Za-z_]\w*)*|\.(?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?))"
)


def _tokenize(src: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    src = src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot parse {src[pos:]!r} in {{{{ {src} }}}}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _parse(text: str) -> list:
    """Template text -> a tree: str, ("act", tokens), ("if", [(cond, body)], else), ("with"/"range", ...)."""
    pieces: list = []
    pos = 0
    for m in _ACTION.finditer(text):
        pieces.append(text[pos : m.start()])
        if m.group(1) and pieces[-1]:
            pieces[-1] = pieces[-1].rstrip(" \t\n")
        pieces.append(("raw", m.group(2).strip(), bool(m.group(3))))
        pos = m.end()
    pieces.append(text[pos:])
    # right trim markers eat the whitespace of the next text piece
    for i, p in enumerate(pieces):
        if isinstance(p, tuple) and p[2] and i + 1 < len(pieces) and isinstance(pieces[i + 1], str):
            pieces[i + 1] = pieces[i + 1].lstrip(" \t\n")
    root: list = []
    stack: list[tuple[list, Any]] = [(root, None)]
    for p in pieces:
        body = stack[-1][0]
        if isinstance(p, str):
            if p:
                body.append(p)
            continue
        src = p[1]
        if src.startswith("/*"):
            continue
        word = src.split(None, 1)[0] if src else ""
        rest = src[len(word) :].strip()
        if word in ("if", "with", "range"):
            node = [word, [(_tokenize(rest), [])], None]
            body.append(node)
            stack.append((node[1][0][1], node))
        elif word == "define":
            node = ["define", json.loads(rest), []]
            body.append(node)
            stack.append((node[2], node))
        elif word == "else":
            node = stack.pop()[1]
            if rest.startswith("if "):
                node[1].append((_tokenize(rest[3:]), []))
                stack.append((node[1][-1][1], node))
            else:
                node[2] = []
                stack.append((node[2], node))
        elif word == "end":
            stack.pop()
        else:
            body.append(("act", _tokenize(src)))
    if len(stack) != 1:
        raise TemplateError("unclosed block")
    return root


def _truthy(v: Any) -> bool:
    return not (v is None or v is False or v == 0 or v == "" or v == {} or v == [])


def _go_str(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a {type(v).__name__} directly: use toYaml")
    return str(v)


def _printf(fmt: str, *args: Any) -> str:
    it = iter(args)

    def sub(m: re.Match) -> str:
        return '"' + _go_str(next(it)) + '"' if m.group(1) == "q" else _go_str(next(it))

    return re.sub(r"%([svdq])", sub, fmt)


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n: int, s: str) -> str:
    return "\n".join(" " * n + line for line in s.split("\n"))


def _kind(v: Any) -> str:
    for t, name in ((bool, "bool"), (int, "int"), (float, "float64"), (str, "string"), (dict, "map")):
        if isinstance(v, t):
            return name
    return "slice" if isinstance(v, list) else "invalid"


def _required(msg: str, v: Any) -> Any:
    if not _truthy(v):
        raise TemplateError(msg)
    return v


FUNCS: dict[str, Callable[..., Any]] = {
    "default": lambda d, v=None: v if _truthy(v) else d,
    "quote": lambda v: json.dumps(_go_str(v)),
    "trunc": lambda n, s: s[:n],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "contains": lambda sub, s: sub in s,
    "printf": _printf,
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "not": lambda v: not _truthy(v),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "dir": posixpath.dirname,
    "kindIs": lambda k, v: _kind(v) == k,
    "ternary": lambda a, b, cond: a if cond else b,
    "required": _required,
}


class _Renderer:
    def __init__(self, defines: dict[str, list]):
        self.defines = defines

    def render(self, nodes: list, dot: Any, scope: dict[str, Any]) -> str:
        out = []
        for n in nodes:
            if isinstance(n, str):
                out.append(n)
            elif isinstance(n, tuple):
                v = self.pipeline(n[1], dot, scope, declare=True)
                if v is not _DECLARED:
                    out.append(_go_str(v))
            elif n[0] == "define":
                continue
            elif n[0] == "if":
                for cond, body in n[1]:
                    if _truthy(self.pipeline(cond, dot, scope)):
                        out.append(self.render(body, dot, dict(scope)))
                        break
                else:
                    if n[2] is not None:
                        out.append(self.render(n[2], dot, dict(scope)))
            elif n[0] == "with":
                cond, body = n[1][0]
                v = self.pipeline(cond, dot, scope)
                if _truthy(v):
                    out.append(self.render(body, v, dict(scope)))
                elif n[2] is not None:
                    out.append(self.render(n[2], dot, dict(scope)))
            elif n[0] == "range":
                toks, body = n[1][0]
                names: list[str] = []
                if ("punct", ":=") in toks:
                    at = toks.index(("punct", ":="))
                    names = [t[1] for t in toks[:at] if t[0] == "word"]
                    toks = toks[at + 1 :]
                seq = self.pipeline(toks, dot, scope)
                items = sorted(seq.items()) if isinstance(seq, dict) else list(enumerate(seq or []))
                for k, v in items:
                    inner = dict(scope)
                    if len(names) == 2:
                        inner[names[0]], inner[names[1]] = k, v
                    elif names:
                        inner[names[0]] = v
                    out.append(self.render(body, v, inner))
            else:
                raise TemplateError(f"unknown node {n[0]}")
        return "".join(out)

    def pipeline(self, toks: list, dot: Any, scope: dict, declare: bool = False) -> Any:
        if len(toks) > 2 and toks[1] == ("punct", ":="):
            if not declare:
                raise TemplateError("declaration inside an expression")
            scope[toks[0][1]] = self.pipeline(toks[2:], dot, scope)
            return _DECLARED
        commands: list[list] = [[]]
        depth = 0
        for t in toks:
            if t == ("punct", "|") and depth == 0:
                commands.append([])
                continue
            depth += t == ("punct", "(")
            depth -= t == ("punct", ")")
            commands[-1].append(t)
        value: Any = _NOTHING
        for cmd in commands:
            value = self.command(cmd, dot, scope, value)
        return value

    def command(self, toks: list, dot: Any, scope: dict, piped: Any) -> Any:
        operands: list = []
        i = 0
        while i < len(toks):
            kind, text = toks[i]
            if text == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += toks[j][1] == "("
                    depth -= toks[j][1] == ")"
                    j += 1
                operands.append(("value", self.pipeline(toks[i + 1 : j - 1], dot, scope)))
                i = j
                continue
            operands.append((kind, text))
            i += 1
        head_kind, head = operands[0]
        args = [self.operand(k, t, dot, scope) for k, t in operands[1:]]
        if piped is not _NOTHING:
            args.append(piped)
        if head_kind == "word" and not head.startswith((".", "$")) and head not in ("true", "false", "nil"):
            if head == "include":
                return self.include(*args)
            if head not in FUNCS:
                raise TemplateError(f"function {head!r} is not in the supported subset")
            return FUNCS[head](*args)
        value = self.operand(head_kind, head, dot, scope)
        if callable(value):
            return value(*args)
        if args:
            raise TemplateError(f"{head} is not a function")
        return value

    def operand(self, kind: str, text: Any, dot: Any, scope: dict) -> Any:
        if kind == "value":
            return text
        if kind == "str":
            return json.loads(text)
        if kind == "num":
            return float(text) if "." in text else int(text)
        if text in ("true", "false"):
            return text == "true"
        if text == "nil":
            return None
        if text.startswith("$"):
            name, _, path = text.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            base = scope[name]
        elif text.startswith("."):
            base, path = dot, text[1:]
        else:
            raise TemplateError(f"unexpected {text!r}")
        for part in path.split(".") if path else []:
            base = base.get(part) if isinstance(base, dict) else getattr(base, part, None)
        return base

    def include(self, name: str, ctx: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r}")
        return self.render(self.defines[name], ctx, {"$": ctx})


_NOTHING = object()
_DECLARED = object()


class _Files:
    def __init__(self, root: Path):
        self._root = root

    def Get(self, name: str) -> str:  # noqa: N802 - Helm's name
        return (self._root / name).read_text()


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def chart_values(overrides: dict | None = None) -> dict:
    return _merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})


def render_chart(
    overrides: dict | None = None, release: str = "fleetprof", namespace: str = "fleetprof"
) -> dict[str, list[dict]]:
    """{template file: [objects]}, like `helm template RELEASE helm/fleetprof -n NAMESPACE --set ...`."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = chart_values(overrides)
    jsonschema.validate(values, json.loads((CHART / "values.schema.json").read_text()))
    ctx = {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
        "Files": _Files(CHART),
    }
    trees = {p.name: _parse(p.read_text()) for p in sorted((CHART / "templates").glob("*.tpl"))}
    trees |= {p.name: _parse(p.read_text()) for p in sorted((CHART / "templates").glob("*.yaml"))}
    defines = {
        n[1]: n[2] for tree in trees.values() for n in tree if isinstance(n, list) and n[0] == "define"
    }
    r = _Renderer(defines)
    out = {}
    for name, tree in trees.items():
        if name.endswith(".tpl"):
            continue
        text = r.render(tree, ctx, {"$": ctx})
        out[name] = [d for d in yaml.safe_load_all(text) if d]
    return out


def all_objects(rendered: dict[str, list[dict]]) -> list[dict]:
    return [o for objs in rendered.values() for o in objs]


# ---- the tests ---------------------------------------------------------------------------------------


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
    tree = _parse('a {{- " b" -}} c{{ if .x }}X{{ else }}Y{{ end }}{{ range .l }}[{{ . }}]{{ end }}')
    assert _Renderer({}).render(tree, {"x": 0, "l": [1, "z"]}, {}) == "a bcY[1][z]"
    tree = _parse('{{ with .m }}{{ .k | quote }}{{ end }}{{ printf "%s-%v" "p" 7 | trunc 3 }}')
    assert _Renderer({}).render(tree, {"m": {"k": "v"}}, {}) == '"v"p-7'
    tree = _parse('{{ define "d" }}n={{ .n }}{{ end }}{{ include "d" . | nindent 2 }}')
    defines = {n[1]: n[2] for n in tree if isinstance(n, list)}
    assert _Renderer(defines).render(tree, {"n": 3}, {}) == "\n  n=3"
    with pytest.raises(TemplateError, match="lookup"):
        _Renderer({}).render(_parse('{{ lookup "v1" "Pod" "" "" }}'), {}, {})


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
    from tests.test_deploy import manifest_objects

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
    from tests.test_deploy import K8S_VERSIONS, validate_object

    objects = all_objects(render_chart(VARIANTS[variant]))
    assert objects
    for obj in objects:
        for version in K8S_VERSIONS:
            validate_object(obj, version)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_flags_are_accepted_by_the_cli(variant: str) -> None:
    from tests.test_deploy import assert_flags_accepted

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
    "by this file's Go-template interpreter instead — see deploy/README.md to run helm lint/template",
)


@needs_helm
def test_helm_lint_passes() -> None:
    r = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_template_output_is_valid_and_matches_the_interpreter(variant: str, tmp_path: Path) -> None:
    from tests.test_deploy import K8S_VERSIONS, validate_object

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
