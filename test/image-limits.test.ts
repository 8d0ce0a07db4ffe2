/**
 * The image limit is one number (issue 27, item 6): at a small --ram-mib on the tiny pack, the
 * figure the RAM plan's image decode line quotes ("images up to N MP (JPEG, PNG)") is what chat
 * and serve admit. PNGs a row of pixels under and over that figure (blank, so their files are
 * tiny: a small file must not let more pixels in) are made from the quoted text itself; the one
 * under is answered, the one over is refused, and the refusal, the plan line and kvl serve's
 * ready line all quote the same figure. `kvl chat` and `kvl serve` as users run them (the
 * compiled CLI in child processes).
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";

import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { KVL, type LiveServer, childEnv, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

/** The plan's image decode line, e.g. "image decode (...)   150.5  images up to 16.0 MP (JPEG, PNG), ..." */
const PLAN_LINE = /^image decode \(file, pixels, resize passes\)\s+[\d.]+\s+images up to (\d+\.\d) MP \(JPEG, PNG\)/m;
/** Width of the test images: small enough for a valid patch grid at a few MP, and "just over"
 * the limit is one row of this many pixels. */
const WIDTH = 4000;

let tmp: { dir: string; cleanup: () => void };
let pack: string;

beforeAll(async () => {
  tmp = tempDir("image-limits");
  ({ pack } = await tinyPack(tmp.dir, 0));
}, 300_000);

afterAll(() => tmp?.cleanup());

function figureOf(text: string, pattern: RegExp, what: string): string {
  const m = pattern.exec(text);
  if (!m) throw new Error(`no ${what} in:\n${text}`);
  return m[1]!;
}

/** Blank PNGs of WIDTH columns: the most rows within `mp` megapixels, and one row more. */
async function aroundLimit(mp: string, name: string): Promise<{ under: string; over: string; rows: number }> {
  const pixels = Math.round(Number(mp) * 10) * 100_000;
  const rows = Math.floor(pixels / WIDTH);
  const paths = { under: join(tmp.dir, `${name}-under.png`), over: join(tmp.dir, `${name}-over.png`) };
  for (const [path, height] of [[paths.under, rows], [paths.over, rows + 1]] as const) {
    await sharp({ create: { width: WIDTH, height, channels: 3, background: "#fff" } }).png().toFile(path);
  }
  expect(WIDTH * rows).toBeLessThanOrEqual(pixels);
  expect(WIDTH * (rows + 1)).toBeGreaterThan(pixels);
  return { ...paths, rows };
}

function chat(args: string[], input: string) {
  const r = spawnSync(process.execPath, [KVL, "chat", pack, ...args], { encoding: "utf8", env: childEnv({}), input, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("one image limit", () => {
  it("kvl chat admits exactly what its plan line quotes, and its refusal quotes the same figure", async () => {
    const args = ["--ram-mib", "520", "--max-context", "4096", "--threads", "2", "--temperature", "0", "--max-new", "1", "--verbose", "--show-tokens"];
    const planned = chat(args, "/quit\n");
    expect(planned.status, planned.stderr).toBe(0);
    const mp = figureOf(planned.stderr, PLAN_LINE, "plan line");
    expect(Number(mp)).toBeLessThan(64); // a limit the budget chose, not the decoder's ceiling

    const { under, over, rows } = await aroundLimit(mp, "chat");
    const r = chat(args, `/image ${over}\n/image ${under}\nDescribe this.\n/quit\n`);
    expect(r.status, r.stderr).toBe(0);
    expect(figureOf(r.stderr, PLAN_LINE, "plan line")).toBe(mp);
    // over: refused from its header, quoting the plan's figure
    const refusal = r.stderr.split("\n").find((l) => l.startsWith("error:")) ?? "";
    expect(refusal).toContain(`image file '${over}' is ${WIDTH}x${rows + 1} = `);
    expect(refusal).toContain(`over the ${mp} MP the RAM plan admits for a JPEG or PNG; downscale it to at most ${mp} MP`);
    // under: attached and answered, the turn shows it
    expect(r.stderr).toContain("(image attached to your next message; 1 pending)");
    expect(r.stderr.match(/^error:/gm)).toHaveLength(1);
    expect(r.stderr).toMatch(/^\[image\] 1: grid \d+x\d+ patches/m);
  }, 300_000);

  describe("kvl serve", () => {
    let server: LiveServer;
    beforeAll(async () => {
      server = await startServer(pack, ["--ram-mib", "520", "--max-queue", "1", "--max-body-mib", "2", "--max-context", "4096", "--verbose"], {});
    }, 300_000);
    afterAll(async () => {
      await server?.stop();
    });

    it("answers an image just under the figure its ready line and plan quote, refuses one just over with that figure", async () => {
      const log = server.log();
      const mp = figureOf(log, /^kvl serve: .*, images up to (\d+\.\d) MP \(JPEG, PNG\); loaded in/m, "ready line");
      expect(figureOf(log, PLAN_LINE, "plan line")).toBe(mp);
      expect(Number(mp)).toBeLessThan(64);
      const model = figureOf(log, /model ready as '([^']+)'/, "model id");

      const { under, over, rows } = await aroundLimit(mp, "serve");
      const ask = (path: string) => server.post("/v1/chat/completions", {
        model, max_tokens: 1, temperature: 0, messages: [{ role: "user", content: [
          { type: "image_url", image_url: { url: `data:image/png;base64,${readFileSync(path).toString("base64")}` } },
          { type: "text", text: "Describe this." }] }],
      });
      const refused = await ask(over);
      expect(refused.status, refused.text).toBe(400);
      const message = (refused.json as { error: { message: string } }).error.message;
      expect(message).toContain(`is ${WIDTH}x${rows + 1} = `);
      expect(message).toContain(`over the ${mp} MP the RAM plan admits for a JPEG or PNG; downscale it to at most ${mp} MP`);
      const answered = await ask(under);
      expect(answered.status, answered.text).toBe(200);
      expect((answered.json as { usage: { prompt_tokens: number } }).usage.prompt_tokens).toBeGreaterThan(100); // the image's media tokens
    }, 300_000);
  });
});
