// Builds the cockpit page into OUT (argv[2], default ../build/ui): app.js bundled and
// minified by esbuild from src/app.js, index.html and app.css copied. Run by CMake (the `ui`
// target) after `npm ci` in a copy of this folder; nothing built is kept in the repository.
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const src = process.env.DEMESNE_UI_SRC || path.join(here, "src");
const out = path.resolve(process.argv[2] || path.join(here, "../build/ui"));
mkdirSync(out, { recursive: true });
await build({ entryPoints: [path.join(src, "app.js")], bundle: true, minify: true, format: "iife",
  target: ["es2020"], outfile: path.join(out, "app.js"), legalComments: "none", logLevel: "warning" });
for (const f of ["index.html", "app.css"]) copyFileSync(path.join(src, f), path.join(out, f));
console.log(`cockpit page built in ${out}`);
