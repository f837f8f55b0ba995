"""A published Connect client for tests: tests/connect_client/client.mjs (@connectrpc/connect-node over
@bufbuild/protobuf, installed by scripts/setup.sh --test) calling querier.v1.QuerierService with the
service built from our own generated descriptors, its answers handed back as our protobuf messages."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, json_format, message_factory
from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.message import Message

from fleetprof._proto.pyroscope import querier_pb2
from tests.conftest import REPO

CLIENT = REPO / "tests" / "connect_client"
# scripts/setup.sh --test runs `npm ci` here from CLIENT's lock file.
INSTALLED = REPO / ".venv" / "share" / "connect-client"
SERVICE = querier_pb2.DESCRIPTOR.services_by_name["QuerierService"]


def _files(root: FileDescriptor) -> list[FileDescriptor]:
    """`root` and every file it imports, each after its own imports (the order a registry reads them)."""
    out: list[FileDescriptor] = []

    def visit(f: FileDescriptor) -> None:
        if f in out:
            return
        for dep in f.dependencies:
            visit(dep)
        out.append(f)

    visit(root)
    return out


def descriptor_set(unserved: Iterable[str] = ()) -> bytes:
    """A serialized FileDescriptorSet of querier.proto and its imports. Each name in `unserved` becomes one
    more QuerierService method (ProfileTypes' messages) that the server does not serve, as a client built
    from Pyroscope's whole service would call it."""
    fds = descriptor_pb2.FileDescriptorSet()
    for f in _files(querier_pb2.DESCRIPTOR):
        proto = fds.file.add()
        f.CopyToProto(proto)
        for message in proto.message_type:
            _name_json_fields(message, f.pool.FindMessageTypeByName(f"{proto.package}.{message.name}"))
        if f is querier_pb2.DESCRIPTOR:
            service = next(s for s in proto.service if s.name == SERVICE.name)
            for name in unserved:
                service.method.add(
                    name=name,
                    input_type=".querier.v1.ProfileTypesRequest",
                    output_type=".querier.v1.ProfileTypesResponse",
                )
    return fds.SerializeToString()


def _name_json_fields(proto: descriptor_pb2.DescriptorProto, message: Descriptor) -> None:
    """Each field's JSON name, as protoc writes it into a descriptor set: CopyToProto leaves it out, and
    protobuf-es reads a field without one as having no JSON name (`profile_typeID` is `profileTypeID`)."""
    for field in proto.field:
        field.json_name = message.fields_by_name[field.name].json_name
    for nested in proto.nested_type:
        _name_json_fields(nested, message.nested_types_by_name[nested.name])


@dataclass(frozen=True)
class Answer:
    """One call's outcome: the response (and the Content-Encoding it came in, None for none), or the
    Connect error code ("invalid_argument") and message."""

    response: Message | None
    code: str | None = None
    message: str = ""
    encoding: str | None = None

    @property
    def ok(self) -> bool:
        return self.code is None


def _node_modules() -> Path:
    """The installed packages; skips where node or they are missing (setup.sh --test installs both), and
    fails where they were installed from another lock file than the one checked in."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed (scripts/setup.sh --test installs it)")
    modules = INSTALLED / "node_modules"
    if not (modules / "@connectrpc" / "connect-node").is_dir():
        pytest.skip(f"the Connect client's npm packages are not in {INSTALLED} (run scripts/setup.sh --test)")
    stamp = INSTALLED / ".installed-lock"
    if not stamp.is_file() or stamp.read_bytes() != (CLIENT / "package-lock.json").read_bytes():
        pytest.fail(f"{INSTALLED} was installed from another package-lock.json: run scripts/setup.sh --test")
    return modules


def _output_class(method: str) -> type[Message]:
    found = SERVICE.methods_by_name.get(method)
    output = found.output_type if found else querier_pb2.ProfileTypesResponse.DESCRIPTOR
    return message_factory.GetMessageClass(output)


@dataclass(frozen=True)
class ConnectClient:
    """Calls on one Connect transport: `binary` (application/proto) or JSON, gzip both ways; `headers` go
    with every call; `ca` is a PEM file to trust for an https `base_url`."""

    base_url: str
    binary: bool
    headers: dict[str, str] | None = None
    ca: Path | None = None
    unserved: tuple[str, ...] = ()

    def calls(self, calls: list[tuple[str, Message]], timeout: float = 120) -> list[Answer]:
        """Every call in order, over one node process (it costs ~0.3 s to start)."""
        modules = _node_modules()
        job = {
            "baseUrl": self.base_url,
            "binary": self.binary,
            "descriptorSet": base64.b64encode(descriptor_set(self.unserved)).decode(),
            "calls": [{"method": m, "request": json_format.MessageToDict(r)} for m, r in calls],
            "headers": self.headers or {},
        }
        if self.ca:
            job["ca"] = str(self.ca)
        run = subprocess.run(
            ["node", str(CLIENT / "client.mjs")],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            cwd=modules.parent,
            env={**os.environ, "NODE_PATH": str(modules)},
            timeout=timeout,
        )
        if run.returncode != 0:
            raise AssertionError(f"the Connect client failed ({run.returncode}): {run.stderr[-3000:]}")
        lines = [json.loads(line) for line in run.stdout.splitlines()]
        assert len(lines) == len(calls), run.stdout
        answers = []
        for (method, _), line in zip(calls, lines, strict=True):
            if line["ok"]:
                response = json_format.ParseDict(line["response"], _output_class(method)())
                answers.append(Answer(response, encoding=line["encoding"]))
            else:
                answers.append(Answer(None, line["code"], line["message"]))
        return answers
