/** WebAssembly instances: each with its own fixed-size shared memory and thread pool, several in
 * one process (the split of a model over instances stands on this). */
import { describe, expect, it } from "vitest";

import { DEFAULT_INSTANCE_BYTES, MAX_INSTANCE_BYTES, WasmBackend } from "../host/core/wasm-backend.js";

describe("wasm instances", () => {
  it("get exactly the memory the host asks for, which cannot grow", async () => {
    const small = await WasmBackend.create();
    expect(small.memory?.buffer.byteLength).toBe(DEFAULT_INSTANCE_BYTES);
    expect(() => small.memory?.grow(1)).toThrow(RangeError);
    small.close();
  });

  it("three instances of 1 GiB side by side, each running the kernels, leaving the process's handlers alone", async () => {
    const instances: WasmBackend[] = [];
    const events = ["uncaughtException", "unhandledRejection", "exit"] as const;
    const before = events.map((e) => process.listenerCount(e));
    try {
      for (let i = 0; i < 3; i++) instances.push(await WasmBackend.create({ memoryBytes: 1 << 30 }));
      expect(new Set(instances.map((b) => b.memory)).size).toBe(3);
      // a library in the host's process: no process-wide handlers of its own
      expect(events.map((e) => process.listenerCount(e))).toEqual(before);
      for (const b of instances) expect(b.conformance("simd128").failed).toBe(0);
    } finally {
      for (const b of instances) b.close();
    }
  });

  it("the largest instance (4 GiB less one page) allocates and computes", async () => {
    const big = await WasmBackend.create({ memoryBytes: MAX_INSTANCE_BYTES });
    try {
      expect(big.memory?.buffer.byteLength).toBe(4 * 2 ** 30 - 65536);
      expect(big.conformance("simd128").failed).toBe(0);
    } finally {
      big.close();
    }
  });

  it("refuses sizes a wasm32 instance cannot have", async () => {
    await expect(WasmBackend.create({ memoryBytes: 4 * 2 ** 30 })).rejects.toThrow(/4 GiB - 64 KiB/);
    await expect(WasmBackend.create({ memoryBytes: 1000 })).rejects.toThrow(RangeError);
  });
});
