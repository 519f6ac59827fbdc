// The cockpit page: every tree of every demesne server of this user, live (server-sent
// events from /api/events; no polling loop), a node's detail, the person's actions. Every
// string that came from a sandbox (names, transcripts, logs, file names, host names, tool
// arguments) is put into the page as text only (text nodes, textContent): never innerHTML,
// never an attribute that the browser would run or load, except the URLs built here from
// encoded parameters.

/** Makes an element; string children become text nodes. */
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "onclick") e.addEventListener("click", v);
    else e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}
const $ = (id) => document.getElementById(id);
/** Replaces an element's children, leaving out the empty ones (the DOM would print "null"). */
const put = (e, ...kids) => e.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
const money = (x) => (typeof x === "number" ? `$${x.toFixed(4)}` : "–");
function duration(s) {
  s = Math.max(0, Math.floor(s || 0));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}
const query = (o) => new URLSearchParams(o).toString();
const list = (x) => (Array.isArray(x) ? x : []);

let csrf = null;
let state = { servers: [] };
let selected = null; // {server, id}
let tail = null;     // the EventSource of the selected node's transcript
let detailSeq = 0;

async function action(body) {
  const res = await fetch("/api/action", { method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Demesne-CSRF": csrf }, body: JSON.stringify(body) });
  const v = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(v?.error?.message || `HTTP ${res.status}`);
  return v;
}
// The outcome of the last action, kept across re-renders of the detail.
let note = null; // {text, error}
function noteView() {
  return el("span", { "data-testid": "action-note", class: note?.error ? "error" : "" }, note ? note.text : "");
}
function report(what, p) {
  const show = () => document.querySelector("[data-testid=action-note]")?.replaceWith(noteView());
  note = { text: `${what}…` };
  show();
  p.then(() => { note = { text: `${what}: done` }; show(); },
    (e) => { note = { text: `${what}: ${e.message}`, error: true }; show(); });
}

// ---- totals and questions -------------------------------------------------------------

function renderTotals() {
  const t = { today: 0, week: 0, running: 0, warm: 0, memory: 0, used: 0, models: {}, trees: {} };
  for (const s of state.servers) {
    const x = s.data?.totals || {};
    t.today += x.today?.usd || 0;
    t.week += x.week?.usd || 0;
    t.running += x.running || 0;
    t.warm += x.warm || 0;
    t.memory += x.memory_mb || 0;
    t.used += x.memory_used_bytes || 0;
    for (const [m, u] of Object.entries(x.week?.models || {})) t.models[m] = (t.models[m] || 0) + u;
    for (const [r, u] of Object.entries(x.week?.trees || {})) t.trees[r] = (t.trees[r] || 0) + u;
  }
  const models = Object.entries(t.models).map(([m, u]) => `${m} ${money(u)}`).join(", ") || "–";
  const trees = Object.entries(t.trees).map(([r, u]) => `${r} ${money(u)}`).join(", ") || "–";
  put($("totals"),
    el("div", {}, el("strong", {}, "spend today "), el("span", { "data-testid": "spend-today" }, money(t.today))),
    el("div", {}, el("strong", {}, "this week "), money(t.week)),
    el("div", {}, el("strong", {}, "by model (week) "), models),
    el("div", {}, el("strong", {}, "by tree (week) "), trees),
    el("div", {}, el("strong", {}, "sandboxes running "), el("span", { "data-testid": "running" }, t.running),
      " · warm ", t.warm, " · memory used ", el("span", { "data-testid": "memory-used" }, mib(t.used)),
      " · reserved ", el("span", { "data-testid": "memory-reserved" }, `${t.memory} MB`)),
    el("div", {}, el("strong", {}, "servers "), el("span", { "data-testid": "server-count" }, state.servers.length)));
}

function renderAsks() {
  const items = [];
  for (const s of state.servers) {
    for (const a of list(s.data?.asks)) {
      const answer = (decision) => report(`answer ${decision}`, action({ server: s.pid, action: "ask", ask_id: a.id,
        decision }));
      items.push(el("div", { class: "ask", "data-testid": "ask" },
        el("span", {}, `run ${a.run_id ?? "?"} asks to reach `), el("code", { "data-testid": "ask-host" },
          `${a.host}:${a.port}`),
        a.has_inputs ? el("span", { class: "inputs" }, "this sandbox holds host inputs") : el("span", {}, "no host inputs"),
        el("button", { onclick: () => answer("once"), "data-testid": "ask-once" }, "allow once"),
        el("button", { onclick: () => answer("run"), "data-testid": "ask-run" }, "allow for this run"),
        el("button", { onclick: () => answer("deny"), "data-testid": "ask-deny" }, "deny")));
    }
  }
  $("asks").hidden = items.length === 0;
  put($("asks"), el("h2", {}, "Waiting for you"), ...items, $("detail").hidden ? noteView() : null);
}

// ---- trees ----------------------------------------------------------------------------

// bytes as MB (the unit the limits are in), one decimal
function mib(b) { return `${(Number(b || 0) / 1048576).toFixed(1)} MB`; }

// a sandbox that is no tree node is named by its tool (and background job)
function nameOf(n) {
  if (n.name) return n.name;
  if (n.standalone) return n.kind === "create" ? "persistent sandbox" : `${n.tool}${n.job_id ? ` (${n.job_id})` : ""}`;
  return "(root)";
}

function nodeRow(s, n, now) {
  const elapsed = n.status === "running" ? (now - n.started_ms) / 1000 : n.elapsed_seconds;
  const lim = n.limits || {};
  const row = el("div", { class: `node${selected && selected.id === n.run_id && selected.server === s.pid ? " selected" : ""}`,
    "data-testid": "node", "data-run": n.run_id, "data-status": n.status,
    onclick: () => select(s.pid, n.run_id) },
  el("span", { class: "name", "data-testid": "node-name" }, nameOf(n)),
  el("span", { class: `status-${n.status}`, "data-testid": "node-status" }, n.status),
  el("span", { class: "meta" }, `${n.kind} · ${n.image || "?"} · ${n.isolation} · egress ${n.egress} · `,
    el("span", { class: "elapsed", "data-started": n.status === "running" ? n.started_ms : "" }, duration(elapsed)),
    ` · ${money(n.total_cost_usd)}`,
    n.budget_usd !== undefined && n.budget_usd !== null ? ` · budget left ${money(n.budget_left_usd)}` : "",
    typeof n.memory_used_bytes === "number"
      ? el("span", {}, " · uses ", el("span", { "data-testid": "node-memory" }, mib(n.memory_used_bytes))) : "",
    lim.memory_mb ? ` · ${lim.memory_mb} MB ${lim.cpus ?? "?"} CPU ${lim.pids ?? "?"} pids` : "",
    n.expires_at ? ` · expires ${new Date(n.expires_at * 1000).toLocaleTimeString()}` : ""));
  return row;
}

function renderTrees() {
  const now = Date.now();
  const parts = [];
  for (const s of state.servers) {
    const trees = list(s.data?.trees);
    const box = el("div", { class: "server", "data-testid": "server", "data-pid": s.pid, "data-transport": s.transport },
      el("h2", {}, `${s.transport} server ${s.pid}`, list(s.urls).length ? ` (${list(s.urls).join(", ")})` : ""));
    if (trees.length === 0) box.append(el("p", {}, "no trees"));
    for (const t of trees) {
      const nodes = list(t.nodes);
      const byId = new Map(nodes.map((n) => [n.run_id, { n, kids: [] }]));
      let root = null;
      for (const n of nodes) {
        const me = byId.get(n.run_id);
        if (n.parent && byId.has(n.parent)) byId.get(n.parent).kids.push(me); else if (!root) root = me;
      }
      const draw = (x) => el("li", {}, nodeRow(s, x.n, now),
        x.kids.length ? el("ul", { class: "tree" }, x.kids.map(draw)) : null);
      if (root && typeof t.budget_usd === "number" && t.budget_usd > 0) {
        // the tree's budget burn-down
        box.append(el("div", { class: "burn" }, el("progress", { max: String(t.budget_usd), value: String(t.spent_usd || 0),
          "data-testid": "burn" }), ` ${money(t.spent_usd || 0)} of ${money(t.budget_usd)} spent`));
      }
      if (root) box.append(el("ul", { class: "tree top", "data-testid": t.standalone ? "run" : "tree",
        "data-root": t.run_id }, draw(root)));
    }
    parts.push(box);
  }
  if (parts.length === 0) parts.push(el("p", {}, "No demesne server is running."));
  put($("trees"), ...parts);
}

// elapsed times move on their own: counted here, once a second (no request)
setInterval(() => {
  for (const e of document.querySelectorAll(".elapsed[data-started]")) {
    const t = Number(e.getAttribute("data-started"));
    if (t) e.textContent = duration((Date.now() - t) / 1000);
  }
}, 1000);

// ---- a node's detail ------------------------------------------------------------------

function table(rows, cols) {
  rows = list(rows);
  if (!rows.length) return el("p", {}, "none");
  cols = cols.filter((c) => rows.some((r) => r[c] !== undefined && r[c] !== null && r[c] !== "")); // the empty ones go
  return el("table", {}, el("tr", {}, cols.map((c) => el("th", {}, c))),
    rows.map((r) => el("tr", {}, cols.map((c) => el("td", {},
      typeof r[c] === "object" && r[c] !== null ? JSON.stringify(r[c]) : r[c] ?? (c === "line" ? "" : ""))))));
}

const IMAGE = /\.(png|jpe?g|gif|webp)$/i;

// `kept`: the file view of this node's last render, if any: a file being shown stays shown
// when the detail is drawn again (every change of the tree draws it again)
function filesView(sv, id, files, kept) {
  files = list(files);
  if (!files.length) return el("p", {}, "none");
  const view = kept || el("div", { "data-testid": "file-view", "data-of": `${sv}/${id}` });
  const rows = files.map((f) => {
    const q = (mode) => `/api/file?${query({ server: sv, id, path: f.path, mode })}`;
    const cells = [el("td", { "data-testid": "file-name" }, f.path), el("td", {}, f.type), el("td", {}, f.size ?? "")];
    if (f.type === "file") {
      cells.push(el("td", {},
        el("a", { href: q("download"), download: "", "data-testid": "file-download" }, "download"), " ",
        el("button", { "data-testid": "file-show", onclick: async () => {
          put(view, el("span", {}, "…"));
          if (IMAGE.test(f.path)) {
            put(view, el("img", { class: "preview", src: q("image"), alt: "" }));
            return;
          }
          const res = await fetch(q("text"), { credentials: "same-origin" });
          const v = await res.json().catch(() => ({}));
          put(view, res.ok ? el("pre", { "data-testid": "file-text" }, v.text, v.truncated ? "\n…" : "")
            : el("p", { class: "error" }, v?.error?.message || `HTTP ${res.status}`));
        } }, "show")));
    } else cells.push(el("td", {}));
    return el("tr", {}, cells);
  });
  return el("div", {}, el("table", {}, el("tr", {}, ["path", "type", "bytes", ""].map((c) => el("th", {}, c))), rows),
    view);
}

function actionsView(sv, d) {
  const seconds = el("input", { type: "number", min: "60", step: "60", value: "3600", "data-testid": "ttl-seconds" });
  const budget = el("input", { type: "number", min: "0", step: "0.5",
    value: String(((d.budget_usd || 0) + 1).toFixed(2)), "data-testid": "budget-usd" });
  return el("div", { class: "actions" },
    el("button", { "data-testid": "cancel-node", disabled: !d.active || null,
      onclick: () => report(d.standalone && d.kind === "create" ? "destroy" : "cancel",
        action({ server: sv, action: "cancel", id: d.run_id })) },
    d.standalone && d.kind === "create" ? "destroy" : "cancel"),
    d.standalone ? null : el("button", { "data-testid": "cancel-subtree", disabled: !d.active || null,
      onclick: () => report("cancel subtree",
        action({ server: sv, action: "cancel", id: d.run_id, subtree: true })) },
    "cancel subtree"),
    d.kind === "create" ? el("span", {}, seconds, el("button", { "data-testid": "extend-ttl",
      onclick: () => report("extend TTL",
        action({ server: sv, action: "ttl", id: d.run_id, seconds: Number(seconds.value) })) },
    "extend TTL")) : null,
    d.standalone ? null : el("span", {}, budget, el("button", { "data-testid": "raise-budget",
      onclick: () => report("raise budget",
        action({ server: sv, action: "budget", id: d.root, budget_usd: Number(budget.value) })) },
    "raise tree budget")),
    noteView());
}

function follow(sv, id, pre) {
  if (tail) tail.close();
  tail = new EventSource(`/api/stream?${query({ server: sv, id, stream: "transcript" })}`);
  tail.addEventListener("lines", (ev) => {
    const { lines } = JSON.parse(ev.data);
    for (const l of list(lines)) pre.append(el("div", { "data-testid": "transcript-line" }, l));
    pre.scrollTop = pre.scrollHeight;
  });
  tail.addEventListener("end", () => { tail.close(); tail = null; });
}

async function showDetail(keepTail) {
  if (!selected) return;
  const { server: sv, id } = selected;
  const seq = ++detailSeq;
  const res = await fetch(`/api/node?${query({ server: sv, id })}`, { credentials: "same-origin" });
  const d = await res.json().catch(() => ({}));
  if (seq !== detailSeq) return;
  const box = $("detail");
  box.hidden = false;
  if (!res.ok) { put(box, el("p", { class: "error" }, d?.error?.message || `HTTP ${res.status}`)); return; }
  let pre = keepTail ? box.querySelector("[data-testid=transcript]") : null;
  // (only this node's: a refresh that overtook the click's own fetch finds the last node's)
  if (pre && pre.getAttribute("data-of") !== `${sv}/${id}`) pre = null;
  let fileView = keepTail ? box.querySelector("[data-testid=file-view]") : null;
  if (fileView && fileView.getAttribute("data-of") !== `${sv}/${id}`) fileView = null;
  if (!pre) {
    pre = el("pre", { "data-testid": "transcript", "data-of": `${sv}/${id}` });
    follow(sv, id, pre);
  }
  const lim = d.limits || {};
  put(box,
    el("h2", { "data-testid": "detail-title" }, `${nameOf(d)} · ${d.run_id}`),
    el("p", {}, `${d.kind} · ${d.image || "?"} · ${d.isolation} · egress ${d.egress} · `,
      el("span", { "data-testid": "detail-status" }, d.status), d.reason ? ` (${d.reason})` : "",
      ` · cost ${money(d.cost_usd)} (subtree ${money(d.total_cost_usd)})`,
      d.budget_usd ? ` · budget ${money(d.budget_usd)}, left ${money(d.budget_left_usd)}` : "",
      typeof d.memory_used_bytes === "number"
        ? el("span", {}, " · uses ", el("span", { "data-testid": "detail-memory" }, mib(d.memory_used_bytes))) : "",
      lim.memory_mb ? ` · limits ${lim.memory_mb} MB, ${lim.cpus} CPU, ${lim.pids} pids` : "",
      d.expires_at ? ` · expires ${new Date(d.expires_at * 1000).toLocaleString()}` : ""),
    actionsView(sv, d),
    d.attach ? el("p", {}, "terminal: ", el("code", { "data-testid": "attach" }, d.attach)) : null,
    list(d.previews).length ? el("p", {}, "previews: ", list(d.previews).map((p) =>
      /^http:\/\/127\.\d{1,3}\.\d{1,3}\.\d{1,3}:\d+\//.test(p.url) // a preview: its own loopback address
        ? el("a", { href: p.url, target: "_blank", rel: "noopener noreferrer" }, `port ${p.port} `) : null)) : null,
    el("h3", {}, "Prompt"), el("pre", { "data-testid": "prompt" }, d.prompt || ""),
    el("h3", {}, d.kind === "agent" || d.kind === "research" ? "Transcript" : "Output"), pre,
    el("h3", {}, "stderr"), el("pre", { "data-testid": "stderr" }, d.stderr || ""),
    el("h3", {}, "Files in /out"), filesView(sv, id, d.files, fileView),
    el("h3", {}, "Egress"), table(d.egress_log, ["time", "method", "host", "port", "verdict", "rule", "decision", "decided_by",
      "status", "error", "line"]),
    el("h3", {}, "Host MCP calls"), table(d.mcp_log, ["time", "server", "tool", "ok", "duration_ms", "error", "arguments", "line"]),
    el("h3", {}, "Children"), table(d.children_nodes, ["name", "run_id", "kind", "status"]),
    d.branch ? el("div", {}, el("h3", {}, "Branch"), el("pre", { "data-testid": "branch" },
      JSON.stringify(d.branch, null, 2))) : null);
  box.setAttribute("data-drawn", String(seq)); // how many times the detail was drawn (tests wait on it)
}

function select(sv, id) {
  selected = { server: sv, id };
  renderTrees();
  showDetail(false);
}

// ---- live state -----------------------------------------------------------------------

function connect() {
  const es = new EventSource("/api/events");
  es.addEventListener("open", () => { $("conn").textContent = "live"; });
  es.addEventListener("error", () => { $("conn").textContent = "reconnecting…"; });
  es.addEventListener("state", (ev) => {
    state = JSON.parse(ev.data);
    renderTotals();
    renderAsks();
    renderTrees();
    if (selected) showDetail(true);
  });
}

async function main() {
  const res = await fetch("/api/session", { credentials: "same-origin" });
  if (!res.ok) {
    $("conn").textContent = "not signed in: open the link `demesne ui` printed";
    return;
  }
  csrf = (await res.json()).csrf;
  connect();
}
main();
