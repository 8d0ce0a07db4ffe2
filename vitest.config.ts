// vitest: the TypeScript tests under test/. Forks, not threads: each test file gets its own
// process, so WebAssembly instances and their pthread workers never share a process across files.
import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    pool: "forks",
    testTimeout: 120_000,
    hookTimeout: 120_000,
    // one event-loop turn after each test, so a run of synchronous tests never holds a worker's
    // RPC past vitest's fixed 60 s timeout (test/support/yield-between-tests.ts)
    setupFiles: ["test/support/yield-between-tests.ts"],
  },
});
