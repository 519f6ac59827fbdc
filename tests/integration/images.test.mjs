// The working images (browser, media, webgamedev, twine) and user images, over MCP with the
// official SDK client, each run through sandbox_script at egress "none" on a real engine.
// The large images are built on one engine only: tests/run sets DEMESNE_IMAGE_TESTS=1 for
// Podman (after `demesne images build --all`); elsewhere this file is skipped.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, rmSync } from "node:fs";
import { spawnSync } from "node:child_process";
import { tmpdir } from "node:os";
import path from "node:path";
import { PNG } from "pngjs";
import { connect, serverEnv, BIN } from "./helpers.mjs";

const RUN = process.env.DEMESNE_IMAGE_TESTS === "1";
const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";
const work = mkdtempSync(path.join(tmpdir(), "demesne-images-"));
const inputs = path.join(work, "in");
const xdg = path.join(work, "config");
const userImages = path.join(xdg, "demesne", "images");
const env = {
  DEMESNE_ENGINE: ENGINE,
  DEMESNE_ALLOWED_PATHS: inputs,
  DEMESNE_OUTPUT_ROOT: path.join(work, "out"),
  DEMESNE_STATE_DIR: path.join(work, "state"),
  XDG_CONFIG_HOME: xdg,
};

function put(file, text) {
  mkdirSync(path.dirname(file), { recursive: true });
  writeFileSync(file, text);
}

// --- what the tests write ----------------------------------------------------------------
// A React widget: a 200x100 red box holding a 100x100 blue one, and a label.
put(path.join(inputs, "browser", "Widget.jsx"), `import { useState } from "react";
export default function Widget({ label }) {
  const [count] = useState(2);
  return (
    <div id="widget" style={{ width: 200, height: 100, display: "flex", background: "rgb(255, 0, 0)" }}>
      <div style={{ width: 100, height: 100, background: "rgb(0, 0, 255)", color: "white" }}>{label} {count}</div>
    </div>
  );
}
`);
// A plain page: green background, a 50x40 yellow box at the top left.
put(path.join(inputs, "browser", "page.html"), `<!doctype html><html><head><meta charset="utf-8"></head>
<body style="margin:0;background:rgb(0,128,0)">
<div id="box" style="width:50px;height:40px;background:rgb(255,255,0)"></div><p>Hello, 世界</p></body></html>
`);
// A changed scene for the game template: a red field, a cyan square the arrow keys move.
put(path.join(inputs, "game", "MainScene.ts"), `import { Scene, type GameObjects, type Types } from "phaser";
export class MainScene extends Scene {
  private player!: GameObjects.Rectangle;
  private keys!: Types.Input.Keyboard.CursorKeys;
  constructor() { super("Main"); }
  create(): void {
    this.add.rectangle(400, 300, 800, 600, 0xff0000);
    this.player = this.add.rectangle(400, 300, 64, 64, 0x00ffff);
    this.keys = this.input.keyboard!.createCursorKeys();
    window.__GAME_STATE__ = "running";
  }
  update(_t: number, delta: number): void {
    if (this.keys.right.isDown) this.player.x += 0.5 * delta;
    if (this.keys.left.isDown) this.player.x -= 0.5 * delta;
    window.__GAME_INFO__ = { player: { x: Math.round(this.player.x), y: Math.round(this.player.y) } };
  }
}
`);
// A three-passage story and a minimal story format (put in the user's twine formats).
put(path.join(inputs, "twine", "story.twee"), `:: StoryTitle
Three Rooms

:: StoryData
{
  "ifid": "D674C58C-DEFA-4F70-B7A2-27742230C0FC",
  "format": "Minimal",
  "format-version": "1.0.0",
  "start": "Hall"
}

:: Hall
You stand in a quiet hall. [[Open the oak door->Library]]

:: Library
Books line every wall. [[Climb the ladder|Attic]]

:: Attic
Dust and moonlight. The end.
`);
const runtime = `(function () {
  var data = document.querySelector("tw-storydata"), byName = {}, byPid = {};
  data.querySelectorAll("tw-passagedata").forEach(function (p) {
    byName[p.getAttribute("name")] = p; byPid[p.getAttribute("pid")] = p;
  });
  var out = document.getElementById("passage");
  function show(p) {
    var text = p.textContent, re = /\\[\\[(.+?)\\]\\]/g, last = 0, m;
    out.setAttribute("data-passage", p.getAttribute("name"));
    out.innerHTML = "";
    while ((m = re.exec(text))) {
      out.appendChild(document.createTextNode(text.slice(last, m.index)));
      var s = m[1], label = s, target = s, i;
      if ((i = s.indexOf("->")) >= 0) { label = s.slice(0, i); target = s.slice(i + 2); }
      else if ((i = s.indexOf("|")) >= 0) { label = s.slice(0, i); target = s.slice(i + 1); }
      var a = document.createElement("a");
      a.href = "#"; a.textContent = label;
      a.onclick = (function (n) { return function (e) { e.preventDefault(); show(byName[n]); }; })(target);
      out.appendChild(a);
      last = re.lastIndex;
    }
    out.appendChild(document.createTextNode(text.slice(last)));
  }
  show(byPid[data.getAttribute("startnode")]);
})();`;
put(path.join(userImages, "twine", "storyformats", "minimal-1.0.0", "format.js"), `window.storyFormat(${JSON.stringify({
  name: "Minimal", version: "1.0.0", author: "demesne tests", proofing: false,
  source: `<!DOCTYPE html><html><head><meta charset="utf-8"><title>{{STORY_NAME}}</title></head><body>{{STORY_DATA}}<div id="passage" class="passage"></div><script>${runtime}</script></body></html>`,
})});\n`);
// A user image FROM a built-in, and one whose build fails.
put(path.join(userImages, "mine", "Containerfile"),
  "FROM python\nCOPY greeting.txt /etc/greeting.txt\nRUN python3 -c 'print(6 * 7)' > /etc/answer.txt\n");
put(path.join(userImages, "mine", "greeting.txt"), "hello from a user image\n");
put(path.join(userImages, "broken", "Containerfile"), "FROM base\nRUN echo this image cannot build >&2; exit 3\n");

let conn;
before(async () => { if (RUN) conn = await connect({ env, fixtures: false }); });
after(async () => {
  await conn?.client.close();
  rmSync(work, { recursive: true, force: true });
});

const LONG = { timeout: 900_000, resetTimeoutOnProgress: true, onprogress: () => {} };
async function script(args) {
  const res = await conn.client.callTool({ name: "sandbox_script", arguments: { egress: "none", ...args } }, undefined, LONG);
  return res;
}
async function ok(args) {
  const res = await script(args);
  assert.ok(!res.isError, `sandbox_script failed: ${res.content?.[0]?.text}`);
  const r = res.structuredContent;
  assert.equal(r.exit_code, 0, `exit ${r.exit_code}\nstdout: ${r.stdout}\nstderr: ${r.stderr}`);
  return r;
}
function png(file) {
  const p = PNG.sync.read(readFileSync(file));
  return { width: p.width, height: p.height, at: (x, y) => Array.from(p.data.subarray((y * p.width + x) * 4, (y * p.width + x) * 4 + 3)), data: p.data };
}
function colours(img) {
  const seen = new Set();
  for (let i = 0; i < img.data.length; i += 4) seen.add(img.data.readUInt32BE(i));
  return seen.size;
}
function cli(...args) {
  const e = serverEnv(env);
  return spawnSync(BIN, args, { env: e, encoding: "utf8", timeout: 900_000 });
}
const t = RUN ? test : (name, fn) => test(name, { skip: "large images are tested on one engine: DEMESNE_IMAGE_TESTS=1 (tests/run, Podman)" }, fn);

t("browser: render-png draws a React widget and an HTML page with no network", async () => {
  const r = await ok({
    image: "browser",
    directories: [path.join(inputs, "browser")],
    command: [
      "set -e",
      `render-png /in/browser/Widget.jsx /out/widget.png --width 320 --height 200 --props '{"label":"demesne"}'`,
      "render-png /in/browser/page.html /out/page.png --width 300 --height 150",
      "render-png /in/browser/page.html /out/box.png --selector '#box' --scale 2",
    ].join("\n"),
    timeout_seconds: 300,
  });
  const widget = png(path.join(r.output_dir, "widget.png"));
  assert.deepEqual([widget.width, widget.height], [320, 200]);
  assert.deepEqual(widget.at(150, 50), [255, 0, 0], "the red box right of the blue one");
  assert.deepEqual(widget.at(50, 90), [0, 0, 255], "the blue box");
  assert.deepEqual(widget.at(300, 180), [255, 255, 255], "the page outside the widget");
  const page = png(path.join(r.output_dir, "page.png"));
  assert.deepEqual([page.width, page.height], [300, 150]);
  assert.deepEqual(page.at(10, 10), [255, 255, 0]);
  assert.deepEqual(page.at(200, 140), [0, 128, 0]);
  const box = png(path.join(r.output_dir, "box.png"));
  assert.deepEqual([box.width, box.height], [100, 80], "the element only, at scale 2");
  assert.deepEqual(box.at(50, 40), [255, 255, 0]);
  assert.match(r.stdout, /"width":320,"height":200/);
});

t("media: ffmpeg makes, transcodes and thumbnails a video; ImageMagick and vips resize", async () => {
  const r = await ok({
    image: "media",
    command: [
      "set -e",
      "cd /out",
      "ffmpeg -hide_banner -loglevel error -f lavfi -i testsrc2=size=320x240:rate=25 -f lavfi -i sine=frequency=440:sample_rate=48000 -t 2 -c:v libx264 -pix_fmt yuv420p -c:a aac -shortest in.mp4",
      "ffmpeg -hide_banner -loglevel error -i in.mp4 -c:v libvpx-vp9 -deadline realtime -cpu-used 8 -b:v 0 -crf 40 -c:a libopus out.webm",
      "ffmpeg -hide_banner -loglevel error -ss 1 -i in.mp4 -frames:v 1 thumb.png",
      "convert thumb.png -resize 160x120 thumb-im.jpg",
      "vips resize thumb.png thumb-vips.webp 0.25",
      "ffprobe -v error -show_entries stream=codec_type,codec_name,width,height -show_entries format=format_name,duration -of json out.webm > probe.json",
      "identify -format '%w %h %m\\n' thumb.png thumb-im.jpg thumb-vips.webp > identify.txt",
      "sox -n -r 44100 -b 16 tone.wav synth 1 sine 440 && lame --quiet tone.wav tone.mp3 && flac --silent tone.wav && opusenc --quiet tone.wav tone.opus",
      "for f in tone.mp3 tone.flac tone.opus; do ffprobe -v error -select_streams a:0 -show_entries stream=codec_name -of default=nw=1:nk=1 $f; done",
    ].join("\n"),
    timeout_seconds: 300,
  });
  const probe = JSON.parse(readFileSync(path.join(r.output_dir, "probe.json"), "utf8"));
  const video = probe.streams.find((s) => s.codec_type === "video");
  const audio = probe.streams.find((s) => s.codec_type === "audio");
  assert.equal(video.codec_name, "vp9");
  assert.deepEqual([video.width, video.height], [320, 240]);
  assert.equal(audio.codec_name, "opus");
  assert.match(probe.format.format_name, /webm/);
  assert.ok(Math.abs(Number(probe.format.duration) - 2) < 0.2, `duration ${probe.format.duration}`);
  assert.equal(readFileSync(path.join(r.output_dir, "identify.txt"), "utf8"), "320 240 PNG\n160 120 JPEG\n80 60 WEBP\n");
  assert.deepEqual(r.stdout.trim().split("\n"), ["mp3", "flac", "opus"]);
});

t("webgamedev: copy the template, change the scene, build and playtest it offline", async () => {
  const r = await ok({
    image: "webgamedev",
    directories: [path.join(inputs, "game")],
    command: [
      "set -e",
      "cp -r /opt/game-template /workspace/game && cd /workspace/game",
      "cp /in/game/MainScene.ts src/scenes/MainScene.ts",
      "npm run build >/out/build.log 2>&1 || { cat /out/build.log; exit 1; }",
      "playtest-game dist --out /out/playtest --keys ArrowRight:400 > /out/report.json",
    ].join("\n"),
    limits: { memory_mb: 4096 },
    timeout_seconds: 600,
  });
  const report = JSON.parse(readFileSync(path.join(r.output_dir, "report.json"), "utf8"));
  assert.equal(report.ready, true);
  assert.equal(report.state, "running");
  assert.deepEqual(report.console_errors, []);
  assert.deepEqual(report.page_errors, []);
  assert.deepEqual(report.phaser.scenes, ["Main"]);
  assert.equal(report.screenshots.length, 2);
  assert.equal(report.screenshots[0].info.player.x, 400);
  // how far depends on the frame rate the loaded machine gives Chromium; that it moved right is the point
  assert.ok(report.screenshots[1].info.player.x > 400, `the square moved right: ${JSON.stringify(report.screenshots[1].info)}`);
  const start = png(report.screenshots[0].file.replace("/out", r.output_dir));
  assert.deepEqual([start.width, start.height], [800, 600]);
  assert.ok(colours(start) >= 2, "not blank");
  assert.deepEqual(start.at(100, 500), [255, 0, 0], "the changed scene's red field");
  assert.deepEqual(start.at(400, 300), [0, 255, 255], "the cyan square in the middle");
});

t("twine: compile a three-passage story and follow two links", async () => {
  const r = await ok({
    image: "twine",
    directories: [path.join(inputs, "twine")],
    command: [
      "set -e",
      "twine-compile --list",
      "twine-compile /in/twine/story.twee /out/story.html >/dev/null",
      "playtest-story /out/story.html --follow 'Open the oak door' --follow 'Climb the ladder' --out /out/pt > /out/report.json",
    ].join("\n"),
    timeout_seconds: 300,
  });
  assert.match(r.stdout, /^Minimal 1\.0\.0 user \/usr\/local\/share\/twine\/storyformats\/minimal-1\.0\.0$/m);
  const report = JSON.parse(readFileSync(path.join(r.output_dir, "report.json"), "utf8"));
  assert.equal(report.error, null);
  assert.deepEqual(report.passages.map((p) => [p.action, p.name, p.text]), [
    ["open", "Hall", "You stand in a quiet hall. Open the oak door"],
    ["follow Open the oak door", "Library", "Books line every wall. Climb the ladder"],
    ["follow Climb the ladder", "Attic", "Dust and moonlight. The end."],
  ]);
  assert.match(readFileSync(path.join(r.output_dir, "story.html"), "utf8"), /<tw-storydata name="Three Rooms"[^>]* format="Minimal"/);
  // the build says which story formats the image holds
  const b = cli("images", "build", "twine");
  assert.equal(b.status, 0, b.stderr);
  assert.match(b.stdout, /^twine\s+demesne\/twine:[0-9a-f]{12} /m);
  assert.match(b.stdout, /^ {4}story format Minimal 1\.0\.0 \(user\)$/m);
});

t("a user image FROM a built-in is built on first use and used by name", async () => {
  const r = await ok({ image: "mine", command: "cat /etc/greeting.txt /etc/answer.txt; python3 -c 'import sys; print(sys.version_info[0])'" });
  assert.equal(r.stdout, "hello from a user image\n42\n3\n");
  const l = cli("images", "list", "mine", "python");
  assert.equal(l.status, 0, l.stderr);
  assert.match(l.stdout, new RegExp(`^mine\\s+demesne/mine:[0-9a-f]{12}\\s+user ${userImages.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}/mine, from python$`, "m"));
  assert.match(l.stdout, /^python\s+demesne\/python:[0-9a-f]{12}\s+built-in, from base$/m);
});

t("a user image that does not build is refused with the build's error; the server goes on", async () => {
  const res = await script({ image: "broken", command: "true" });
  assert.equal(res.isError, true);
  assert.match(res.content[0].text, /building image broken failed: .*(exit status 3|non-zero code: 3)/s);
  const r = await ok({ image: "base", command: "echo still here" });
  assert.equal(r.stdout, "still here\n");
});
