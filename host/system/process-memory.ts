/**
 * process-memory.ts — this process's peak resident set, as the OS counts it.
 *
 * Linux: VmHWM of /proc/self/status (getrusage's ru_maxrss survives exec and would report a
 * larger parent, e.g. a test runner). Elsewhere: process.resourceUsage().maxRSS.
 */
import { readFileSync } from "node:fs";

export function peakRssBytes(): number | null {
  if (process.platform === "linux") {
    try {
      const line = readFileSync("/proc/self/status", "latin1").split("\n").find((l) => l.startsWith("VmHWM:"));
      if (line) return Number(line.split(/\s+/)[1]) * 1024;
    } catch {
      /* fall back */
    }
  }
  const kib = process.resourceUsage().maxRSS;
  return kib > 0 ? kib * 1024 : null;
}
