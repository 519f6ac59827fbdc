// The main job on real input: one sandbox_script call through demesne's MCP server over
// stdio, made by the official MCP SDK client. Prints the result and the output folder.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { readdirSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const transport = new StdioClientTransport({
  command: process.env.DEMESNE_BIN || path.join(root, "build/demesne"),
  args: ["serve"],
  env: { ...process.env },
  stderr: "inherit",
});
const client = new Client({ name: "demesne-demo", version: "1.0.0" });
await client.connect(transport);
const command = process.argv[2] || "uname -a; python3 --version; echo hi > /out/hello.txt";
console.log(`$ ${command}`);
const result = await client.callTool(
  { name: "sandbox_script", arguments: { command } },
  undefined,
  { timeout: 900_000, resetTimeoutOnProgress: true, onprogress: (p) => p.message && console.log(`… ${p.message}`) },
);
const r = result.structuredContent;
if (result.isError || !r) {
  console.error(result.content?.[0]?.text ?? JSON.stringify(result));
  process.exitCode = 1;
} else {
  console.log(r.stdout.trimEnd());
  if (r.stderr) console.log(r.stderr.trimEnd());
  console.log(`exit_code: ${r.exit_code}  duration_ms: ${r.duration_ms}`);
  console.log(`output_dir: ${r.output_dir}`);
  console.log(`files: ${readdirSync(r.output_dir).join(", ")}`);
  if (r.exit_code !== 0) process.exitCode = 1;
}
await client.close();
