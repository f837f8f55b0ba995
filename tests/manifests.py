"""Checks that deploy/ and helm/ tests share: strict Kubernetes schemas and the CLI's flags in manifests."""

from __future__ import annotations

import re
from functools import cache

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO, fleetprof

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))

# The oldest Kubernetes the chart supports (appArmorProfile in securityContext is 1.30+) and the newest
# schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version().rsplit(".", 1)[0])

# ServiceMonitor is a prometheus-operator CRD, which the Kubernetes schemas lack: SERVICE_MONITOR_SCHEMA is
# written from the CRD's documented fields (monitoring.coreos.com/v1 ServiceMonitorSpec, Endpoint,
# RelabelConfig, NamespaceSelector), closed to unknown fields like the rest.
_STR = {"type": "string"}
_STRLIST = {"type": "array", "items": _STR}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": _STR},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": _STR,
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": _STRLIST,
                },
            },
        },
    },
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": _STR,
        "targetLabel": _STR,
        "regex": _STR,
        "modulus": {"type": "integer", "minimum": 1},
        "replacement": _STR,
        "action": {
            "enum": [
                "replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                "dropequal", "DropEqual",
            ]
        },
    },
}  # fmt: skip
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
             "(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": _STR,
                "labels": {"type": "object", "additionalProperties": _STR},
                "annotations": {"type": "object", "additionalProperties": _STR},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": _STR,
                "targetLabels": _STRLIST,
                "podTargetLabels": _STRLIST,
                "sampleLimit": {"type": "integer", "minimum": 0},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STRLIST},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": _STR,
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "params": {"type": "object", "additionalProperties": _STRLIST},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "honorTimestamps": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        },
                        "oneOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                    },
                },
            },
        },
    },
}


def validate_object(obj: dict, version: str) -> None:
    """One object against Kubernetes `version`'s schema (strict), or ours for ServiceMonitor."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") == "ServiceMonitor":
        try:
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        except jsonschema.ValidationError as err:
            pytest.fail(f"{name}: {err.message} at {list(err.absolute_path)}")
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(f"{name} is not valid Kubernetes {version}: {err.message} at {list(err.path)}")


def manifest_objects() -> list[dict]:
    """Every object of deploy/kubernetes/*.yaml."""
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


@cache
def cli_flags(command: str) -> frozenset[str]:
    """The flags `fleetprof COMMAND --help` names."""
    r = fleetprof(command, "--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out))


def flags_used(args: list[str]) -> list[str]:
    """The flags in a command line, without their values."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def assert_flags_accepted(workload: dict) -> None:
    """The DaemonSet's or StatefulSet's `fleetprof` command line uses only flags its command accepts."""
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["fleetprof"]
    command, *args = c["args"]
    assert command in ("agent", "collector")
    unknown = sorted(set(flags_used(args)) - cli_flags(command))
    assert not unknown, f"{workload['metadata']['name']}: `fleetprof {command}` does not accept {unknown}"
