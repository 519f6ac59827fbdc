// Shared by the image's helpers (render-png here; playtest-game and playtest-story in the
// images built on this one): launching Chromium, serving a folder on loopback, collecting
// what a page reports, and small CLI chores. Importable by agents too:
//   import { launch } from "/usr/local/lib/demesne/browser.mjs";
import { chromium } from "playwright-core";
import { createServer } from "node:http";
import { createReadStream, statSync, readFileSync } from "node:fs";
import path from "node:path";

/** Debian's wrapper; it adds the flags in /etc/chromium.d/demesne. */
export const CHROMIUM = "/usr/bin/chromium";

/**
 * Starts the image's Chromium through Playwright, headless.
 * @param {import("playwright-core").LaunchOptions} [opts] merged over the defaults
 * @returns {Promise<import("playwright-core").Browser>}
 */
export function launch(opts = {}) {
  return chromium.launch({ executablePath: CHROMIUM, headless: true, ...opts });
}

/**
 * Records what a page reports: console messages of type error, uncaught exceptions
 * (pageerror), and requests that failed. Returns the live lists.
 * @param {import("playwright-core").Page} page
 * @returns {{console_errors: string[], page_errors: string[], failed_requests: string[], console: string[]}}
 */
export function watch(page) {
  const seen = { console_errors: [], page_errors: [], failed_requests: [], console: [] };
  page.on("console", (m) => {
    const line = `${m.type()}: ${m.text()}`;
    if (seen.console.length < 500) seen.console.push(line);
    if (m.type() === "error") {
      const where = m.location()?.url;
      seen.console_errors.push(where && !m.text().includes(where) ? `${m.text()} (${where})` : m.text());
    }
  });
  page.on("pageerror", (e) => seen.page_errors.push(String(e && e.stack || e)));
  page.on("requestfailed", (r) => seen.failed_requests.push(`${r.url()}: ${r.failure()?.errorText}`));
  return seen;
}

const TYPES = {
  ".html": "text/html; charset=utf-8", ".htm": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8", ".json": "application/json", ".map": "application/json",
  ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
  ".webp": "image/webp", ".svg": "image/svg+xml", ".ico": "image/x-icon",
  ".wav": "audio/wav", ".mp3": "audio/mpeg", ".ogg": "audio/ogg", ".m4a": "audio/mp4",
  ".mp4": "video/mp4", ".webm": "video/webm", ".woff": "font/woff", ".woff2": "font/woff2",
  ".ttf": "font/ttf", ".otf": "font/otf", ".wasm": "application/wasm", ".txt": "text/plain; charset=utf-8",
  ".xml": "application/xml", ".glsl": "text/plain", ".fnt": "application/xml",
};

/**
 * Serves the files under `dir` on 127.0.0.1 (a free port), read-only; `/` is index.html.
 * @param {string} dir
 * @returns {Promise<{url: string, close: () => Promise<void>}>} url ends with "/"
 */
export function serve(dir) {
  const root = path.resolve(dir);
  const server = createServer((req, res) => {
    let rel;
    try { rel = decodeURIComponent(new URL(req.url, "http://x").pathname); } catch { res.writeHead(400).end(); return; }
    let file = path.join(root, rel);
    if (file !== root && !file.startsWith(root + path.sep)) { res.writeHead(403).end(); return; }
    try { if (statSync(file).isDirectory()) file = path.join(file, "index.html"); } catch { /* 404 below */ }
    let st;
    try { st = statSync(file); } catch {
      // Chromium asks for /favicon.ico on its own; a game without one is not broken
      if (rel === "/favicon.ico") { res.writeHead(204).end(); return; }
      res.writeHead(404).end("not found");
      return;
    }
    if (!st.isFile()) { res.writeHead(404).end("not found"); return; }
    res.writeHead(200, { "Content-Type": TYPES[path.extname(file).toLowerCase()] || "application/octet-stream",
      "Content-Length": st.size, "Cache-Control": "no-store" });
    if (req.method === "HEAD") { res.end(); return; }
    createReadStream(file).pipe(res);
  });
  return new Promise((resolve, reject) => {
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      resolve({ url: `http://127.0.0.1:${port}/`, close: () => new Promise((r) => server.close(() => r())) });
    });
  });
}

/**
 * Width and height of a PNG file, read from its IHDR chunk (PNG spec, section 11.2.2).
 * @param {string} file
 * @returns {{width: number, height: number}}
 */
export function pngSize(file) {
  const b = readFileSync(file);
  if (b.length < 24 || b.toString("latin1", 12, 16) !== "IHDR") throw new Error(`${file} is not a PNG`);
  return { width: b.readUInt32BE(16), height: b.readUInt32BE(20) };
}

/**
 * Parses a positive integer option; exits with a message naming the option otherwise.
 * @param {string} name option name, for the message
 * @param {string|undefined} v
 * @param {number} dflt used when v is undefined
 */
export function int(name, v, dflt) {
  if (v === undefined) return dflt;
  const n = Number(v);
  if (!Number.isInteger(n) || n <= 0) die(`--${name}: expected a positive whole number, got ${JSON.stringify(v)}`);
  return n;
}

/** Prints `msg` on stderr with the program's name and exits with `code` (2: usage). */
export function die(msg, code = 2) {
  process.stderr.write(`${path.basename(process.argv[1] || "helper")}: ${msg}\n`);
  process.exit(code);
}
