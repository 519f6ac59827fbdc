// Build step: makes playwright-core's chromium.launch() find Debian's Chromium without an
// executablePath. Playwright looks for the browser it would have downloaded under
// $PLAYWRIGHT_BROWSERS_PATH/<name>-<revision>/…; this links those paths to /usr/bin/chromium
// (the Debian wrapper, which adds the flags in /etc/chromium.d/demesne) and then checks that
// Playwright resolves them. A Playwright upgrade that moves the paths fails the build here.
import { mkdirSync, symlinkSync, writeFileSync, existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

const require = createRequire(import.meta.url);
const root = process.env.PLAYWRIGHT_BROWSERS_PATH;
if (!root) throw new Error("PLAYWRIGHT_BROWSERS_PATH is not set");
const pkg = path.dirname(require.resolve("playwright-core/package.json"));
const { browsers } = JSON.parse(readFileSync(path.join(pkg, "browsers.json"), "utf8"));
const arch = process.arch === "arm64" ? "linux-arm64" : "linux64";
const layout = {
  chromium: [`chrome-${arch}`, "chrome"],
  "chromium-headless-shell": [`chrome-headless-shell-${arch}`, "chrome-headless-shell"],
};
for (const b of browsers) {
  if (!layout[b.name]) continue;
  const dir = path.join(root, `${b.name.replace(/-/g, "_")}-${b.revision}`);
  const exe = path.join(dir, ...layout[b.name]);
  mkdirSync(path.dirname(exe), { recursive: true });
  if (!existsSync(exe)) symlinkSync("/usr/bin/chromium", exe);
  writeFileSync(path.join(dir, "INSTALLATION_COMPLETE"), "");
  writeFileSync(path.join(dir, "DEPENDENCIES_VALIDATED"), "");
}
const { chromium } = require("playwright-core");
const resolved = chromium.executablePath();
if (!existsSync(resolved)) throw new Error(`playwright-core looks for Chromium at ${resolved}, which is not linked`);
console.log(`playwright-core ${require("playwright-core/package.json").version}: chromium -> ${resolved} -> /usr/bin/chromium`);
