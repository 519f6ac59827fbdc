#!/usr/bin/env node
// playtest-story: opens a compiled Twine 2 story in headless Chromium, follows links by their
// text, and records each passage it sees (text, name where the format shows one, screenshot).
// See the twine image's README.
import { parseArgs } from "node:util";
import { mkdirSync, writeFileSync, existsSync, statSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { launch, watch, int, die } from "/usr/local/lib/demesne/browser.mjs";

// Where known story formats put the current passage (Harlowe, SugarCube 2, Snowman,
// Chapbook, then anything marked as a passage); the first that matches a visible element wins.
const SELECTORS = ["tw-passage", "#passages .passage", "#passage", ".passage", "[data-passage]", "article", "body"];
// What a link can be: anchors, Harlowe's tw-link, buttons and anything with a link role.
const LINKS = "a, tw-link, tw-expression[type=macro] tw-link, button, [role=link], [data-passage][tabindex], .link-internal";

const USAGE = `usage: playtest-story STORY.html [--follow TEXT]... [options]
  --follow TEXT     click the link whose text is TEXT (exactly, spaces trimmed), then record
                    the passage it shows; repeat for a path through the story
  --out DIR         where screenshots and report.json go (default /out/playtest-story)
  --selector CSS    the element that holds the current passage (default: the first visible
                    of ${SELECTORS.join(", ")})
  --width N, --height N  viewport (default 1024x768)
  --timeout N       seconds to wait for each passage (default 15)
Prints the report as JSON on stdout and writes DIR/report.json:
  {story, passages: [{step, action, name, text, screenshot}], links, console_errors, page_errors}
  (links: the link texts of the last passage)
Exit 0 when every link was found and followed with no page errors, 1 otherwise, 2 for bad arguments.`;

let args;
try {
  args = parseArgs({ allowPositionals: true, options: {
    follow: { type: "string", multiple: true }, out: { type: "string" }, selector: { type: "string" },
    width: { type: "string" }, height: { type: "string" }, timeout: { type: "string" },
    help: { type: "boolean", short: "h" } } });
} catch (e) {
  die(`${e.message}\n${USAGE}`);
}
const o = args.values;
if (o.help) { process.stdout.write(USAGE + "\n"); process.exit(0); }
if (args.positionals.length !== 1) die(`expected one STORY.html\n${USAGE}`);
const story = path.resolve(args.positionals[0]);
if (!existsSync(story) || !statSync(story).isFile()) die(`STORY: ${story} is not a file`);
const out = path.resolve(o.out || "/out/playtest-story");
const width = int("width", o.width, 1024);
const height = int("height", o.height, 768);
const timeout = int("timeout", o.timeout, 15) * 1000;
mkdirSync(out, { recursive: true });

const report = { story, passages: [], links: [], console_errors: [], page_errors: [], error: null };

// The current passage: {name, text} from the first visible candidate element.
async function current(page) {
  return page.evaluate(({ selectors, explicit }) => {
    const visible = (el) => !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length);
    for (const sel of explicit ? [explicit] : selectors) {
      const el = [...document.querySelectorAll(sel)].find(visible);
      if (el) {
        const named = el.closest("[data-passage], [name]") || el.querySelector("[data-passage]");
        const name = el.getAttribute("data-passage") || el.getAttribute("name")
          || (named && (named.getAttribute("data-passage") || named.getAttribute("name"))) || null;
        return { name, text: el.innerText.replace(/[ \t]+\n/g, "\n").trim() };
      }
    }
    return { name: null, text: "" };
  }, { selectors: SELECTORS, explicit: o.selector || null });
}

async function record(page, action) {
  const p = await current(page);
  const file = path.join(out, `${String(report.passages.length).padStart(2, "0")}.png`);
  await page.screenshot({ path: file, fullPage: true });
  report.passages.push({ step: report.passages.length, action, name: p.name, text: p.text, screenshot: file });
  report.links = await page.locator(LINKS).evaluateAll((els) => els
    .filter((el) => el.offsetWidth || el.offsetHeight).map((el) => el.innerText.trim()).filter(Boolean));
  return p;
}

// Waits until the passage text differs from `before` (a format may render asynchronously).
async function changed(page, before) {
  const t0 = Date.now();
  while (Date.now() - t0 < timeout) {
    const p = await current(page);
    if (p.text && p.text !== before) return true;
    await page.waitForTimeout(50);
  }
  return false;
}

let browser;
try {
  browser = await launch();
  const page = await (await browser.newContext({ viewport: { width, height } })).newPage();
  page.setDefaultTimeout(timeout);
  const seen = watch(page);
  report.console_errors = seen.console_errors;
  report.page_errors = seen.page_errors;
  await page.goto(pathToFileURL(story).href, { waitUntil: "load" });
  await changed(page, "");
  let last = await record(page, "open");
  for (const text of o.follow || []) {
    const exact = new RegExp(`^\\s*${text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}\\s*$`);
    let link = page.locator(LINKS).filter({ hasText: exact, visible: true }).first();
    if (await link.count() === 0) link = page.getByText(text, { exact: true }).first();
    if (await link.count() === 0) {
      throw new Error(`no link ${JSON.stringify(text)} in passage ${last.name ?? report.passages.length - 1}; its links: ${JSON.stringify(report.links)}`);
    }
    await link.click();
    if (!await changed(page, last.text)) throw new Error(`following ${JSON.stringify(text)} showed no new passage within ${timeout / 1000} s`);
    last = await record(page, `follow ${text}`);
  }
} catch (e) {
  report.error = e.message;
} finally {
  await browser?.close().catch(() => {});
}
writeFileSync(path.join(out, "report.json"), JSON.stringify(report, null, 2) + "\n");
process.stdout.write(JSON.stringify(report) + "\n");
if (report.error) process.stderr.write(`playtest-story: ${report.error}\n`);
for (const e of report.page_errors) process.stderr.write(`playtest-story: page error: ${e}\n`);
process.exitCode = report.error || report.page_errors.length ? 1 : 0;
