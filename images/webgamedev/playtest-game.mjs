#!/usr/bin/env node
// playtest-game: serves a built web game on loopback, opens it in headless Chromium, waits
// until the page says the game is running, presses keys, and takes a screenshot after each
// step. See the webgamedev image's README for the page contract and the report.
import { parseArgs } from "node:util";
import { mkdirSync, writeFileSync, existsSync, statSync } from "node:fs";
import path from "node:path";
import { launch, watch, serve, int, die } from "/usr/local/lib/demesne/browser.mjs";

const USAGE = `usage: playtest-game [DIST] [options]
  DIST           the built game: a folder with index.html (default ./dist)
  --out DIR      where the screenshots and report.json go (default /out/playtest)
  --keys STEPS   comma-separated steps, each followed by a screenshot:
                   KEY        press KEY (held 100 ms), e.g. ArrowRight, Space, KeyA, Enter
                   KEY:MS     hold KEY for MS milliseconds
                   wait:MS    only wait MS milliseconds
                 Key names are Playwright's (KeyboardEvent.key values or codes)
  --ready EXPR   a JavaScript expression that is true once the game runs
                 (default: window.__GAME_STATE__ === "running")
  --width N      viewport width (default 800)
  --height N     viewport height (default 600)
  --settle MS    wait after the game is ready and after each step before its screenshot (default 300)
  --timeout N    seconds to wait for the game to be ready (default 30)
Prints the report as JSON on stdout and writes it to DIR/report.json:
  {url, ready, state, info, phaser, console_errors, page_errors, failed_requests, screenshots}
Exit 0 when the game got ready with no console or page errors, 1 otherwise, 2 for bad arguments.`;

let args;
try {
  args = parseArgs({
    allowPositionals: true,
    options: {
      out: { type: "string" }, keys: { type: "string" }, ready: { type: "string" },
      width: { type: "string" }, height: { type: "string" }, settle: { type: "string" },
      timeout: { type: "string" }, help: { type: "boolean", short: "h" },
    },
  });
} catch (e) {
  die(`${e.message}\n${USAGE}`);
}
const o = args.values;
if (o.help) { process.stdout.write(USAGE + "\n"); process.exit(0); }
if (args.positionals.length > 1) die(`expected at most one DIST folder\n${USAGE}`);
const dist = path.resolve(args.positionals[0] || "dist");
if (!existsSync(path.join(dist, "index.html"))) die(`DIST: ${dist} has no index.html (build the game first: npm run build)`);
const out = path.resolve(o.out || "/out/playtest");
const width = int("width", o.width, 800);
const height = int("height", o.height, 600);
const settle = o.settle === undefined ? 300 : Number(o.settle);
if (!Number.isInteger(settle) || settle < 0) die(`--settle: expected a whole number of milliseconds, got ${JSON.stringify(o.settle)}`);
const timeout = int("timeout", o.timeout, 30) * 1000;
const ready = o.ready || 'window.__GAME_STATE__ === "running"';
const steps = (o.keys ? o.keys.split(",") : []).map((s) => s.trim()).filter(Boolean).map((s) => {
  const m = /^([^:]+)(?::(\d+))?$/.exec(s);
  if (!m) die(`--keys: cannot read step ${JSON.stringify(s)}: expected KEY, KEY:MS or wait:MS`);
  if (m[1] === "wait") {
    if (m[2] === undefined) die(`--keys: ${s}: wait needs milliseconds (wait:500)`);
    return { wait: Number(m[2]), label: `wait-${m[2]}` };
  }
  return { key: m[1], hold: m[2] === undefined ? 100 : Number(m[2]), label: m[1] };
});
mkdirSync(out, { recursive: true });
if (!statSync(out).isDirectory()) die(`--out: ${out} is not a folder`);

const report = { url: null, ready: false, state: null, info: null, phaser: null,
  console_errors: [], page_errors: [], failed_requests: [], screenshots: [] };
let server, browser;
async function snapshot(page, name) {
  const file = path.join(out, `${String(report.screenshots.length).padStart(2, "0")}-${name.replace(/[^A-Za-z0-9_.-]/g, "_")}.png`);
  await page.screenshot({ path: file });
  const st = await page.evaluate(() => ({
    state: window.__GAME_STATE__ ?? null,
    info: window.__GAME_INFO__ === undefined ? null : JSON.parse(JSON.stringify(window.__GAME_INFO__)),
    phaser: window.game && window.game.scene ? {
      running: !!window.game.isRunning,
      renderer: window.game.renderer ? (window.game.renderer.type === 2 ? "WEBGL" : "CANVAS") : null,
      scenes: window.game.scene.getScenes(true).map((s) => s.scene.key),
    } : null,
  }));
  Object.assign(report, st);
  report.screenshots.push({ step: name, file, info: st.info });
}
try {
  server = await serve(dist);
  report.url = server.url;
  browser = await launch();
  const page = await (await browser.newContext({ viewport: { width, height } })).newPage();
  const seen = watch(page);
  report.console_errors = seen.console_errors;
  report.page_errors = seen.page_errors;
  report.failed_requests = seen.failed_requests;
  await page.goto(server.url, { waitUntil: "load", timeout });
  report.ready = await page.waitForFunction(ready, null, { timeout }).then(() => true, () => false);
  await page.waitForTimeout(settle);
  await snapshot(page, "start");
  if (report.ready) {
    await page.locator("canvas").first().focus().catch(() => {});
    for (const s of steps) {
      if (s.wait !== undefined) {
        await page.waitForTimeout(s.wait);
      } else {
        await page.keyboard.down(s.key);
        await page.waitForTimeout(s.hold);
        await page.keyboard.up(s.key);
      }
      await page.waitForTimeout(settle);
      await snapshot(page, s.label);
    }
  }
} catch (e) {
  report.page_errors.push(`playtest-game: ${e.message}`);
} finally {
  await browser?.close().catch(() => {});
  await server?.close();
}
writeFileSync(path.join(out, "report.json"), JSON.stringify(report, null, 2) + "\n");
process.stdout.write(JSON.stringify(report) + "\n");
if (!report.ready) process.stderr.write(`playtest-game: the game did not get ready (${ready}) within ${timeout / 1000} s\n`);
for (const e of [...report.console_errors, ...report.page_errors]) process.stderr.write(`playtest-game: ${e}\n`);
process.exitCode = report.ready && report.console_errors.length === 0 && report.page_errors.length === 0 ? 0 : 1;
