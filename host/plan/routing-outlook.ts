/**
 * routing-outlook.ts — what a plan's expert cache should expect from a trained model's routing,
 * quoted by the plan's table and the load line whenever the cache cannot hold every expert (issue
 * 38): a realistic row and a worst-case row, never only the random-weight model's figure.
 *
 * - Realistic: the hit rate of the default (adaptive) policy simulated on the calibrated trace of
 *   bench/routing-trace.ts (reuse and popularity set to the published figures for trained MoE
 *   models; its sources are in that file), tabulated below by resident fraction.
 * - Worst: uniform routing, where no policy hits more than the resident fraction.
 * The measured C cache came within 0.4-5 points below the simulation at the same size (pins and
 * read-ahead share its slots; bench/RESULTS.md "Cache policy in the C cache"), so both are "about".
 *
 * Owns: the table, its interpolation and the bytes a token then reads. Does not own the plan's
 * sizes (planner.ts), the trace generator or the simulation (bench/routing-trace.ts; the table is
 * checked against them by test/routing-outlook.test.ts).
 */

/**
 * Hit rate of the adaptive policy on the calibrated trace at 0, 5, 10, ..., 100 % of the extents
 * resident: `npx vite-node bench/routing-trace-cli.ts outlook` (1000 tokens of the full-size
 * Kimi-VL shape, seed 0, the first 64 tokens warm-up; 2026-12-06).
 */
export const CALIBRATED_HIT_BY_RESIDENT_5PCT: readonly number[] = [
  0, 0.229, 0.448, 0.55, 0.628, 0.7, 0.772, 0.814, 0.838, 0.858, 0.876, 0.893, 0.909, 0.924, 0.938, 0.95, 0.962, 0.973,
  0.983, 0.991, 0.998,
];

/** The calibrated table at a resident fraction in [0, 1], interpolated linearly; 1 when all fit. */
export function calibratedHitRate(resident: number): number {
  if (!(resident >= 0)) throw new RangeError(`resident fraction ${resident}`);
  if (resident >= 1) return 1;
  const x = resident * 20;
  const i = Math.floor(x);
  const a = CALIBRATED_HIT_BY_RESIDENT_5PCT[i]!;
  const b = CALIBRATED_HIT_BY_RESIDENT_5PCT[i + 1]!;
  return a + (b - a) * (x - i);
}

export interface RoutingOutlook {
  /** extents the cache holds, of all */
  readonly cached: number;
  readonly extents: number;
  /** expected hit rate and bytes read from disk a decoded token, realistic (calibrated trace) */
  readonly realisticHit: number;
  readonly realisticBytes: number;
  /** the same under uniform routing (hit rate = resident fraction) */
  readonly worstHit: number;
  readonly worstBytes: number;
}

/**
 * The outlook of a cache of `cached` extents of `extents`, a token taking `picksPerToken`
 * extents (MoE layers x top-k) of `extentBytes` each (padded, as read); null when all fit.
 */
export function routingOutlook(cached: number, extents: number, picksPerToken: number, extentBytes: number): RoutingOutlook | null {
  if (extents <= 0 || cached >= extents) return null;
  const resident = cached / extents;
  const realisticHit = calibratedHitRate(resident);
  const bytes = (hit: number): number => (1 - hit) * picksPerToken * extentBytes;
  return { cached, extents, realisticHit, realisticBytes: bytes(realisticHit), worstHit: resident, worstBytes: bytes(resident) };
}

const pct = (x: number): string => `${Math.round(100 * x)} %`;
const gb = (x: number): string => `${(x / 1e9).toFixed(2)} GB`;

/** One sentence for the load line and the plan's table; q4: the experts are 4-bit already;
 * textOnly: the extents the same budget would cache without the vision tower (null: not known). */
export function outlookText(o: RoutingOutlook, q4: boolean, textOnly: number | null = null): string {
  const remedies = ["more RAM"];
  if (!q4) remedies.push("4-bit experts (kvl pack --expert-dtype q4)");
  const textOnlyHit = textOnly === null ? 0 : calibratedHitRate(Math.min(textOnly, o.extents) / o.extents);
  // only when it would say a higher figure (natively the image lines are lent to the cache anyway)
  if (textOnly !== null && textOnly > o.cached && pct(textOnlyHit) !== pct(o.realisticHit)) {
    remedies.push(`--no-vision (no images: ${Math.min(textOnly, o.extents)} extents, about ${pct(textOnlyHit)} found)`);
  }
  return `experts: ${o.cached} of ${o.extents} extents in RAM (${pct(o.cached / o.extents)}); a trained model's routing should find ` +
    `about ${pct(o.realisticHit)} of its picks there and read about ${gb(o.realisticBytes)} a token from disk ` +
    `(worst case, uniform routing: ${pct(o.worstHit)}, ${gb(o.worstBytes)}); ${remedies.join(", or ")}` +
    (remedies.length > 1 ? ", read less" : " reads less");
}
