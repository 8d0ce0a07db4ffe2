#!/usr/bin/env node
/**
 * kvl.ts — the `kvl` executable (package.json "bin"): runs the command tree of program.ts.
 */
import { runKvl } from "./program.js";

await runKvl(process.argv);
