/**
 * addon-probe.ts — the child's side of backend.ts's test load of the native addon: loads the addon
 * at a path and prints its kernel sets as JSON on stdout (a wrong instruction set or a missing
 * library kills or fails this child, never the process that asked).
 *
 * Owns: the hidden first argument that makes the kvl command run the probe (cli/kvl.ts), so the
 * child is `process.execPath` with kvl's own arguments (paths.ts kvlCommandArgs) both from the
 * package and as a single executable, which takes no `node -e`. Kept to Node built-ins: the probe
 * runs before every command that picks a backend, and cli/kvl.ts imports it before anything that
 * can fail (paths.ts extracting a single executable's files), so it imports nothing of kvl.
 */
import { createRequire } from "node:module";

export const ADDON_PROBE_ARG = "__kvl-addon-probe";

/** What the probe prints. */
export interface AddonProbeReport {
  sets: Array<{ name: string; supported: boolean }>;
  def: string;
}

export function runAddonProbe(path: string): void {
  const addon = createRequire(path)(path) as { kernelSets(): AddonProbeReport["sets"]; defaultKernelSet(): string };
  const report: AddonProbeReport = { sets: addon.kernelSets(), def: addon.defaultKernelSet() };
  process.stdout.write(JSON.stringify(report));
}
