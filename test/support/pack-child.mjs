// pack-child.mjs — `kvl pack ...` as the tests run it in a child process (so it can be
// SIGKILLed): the compiled command tree of cli/program.ts, exactly as dist/cli/kvl.js runs it.
// Needs dist/ (npx tsc -p .).
//   node test/support/pack-child.mjs pack SRC DST [--allow-revision] [--delete-consumed-shards] [--quiet] [--backend B]
import { runKvl } from "../../dist/cli/program.js";

await runKvl(process.argv);
