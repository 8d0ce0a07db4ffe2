/**
 * yield-between-tests.ts — a vitest setup file (vitest.config.ts): one turn of the event loop
 * after every test.
 *
 * Why: vitest runs a file's tests one after another without passing through the event loop when
 * they are synchronous, and many of ours are (spawnSync of the CLI, the float64 references, core
 * calls). A run of them held a worker's loop for up to 61 s (measured with a 1 s interval timer,
 * 2026-12-06: test/chat.test.ts's tests before "Ctrl-C stops the reply"; 48 s in
 * test/engine.test.ts), and vitest's worker RPC answers only from the loop, with a fixed 60 s
 * timeout: CI reported "[vitest-worker]: Timeout calling onTaskUpdate" as an unhandled error
 * (vitest-dev/vitest#8164, #6479). setImmediate runs after the loop's poll phase, where the RPC's
 * messages are read, so each test's block is its own again (none is over 21 s).
 */
import { afterEach } from "vitest";

afterEach(() => new Promise<void>((resolve) => setImmediate(resolve)));
