import { Scene, type GameObjects, type Types } from "phaser";

// A square that the arrow keys move and Space recolours. Replace it with your game.
export class MainScene extends Scene {
  private player!: GameObjects.Rectangle;
  private cursors!: Types.Input.Keyboard.CursorKeys;
  private presses = 0;

  constructor() {
    super("Main");
  }

  create(): void {
    this.add.text(16, 16, "Phaser 4 template: arrow keys move, Space recolours", {
      fontFamily: "DejaVu Sans, sans-serif",
      fontSize: "20px",
      color: "#ffffff",
    });
    this.player = this.add.rectangle(400, 300, 64, 64, 0xffcc00);
    const keyboard = this.input.keyboard!;
    this.cursors = keyboard.createCursorKeys();
    keyboard.on("keydown-SPACE", () => {
      this.presses += 1;
      this.player.setFillStyle(this.presses % 2 ? 0x00e436 : 0xffcc00);
    });
    window.__GAME_STATE__ = "running";
    this.publish();
  }

  update(_time: number, delta: number): void {
    const step = 0.4 * delta;
    const { left, right, up, down } = this.cursors;
    if (left.isDown) this.player.x -= step;
    if (right.isDown) this.player.x += step;
    if (up.isDown) this.player.y -= step;
    if (down.isDown) this.player.y += step;
    this.player.x = Math.min(Math.max(this.player.x, 32), 768);
    this.player.y = Math.min(Math.max(this.player.y, 32), 568);
    this.publish();
  }

  private publish(): void {
    window.__GAME_INFO__ = {
      scene: this.scene.key,
      player: { x: Math.round(this.player.x), y: Math.round(this.player.y) },
      presses: this.presses,
    };
  }
}
