/**
 * env.ts — how kvl reads its KVL_* environment variables: every one goes through these readers,
 * so a value that is set but not valid is a one-line UserError naming the variable and its valid
 * values, whichever command reads it. An empty value counts as unset, except for a key
 * (envRequiredText).
 *
 * Owns: the readers (a choice, a positive whole number, free text). Does not own: which variable
 * means what (backend.ts: KVL_BACKEND, KVL_ADDON; plan/instances.ts: KVL_INSTANCES; packer/pack.ts:
 * KVL_PACK_FLUSH_ITEMS; cli/serve.ts: KVL_API_KEY) or the check of them all before a command
 * runs (cli/options.ts checkEnvironment).
 */
import { UserError } from "./user-error.js";

/** The variable's value, or undefined when it is unset or empty. */
function raw(name: string, env: NodeJS.ProcessEnv): string | undefined {
  const value = env[name];
  return value === undefined || value === "" ? undefined : value;
}

function invalid(name: string, value: string, expected: string): UserError {
  return new UserError(`${name}=${JSON.stringify(value)} is not valid: expected ${expected}; fix or unset the variable`);
}

/** A variable that names one of `choices`. */
export function envChoice<T extends string>(name: string, choices: readonly T[], env: NodeJS.ProcessEnv = process.env): T | undefined {
  const value = raw(name, env);
  if (value === undefined) return undefined;
  if (!(choices as readonly string[]).includes(value)) throw invalid(name, value, `one of ${choices.join(", ")}`);
  return value as T;
}

/** A variable that holds a whole number of at least 1. */
export function envPositiveInt(name: string, env: NodeJS.ProcessEnv = process.env): number | undefined {
  const value = raw(name, env);
  if (value === undefined) return undefined;
  const n = Number(value);
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n) || n < 1) throw invalid(name, value, "a whole number of at least 1");
  return n;
}

/** A variable that must not be empty when it is set (a key): `KVL_API_KEY=` is more likely a
 * key that did not make it into the variable than a wish for none, so it is refused, as an empty
 * option is. */
export function envRequiredText(name: string, env: NodeJS.ProcessEnv = process.env): string | undefined {
  if (env[name] === "") throw new UserError(`${name} is set but empty; set it to the key, or unset it (unset ${name}) to serve without one`);
  return raw(name, env);
}

/** A variable that holds any text (a path, a key). */
export function envString(name: string, env: NodeJS.ProcessEnv = process.env): string | undefined {
  return raw(name, env);
}
