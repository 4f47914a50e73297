// Streams one greedy completion from a batchwire server, using only the .proto files.
// Usage: node client.js HOST:PORT PROMPT MAX_TOKENS [TOOLS_JSON]
// Prints one JSON line: the text, the token ids, the number of messages, finish_reason, usage,
// and the tool calls. With TOOLS_JSON ([{name, description, parameters}]) the prompt is a user
// message and the model must call one of the tools (TOOL_CHOICE_REQUIRED).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, prompt, maxTokens, toolsJson] = process.argv.slice(2);
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

// `optional` fields: an explicit 0 is sent, so temperature 0 means greedy, not the default.
const sampling = { temperature: 0, max_tokens: Number(maxTokens), ignore_eos: !toolsJson };
const request = toolsJson === undefined ? { text: prompt, sampling } : {
  messages: [{ role: "user", content: prompt }],
  tools: JSON.parse(toolsJson).map((t) => ({ ...t, parameters: JSON.stringify(t.parameters) })),
  tool_choice: "TOOL_CHOICE_REQUIRED",
  sampling,
};
const call = client.Generate(request, { deadline: Date.now() + 120_000 });

const result = {
  text: "", token_ids: [], messages: 0, finish_reason: null, usage: null, tool_calls: [],
};
call.on("data", (message) => {
  result.text += message.text;
  result.token_ids.push(...message.token_ids);
  result.messages += 1;
  if (message.finish_reason) {
    result.finish_reason = message.finish_reason;
    result.usage = message.usage;
    result.tool_calls = message.tool_calls;
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
