// lent-cache.mjs — one greedy image turn on a native expert cache that borrows the plan's image
// lines (planner.ts expertLoans): the cache holds one layer's top-k + 1 extents of its own, the
// rest lent while no image is in flight, taken back for the image's decode and encode
// (kvl_engine_set_expert_slots: on Windows MEM_RESET + VirtualUnlock, on Linux MADV_DONTNEED) and
// lent again after it. windows.mjs runs it with node.exe under Wine and with Linux's node and
// compares the tokens. `kvl chat` cannot ask for such a cache on the tiny model (--cache-mib is
// whole MiB, more than its experts), hence a script over dist/.
//   node test/portability/lent-cache.mjs PACK IMAGE
// Prints one JSON line: { lends, tokens, extentsLent }.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const [pack, image] = process.argv.slice(2);
if (!pack || !image) throw new Error("usage: node test/portability/lent-cache.mjs PACK IMAGE");
const root = fileURLToPath(new URL("../..", import.meta.url));
const load = (rel) => import(pathToFileURL(join(root, "dist", rel)).href);
const { ChatModel } = await load("host/chat-model.js");
const { chooseBackend } = await load("host/core/backend.js");
const { defaultReplyParams } = await load("host/text/reply-params.js");
const { modelOf, readPackFacts } = await load("host/plan/core-bytes.js");

const m = modelOf(await readPackFacts(pack));
const model = await ChatModel.open(pack, {
  backend: chooseBackend({ option: "native" }), ramMib: 1024, cacheMib: ((m.topK + 1) * m.extent + 100) / 2 ** 20, trunkCacheMib: null,
  maxContext: 1024, threads: 1, kernels: "auto", actDtype: "auto", loadVision: true, instances: 1,
});
try {
  const conversation = await model.newConversation();
  const picture = await model.loadImage(readFileSync(image), "picture");
  const report = await conversation.generate([{ role: "user", parts: [picture, "Describe the picture."] }],
    { ...defaultReplyParams(), temperature: 0, maxNewTokens: 8 }, () => undefined);
  await conversation.close();
  console.log(JSON.stringify({ lends: model.client.lendsImageRoom, tokens: report.outputTokenIds, extentsLent: model.plan.expertExtentsLent }));
} finally {
  await model.close();
}
