// A scripted model vendor on 127.0.0.1 for end-to-end tests of agent trees: it speaks the
// Anthropic Messages API (SSE) to Claude Code and the OpenAI Responses API to Codex, as
// recorded in shared/reference/agent-clis.md, and plays each agent from a plan.
//
// An agent's prompt names its plan (PLAN:<id>; the first one in a request's history is the
// agent's own, since a prompt it writes for a child comes later). A plan is a list of steps:
//   {tool, args(ctx)}  call a tool of the in-sandbox `demesne` MCP server (Claude Code's
//                      mcp__demesne__<tool>, Codex's mcp__demesne namespace or code mode),
//                      or, with `server`, of that MCP server (a host MCP server's)
//   {shell}            run a shell command with the CLI's own shell tool (a string, or ctx => string)
//   {final}            end the turn with this answer
// and any step may have `id` (for ctx.result(id) and ctx.job(id)), `again(text, ctx)` (repeat
// while it holds for the step's result: a wait that answered `running`), or `next(text,
// ctx)` (the id of the step to go to after this one, or undefined for the following one).
// A plan made with {turns: true} spans several turns of one session (a resumed session: a
// `continue`): each user message that follows a final answer in the history counts as one
// result, NEW_TURN, so the step after a {final} is taken in the next turn.
// Each request is answered with the step the results so far lead to, so the vendor keeps no
// state between requests beyond the plan; every step taken is recorded in plan.taken, and
// every response the plan was billed for in plan.responses ({model, step, input, output,
// cache_read}; plan.served counts them).
import http from "node:http";
import { randomBytes } from "node:crypto";

/** The result a plan with {turns: true} sees for a user message after a final answer. */
export const NEW_TURN = "(a new turn of the same session)";
const JOB = /job-[0-9]{8}T[0-9]{6}Z-[0-9a-f]+/;
/** The job id a tool result names, or a marker that fails loudly. */
export const jobOf = (text) => (text || "").match(JOB)?.[0] || "no-job-id-in-the-result";
const TERMINAL = /"status":\s*"(succeeded|failed|cancelled|lost)"|status: (succeeded|failed|cancelled|lost)/;
/** True while a sandbox_wait result says the job is still running. */
export const stillRunning = (text) => !TERMINAL.test(text || "");
/** The terminal status a result names ("succeeded", "failed", …), or null. */
export const statusOf = (text) => {
  const m = (text || "").match(TERMINAL);
  return m ? m[1] || m[2] : null;
};

const textOf = (x) => (typeof x === "string" ? x : Array.isArray(x)
  ? x.map((b) => (typeof b?.text === "string" ? b.text : JSON.stringify(b))).join("\n") : JSON.stringify(x));

/**
 * Starts the vendor. Requests must carry `secret` (the host's real credential, swapped in
 * by demesne's vendor route); others get 401. `intercept(kind, body, res, size)` (optional)
 * sees each authorised request first ("anthropic" or "openai", its parsed body, the
 * response, its size in bytes) and returns true when it answered it itself. Every answer
 * the vendor writes whole is recorded in `served`: {model, input, output}.
 * @param {{secret: string, intercept?: Function}} o
 * @returns {Promise<{port: number, plan: Function, plans: Map, served: object[], close: () => Promise<void>}>}
 */
export async function startVendor({ secret, intercept }) {
  const plans = new Map();
  const served = [];

  /**
   * Adds a plan and returns its id. tokens: {input, output, cache_read?} billed per response
   * (each plus the number of the response, so no two responses of a plan bill alike; no
   * cache_read: none billed); opts.turns: the plan spans several turns (see NEW_TURN).
   */
  function plan(id, steps, tokens = { input: 100, output: 10 }, opts = {}) {
    const byId = new Map();
    steps.forEach((s, i) => { if (s.id) byId.set(s.id, i); });
    plans.set(id, { id, steps, byId, tokens, turns: !!opts.turns, served: 0, responses: [], taken: [], results: [],
      offered: null });
    return id;
  }

  // The step to take after `results` (the texts of the tool results so far, in order).
  function nextStep(p, results) {
    const last = new Map();
    let pc = 0;
    let guard = 0;
    const ctx = (lastText) => ({
      last: lastText,
      result: (id) => last.get(id),
      job: (id) => jobOf(last.get(id)),
    });
    for (const r of results) {
      const s = p.steps[pc];
      if (!s) break;
      last.set(s.id ?? pc, r);
      if (++guard > 200) break;
      if (s.again && s.again(r, ctx(r))) continue;
      const to = s.next ? s.next(r, ctx(r)) : undefined;
      if (to !== undefined) {
        if (!p.byId.has(to)) throw new Error(`plan ${p.id}: no step ${to}`);
        pc = p.byId.get(to);
      } else {
        pc++;
      }
    }
    const c = ctx(results[results.length - 1]);
    const s = p.steps[pc] || { final: "done" };
    const step = { index: pc, id: s.id, final: s.final };
    if (s.tool) { step.tool = s.tool; step.server = s.server || "demesne"; step.args = s.args ? s.args(c) : {}; }
    if (s.shell !== undefined) step.shell = typeof s.shell === "function" ? s.shell(c) : s.shell;
    return step;
  }

  function planOf(history) {
    const m = JSON.stringify(history).match(/PLAN:([a-z0-9-]+)/);
    return m && plans.has(m[1]) ? plans.get(m[1]) : null;
  }

  // The step for this request of plan p, recorded; null when the plan threw (answered as text).
  function take(p, results, offered, body) {
    p.results = results;
    p.offered = offered;
    p.body = body; // the last request, as the CLI sent it
    let step;
    try {
      step = nextStep(p, results);
    } catch (e) {
      p.error = String(e?.stack || e);
      step = { final: `plan error: ${e}` };
    }
    p.taken.push(step);
    const n = p.served++;
    const usage = { input: p.tokens.input + n, output: p.tokens.output + n,
      cache_read: p.tokens.cache_read === undefined ? 0 : p.tokens.cache_read + n };
    p.responses.push({ ...usage, model: body.model, step: step.index });
    return { step, usage };
  }

  function toolName(tools, want, server = "demesne") {
    for (const t of tools || []) {
      if (t?.type === "namespace" && t.name.includes(server) && (t.tools || []).some((x) => x.name === want)) {
        return { name: want, namespace: t.name };
      }
    }
    const name = (tools || []).map((t) => t?.name).find((n) => n === `mcp__${server}__${want}`);
    return name ? { name } : null;
  }
  const offeredNames = (tools) => (tools || []).flatMap((t) => (t?.type === "namespace"
    ? (t.tools || []).map((x) => `${t.name}:${x.name}`) : [t?.name]));

  function anthropic(res, body) {
    const msgs = body.messages || [];
    const side = Array.isArray(body.tools) && body.tools.length === 0;
    const p = side ? null : planOf(msgs);
    const model = body.model || "claude-sonnet-5";
    let blocks = [{ type: "text", text: "ok" }], stop = "end_turn", usage = { input: 1, output: 1, cache_read: 0 };
    if (p) {
      const results = [];
      let ended = false; // the last assistant message was a final answer (no tool call)
      for (const m of msgs) {
        if (m.role === "assistant") {
          ended = !(Array.isArray(m.content) && m.content.some((b) => b?.type === "tool_use"));
          continue;
        }
        if (p.turns && ended) results.push(NEW_TURN);
        ended = false;
        if (m.role !== "user" || !Array.isArray(m.content)) continue;
        for (const b of m.content) if (b.type === "tool_result") results.push(textOf(b.content));
      }
      const t = take(p, results, offeredNames(body.tools), body);
      usage = t.usage;
      const { step } = t;
      const id = "toolu_" + randomBytes(6).toString("hex");
      if (step.tool) {
        const name = toolName(body.tools, step.tool, step.server)?.name || `missing__${step.tool}`;
        blocks = [{ type: "tool_use", id, name, input: step.args }];
        stop = "tool_use";
      } else if (step.shell !== undefined) {
        blocks = [{ type: "tool_use", id, name: "Bash", input: { command: step.shell, description: "step", timeout: 600000 } }];
        stop = "tool_use";
      } else {
        blocks = [{ type: "text", text: step.final }];
      }
    }
    const id = "msg_" + randomBytes(6).toString("hex");
    const u = { input_tokens: usage.input, output_tokens: 1, cache_read_input_tokens: usage.cache_read,
      cache_creation_input_tokens: 0 };
    served.push({ model, input: usage.input, output: usage.output });
    if (!body.stream) {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ id, type: "message", role: "assistant", model, content: blocks, stop_reason: stop,
        usage: { ...u, output_tokens: usage.output } }));
      return;
    }
    const events = [{ type: "message_start", message: { id, type: "message", role: "assistant", content: [], model,
      stop_reason: null, usage: u } }];
    blocks.forEach((b, index) => {
      if (b.type === "text") {
        events.push({ type: "content_block_start", index, content_block: { type: "text", text: "" } });
        events.push({ type: "content_block_delta", index, delta: { type: "text_delta", text: b.text } });
      } else {
        events.push({ type: "content_block_start", index, content_block: { type: "tool_use", id: b.id, name: b.name, input: {} } });
        events.push({ type: "content_block_delta", index, delta: { type: "input_json_delta", partial_json: JSON.stringify(b.input) } });
      }
      events.push({ type: "content_block_stop", index });
    });
    events.push({ type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: usage.output } });
    events.push({ type: "message_stop" });
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    for (const ev of events) res.write(`event: ${ev.type}\ndata: ${JSON.stringify(ev)}\n\n`);
    res.end();
  }

  // Codex offers tools at the top level (MCP servers as a namespace) or, in code mode, inside
  // an `additional_tools` input item whose `exec` tool runs JavaScript with the tools on `tools`
  // (a name with characters other than letters, digits and `_` is found as Codex spells it).
  function codexTools(body) {
    const extra = (body.input || []).filter((i) => i?.type === "additional_tools").flatMap((i) => i.tools || []);
    return [...(body.tools || []), ...extra];
  }
  const codeMode = (tools) => tools.some((t) => t?.type === "namespace" && (t.tools || []).some((x) => x.name === "exec"
    && x.type === "custom"));

  function openai(res, body) {
    const input = body.input || [];
    const p = planOf(input.filter((i) => i?.type !== "additional_tools"));
    const model = body.model;
    let item = { type: "message", role: "assistant", id: "msg_x", content: [{ type: "output_text", text: "ok" }] };
    let usage = { input: 1, output: 1, cache_read: 0 };
    const callId = () => "call_" + randomBytes(6).toString("hex");
    if (p) {
      const tools = codexTools(body);
      const results = [];
      let ended = false; // the last assistant item was a final message (no tool call after it)
      for (const i of input) {
        if (i?.type === "message" && i.role === "assistant") { ended = true; continue; }
        if (typeof i?.type === "string" && i.type.endsWith("_call")) { ended = false; continue; }
        if (i?.type === "message" && i.role === "user" && p.turns && ended) { results.push(NEW_TURN); ended = false; }
        if (typeof i?.type === "string" && i.type.endsWith("_output") && i.call_id) results.push(textOf(i.output));
      }
      const t = take(p, results, offeredNames(tools), body);
      usage = t.usage;
      const { step } = t;
      if (step.tool && codeMode(tools)) {
        p.codeMode = true;
        item = { type: "custom_tool_call", id: "ctc_" + randomBytes(6).toString("hex"), call_id: callId(), name: "exec",
          input: `// @exec: {"yield_time_ms": 300000}\nconst want = ${JSON.stringify(`mcp__${step.server}__${step.tool}`)}.replace(/[^A-Za-z0-9_]/g, "_");\n`
            + "const name = [...Object.keys(tools), ...ALL_TOOLS.map((t) => t.name)].find((n) => n.replace(/[^A-Za-z0-9_]/g, \"_\") === want) || want;\n"
            + `const r = await tools[name](${JSON.stringify(step.args)});\n`
            + "text(JSON.stringify(r));\n" };
      } else if (step.tool) {
        const tn = toolName(tools, step.tool, step.server) || { name: `missing__${step.tool}` };
        item = { type: "function_call", id: "fc_" + randomBytes(6).toString("hex"), call_id: callId(), name: tn.name,
          ...(tn.namespace ? { namespace: tn.namespace } : {}), arguments: JSON.stringify(step.args) };
      } else if (step.shell !== undefined) {
        item = { type: "function_call", id: "fc_" + randomBytes(6).toString("hex"), call_id: callId(), name: "exec_command",
          arguments: JSON.stringify({ cmd: step.shell }) };
      } else {
        item = { type: "message", role: "assistant", id: "msg_" + randomBytes(6).toString("hex"),
          content: [{ type: "output_text", text: step.final }] };
      }
    }
    const id = "resp_" + randomBytes(6).toString("hex");
    served.push({ model, input: usage.input, output: usage.output });
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    for (const ev of [
      { type: "response.created", response: { id, model } },
      { type: "response.output_item.done", output_index: 0, item },
      { type: "response.completed", response: { id, model, output: [item], usage: {
        input_tokens: usage.input + usage.cache_read, input_tokens_details: { cached_tokens: usage.cache_read },
        output_tokens: usage.output, output_tokens_details: { reasoning_tokens: 0 },
        total_tokens: usage.input + usage.cache_read + usage.output } } },
    ]) res.write(`data: ${JSON.stringify(ev)}\n\n`);
    res.end();
  }

  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      if (req.method !== "POST") { res.writeHead(404); res.end(); return; }
      const auth = req.headers["x-api-key"] || req.headers.authorization || "";
      if (!auth.includes(secret)) { res.writeHead(401); res.end(); return; }
      let body = {};
      const raw = Buffer.concat(chunks);
      try { body = JSON.parse(raw.toString("utf8") || "{}"); } catch { /* empty */ }
      const kind = req.url.startsWith("/openai/") ? "openai" : "anthropic";
      if (intercept && intercept(kind, body, res, raw.length)) return;
      if (kind === "openai") openai(res, body); else anthropic(res, body);
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  return {
    port: server.address().port,
    plan,
    plans,
    served,
    close: () => new Promise((r) => server.close(r)),
  };
}
