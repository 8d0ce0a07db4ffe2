#!/usr/bin/env node
/**
 * kvl.ts — the `kvl` executable (package.json "bin", and the entry of the single executable that
 * scripts/build-exe.mjs bundles): runs the command tree of program.ts, or, given the hidden
 * argument of host/core/addon-probe.ts, only the native addon's test load. No top-level await (a
 * CommonJS bundle cannot hold one); the command tree is imported only when it runs, so the probe
 * stays small and a UserError while loading it is one line.
 */
import { ADDON_PROBE_ARG, runAddonProbe } from "../host/core/addon-probe.js";
import { UserError } from "../host/system/user-error.js";

if (process.argv[2] === ADDON_PROBE_ARG) {
  runAddonProbe(process.argv[3] ?? "");
} else {
  import("./program.js").then(
    ({ runKvl }) => runKvl(process.argv),
    (err: unknown) => {
      // a failure while loading (a single executable that cannot write its files): one line
      if (!(err instanceof UserError)) throw err;
      process.stderr.write(`kvl: error: ${err.message}\n`);
      process.exitCode = 1;
    },
  );
}
