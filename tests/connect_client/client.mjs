// A published Connect client (@connectrpc/connect-node) driving querier.v1.QuerierService, for
// tests/support/connect.py. The service is built at run time from the FileDescriptorSet the caller sends, with
// @bufbuild/protobuf's registry: no generated code, so the protos the server was generated from are the
// protos the client speaks.
//
// stdin: one JSON object {baseUrl, binary, descriptorSet (base64 FileDescriptorSet), calls: [{method,
//   request (proto3 JSON)}], headers?, ca? (a PEM file the server's certificate chains to)}
// stdout: one JSON line per call, in order: {ok: true, response (proto3 JSON), encoding (the response's
//   Content-Encoding, or null)} or {ok: false, code (the protocol's name: "invalid_argument"), message}
//
// The packages are CommonJS-resolved (createRequire) so that NODE_PATH finds them where
// scripts/setup.sh installed them: ES module imports ignore NODE_PATH.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { createFileRegistry, fromBinary, fromJson, toJson } = require("@bufbuild/protobuf");
const { FileDescriptorSetSchema } = require("@bufbuild/protobuf/wkt");
const { Code, ConnectError, createClient } = require("@connectrpc/connect");
const { compressionGzip, createConnectTransport } = require("@connectrpc/connect-node");

const SERVICE = "querier.v1.QuerierService";

// Code.InvalidArgument -> "invalid_argument", as the Connect protocol and the server's error JSON name it.
function codeName(code) {
  return Code[code].replace(/(?<=[a-z])([A-Z])/g, "_$1").toLowerCase();
}

async function main() {
  const job = JSON.parse(readFileSync(0, "utf8"));
  const registry = createFileRegistry(
    fromBinary(FileDescriptorSetSchema, Buffer.from(job.descriptorSet, "base64")),
  );
  const service = registry.getService(SERVICE);
  if (!service) throw new Error(`the descriptor set has no ${SERVICE}`);
  const transport = createConnectTransport({
    baseUrl: job.baseUrl,
    httpVersion: "1.1",
    useBinaryFormat: Boolean(job.binary),
    acceptCompression: [compressionGzip],
    sendCompression: compressionGzip,
    compressMinBytes: 0, // gzip every request, however small: the server must inflate them all
    nodeOptions: job.ca ? { ca: readFileSync(job.ca) } : undefined,
  });
  const client = createClient(service, transport);
  for (const call of job.calls) {
    const method = service.methods.find((m) => m.name === call.method);
    if (!method) throw new Error(`${SERVICE} has no method ${call.method}`);
    let line;
    try {
      const request = fromJson(method.input, call.request ?? {}, { registry });
      let encoding = null;
      const response = await client[method.localName](request, {
        headers: job.headers ?? {},
        onHeader: (header) => (encoding = header.get("content-encoding")),
      });
      line = { ok: true, response: toJson(method.output, response, { registry }), encoding };
    } catch (err) {
      const e = ConnectError.from(err);
      line = { ok: false, code: codeName(e.code), message: e.rawMessage };
    }
    process.stdout.write(JSON.stringify(line) + "\n");
  }
}

main().catch((err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exit(1);
});
