// no-fetch.cjs — preloaded (`node -r wasm-core/tests/no-fetch.cjs prog.js`) into the standalone
// programs emscripten 3.1.6 links (the C tests as WebAssembly in scripts/test, bench/kernels_ab.sh):
// their loader fetch()es its .wasm whenever fetch exists, which fails for a file path in Node;
// without fetch it reads the file. (`node --no-experimental-fetch` did the same on Node 20 and 22,
// but Node 24 and later reject that flag.) kvl itself passes the bytes (host/core/wasm-backend.ts).
delete globalThis.fetch;
