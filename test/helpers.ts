/** Shared by the vitest files: which backends this machine can run, decided without the host's
 * own selection logic (so the tests of that logic do not assume it). */
import { existsSync } from "node:fs";

import { nativeAddonPath } from "../host/system/paths.js";

/** The addon is built by `npm ci` wherever a C compiler exists; CI always has one. */
export const nativeBuilt: boolean = existsSync(nativeAddonPath());
