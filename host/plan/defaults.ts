/**
 * defaults.ts — the model options' defaults, declared once: what kvl chat, serve, bench and
 * doctor run with when an option is not given (cli/options.ts declares the options with them) and
 * what the planner takes when a PlanOptions field is absent (settings.ts).
 *
 * Owns: these values. Does not own: the options (cli/options.ts), their checks (settings.ts), the
 * auto act mode's table (act-mode.ts).
 */
import type { ExpertLookahead, KernelChoice } from "../core/core-api.js";
import type { ActDtypeChoice } from "./act-mode.js";
import type { RamChoice } from "./ram-budget.js";

/** --ram-mib: the RAM budget the plan holds every resident byte to; auto: what this machine can
 * give now, less headroom (ram-budget.ts). */
export const DEFAULT_RAM_MIB: RamChoice = "auto";
/** --max-context: tokens a session holds. */
export const DEFAULT_MAX_CONTEXT = 4096;
/** Prefill chunk in tokens, as kvl_session_options' default (split-engine.ts uses it where a session names none). */
export const DEFAULT_MAX_BATCH = 256;
/** --threads: compute threads per engine; 0 = every core. */
export const DEFAULT_THREADS = 0;
/** --kernels: the fastest set this CPU and backend have. */
export const DEFAULT_KERNELS: KernelChoice = "auto";
/** --act-dtype: the mode act-mode.ts's table gives for the backend and kernel set. */
export const DEFAULT_ACT_DTYPE: ActDtypeChoice = "auto";
/** --expert-lookahead: read the next layer's predicted experts ahead whenever the expert cache
 * cannot hold them all (kvl_core.h KVL_LOOKAHEAD_AUTO). */
export const DEFAULT_EXPERT_LOOKAHEAD: ExpertLookahead = "auto";
