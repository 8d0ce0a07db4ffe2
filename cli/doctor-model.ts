/**
 * doctor-model.ts — `kvl doctor MODEL`'s report as text: one line `OK|WARN|FAIL  name: detail`
 * per check (the RAM plan's table after the RAM line with --verbose or a refusal), then one
 * verdict line (`PASS`, or `FAIL: <what to fix>`); --json prints the report itself.
 *
 * Owns: rendering. Does not own: the checks (host/engine/model-doctor.ts).
 */
import type { ModelDoctorReport } from "../host/engine/model-doctor.js";

/** The text report: one line per check (the plan's table after the RAM line with --verbose or a
 * refusal), then the verdict. */
export function renderModelDoctor(report: ModelDoctorReport, verbose: boolean): string {
  const lines: string[] = [];
  for (const c of report.checks) {
    lines.push(`${c.status.padEnd(4)}  ${c.name}: ${c.detail}`);
    if (c.name === "RAM" && report.ramPlan && (verbose || report.ramPlanRefused)) {
      lines.push(...report.ramPlan.split("\n").map((l) => `      ${l}`));
    }
  }
  lines.push(report.verdict);
  return lines.join("\n");
}
