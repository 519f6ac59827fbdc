#!/usr/bin/env node
// render-png: renders an HTML file, or a React component file, to a PNG in headless Chromium.
// See /usr/local/share/doc/demesne/browser.md (images/browser/README.md) for the options.
import { parseArgs } from "node:util";
import { mkdtempSync, writeFileSync, rmSync, existsSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";
import * as esbuild from "esbuild";
import { launch, watch, pngSize, int, die } from "./browser.mjs";

const USAGE = `usage: render-png INPUT OUTPUT.png [options]
  INPUT        an .html/.htm file, or a React component file (.jsx .tsx .js .ts) whose
               default export (or --export NAME) is rendered into an empty page
  --width N    viewport width in CSS pixels (default 1280)
  --height N   viewport height in CSS pixels (default 720)
  --full-page  capture the whole scrollable page, not only the viewport
  --selector S capture only the first element matching the CSS selector S
  --scale N    device scale factor (default 1; 2 doubles the PNG's pixels)
  --props JSON props for the React component (default {})
  --export N   the component's export name (default: the default export)
  --css FILE   a stylesheet to add to the component's page (repeatable)
  --wait-for S wait until an element matching S is visible before capturing
  --wait-ms N  wait N more milliseconds before capturing (animations, timers)
  --transparent  no white page background (PNG with alpha)
  --timeout N  seconds for the whole render (default 30)
Prints {"output","width","height","console_errors","page_errors"} as JSON on stdout.
Exit 0 on success, 1 when the page could not be rendered, 2 for bad arguments.`;

let args;
try {
  args = parseArgs({
    allowPositionals: true,
    options: {
      width: { type: "string" }, height: { type: "string" }, "full-page": { type: "boolean" },
      selector: { type: "string" }, scale: { type: "string" }, props: { type: "string" },
      export: { type: "string" }, css: { type: "string", multiple: true }, "wait-for": { type: "string" },
      "wait-ms": { type: "string" }, transparent: { type: "boolean" }, timeout: { type: "string" },
      help: { type: "boolean", short: "h" },
    },
  });
} catch (e) {
  die(`${e.message}\n${USAGE}`);
}
const o = args.values;
if (o.help) { process.stdout.write(USAGE + "\n"); process.exit(0); }
if (args.positionals.length !== 2) die(`expected INPUT and OUTPUT.png\n${USAGE}`);
const [input, output] = args.positionals.map((p) => path.resolve(p));
if (!existsSync(input) || !statSync(input).isFile()) die(`INPUT: ${input} is not a file`);
if (!output.toLowerCase().endsWith(".png")) die(`OUTPUT: ${output} must end in .png`);
const width = int("width", o.width, 1280);
const height = int("height", o.height, 720);
const timeout = int("timeout", o.timeout, 30) * 1000;
const waitMs = o["wait-ms"] === undefined ? 0 : int("wait-ms", o["wait-ms"], 0);
const scale = o.scale === undefined ? 1 : Number(o.scale);
if (!(scale > 0 && scale <= 8)) die(`--scale: expected a number above 0 and at most 8, got ${JSON.stringify(o.scale)}`);
let props = {};
if (o.props !== undefined) {
  try { props = JSON.parse(o.props); } catch (e) { die(`--props: not JSON: ${e.message}`); }
  if (props === null || typeof props !== "object" || Array.isArray(props)) die("--props: expected a JSON object");
}
const ext = path.extname(input).toLowerCase();
const isHtml = ext === ".html" || ext === ".htm";
if (!isHtml && ![".jsx", ".tsx", ".js", ".ts", ".mjs"].includes(ext)) {
  die(`INPUT: ${input}: expected .html, .htm, .jsx, .tsx, .js, .ts or .mjs`);
}

// A React component becomes a page: esbuild bundles an entry that renders it, with the
// component's own imports (CSS, images as data: URLs) resolved from its folder.
async function componentPage(dir) {
  const entry = `
    import * as React from "react";
    import { createRoot } from "react-dom/client";
    import { flushSync } from "react-dom";
    import * as mod from ${JSON.stringify(input)};
    const name = ${JSON.stringify(o.export || "default")};
    const C = mod[name];
    if (C === undefined) throw new Error("the component file has no export named " + name);
    const root = createRoot(document.getElementById("root"));
    flushSync(() => root.render(React.createElement(C, ${JSON.stringify(props)})));
    window.__renderPngReady = true;`;
  let built;
  try {
    built = await esbuild.build({
      stdin: { contents: entry, resolveDir: path.dirname(input), loader: "jsx", sourcefile: "render-png-entry.jsx" },
      bundle: true, write: false, outdir: dir, format: "iife", jsx: "automatic", logLevel: "silent",
      nodePaths: ["/usr/local/lib/node_modules"],
      define: { "process.env.NODE_ENV": '"production"' },
      loader: { ".png": "dataurl", ".jpg": "dataurl", ".jpeg": "dataurl", ".gif": "dataurl", ".webp": "dataurl",
        ".svg": "dataurl", ".woff": "dataurl", ".woff2": "dataurl", ".ttf": "dataurl", ".otf": "dataurl" },
    });
  } catch (e) {
    const msgs = (e.errors || []).map((m) => `${m.location ? `${m.location.file}:${m.location.line}: ` : ""}${m.text}`);
    throw new Error(`bundling ${input} failed:\n${msgs.join("\n") || e.message}`);
  }
  const js = built.outputFiles.filter((f) => f.path.endsWith(".js")).map((f) => f.text).join("\n");
  const css = built.outputFiles.filter((f) => f.path.endsWith(".css")).map((f) => f.text);
  for (const c of o.css || []) css.push(`@import url(${JSON.stringify(pathToFileURL(path.resolve(c)).href)});`);
  const page = `<!doctype html><html><head><meta charset="utf-8">
<style>html,body{margin:0;padding:0}</style>${css.map((c) => `<style>${c}</style>`).join("")}
</head><body><div id="root"></div><script>${js.replace(/<\/script/gi, "<\\/script")}</script></body></html>`;
  const file = path.join(dir, "index.html");
  writeFileSync(file, page);
  return file;
}

const tmp = mkdtempSync(path.join(tmpdir(), "render-png-"));
let browser;
const timer = setTimeout(() => { process.stderr.write(`render-png: timed out after ${timeout / 1000} s\n`); process.exit(1); }, timeout);
try {
  const file = isHtml ? input : await componentPage(tmp);
  browser = await launch();
  const context = await browser.newContext({ viewport: { width, height }, deviceScaleFactor: scale });
  const page = await context.newPage();
  page.setDefaultTimeout(timeout);
  const seen = watch(page);
  await page.goto(pathToFileURL(file).href, { waitUntil: "load" });
  if (!isHtml) {
    const ok = await page.waitForFunction(() => window.__renderPngReady === true, null, { timeout: Math.min(timeout, 15000) })
      .then(() => true, () => false);
    if (!ok) {
      throw new Error(`the component did not render: ${[...seen.page_errors, ...seen.console_errors].join("\n") || "no error was reported"}`);
    }
  }
  if (o["wait-for"]) await page.locator(o["wait-for"]).first().waitFor({ state: "visible" });
  await page.evaluate(() => document.fonts.ready.then(() => undefined));
  if (waitMs) await page.waitForTimeout(waitMs);
  const shot = { path: output, omitBackground: !!o.transparent, animations: "disabled" };
  if (o.selector) {
    const el = page.locator(o.selector).first();
    if (await el.count() === 0) throw new Error(`--selector ${o.selector}: no element matches`);
    await el.screenshot(shot);
  } else {
    await page.screenshot({ ...shot, fullPage: !!o["full-page"] });
  }
  const size = pngSize(output);
  process.stdout.write(JSON.stringify({ output, ...size, console_errors: seen.console_errors, page_errors: seen.page_errors }) + "\n");
} catch (e) {
  process.stderr.write(`render-png: ${e.message}\n`);
  process.exitCode = 1;
} finally {
  clearTimeout(timer);
  await browser?.close().catch(() => {});
  rmSync(tmp, { recursive: true, force: true });
}
