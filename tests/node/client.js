// Streams one greedy completion from a batchwire server, using only the .proto files.
// Usage: node client.js HOST:PORT PROMPT MAX_TOKENS
// Prints one JSON line: the text, the token ids, the number of messages, finish_reason, usage.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, prompt, maxTokens] = process.argv.slice(2);
if (!address || prompt === undefined || !maxTokens) {
  console.error("usage: node client.js HOST:PORT PROMPT MAX_TOKENS");
  process.exit(2);
}

const definition = protoLoader.loadSync("batchwire/v1/generate.proto", {
  includeDirs: [path.resolve(__dirname, "..", "..", "protos")],
  keepCase: true, // field names as in the .proto: max_tokens, finish_reason
  longs: String,
  enums: String,
  oneofs: true,
});
const { Generation } = grpc.loadPackageDefinition(definition).batchwire.v1;
const client = new Generation(address, grpc.credentials.createInsecure());

const request = {
  text: prompt,
  // `optional` fields: an explicit 0 is sent, so temperature 0 means greedy, not the default.
  sampling: { temperature: 0, max_tokens: Number(maxTokens), ignore_eos: true },
};
const call = client.Generate(request, { deadline: Date.now() + 120_000 });

const result = { text: "", token_ids: [], messages: 0, finish_reason: null, usage: null };
call.on("data", (message) => {
  result.text += message.text;
  result.token_ids.push(...message.token_ids);
  result.messages += 1;
  if (message.finish_reason) {
    result.finish_reason = message.finish_reason;
    result.usage = message.usage;
  }
});
call.on("error", (error) => {
  console.error(`gRPC error ${error.code}: ${error.details}`);
  process.exit(1);
});
call.on("end", () => {
  console.log(JSON.stringify(result));
  client.close();
});
