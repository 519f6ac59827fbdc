import { defineConfig } from "vite";

// base "./": dist/ works from any folder or URL path (playtest-game serves it at /).
export default defineConfig({
  base: "./",
  build: {
    outDir: "dist",
    // Phaser alone is about 1.5 MB minified; one chunk is fine for a game.
    chunkSizeWarningLimit: 4096,
  },
  server: { host: "127.0.0.1" },
  preview: { host: "127.0.0.1" },
});
