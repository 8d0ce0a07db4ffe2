/**
 * Interactive `kvl chat` under a real terminal (issue 27, items 7 and 9): the compiled CLI on a
 * tiny synthesized pack inside tmux (its own server socket, killed in afterAll), driven with
 * send-keys; everything the chat writes to the terminal is logged raw (pipe-pane), the screen
 * read with capture-pane. Waits poll the log with a bound; nothing is timed.
 *   - Ctrl-C during an image turn stops it; the stopped turn keeps its image (the prompt the
 *     model saw: the official ids of that turn), the next message goes without it;
 *   - Ctrl-C right after Enter (one read from the terminal) stops the turn just sent;
 *   - an image that fails to decode is refused at /image, saying so, before any text is typed;
 *     nothing stays pending (the next message is the official ids of that text alone);
 *   - control characters of the model's reply reach the terminal only in a visible form;
 *   - the image lines on stderr (imageLines, on a stand-in stream): on a terminal, the line
 *     redrawn while an image encodes, cleared, then the image's line; elsewhere the last only.
 * Expected ids are the committed goldens of test/fixtures/goldens/tokenizer.json (Python, from
 * the official tokenizer and template).
 */
import { execFileSync } from "node:child_process";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { imageLines } from "../cli/chat.js";
import { packageRoot } from "../host/system/paths.js";
import { KVL, childEnv } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const TMUX = "/usr/bin/tmux";
const SOCKET = `kvltest-${process.pid}`;
const SESSION = "chat";

const GOLDENS = JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "goldens", "tokenizer.json"), "utf8")) as {
  conversations: Array<{ name: string; add_generation_prompt: boolean; tokens: number[] }>;
  specials: Record<string, number>;
};
function golden(name: string): number[] {
  const c = GOLDENS.conversations.find((g) => g.name === name && g.add_generation_prompt);
  if (!c) throw new Error(`no golden conversation ${name}`);
  return c.tokens;
}
const USER = GOLDENS.specials["<|im_user|>"]!;
const MEDIA_START = GOLDENS.specials["<|media_start|>"]!;
const MEDIA_PAD = GOLDENS.specials["<|media_pad|>"]!;

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let log: string;
/** 84x56: the goldens' image-a size (a 4x6 patch grid); and the same PNG cut short after its header. */
let imageA: string;
let truncated: string;

function tmux(...args: string[]): string {
  return execFileSync(TMUX, ["-L", SOCKET, ...args], { encoding: "utf8", env: childEnv({}) });
}

function output(): string {
  try {
    return readFileSync(log, "utf8");
  } catch {
    return "";
  }
}

/** Polls the terminal log (from `from` on) until `test` holds; fails after two minutes with the log. */
async function waitFor(from: number, test: (text: string) => boolean, what: string): Promise<string> {
  const deadline = Date.now() + 120_000;
  for (;;) {
    const text = output().slice(from);
    if (test(text)) return text;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}; the terminal showed:\n${text.slice(-4000)}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Types a line (literally) and Enter, plus `after` keys in the same send (one write to the terminal). */
function typeLine(text: string, ...after: string[]): number {
  const at = output().length;
  tmux("send-keys", "-t", SESSION, "-l", text);
  tmux("send-keys", "-t", SESSION, "Enter", ...after);
  return at;
}

/** The prompt ids of the next --show-tokens report after `from`, and the text up to it. */
async function nextPromptIds(from: number): Promise<{ ids: number[]; text: string }> {
  const text = await waitFor(from, (t) => /\[tokens\] prompt \d+ \(reused \d+\):[\d ]*\r?\n/.test(t), "the turn's [tokens] line");
  const m = /\[tokens\] prompt \d+ \(reused \d+\):([\d ]*)\r?\n/.exec(text)!;
  return { ids: m[1]!.trim().split(/\s+/).map(Number), text: text.slice(0, m.index) };
}

/** The ids after the last user-turn start: the last user message and the generation prompt. */
function lastUserTurn(ids: number[]): number[] {
  return ids.slice(ids.lastIndexOf(USER));
}

beforeAll(async () => {
  tmp = tempDir("chat-tty");
  ({ pack } = await tinyPack(tmp.dir, 0));
  // a pattern (test/chat.test.ts's image A), over which the tiny model's greedy reply soon has control characters
  const data = Buffer.alloc(84 * 56 * 3);
  for (let i = 0; i < data.length; i++) data[i] = (i * 37 + ((i / 3) | 0) * 11) & 0xff;
  const full = await sharp(data, { raw: { width: 84, height: 56, channels: 3 } }).png().toBuffer();
  imageA = join(tmp.dir, "a.png");
  writeFileSync(imageA, full);
  truncated = join(tmp.dir, "cut.png");
  writeFileSync(truncated, full.subarray(0, Math.floor(full.length * 0.6))); // header intact, pixels cut
  log = join(tmp.dir, "terminal.log");
  // the chat waits for a go file, so pipe-pane logs it from its first byte
  const go = join(tmp.dir, "go");
  const limit = (JSON.parse(readFileSync(join(pack, "config.json"), "utf8")) as { text_config: { max_position_embeddings: number } })
    .text_config.max_position_embeddings;
  const chat = [process.execPath, KVL, "chat", pack, "--temperature", "0", "--max-new", String(limit), "--max-context", String(limit),
    "--ram-mib", "2048", "--threads", "2", "--show-tokens"].map((a) => `'${a}'`).join(" ");
  tmux("-f", "/dev/null", "new-session", "-d", "-s", SESSION, "-x", "200", "-y", "50",
    `sh -c 'while [ ! -e ${go} ]; do sleep 0.05; done; exec ${chat.replace(/'/g, "'\\''")}'`);
  tmux("pipe-pane", "-t", SESSION, "-o", `cat >> '${log}'`);
  writeFileSync(go, "");
  await waitFor(0, (t) => t.includes("commands: /reset") && t.includes("> "), "the chat's first prompt");
}, 300_000);

afterAll(() => {
  try {
    // the server leaves its socket file behind when killed
    const socket = tmux("display-message", "-p", "#{socket_path}").trim();
    tmux("kill-server");
    rmSync(socket, { force: true });
  } catch {
    // already gone
  }
  tmp?.cleanup();
});

describe("kvl chat in a terminal", () => {
  it("Ctrl-C stops an image turn: the turn keeps its image, the next message goes without it; the reply's control characters are shown escaped", async () => {
    let at = typeLine(`/image ${imageA}`);
    await waitFor(at, (t) => t.includes("(image attached to your next message; 1 pending)"), "the image attached");

    at = typeLine("Describe this.");
    // the reply streams; stop it once it has shown a control character (as \xNN)
    await waitFor(at, (t) => /Describe this\.\r*\n[^]*\\x[0-9a-f]{2}/.test(t), "a control character in the reply");
    tmux("send-keys", "-t", SESSION, "C-c");
    const first = await nextPromptIds(at);
    const turn = first.text;
    expect(turn).toContain(" [stopped]\r\n(the stopped turn keeps its image; nothing is attached to your next message)");
    const echo = /Describe this\.\r*\n/.exec(turn)!; // readline's \r\n after the typed line, the tty's onlcr on top
    const streamed = turn.slice(echo.index + echo[0].length, turn.indexOf(" [stopped]"));
    // on the terminal: newlines (the tty's \r\n), tabs and printable text only
    expect(streamed).not.toMatch(/[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f-\u009f]|\r(?!\n)/);
    // the stopped turn was the official prompt of one image and that text
    expect(first.ids).toEqual(golden("image_text"));

    // Enter and Ctrl-C in one read: the turn just sent is stopped before it runs
    at = typeLine("Count forever", "C-c");
    const second = await nextPromptIds(at);
    expect(second.text).toContain(" [stopped]");
    expect(second.text).not.toContain("use /quit");
    expect(output().slice(at)).toMatch(/\[tokens\] output \d+ \(cancelled\)/);
    // the image is where the stopped turn had it, and only there
    expect(second.ids.slice(0, golden("image_text").length)).toEqual(golden("image_text"));
    expect(second.ids.filter((t) => t === MEDIA_START)).toHaveLength(1);
    expect(lastUserTurn(second.ids)).not.toContain(MEDIA_PAD);
    expect(second.ids.indexOf(MEDIA_START)).toBeLessThan(second.ids.lastIndexOf(USER));
  }, 300_000);

  it("an image that fails to decode is refused when it is attached, saying so; nothing stays pending and the next message goes without it", async () => {
    let at = typeLine("/reset");
    await waitFor(at, (t) => t.includes("(conversation cleared)"), "the reset");
    // the header is whole, the pixels are cut: only a full decode finds it, and it runs at /image,
    // before any message is typed (the old chat accepted it here and lost the next message's text)
    at = typeLine(`/image ${truncated}`);
    const refused = await waitFor(at, (t) => /error: .* is corrupt or truncated and cannot be decoded/.test(t), "the decode error");
    expect(refused).not.toContain("image attached");

    // Ctrl-C in the same read as Enter stops the reply at once: only the prompt matters
    at = typeLine("What is 2+2?", "C-c");
    const { ids } = await nextPromptIds(at);
    expect(ids).toEqual(golden("text"));
  }, 300_000);
});

describe("kvl chat's image lines on stderr (imageLines)", () => {
  const base = { index: 0, count: 2, name: "photo\u0007.png", grid: [66, 66] as [number, number], mediaTokens: 1089, cached: false };
  const capture = (isTTY: boolean) => {
    const out: string[] = [];
    return { err: { isTTY, write: (text: string) => out.push(text) }, out };
  };

  it("on a terminal: a line redrawn each second while the image encodes, cleared, then the image's line", () => {
    const { err, out } = capture(true);
    const hooks = imageLines({}, err);
    hooks.onImage!({ ...base, phase: "start", elapsedS: 0 });
    hooks.onImage!({ ...base, phase: "encoding", elapsedS: 1.02 });
    hooks.onImage!({ ...base, phase: "encoding", elapsedS: 2.04 });
    hooks.onImage!({ ...base, phase: "done", elapsedS: 2.5 });
    expect(out).toEqual([
      "\r\x1b[K[image 1/2] photo\\x07.png: encoding 1089 media tokens... 1 s",
      "\r\x1b[K[image 1/2] photo\\x07.png: encoding 1089 media tokens... 2 s",
      "\r\x1b[K",
      "[image 1/2] photo\\x07.png: 1089 media tokens (grid 66x66), encoded in 2.5 s\n",
    ]);
  });

  it("not on a terminal: only the line once the image is ready; from the cache it says so; --json and --quiet print nothing", () => {
    const { err, out } = capture(false);
    const hooks = imageLines({}, err);
    hooks.onImage!({ ...base, phase: "encoding", elapsedS: 1 });
    hooks.onImage!({ ...base, index: 1, phase: "done", elapsedS: 0.01, cached: true });
    expect(out).toEqual(["[image 2/2] photo\\x07.png: 1089 media tokens (grid 66x66), embeddings from the cache\n"]);
    expect(imageLines({ json: true }, err)).toEqual({});
    expect(imageLines({ quiet: true }, err)).toEqual({});
  });
});
