import { AUTO, Game, type Types } from "phaser";
import { MainScene } from "./scenes/MainScene";

const config: Types.Core.GameConfig = {
  type: AUTO, // WebGL (SwiftShader in the sandbox), Canvas where WebGL is missing
  width: 800,
  height: 600,
  parent: "game",
  backgroundColor: "#1d2b53",
  scene: [MainScene],
};

window.game = new Game(config);
