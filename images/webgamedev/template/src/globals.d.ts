import type { Game } from "phaser";

// What the page tells a playtest (playtest-game reads both; see the image's README).
declare global {
  interface Window {
    game?: Game;
    /** "running" once the first scene has been created. */
    __GAME_STATE__?: string;
    /** Anything the game wants a playtest to see, as plain JSON. */
    __GAME_INFO__?: Record<string, unknown>;
  }
}
