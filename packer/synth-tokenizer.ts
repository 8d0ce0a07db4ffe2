/**
 * synth-tokenizer.ts — tokenizer assets of a synthesized checkpoint (the real vocabulary cannot be
 * downloaded here).
 *
 * Owns: a deterministic stand-in `tiktoken.model` with exactly as many base ranks as the real one,
 * `tokenizer_config.json` with the official special-token ids, our own `chat_template.jinja` that
 * renders the official prompt strings (spec §7.1), and `generation_config.json`. Does not own:
 * tokenizing or rendering at run time (host/).
 *
 * The vocabulary: ranks 0..255 are the single bytes in GPT-2 byte order (rank 0 = "!"), then
 * merges learned by a small byte-pair training run on an embedded multilingual sample (so real
 * English, Vietnamese, Chinese and code become multi-byte tokens), then deterministic filler
 * tokens (pairs of existing tokens) up to the full rank count. Token ids therefore differ from the
 * real model's; only the special ids and the structure match. The bytes are those the earlier
 * Python synthesizer wrote (test/fixtures/python-packer-sha256.json).
 */
import { Buffer } from "node:buffer";

const N_BASE_TOKENS = 163_584;
const N_SPECIAL_SLOTS = 256; // ids N_BASE_TOKENS .. N_BASE_TOKENS + 255 (= vocab 163840 - 1)

const NAMED_SPECIALS: ReadonlyMap<number, string> = new Map([
  [163584, "[BOS]"], [163585, "[EOS]"], [163586, "<|im_end|>"], [163587, "<|im_user|>"],
  [163588, "<|im_assistant|>"], [163590, "<|start_header_id|>"], [163591, "<|end_header_id|>"],
  [163593, "[EOT]"], [163594, "<|im_system|>"], [163601, "<|im_middle|>"],
  [163602, "<|media_start|>"], [163603, "<|media_content|>"], [163604, "<|media_end|>"],
  [163605, "<|media_pad|>"], [163838, "[UNK]"], [163839, "[PAD]"],
]);
const BOS_ID = 163584;
const EOS_ID = 163585;
const IM_END_ID = 163586;
const PAD_ID = 163839;

/**
 * The official pre-tokenizer (spec §8) in JavaScript `v`-flag syntax, used here only to split the
 * training sample: class intersections are nested sets, and `(?i:'s|...)` (which Node 20's regex
 * lacks) is spelled out. On the sample (no U+0085, no U+FEFF, where the two engines' `\s`
 * differ) it splits exactly as the official pattern does under Python's `regex`.
 */
const SAMPLE_SPLIT = new RegExp([
  String.raw`[\p{sc=Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--[\p{sc=Han}]]*[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--[\p{sc=Han}]]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?`,
  String.raw`[^\r\n\p{L}\p{N}]?[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--[\p{sc=Han}]]+[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--[\p{sc=Han}]]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
].join("|"), "gv");

const SAMPLE = `The quick brown fox jumps over the lazy dog. Hello! How can I assist you today? Please describe
the image in one short sentence. What is the capital of France? The capital of France is Paris.
Reply with exactly one short word: hello. There are three cats on the table and a red ball.
I think that this is a good idea, but we should check the results before we continue.
You are a helpful assistant. The user asked a question about the weather and the answer was sunny.
In the picture, a man is riding a bicycle down a street next to tall buildings and green trees.
Xin chào! Tôi là một trợ lý hữu ích. Hôm nay trời đẹp quá. Viết đúng một từ: chào.
Việt Nam là một quốc gia ở Đông Nam Á. Thủ đô của Việt Nam là Hà Nội. Cảm ơn bạn rất nhiều.
Bức ảnh này cho thấy một con mèo đang ngủ trên ghế. Chúng tôi muốn biết thêm về người dùng.
你好！我是一个有用的助手。今天天气很好。请用一句话描述这张图片。中国的首都是北京。
这张图片显示了一只猫在椅子上睡觉。我们想了解更多关于用户的信息。谢谢你的帮助。
def main(argv: list[str]) -> int:
    for index, value in enumerate(argv):
        if value == "--help":
            print("usage: main [options]")
            return 0
    return 1

import numpy as np
x = np.zeros((3, 4), dtype=np.float32)
result = {"name": "kvl", "version": 1, "items": [1, 2, 3]}
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
`;

/** Token bytes are held as latin1 strings: one char per byte, cheap to join and compare. */
type ByteString = string;

/** Bytes in GPT-2 order: printable '!'..'~', '¡'..'¬', '®'..'ÿ', then the rest ascending. */
function gpt2ByteOrder(): number[] {
  const range = (a: number, b: number): number[] => Array.from({ length: b - a + 1 }, (_, i) => a + i);
  const printable = [...range(0x21, 0x7e), ...range(0xa1, 0xac), ...range(0xae, 0xff)];
  const seen = new Set(printable);
  return [...printable, ...range(0, 255).filter((b) => !seen.has(b))];
}

/** Python's bytes comparison (and tuple-of-bytes comparison) on latin1 strings. */
function compareBytes(a: ByteString, b: ByteString): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/** Plain byte-pair training: repeatedly merge the most frequent adjacent pair (ties broken by the
 * pair's bytes, larger wins, so the result is deterministic) until every pre-token is one token. */
function trainMerges(text: string, maxMerges: number): ByteString[] {
  const words = new Map<ByteString, number>();
  for (const m of text.matchAll(SAMPLE_SPLIT)) {
    const bytes = Buffer.from(m[0], "utf8").toString("latin1");
    words.set(bytes, (words.get(bytes) ?? 0) + 1);
  }
  const seqs = [...words].map(([w, count]) => ({ seq: [...w], count }));
  const merged: ByteString[] = [];
  for (let n = 0; n < maxMerges; n++) {
    const pairs = new Map<string, { a: ByteString; b: ByteString; count: number }>();
    for (const { seq, count } of seqs) {
      for (let i = 0; i + 1 < seq.length; i++) {
        const key = `${seq[i]!.length}:${seq[i]}${seq[i + 1]}`;
        const entry = pairs.get(key);
        if (entry) entry.count += count;
        else pairs.set(key, { a: seq[i]!, b: seq[i + 1]!, count });
      }
    }
    let best: { a: ByteString; b: ByteString; count: number } | undefined;
    for (const p of pairs.values()) {
      if (!best || p.count > best.count ||
          (p.count === best.count && (compareBytes(p.a, best.a) || compareBytes(p.b, best.b)) > 0)) best = p;
    }
    if (!best) break;
    const token = best.a + best.b;
    merged.push(token);
    for (const { seq } of seqs) {
      for (let i = 0; i < seq.length - 1; i++) {
        if (seq[i] === best.a && seq[i + 1] === best.b) seq.splice(i, 2, token);
      }
    }
  }
  return merged;
}

let ranksCache: ByteString[] | undefined;

/** Token bytes by rank: exactly N_BASE_TOKENS distinct byte strings. */
function rankedTokens(): ByteString[] {
  if (ranksCache) return ranksCache;
  const tokens: ByteString[] = gpt2ByteOrder().map((b) => String.fromCharCode(b));
  const seen = new Set(tokens);
  for (const token of trainMerges(SAMPLE, 4000)) {
    if (!seen.has(token)) {
      seen.add(token);
      tokens.push(token);
    }
  }
  // Filler: concatenations of two existing tokens, swept so that both parts have low rank (every
  // filler token is reachable by merging lower-ranked tokens).
  const base = tokens.slice();
  let full = tokens.length >= N_BASE_TOKENS;
  for (let s = 0; !full; s++) {
    for (let t = 0; t <= s && !full; t++) {
      const pairs: Array<[number, number]> = t !== s ? [[s, t], [t, s]] : [[s, s]];
      for (const [a, b] of pairs) {
        if (a >= base.length || b >= base.length) continue;
        const token = base[a]! + base[b]!;
        if (seen.has(token)) continue;
        seen.add(token);
        tokens.push(token);
        if (tokens.length === N_BASE_TOKENS) {
          full = true;
          break;
        }
      }
    }
  }
  ranksCache = tokens;
  return tokens;
}

function specialName(id: number): string {
  return NAMED_SPECIALS.get(id) ?? `<|reserved_token_${id}|>`;
}

function tiktokenModelBytes(): Buffer {
  const lines = rankedTokens().map((tok, rank) => `${Buffer.from(tok, "latin1").toString("base64")} ${rank}`);
  return Buffer.from(`${lines.join("\n")}\n`, "latin1");
}

function tokenizerConfig(): Record<string, unknown> {
  const decoder: Record<string, unknown> = {};
  for (let i = N_BASE_TOKENS; i < N_BASE_TOKENS + N_SPECIAL_SLOTS; i++) {
    decoder[String(i)] = { content: specialName(i), lstrip: false, normalized: false, rstrip: false, single_word: false, special: true };
  }
  return {
    added_tokens_decoder: decoder,
    additional_special_tokens: [163586, 163587, 163588, 163594, 163601, 163602, 163603, 163604, 163605].map((i) => NAMED_SPECIALS.get(i)),
    auto_map: { AutoTokenizer: ["tokenization_moonshot.TikTokenTokenizer", null] },
    bos_token: "[BOS]",
    eos_token: "[EOS]",
    pad_token: "[PAD]",
    unk_token: "[UNK]",
    clean_up_tokenization_spaces: false,
    model_max_length: 1048576,
    tokenizer_class: "TikTokenTokenizer",
  };
}

/** Our own template text; renders exactly the official prompt strings (spec §7.1). */
const CHAT_TEMPLATE = `{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role == 'system' -%}<|im_system|>
{%- elif role == 'user' -%}<|im_user|>
{%- elif role == 'assistant' -%}<|im_assistant|>
{%- endif -%}
{{- role -}}<|im_middle|>
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
<|media_start|>image<|media_content|><|media_pad|><|media_end|>
{%- elif 'text' in part -%}
{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
`;

function generationConfig(): Record<string, unknown> {
  return {
    bos_token_id: BOS_ID,
    do_sample: true,
    eos_token_id: [IM_END_ID, EOS_ID],
    pad_token_id: PAD_ID,
    temperature: 0.2,
    transformers_version: "4.50.3",
  };
}

/** A JSON file as the official checkpoint's are laid out: two-space indent, then a line feed
 * (added_tokens_decoder's keys are ids, which JSON.stringify writes in ascending order). */
function jsonFile(value: unknown): string {
  return `${JSON.stringify(value, null, 2)}\n`;
}

/** File name -> contents of tiktoken.model, tokenizer_config.json, chat_template.jinja and
 * generation_config.json. */
export function tokenizerAssets(): Map<string, Buffer> {
  return new Map([
    ["tiktoken.model", tiktokenModelBytes()],
    ["tokenizer_config.json", Buffer.from(jsonFile(tokenizerConfig()), "utf8")],
    ["chat_template.jinja", Buffer.from(CHAT_TEMPLATE, "utf8")],
    ["generation_config.json", Buffer.from(jsonFile(generationConfig()), "utf8")],
  ]);
}
