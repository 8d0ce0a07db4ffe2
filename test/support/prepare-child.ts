/**
 * prepare-child.ts — `kvl prepare` as its own process, for the tests that kill it mid-download or
 * read its exit status and stderr: the whole `kvl` program (cli/program.ts) from the sources,
 * run with vite-node so no build step is needed.
 *   node node_modules/vite-node/vite-node.mjs test/support/prepare-child.ts -- prepare DST [options]
 */
import { runKvl } from "../../cli/program.js";

await runKvl(process.argv);
