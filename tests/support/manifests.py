"""Checks that deploy/ and helm/ tests share: strict Kubernetes schemas and the CLI's flags in manifests."""

from __future__ import annotations

import contextlib
import io
import posixpath
import re
from collections.abc import Iterable, Mapping
from functools import cache

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fleetprof.cli.parser import build_parser
from tests.conftest import REPO, fleetprof

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))

# The oldest Kubernetes the chart supports (appArmorProfile in securityContext is 1.30+) and the newest
# schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version().rsplit(".", 1)[0])

# ServiceMonitor is a prometheus-operator CRD, which the Kubernetes schemas lack: SERVICE_MONITOR_SCHEMA is
# written from the CRD's documented fields (monitoring.coreos.com/v1 ServiceMonitorSpec, Endpoint,
# RelabelConfig, NamespaceSelector, SafeAuthorization, TLSConfig), closed to unknown fields like the rest.
# Likewise CERTIFICATE_SCHEMA for cert-manager's Certificate (cert-manager.io/v1 CertificateSpec).
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
_SECRET_KEY = {  # SecretKeySelector / ConfigMapKeySelector
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "key"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "key": {"type": "string", "minLength": 1},
        "optional": {"type": "boolean"},
    },
}
_SECRET_OR_CONFIGMAP = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"secret": _SECRET_KEY, "configMap": _SECRET_KEY},
    "oneOf": [{"required": ["secret"]}, {"required": ["configMap"]}],
}
_TLS_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "ca": _SECRET_OR_CONFIGMAP,
        "cert": _SECRET_OR_CONFIGMAP,
        "keySecret": _SECRET_KEY,
        "serverName": _STR,
        "insecureSkipVerify": {"type": "boolean"},
        "caFile": _STR,
        "certFile": _STR,
        "keyFile": _STR,
        "minVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]},
        "maxVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]},
    },
}
_AUTHORIZATION = {  # SafeAuthorization: type defaults to Bearer; "Basic" is refused by the operator
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "type": {"type": "string", "not": {"enum": ["Basic", "basic"]}},
        "credentials": _SECRET_KEY,
    },
}
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
                            "authorization": _AUTHORIZATION,
                            "bearerTokenSecret": _SECRET_KEY,
                            "tlsConfig": _TLS_CONFIG,
                        },
                        "oneOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                    },
                },
            },
        },
    },
}


_GO_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
_KEY_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
    "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
    "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip
_METADATA = SERVICE_MONITOR_SCHEMA["properties"]["metadata"]
CERTIFICATE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["secretName", "issuerRef"],
            # cert-manager's webhook: a certificate must name something
            "anyOf": [
                {"required": [k]} for k in ("commonName", "dnsNames", "ipAddresses", "uris", "emailAddresses")
            ],
            "properties": {
                "secretName": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                "secretTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "labels": {"type": "object", "additionalProperties": _STR},
                        "annotations": {"type": "object", "additionalProperties": _STR},
                    },
                },
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "items": _STR},
                "ipAddresses": _STRLIST,
                "uris": _STRLIST,
                "emailAddresses": _STRLIST,
                "duration": _GO_DURATION,
                "renewBefore": _GO_DURATION,
                "isCA": {"type": "boolean"},
                "revisionHistoryLimit": {"type": "integer", "minimum": 1},
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {"name": {"type": "string", "minLength": 1}, "kind": _STR, "group": _STR},
                },
            },
        },
    },
}
_CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "Certificate": CERTIFICATE_SCHEMA}


def validate_object(obj: dict, version: str) -> None:
    """One object against Kubernetes `version`'s schema (strict), or ours for ServiceMonitor and
    Certificate (CRDs)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") in _CRD_SCHEMAS:
        try:
            jsonschema.validate(obj, _CRD_SCHEMAS[obj["kind"]])
        except jsonschema.ValidationError as err:
            pytest.fail(f"{name}: {err.message} at {list(err.absolute_path)}")
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(f"{name} is not valid Kubernetes {version}: {err.message} at {list(err.path)}")


def readme_secrets() -> dict[str, set[str]]:
    """The Secrets deploy/README.md tells plain-manifest users to create: name -> keys."""
    text = (DEPLOY / "README.md").read_text()
    made = {}
    for m in re.finditer(
        r"kubectl -n fleetprof create secret generic (\S+)((?: --from-literal=[^=\s]+=\S+)+)", text
    ):
        made[m.group(1)] = set(re.findall(r"--from-literal=([^=\s]+)=", m.group(2)))
    return made


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
    """The DaemonSet's or StatefulSet's `fleetprof` command line uses only flags its command accepts (as
    `--help` names them), with values the CLI's parser takes."""
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["fleetprof"]
    command, *args = c["args"]
    assert command in ("agent", "collector")
    unknown = sorted(set(flags_used(args)) - cli_flags(command))
    assert not unknown, f"{workload['metadata']['name']}: `fleetprof {command}` does not accept {unknown}"
    assert_args_parse(workload)


def _container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def assert_args_parse(workload: dict) -> None:
    """The workload's command line, values included, is one `fleetprof` parses: a flag value the CLI
    refuses (a bad HOST:PORT, a frequency out of range) fails here. $(VAR) references stand in as text."""
    c = _container(workload)
    argv = [re.sub(r"\$\((\w+)\)", r"\1", a) for a in c["args"]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(
            f"{workload['metadata']['name']}: `fleetprof {' '.join(argv)}` is refused:\n{err.getvalue()}"
        )


# A kubernetes.io/tls Secret as cert-manager writes it (ca.crt too, for a CA issuer): what a volume that
# mounts every key of a TLS Secret shows.
TLS_SECRET_KEYS = frozenset({"tls.crt", "tls.key", "ca.crt"})


def secret_sources(workload: dict) -> list[dict]:
    """Every Secret the pod references through its volumes: {"name", "keys" (None: all of them), "volume"}."""
    out = []
    for vol in workload["spec"]["template"]["spec"].get("volumes", []):
        if "secret" in vol:
            src = vol["secret"]
            out.append({"name": src["secretName"], "items": src.get("items"), "volume": vol["name"]})
        for proj in vol.get("projected", {}).get("sources", []):
            if "secret" in proj:
                src = proj["secret"]
                out.append({"name": src["name"], "items": src.get("items"), "volume": vol["name"]})
    return out


def secret_files(workload: dict, secret_keys: Mapping[str, Iterable[str]]) -> dict[str, tuple[str, str]]:
    """Each file the container sees from a Secret: path -> (Secret name, key). `secret_keys` gives the keys
    of Secrets mounted whole (no `items`); a Secret not in it is taken for a TLS Secret."""
    c = _container(workload)
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    files = {}
    for src in secret_sources(workload):
        if src["volume"] not in mounts:
            continue
        if src["items"] is not None:
            pairs = [(i["path"], i["key"]) for i in src["items"]]
        else:
            pairs = [(k, k) for k in secret_keys.get(src["name"], TLS_SECRET_KEYS)]
        for path, key in pairs:
            files[posixpath.join(mounts[src["volume"]], path)] = (src["name"], key)
    return files


def host_files(workload: dict, path: str) -> tuple[str, str] | None:
    """Where a path in the container comes from when it is not a Secret's: ("ConfigMap NAME", key) for a
    ConfigMap volume's item, ("hostPath DIR", file) under a host directory (the kubelet's certificates);
    None otherwise."""
    c = _container(workload)
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    for vol in workload["spec"]["template"]["spec"].get("volumes", []):
        mount = mounts.get(vol["name"])
        if mount is None:
            continue
        if "configMap" in vol:
            for item in vol["configMap"].get("items", []):
                if posixpath.join(mount, item["path"]) == path:
                    return (f"ConfigMap {vol['configMap']['name']}", item["key"])
        if "hostPath" in vol and path.startswith(mount + "/"):
            return (f"hostPath {vol['hostPath']['path']}", path[len(mount) + 1 :])
    return None


def file_flags(workload: dict) -> dict[str, str]:
    """--FLAG=/absolute/path arguments under /etc/fleetprof (tokens, certificates): flag -> path."""
    return {
        a.split("=", 1)[0]: a.split("=", 1)[1]
        for a in _container(workload)["args"]
        if a.startswith("--") and "=/etc/fleetprof/" in a
    }


def assert_file_flags_are_mounted(
    workload: dict, secret_keys: Mapping[str, Iterable[str]]
) -> dict[str, tuple]:
    """Every token or certificate flag names a file a mounted Secret provides, read-only and mounted whole
    (no subPath: a subPath mount never sees a rotated Secret). Returns flag -> (Secret, key)."""
    c = _container(workload)
    files = secret_files(workload, secret_keys)
    for m in c.get("volumeMounts", []):
        if m["mountPath"].startswith("/etc/fleetprof/"):
            assert m.get("readOnly") is True, f"{m['name']} is not mounted read-only"
            assert "subPath" not in m, f"{m['name']} uses subPath: rotated Secrets would not reach it"
    out = {}
    for flag, path in file_flags(workload).items():
        found = files.get(path) or host_files(workload, path)
        assert found, f"{workload['metadata']['name']}: {flag}={path} is no mounted Secret's file"
        out[flag] = found
    return out
