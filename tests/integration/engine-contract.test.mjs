// The engine adapter contract (tests/lua/engine_contract.lua) against the real engine at
// DEMESNE_ENGINE, through the built-in docker adapter: tests/run runs this file once per
// engine, so Podman and Docker both pass the suite the fake engine of the Lua unit tests
// passes. The binary runs its embedded runtime; the test files are read from the tree.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { BIN, ROOT, serverEnv } from "./helpers.mjs";

const ENGINE = process.env.DEMESNE_ENGINE || "unix:///run/podman/podman.sock";

test("the docker adapter passes the engine contract on " + ENGINE, { timeout: 900_000 }, () => {
  const state = mkdtempSync(path.join(tmpdir(), "demesne-contract-"));
  try {
    const r = spawnSync(BIN, ["test", "tests/lua/engine_contract_live.lua"], {
      cwd: ROOT,
      env: serverEnv({ DEMESNE_ENGINE: ENGINE, DEMESNE_STATE_DIR: state }),
      encoding: "utf8",
      timeout: 850_000,
    });
    const out = `${r.stdout}\n${r.stderr}`;
    const summary = /(\d+) passed, (\d+) failed/.exec(r.stdout);
    assert.ok(summary, `no summary line:\n${out}`);
    assert.equal(Number(summary[2]), 0, out);
    // every test of the suite ran: a suite that loads no test must not pass
    const ran = r.stdout.match(/^ok - engine_contract_live: \S+$/gm) || [];
    assert.ok(ran.length >= 15, `only ${ran.length} contract tests ran:\n${out}`);
    assert.equal(Number(summary[1]), ran.length);
    assert.equal(r.status, 0, out);
  } finally {
    rmSync(state, { recursive: true, force: true });
  }
});
