/**
 * machine-memory.ts — what memory this machine can give kvl now: the physical total and what the
 * operating system says is available, and on Linux the memory cgroup kvl runs in (its limit and
 * what the group already uses).
 *
 * Owns: reading those figures (Linux: /proc/meminfo MemAvailable and MemTotal, the cgroup v2
 * memory.max / memory.current of this process's group and its ancestors, or v1
 * memory.limit_in_bytes / memory.usage_in_bytes; elsewhere Node's os.freemem(), which libuv takes
 * from GlobalMemoryStatusEx's ullAvailPhys on Windows). Does not own: what budget follows from
 * them (plan/ram-budget.ts).
 */
import { readFileSync } from "node:fs";
import { freemem, totalmem } from "node:os";
import { join } from "node:path";

export interface MachineMemory {
  /** Physical memory, bytes. */
  readonly totalBytes: number;
  /** What the OS says can be had without swapping, bytes. */
  readonly availableBytes: number;
  /** Where availableBytes came from (for the load line). */
  readonly availableSource: string;
  /** The smallest memory limit of this process's cgroup and its ancestors, or null without one. */
  readonly cgroupLimitBytes: number | null;
  /** What that group already holds (every process in it, this one included) less the inactive
   * file cache the kernel reclaims first (the "working set", as container runtimes count it), or null. */
  readonly cgroupUsageBytes: number | null;
  /** This process's resident bytes when read (what the group's usage already counts of kvl). */
  readonly ownRssBytes: number;
}

/** A file's text, or null when it cannot be read. */
type ReadText = (path: string) => string | null;

const readText: ReadText = (path) => {
  try {
    return readFileSync(path, "utf8");
  } catch {
    return null;
  }
};

function meminfoBytes(text: string, key: string): number | null {
  const m = new RegExp(`^${key}:\\s+(\\d+) kB`, "m").exec(text);
  return m ? Number(m[1]) * 1024 : null;
}

/** A cgroup limit file's value in bytes; null for "max" or a v1 "unlimited" (2^63 rounded to pages). */
function limitBytes(text: string | null): number | null {
  if (text === null) return null;
  const t = text.trim();
  if (t === "max" || !/^\d+$/.test(t)) return null;
  const n = Number(t);
  return n >= 2 ** 60 ? null : n;
}

/** The memory cgroup of this process: its smallest limit up the hierarchy and the group's usage. */
export function readCgroupMemory(read: ReadText = readText, root = "/sys/fs/cgroup"): { limit: number | null; usage: number | null } {
  const self = read("/proc/self/cgroup");
  if (self === null) return { limit: null, usage: null };
  const lines = self.trim().split("\n");
  // v1: "N:memory:/path" (also "N:cpu,memory:/path"); v2: "0::/path"
  const v1 = lines.map((l) => l.split(":")).find((p) => p.length >= 3 && p[1]!.split(",").includes("memory"));
  const v2 = lines.map((l) => l.split(":")).find((p) => p.length >= 3 && p[0] === "0" && p[1] === "");
  const [base, path, limitFile, usageFile, inactiveKey] = v1
    ? [join(root, "memory"), v1.slice(2).join(":"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"]
    : v2
      ? [root, v2.slice(2).join(":"), "memory.max", "memory.current", "inactive_file"]
      : [null, null, null, null, null];
  if (base === null) return { limit: null, usage: null };
  // a limit on any ancestor binds this group too: the smallest one counts, and its group's usage
  let limit: number | null = null;
  let usage: number | null = null;
  const parts = path.split("/").filter(Boolean);
  for (let depth = parts.length; depth >= 0; depth--) {
    const dir = join(base, ...parts.slice(0, depth));
    const l = limitBytes(read(join(dir, limitFile)));
    if (l !== null && (limit === null || l < limit)) {
      limit = l;
      const u = read(join(dir, usageFile));
      const inactive = new RegExp(`^${inactiveKey} (\\d+)$`, "m").exec(read(join(dir, "memory.stat")) ?? "");
      usage = u !== null && /^\d+$/.test(u.trim()) ? Math.max(0, Number(u.trim()) - (inactive ? Number(inactive[1]) : 0)) : null;
    }
  }
  return { limit, usage };
}

/** The figures now. */
export function readMachineMemory(platform: NodeJS.Platform = process.platform, read: ReadText = readText): MachineMemory {
  const ownRssBytes = process.memoryUsage.rss();
  if (platform === "linux") {
    const meminfo = read("/proc/meminfo");
    const available = meminfo === null ? null : meminfoBytes(meminfo, "MemAvailable");
    const total = meminfo === null ? null : meminfoBytes(meminfo, "MemTotal");
    const cgroup = readCgroupMemory(read);
    return {
      totalBytes: total ?? totalmem(),
      availableBytes: available ?? freemem(),
      availableSource: available !== null ? "MemAvailable" : "free memory",
      cgroupLimitBytes: cgroup.limit,
      cgroupUsageBytes: cgroup.usage,
      ownRssBytes,
    };
  }
  return {
    totalBytes: totalmem(),
    availableBytes: freemem(),
    availableSource: platform === "win32" ? "available physical memory" : "free memory",
    cgroupLimitBytes: null,
    cgroupUsageBytes: null,
    ownRssBytes,
  };
}
