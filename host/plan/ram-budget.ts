/**
 * ram-budget.ts — the RAM budget a plan is held to: a number the user gave (--ram-mib N), or
 * `auto`, what this machine can give now (machine-memory.ts's figures) less headroom.
 *
 * The auto rule:
 *  - from the OS's available memory (Linux MemAvailable, which already counts the page cache
 *    that can be dropped; Windows ullAvailPhys) keep HEADROOM_FRACTION of physical memory, at
 *    least HEADROOM_MIN_MIB, free: the other programs of a laptop (a browser that opens tabs, an
 *    editor) grow after kvl has planned, and a budget of all that is free now would push them into
 *    swap. On 16 GiB with 9 GiB available that is 9 − 2.4 = 6.6 GiB for kvl;
 *  - inside a memory cgroup (Linux, v1 or v2), what its limit leaves once the group's other
 *    processes are counted, less CGROUP_MARGIN_FRACTION of the limit (at least
 *    CGROUP_MARGIN_MIN_MIB): the plan counts kvl's own resident bytes, the margin covers what it
 *    does not (the kernel's page tables, the allocators' slack; peak RSS measured 0.95-0.96 of a
 *    plan), and exceeding the limit is an OOM kill, not swap;
 *  - the smaller of the two; the planner then caps it at what the model can use at all.
 * Owns: the rule and its description. Does not own: the figures (machine-memory.ts) or the plan.
 */
import { type MachineMemory, readMachineMemory } from "../system/machine-memory.js";
import { UserError } from "../system/user-error.js";

const MIB = 2 ** 20;
export const HEADROOM_FRACTION = 0.15;
export const HEADROOM_MIN_MIB = 1536;
export const CGROUP_MARGIN_FRACTION = 1 / 16;
export const CGROUP_MARGIN_MIN_MIB = 256;

/** --ram-mib as given: a number of MiB or auto. */
export type RamChoice = number | "auto";

export interface RamBudget {
  readonly mib: number;
  readonly chosenBy: "auto" | "option";
  /** How auto came to it (null for an explicit number). */
  readonly detail: string | null;
}

/** --ram-mib's value: auto or a whole number of MiB (a bad one is one line naming the option). */
export function parseRamChoice(text: string, flag = "--ram-mib"): RamChoice {
  if (text === "auto") return "auto";
  const n = Number(text);
  if (!/^\s*\+?\d+\s*$/.test(text) || !Number.isSafeInteger(n) || n < 1) {
    throw new UserError(`${flag} ${JSON.stringify(text)}: use auto (what this machine can give now) or a whole number of MiB`);
  }
  return n;
}

const mib = (bytes: number): number => Math.floor(bytes / MIB);

/** The budget auto gives for these figures. */
export function autoRamBudget(mem: MachineMemory): RamBudget {
  const totalMib = mib(mem.totalBytes);
  const headroom = Math.max(HEADROOM_MIN_MIB, Math.round(HEADROOM_FRACTION * totalMib));
  const fromMachine = mib(mem.availableBytes) - headroom;
  const parts = [`${mem.availableSource} ${mib(mem.availableBytes)} MiB less ${headroom} MiB headroom ` +
    `(${Math.round(100 * HEADROOM_FRACTION)} % of ${totalMib} MiB, at least ${HEADROOM_MIN_MIB})`];
  let chosen = fromMachine;
  if (mem.cgroupLimitBytes !== null) {
    const limit = mib(mem.cgroupLimitBytes);
    const others = mem.cgroupUsageBytes === null ? 0 : Math.max(0, mib(mem.cgroupUsageBytes - mem.ownRssBytes));
    const margin = Math.max(CGROUP_MARGIN_MIN_MIB, Math.round(CGROUP_MARGIN_FRACTION * limit));
    const fromCgroup = limit - others - margin;
    parts.push(`cgroup limit ${limit} MiB less ${others} MiB used by others and ${margin} MiB margin`);
    if (fromCgroup < chosen) {
      chosen = fromCgroup;
      parts.reverse();
    }
  }
  const mibChosen = Math.max(chosen, 1);
  return { mib: mibChosen, chosenBy: "auto", detail: `auto: ${parts[0]}${parts[1] ? ` (smaller than ${parts[1]})` : ""}` };
}

/** The budget for a --ram-mib choice; auto reads the machine now unless figures are given. */
export function ramBudget(choice: RamChoice, memory?: MachineMemory): RamBudget {
  if (choice !== "auto") return { mib: choice, chosenBy: "option", detail: null };
  return autoRamBudget(memory ?? readMachineMemory());
}
