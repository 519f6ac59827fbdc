#!/usr/bin/env node
// twine-compile: Twee 3 -> Twine 2 HTML with extwee, picking the story format from the
// ones installed in the image (or a format.js given by path). See the twine image's README.
import { parseArgs } from "node:util";
import { readdirSync, readFileSync, existsSync, statSync } from "node:fs";
import { spawnSync } from "node:child_process";
import vm from "node:vm";
import path from "node:path";

const FORMATS = "/usr/local/share/twine/storyformats";
const USAGE = `usage: twine-compile INPUT.twee OUTPUT.html [--format NAME[@VERSION] | --format FILE.js]
       twine-compile --list [--notes]
  --format  a story format installed in the image (NAME, or NAME@VERSION), or the path of a
            format.js; default: the "format" and "format-version" of the story's StoryData
  --list    print the installed story formats, one a line: NAME VERSION ORIGIN FOLDER
  --notes   with --list: print them as build notes ("demesne-note: …")`;

/**
 * Reads a Twine 2 story format file (JSONP: window.storyFormat({...})).
 * @param {string} file
 * @returns {{name: string, version: string, proofing?: boolean}}
 */
function readFormat(file) {
  let found;
  vm.runInNewContext(readFileSync(file, "utf8"), { window: { storyFormat: (o) => { found = o; } } }, { timeout: 5000 });
  if (!found || typeof found.name !== "string" || typeof found.version !== "string" || typeof found.source !== "string") {
    throw new Error(`${file} is not a Twine 2 story format (window.storyFormat({name, version, source, …}))`);
  }
  return found;
}

/** The installed formats: [{name, version, origin, dir, file}], sorted by name then version. */
function installed() {
  const out = [];
  const dirs = existsSync(FORMATS) ? readdirSync(FORMATS) : [];
  for (const d of dirs) {
    const file = path.join(FORMATS, d, "format.js");
    if (!existsSync(file)) continue;
    let f;
    try { f = readFormat(file); } catch (e) { process.stderr.write(`twine-compile: skipping ${file}: ${e.message}\n`); continue; }
    const originFile = path.join(FORMATS, d, "ORIGIN");
    const origin = existsSync(originFile) ? readFileSync(originFile, "utf8").trim() : "user";
    out.push({ name: f.name, version: f.version, proofing: !!f.proofing, origin, dir: d, file });
  }
  return out.sort((a, b) => a.name.localeCompare(b.name) || cmpVersion(a.version, b.version));
}

function cmpVersion(a, b) {
  const pa = a.split(/[.+-]/).map(Number), pb = b.split(/[.+-]/).map(Number);
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const d = (pa[i] || 0) - (pb[i] || 0);
    if (d) return d;
  }
  return 0;
}

/** The StoryData of a Twee 3 file ({} when it has none). */
function storyData(src) {
  const m = /^::\s*StoryData\b[^\n]*\n([\s\S]*?)(?=^::|$(?![\s\S]))/m.exec(src);
  if (!m) return {};
  try { return JSON.parse(m[1]); } catch (e) { throw new Error(`the StoryData passage is not JSON: ${e.message}`); }
}

function fail(msg, code = 1) {
  process.stderr.write(`twine-compile: ${msg}\n`);
  process.exit(code);
}

let args;
try {
  args = parseArgs({ allowPositionals: true, options: {
    format: { type: "string" }, list: { type: "boolean" }, notes: { type: "boolean" }, help: { type: "boolean", short: "h" } } });
} catch (e) {
  fail(`${e.message}\n${USAGE}`, 2);
}
const o = args.values;
if (o.help) { process.stdout.write(USAGE + "\n"); process.exit(0); }
if (o.list) {
  const all = installed();
  if (o.notes) {
    if (all.length === 0) process.stdout.write("demesne-note: story formats: none installed\n");
    for (const f of all) process.stdout.write(`demesne-note: story format ${f.name} ${f.version} (${f.origin})\n`);
  } else {
    for (const f of all) process.stdout.write(`${f.name} ${f.version} ${f.origin} ${path.join(FORMATS, f.dir)}\n`);
  }
  process.exit(0);
}
if (args.positionals.length !== 2) fail(`expected INPUT.twee and OUTPUT.html\n${USAGE}`, 2);
const [input, output] = args.positionals.map((p) => path.resolve(p));
if (!existsSync(input) || !statSync(input).isFile()) fail(`INPUT: ${input} is not a file`, 2);

let formatFile;
const list = () => installed().map((f) => `${f.name}@${f.version}`).join(", ") || "none";
if (o.format && (o.format.endsWith(".js") || o.format.includes("/"))) {
  formatFile = path.resolve(o.format);
  if (!existsSync(formatFile)) fail(`--format: ${formatFile} does not exist`, 2);
  try { readFormat(formatFile); } catch (e) { fail(`--format: ${e.message}`, 2); }
} else {
  let name, version;
  if (o.format) {
    [name, version] = o.format.split("@");
  } else {
    let data;
    try { data = storyData(readFileSync(input, "utf8")); } catch (e) { fail(`${input}: ${e.message}`); }
    name = data.format;
    version = data["format-version"];
    if (!name) fail(`${input} names no story format (StoryData "format") and --format is not given; installed: ${list()}`, 2);
  }
  const same = installed().filter((f) => f.name.toLowerCase() === name.toLowerCase());
  const pick = (version && same.find((f) => f.version === version))
    || (version && same.filter((f) => f.version.split(".")[0] === version.split(".")[0]).pop())
    || (!version && same.pop());
  if (!pick) fail(`no installed story format ${name}${version ? "@" + version : ""}; installed: ${list()}`);
  if (version && pick.version !== version) process.stderr.write(`twine-compile: ${name} ${version} is not installed; using ${pick.version}\n`);
  formatFile = pick.file;
}
const r = spawnSync("extwee", ["-c", "-i", input, "-s", formatFile, "-o", output], { encoding: "utf8" });
if (r.status !== 0 || !existsSync(output)) {
  fail(`extwee failed (exit ${r.status}):\n${(r.stderr || "") + (r.stdout || "")}`);
}
process.stdout.write(JSON.stringify({ output, format: readFormat(formatFile).name, format_file: formatFile }) + "\n");
