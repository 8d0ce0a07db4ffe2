/* kvl_core.h — the one public header of the kvl native core.
 *
 * An engine owns what is shared and immutable after open: the packed stores, the trunk and
 * expert caches, the thread pool, the selected kernels. A session owns one KV timeline
 * (the compressed MLA latent history) and its scratch arena. Sessions of one engine must not
 * run concurrently (one worker drives the engine); an engine may hold several sessions.
 *
 * Every function returns a kvl_status; on failure a human-readable detail is available from
 * kvl_engine_last_error() (or the err buffer of kvl_engine_open). Nothing here calls exit().
 * Options structs: a zero-initialised struct means "defaults".
 */
#ifndef KVL_H
#define KVL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(KVL_BUILDING_DLL)
#define KVL_API __declspec(dllexport)
#elif defined(_WIN32)
#define KVL_API __declspec(dllimport)
#elif defined(__GNUC__)
#define KVL_API __attribute__((visibility("default")))
#else
#define KVL_API
#endif

#define KVL_ABI_VERSION 1

/* ---- The codes that cross into JavaScript, declared once ----
 * Each list is X(SYMBOL, value, "name") rows: the C enum below each list is generated from it,
 * and kvl_constants(KVL_CONST_*) returns it as a table of {name, value} (beside
 * kvl_struct_layout), which the hosts ask for instead of spelling the codes again
 * (test/boundary.test.ts fails where host/ disagrees with it). For statuses the name is the
 * status's text (kvl_strerror). */
#define KVL_STATUS_ROWS(X)                                                                         \
    X(OK, 0, "ok")                                                                                 \
    X(ERR_IO, 1, "I/O error")    /* a read/open failed (file missing, short read, disk error) */   \
    /* a pack file is corrupt, truncated or of another version */                                 \
    X(ERR_FORMAT, 2, "corrupt or unsupported pack file")                                           \
    /* the stores disagree with each other or with config/hparams */                              \
    X(ERR_CONFIG, 3, "pack configuration mismatch")                                                \
    X(ERR_NOMEM, 4, "out of memory") /* an allocation failed */                                    \
    /* a caller error: bad option, null pointer, token id out of range */                         \
    X(ERR_INVALID_ARG, 5, "invalid argument")                                                      \
    X(ERR_CONTEXT_FULL, 6, "context full") /* the session's max_context would be exceeded */       \
    /* kvl_session_cancel() interrupted the call; the session is rolled back to its position      \
       before the call */                                                                         \
    X(ERR_CANCELLED, 7, "cancelled")                                                               \
    X(ERR_UNSUPPORTED, 8, "unsupported") /* e.g. forced direct I/O that the filesystem refuses */  \
    X(ERR_INTERNAL, 9, "internal error")                                                           \
    /* a tensor's data, read from trunk.bin, experts.bin or vision.bin, does not match its CRC-32 \
       in the index: the file is damaged. kvl_engine_last_error() names the file and the tensor.  \
       Nothing computed from those bytes was returned; the session is rolled back and the engine  \
       stays usable (a later call that needs the same tensor reads and checks it again, and fails \
       again). */                                                                                 \
    X(ERR_CORRUPT, 10, "pack data does not match its CRC (corrupt file)")

/* One enum member per row. */
#define KVL_CONST_MEMBER(sym, value, name) KVL_##sym = value,

typedef enum kvl_status { KVL_STATUS_ROWS(KVL_CONST_MEMBER) } kvl_status;

KVL_API const char *kvl_strerror(kvl_status status);
KVL_API int kvl_abi_version(void);

typedef struct kvl_engine kvl_engine;
typedef struct kvl_session kvl_session;

/* kvl_engine_options.io_mode */
#define KVL_IO_ROWS(X) X(IO_AUTO, 0, "auto") X(IO_DIRECT, 1, "direct") X(IO_BUFFERED, 2, "buffered")
enum { KVL_IO_ROWS(KVL_CONST_MEMBER) };
/* kvl_engine_options.kernels: the levels; 4 in WebAssembly builds only */
#define KVL_KERNEL_LEVEL_ROWS(X)                                                                   \
    X(KERNELS_AUTO, 0, "auto") X(KERNELS_SCALAR, 1, "scalar") X(KERNELS_AVX2, 2, "avx2")           \
    X(KERNELS_AVX512, 3, "avx512") X(KERNELS_SIMD128, 4, "simd128")
enum { KVL_KERNEL_LEVEL_ROWS(KVL_CONST_MEMBER) };
/* Every kernel set any build has (kvl_engine_info.kernels, kvl_kernels_conformance), with its
 * level: a table only (KVL_CONST_KERNEL_SETS), no enum. A build has some of them
 * (kvl_kernels_compiled_names, wasm-core/src/kernels). */
#define KVL_KERNEL_SET_ROWS(X)                                                                     \
    X(SET_SCALAR, 1, "scalar") X(SET_AVX2, 2, "avx2") X(SET_AVX512, 3, "avx512")                   \
    X(SET_AVX512_BF16, 3, "avx512-bf16") X(SET_SIMD128, 4, "simd128")                              \
    X(SET_SIMD128_RELAXED, 4, "simd128-relaxed")
/* The KV cache's rows. I16 goes with act_dtype I16X1 and I8 (and only with them; DEFAULT picks
 * it there): each row [latent | roped key] quantised to int16 once, as it is stored, with one
 * FP32 scale per row, plus the latents transposed in tiles of 128 positions, so that attention's
 * two products run on integers for prefill and decode alike (model.c attn_i16). 2*(lat+r) + 4 +
 * 2*lat bytes per position and layer (FP32: 4*(lat+r)). */
#define KVL_KV_ROWS(X) X(KV_DEFAULT, 0, "default") X(KV_F32, 1, "f32") X(KV_BF16, 2, "bf16") X(KV_I16, 3, "i16")
enum { KVL_KV_ROWS(KVL_CONST_MEMBER) };
/* Inputs of the text decoder's Linear layers (attention projections, MLPs, experts, lm_head;
 * not the router, not the attention itself). DEFAULT = F32: exact, within 1e-3 of the FP32
 * reference. BF16 (opt-in) rounds them to BF16 as the checkpoint's own BF16 inference does
 * (products and sums stay FP32) and runs on BF16 dot products where the CPU has them
 * (AVX512_BF16; elsewhere it is slower than F32): about 2x the prefill rate. Its logits move by
 * BF16 rounding, not by 1e-3: an activation that lies near a rounding midpoint can round either
 * way under FP32 summation-order differences (test/engine-session.test.ts holds BF16 to that).
 * I16X1 (opt-in; the fastest mode natively and on WebAssembly, where SIMD128 widens weights to
 * FP32 slowly but runs integer dot products at native speed) quantises each input vector of those
 * same Linear layers once per product to integers (kernels.h quantize_i16_act) and runs integer
 * products: Q8 and Q4 weights (the experts, Q4 in a --expert-dtype q4 pack; the trunk of a
 * --trunk-dtype q8 pack) with 16-bit inputs and an FP32 scale per 64 columns, resident BF16 trunk weights (every one but kv_b_proj, which the
 * attention uses in FP32) and lm_head converted at open to int16 rows with one FP32 scale per row
 * (kvl_quantize_rows_i16: the same bytes plus 4 per row) with 15-bit inputs and one scale per
 * vector. Trunk tensors streamed per token (a trunk cache smaller than the trunk) keep the exact
 * FP32 product. The vision tower's Linear layers run in BF16 on AMX where it runs (every mode
 * but F32; README "Numerics"), else FP32. It keeps the KV cache as KVL_KV_I16, so that
 * attention's products run on integers too: logits move by 1.4-4e-3 on the test models, which
 * its own test bound allows for (test/engine.test.ts intModeBound). I8 is I16X1 with the routed
 * experts' inputs quantised to 8 bits (|x| <= 127) per 64 columns, as llama.cpp quantises
 * activations (a Q8 trunk keeps 16 bits: 8 moved the test models' logits 35x as far, model.c
 * mm_add_expert): decoding runs them on 8-bit dot products (AVX2 VPMADDUBSW, AVX-512 VNNI
 * VPDPBUSD; SIMD128 has none and runs the int16 product on the same integers), at a coarser
 * rounding that its test bound measures.
 * 3 is reserved: it was I16, two integer terms per input, which was slower than I16X1 on every
 * backend and kernel set and less exact than F32; kvl_engine_open refuses it with
 * KVL_ERR_INVALID_ARG and a message naming I16X1 and F32. */
#define KVL_ACT_ROWS(X)                                                                            \
    X(ACT_DEFAULT, 0, "default") X(ACT_F32, 1, "f32") X(ACT_BF16, 2, "bf16")                       \
    X(ACT_I16_REMOVED, 3, "i16") X(ACT_I16X1, 4, "i16x1") X(ACT_I8, 5, "i8")
enum { KVL_ACT_ROWS(KVL_CONST_MEMBER) };
/* kvl_engine_options.expert_lookahead: reading the next layer's predicted experts ahead while a
 * layer computes (model.c predict_next). */
#define KVL_LOOKAHEAD_ROWS(X) X(LOOKAHEAD_AUTO, 0, "auto") X(LOOKAHEAD_OFF, 1, "off")
enum { KVL_LOOKAHEAD_ROWS(KVL_CONST_MEMBER) };
/* Pack records' dtypes: the dtype field of a .idx record (docs/FORMAT.md "Records"). BF16 and F32
 * are dense; Q8_EXPERT one routed expert's extent, row-wise Q8; Q8_ROWS one row-wise Q8 matrix (a
 * trunk Linear weight; format version 2); Q4_EXPERT one routed expert's extent in groups of 32
 * with BF16 scales (kvl pack --expert-dtype q4; format version 3). The name is FORMAT.md's. */
#define KVL_DTYPE_ROWS(X)                                                                          \
    X(DTYPE_BF16, 1, "BF16") X(DTYPE_F32, 2, "F32") X(DTYPE_Q8_EXPERT, 3, "Q8_EXPERT")             \
    X(DTYPE_Q8_ROWS, 4, "Q8_ROWS") X(DTYPE_Q4_EXPERT, 5, "Q4_EXPERT")
enum { KVL_DTYPE_ROWS(KVL_CONST_MEMBER) };
/* kvl_engine_options.expert_cache_policy: which resident extent the expert cache evicts
 * (expert_cache.c pick_victim). DEFAULT is ADAPTIVE. FREQUENCY: fewest recent acquisitions, then
 * least recently used; LRU: least recently used; ADAPTIVE: keeps key-only shadow copies of both
 * (the same capacity, no data) and evicts as the one that hit more over the recent past (set
 * dueling). Reads only: logits and tokens are the same under every policy. */
#define KVL_CACHE_POLICY_ROWS(X)                                                                   \
    X(CACHE_POLICY_DEFAULT, 0, "default") X(CACHE_POLICY_ADAPTIVE, 1, "adaptive")                  \
    X(CACHE_POLICY_FREQUENCY, 2, "frequency") X(CACHE_POLICY_LRU, 3, "lru")
enum { KVL_CACHE_POLICY_ROWS(KVL_CONST_MEMBER) };

/* ---- The structs that cross into JavaScript, described once ----
 * kvl_engine_options, kvl_engine_info and kvl_stats are each declared by one X-macro list below,
 * which also generates the table kvl_struct_layout() returns. The native addon (native/addon.c)
 * and the WebAssembly host (host/core/wasm-engine.ts) convert these structs to and from JS objects
 * from that table alone; neither spells out a field. Each row is
 *     X(kind, name, offset, bytes)
 * kind: a kvl_field_kind without its KVL_FIELD_ prefix (it gives the C type); offset and bytes:
 * where the member lies and its size, the same in every build (x86-64 Linux and Windows, wasm32).
 * layout.c checks every row against the compiler's offsetof/sizeof, and the struct's size against
 * the end of its last row, at compile time: a layout change is a deliberate edit of these numbers.
 * The JS property of a field is its C name in camelCase (vocab_size -> vocabSize; no exceptions).
 * To add a field: one row here (at the end of its struct, so that no offset moves) and its property
 * in the TypeScript type (EngineOptions, EngineInfo or EngineStats, host/core/core-api.ts);
 * test/boundary.test.ts fails until both are there. */
typedef enum kvl_field_kind {
    KVL_FIELD_I32 = 1,    /* int32_t (JS: a number) */
    KVL_FIELD_BOOL32 = 2, /* int32_t, 0 = false, 1 = true (JS: a boolean; also a number on input) */
    KVL_FIELD_I64 = 3,    /* int64_t (JS: a number, exact within +-2^53) */
    KVL_FIELD_U64 = 4,    /* uint64_t (JS: a number, exact below 2^53) */
    KVL_FIELD_CHARS = 5   /* char[bytes]: NUL-terminated UTF-8, NUL-padded (JS: a string) */
} kvl_field_kind;

/* The C type and array suffix of each kind: KVL_FIELD_MEMBER declares one row as a member. */
#define KVL_FIELD_CTYPE_I32 int32_t
#define KVL_FIELD_CTYPE_BOOL32 int32_t
#define KVL_FIELD_CTYPE_I64 int64_t
#define KVL_FIELD_CTYPE_U64 uint64_t
#define KVL_FIELD_CTYPE_CHARS char
#define KVL_FIELD_DIM_I32(bytes)
#define KVL_FIELD_DIM_BOOL32(bytes)
#define KVL_FIELD_DIM_I64(bytes)
#define KVL_FIELD_DIM_U64(bytes)
#define KVL_FIELD_DIM_CHARS(bytes) [bytes]
#define KVL_FIELD_MEMBER(kind, name, offset, bytes) \
    KVL_FIELD_CTYPE_##kind name KVL_FIELD_DIM_##kind(bytes);

#define KVL_ENGINE_OPTIONS_FIELDS(X)                                                              \
    X(I32, n_threads, 0, 4)           /* 0 = every core */                                        \
    X(U64, expert_cache_bytes, 8, 8)  /* 0 = 512 MiB; rounded down to whole extents, minimum one  \
                                         layer's top-k extents (error below that) */              \
    X(I64, trunk_cache_bytes, 16, 8)  /* -1 = stream every non-global trunk tensor, 0 = keep them \
                                         all resident, >0 = byte budget for resident non-global   \
                                         trunk tensors (a prefix in forward order; the rest       \
                                         stream). The host planner (host/plan/planner.ts) always  \
                                         passes its planned figure. */                            \
    X(I32, io_mode, 24, 4)            /* KVL_IO_*: AUTO tries direct I/O and falls back to        \
                                         buffered, reporting which one it got in                  \
                                         kvl_engine_info */                                       \
    X(I32, kernels, 28, 4)            /* KVL_KERNELS_*: AUTO = best the CPU supports */           \
    X(I32, kv_dtype, 32, 4)           /* KVL_KV_*; DEFAULT = F32, or I16 with act_dtype I16X1 or  \
                                         I8 (BF16 moved tiny-model logits by 4e-2, over the 1e-3  \
                                         correctness tolerance) */                                \
    X(BOOL32, load_vision, 36, 4)     /* 1 = open vision.idx/vision.bin too */                    \
    X(I32, act_dtype, 40, 4)          /* KVL_ACT_* */                                             \
    /* Decoder layers this engine runs: [layer_begin, layer_end); 0 and 0 = every layer. The host \
     * splits a model over several WebAssembly instances (each memory at most 4 GiB) this way:    \
     * each engine holds the weights, caches and KV of its own layers only, and sessions pass     \
     * hidden states along (kvl_session_forward). */                                              \
    X(I32, layer_begin, 44, 4)                                                                    \
    X(I32, layer_end, 48, 4)                                                                      \
    /* KVL_LOOKAHEAD_*: AUTO reads the next layer's predicted experts while a layer computes     \
     * (its router applied to the current hidden state) whenever the expert cache cannot hold     \
     * every extent of the engine's layers; OFF never does (for A/B runs). Reads only: logits     \
     * and tokens are the same either way. */                                                    \
    X(I32, expert_lookahead, 52, 4)                                                               \
    X(I32, expert_cache_policy, 56, 4) /* KVL_CACHE_POLICY_* */

typedef struct kvl_engine_options {
    KVL_ENGINE_OPTIONS_FIELDS(KVL_FIELD_MEMBER)
} kvl_engine_options;

#define KVL_ENGINE_INFO_FIELDS(X)                                                                 \
    /* dimensions read from the pack */                                                           \
    X(I32, vocab_size, 0, 4)                                                                      \
    X(I32, hidden_size, 4, 4)                                                                     \
    X(I32, n_layers, 8, 4)                                                                        \
    X(I32, n_heads, 12, 4)                                                                        \
    X(I32, kv_lora_rank, 16, 4)                                                                   \
    X(I32, qk_rope_head_dim, 20, 4)                                                               \
    X(I32, n_routed_experts, 24, 4)                                                               \
    X(I32, num_experts_per_tok, 28, 4)                                                            \
    X(I32, max_position_embeddings, 32, 4)                                                        \
    X(I32, vision_hidden_size, 36, 4)                                                             \
    X(I32, vision_merge_h, 40, 4)                                                                 \
    X(I32, vision_merge_w, 44, 4)                                                                 \
    X(I32, vision_patch_size, 48, 4)                                                              \
    X(I32, media_placeholder_token_id, 52, 4)                                                     \
    /* what the engine chose */                                                                   \
    X(I32, n_threads, 56, 4)                                                                      \
    X(BOOL32, trunk_direct_io, 60, 4)      /* 1 direct, 0 buffered */                             \
    X(BOOL32, expert_direct_io, 64, 4)                                                            \
    X(BOOL32, vision_direct_io, 68, 4)                                                            \
    X(CHARS, kernels, 72, 16)              /* "scalar" | "simd128" | "avx2" | "avx512" |          \
                                              "avx512-bf16" */                                    \
    X(CHARS, kv_dtype, 88, 8)              /* "f32" | "bf16" | "i16" */                           \
    /* resident bytes the engine allocated at open (for the RAM planner's check) */               \
    X(U64, global_bytes, 96, 8)            /* lm_head, final norm, small tensors kept resident */ \
    X(U64, trunk_cache_bytes, 104, 8)      /* resident non-global trunk tensors (with act_dtype   \
                                              i16x1 or i8: their int16 rows and per-row scales,   \
                                              engine.c load_text) */                              \
    X(U64, expert_cache_bytes, 112, 8)     /* the expert cache slab */                            \
    X(U64, engine_workspace_bytes, 120, 8)                                                        \
    X(U64, expert_extent_bytes, 128, 8)    /* one (layer, expert) extent, padded to 4 KiB */      \
    X(CHARS, act_dtype, 136, 8)            /* "f32" | "bf16" | "i16x1" | "i8": inputs of the      \
                                              Linear layers */                                    \
    X(I32, layer_begin, 144, 4)            /* the decoder layers this engine runs */              \
    X(I32, layer_end, 148, 4)                                                                     \
    X(BOOL32, expert_lookahead, 152, 4)    /* 1: the next layer's predicted experts are read      \
                                              ahead (expert_lookahead AUTO and a cache smaller    \
                                              than every extent of the engine's layers) */        \
    X(CHARS, expert_cache_policy, 156, 12) /* "adaptive" | "frequency" | "lru" */

typedef struct kvl_engine_info {
    KVL_ENGINE_INFO_FIELDS(KVL_FIELD_MEMBER)
} kvl_engine_info;

#define KVL_STATS_FIELDS(X)                                                                       \
    X(U64, expert_hits, 0, 8)                                                                     \
    X(U64, expert_misses, 8, 8)                                                                   \
    X(U64, expert_bytes_read, 16, 8)                                                              \
    X(U64, expert_stall_ns, 24, 8)     /* time compute waited for expert reads */                 \
    X(U64, trunk_hits, 32, 8)                                                                     \
    X(U64, trunk_misses, 40, 8)                                                                   \
    X(U64, trunk_bytes_read, 48, 8)                                                               \
    X(U64, trunk_stall_ns, 56, 8)                                                                 \
    X(U64, vision_bytes_read, 64, 8)                                                              \
    X(U64, tokens_prefilled, 72, 8)                                                               \
    X(U64, tokens_decoded, 80, 8)                                                                 \
    /* CRC-32 checks of pack data as it is first read (docs/FORMAT.md "Checks at run time"):     \
     * time spent computing them — summed over the expert readers and the trunk streamer that     \
     * made them, plus the wall time of the pool runs that made those at open and for vision —    \
     * and the bytes checked. */                                                                  \
    X(U64, verify_ns, 88, 8)                                                                      \
    X(U64, verify_bytes, 96, 8)                                                                   \
    /* The next layer's predicted experts read ahead (expert_lookahead): reads queued; of them,   \
     * acquired before being evicted (these count as misses too), read and evicted or failed     \
     * unused, cancelled before any byte was read, and resident or in flight, not yet used, at   \
     * the time of the call: issued == used + wasted + cancelled + pending. */                   \
    X(U64, expert_lookahead_issued, 104, 8)                                                       \
    X(U64, expert_lookahead_used, 112, 8)                                                         \
    X(U64, expert_lookahead_wasted, 120, 8)                                                       \
    X(U64, expert_lookahead_cancelled, 128, 8)                                                    \
    X(U64, expert_lookahead_pending, 136, 8)

typedef struct kvl_stats {
    KVL_STATS_FIELDS(KVL_FIELD_MEMBER)
} kvl_stats;

/* Which struct kvl_struct_layout describes. */
enum { KVL_STRUCT_ENGINE_OPTIONS = 1, KVL_STRUCT_ENGINE_INFO = 2, KVL_STRUCT_STATS = 3 };

/* One row of a layout table: a member of a KVL_STRUCT_* struct. In wasm32 (as
 * host/core/wasm-engine.ts reads it): name at 0 (a 4-byte address), offset at 4, bytes at 8,
 * kind at 12; 16 bytes in all (layout.c checks this). */
typedef struct kvl_field_desc {
    const char *name;              /* the C member name */
    uint32_t offset;               /* bytes from the start of the struct */
    uint32_t bytes;                /* sizeof the member */
    int32_t kind;                  /* KVL_FIELD_* */
} kvl_field_desc;

/* The layout of one KVL_STRUCT_* struct: its members in declaration order, as a static table
 * that lives as long as the process (never freed). *count = the number of members and
 * *struct_bytes = sizeof the struct (either pointer may be NULL). An unknown `which` returns NULL
 * with 0 in both. */
KVL_API const kvl_field_desc *kvl_struct_layout(int which, int *count, size_t *struct_bytes);

/* Which list of codes kvl_constants returns (the *_ROWS lists above). */
enum {
    KVL_CONST_STATUS = 1,        /* KVL_STATUS_ROWS: name = the status's text */
    KVL_CONST_KERNEL_LEVELS = 2, /* KVL_KERNEL_LEVEL_ROWS */
    KVL_CONST_KERNEL_SETS = 3,   /* KVL_KERNEL_SET_ROWS: value = the set's level */
    KVL_CONST_ACT = 4,           /* KVL_ACT_ROWS */
    KVL_CONST_IO = 5,            /* KVL_IO_ROWS */
    KVL_CONST_KV = 6,            /* KVL_KV_ROWS */
    KVL_CONST_LOOKAHEAD = 7,     /* KVL_LOOKAHEAD_ROWS */
    KVL_CONST_LOGITS = 8,        /* KVL_LOGITS_ROWS */
    KVL_CONST_ROUTING = 9,       /* KVL_ROUTING_ROWS */
    KVL_CONST_CACHE_POLICY = 10, /* KVL_CACHE_POLICY_ROWS */
    KVL_CONST_DTYPE = 11         /* KVL_DTYPE_ROWS: name = FORMAT.md's */
};

/* One row of a constants table. In wasm32: name at 0 (a 4-byte address), value at 4; 8 bytes in
 * all (layout.c checks this). */
typedef struct kvl_const_desc {
    const char *name;
    int32_t value;
} kvl_const_desc;

/* The rows of one KVL_CONST_* list in declaration order, as a static table that lives as long as
 * the process; *count = the number of rows (may be NULL). An unknown `which` returns NULL with 0. */
KVL_API const kvl_const_desc *kvl_constants(int which, int *count);

KVL_API kvl_status kvl_engine_open(const char *pack_dir, const kvl_engine_options *options,
                                   kvl_engine **out_engine, char *err, size_t err_len);
KVL_API void kvl_engine_free(kvl_engine *engine);
KVL_API kvl_status kvl_engine_get_info(const kvl_engine *engine, kvl_engine_info *out);
KVL_API kvl_status kvl_engine_get_stats(const kvl_engine *engine, kvl_stats *out);
KVL_API void kvl_engine_reset_stats(kvl_engine *engine);
/* The expert cache's slots in use, within the extents it was opened with (expert_cache_bytes /
 * expert_extent_bytes): `slots` clamped to [one layer's top-k, that count]. Fewer: the extents of
 * the slots set aside are dropped (reads in flight finish first) and their memory given back to
 * the OS natively (a WebAssembly memory never shrinks); more: those slots fill again as reads
 * claim them, after the C heap's free memory is given back (glibc keeps it otherwise). The RAM
 * plan lends its image lines to the cache this way while no image is in flight. Tokens never
 * depend on it: only which reads hit. Not while a call runs on the engine (KVL_ERR_INVALID_ARG,
 * nothing changed). *active (may be NULL): the slots in use after the call; an engine without
 * an expert cache has 0 and returns KVL_OK. */
KVL_API kvl_status kvl_engine_set_expert_slots(kvl_engine *engine, int32_t slots, int32_t *active);
/* detail message of the last failed call on this engine or any of its sessions */
KVL_API const char *kvl_engine_last_error(const kvl_engine *engine);

typedef struct kvl_session_options {
    int32_t max_context;           /* tokens; 0 = 4096; must be <= max_position_embeddings */
    int32_t max_batch;             /* prefill chunk size in tokens; 0 = 256 */
} kvl_session_options;

/* Bytes a session with these options will allocate (KV + arena), for the RAM planner. */
KVL_API kvl_status kvl_session_bytes(const kvl_engine *engine, const kvl_session_options *options,
                                     uint64_t *out_bytes);
KVL_API kvl_status kvl_session_new(kvl_engine *engine, const kvl_session_options *options,
                                   kvl_session **out_session);
KVL_API void kvl_session_free(kvl_session *session);
KVL_API int32_t kvl_session_position(const kvl_session *session);
/* Drop everything after the first n_tokens positions (0 <= n_tokens <= position). */
KVL_API kvl_status kvl_session_truncate(kvl_session *session, int32_t n_tokens);

#define KVL_LOGITS_ROWS(X) X(LOGITS_NONE, 0, "none") X(LOGITS_LAST, 1, "last") X(LOGITS_ALL, 2, "all")
enum { KVL_LOGITS_ROWS(KVL_CONST_MEMBER) };

/* Append n_tokens tokens to the session. Each token equal to media_placeholder_token_id takes,
 * in order, the next row of media_embeds (n_media rows x hidden_size floats, already rounded to
 * BF16 by the caller if it wants the official boundary); their count must equal n_media.
 * logits: NULL with KVL_LOGITS_NONE; vocab floats for LAST; n_tokens*vocab floats for ALL. */
KVL_API kvl_status kvl_session_prefill(kvl_session *session, const int32_t *tokens,
                                       int32_t n_tokens, const float *media_embeds,
                                       int32_t n_media, int32_t logits_mode, float *logits);
/* Append one token and return its logits (vocab floats). No allocation. */
KVL_API kvl_status kvl_session_step(kvl_session *session, int32_t token, float *logits);
/* The general form of prefill/step, for engines that run a range of layers. The first range
 * (layer_begin 0) takes tokens (and media rows, as prefill); a later range takes hidden_in, the
 * previous range's hidden_out (n_tokens x hidden_size floats: the residual stream entering
 * layer_begin), and tokens NULL. A range that ends before the last layer writes hidden_out and
 * takes logits_mode NONE; the last range computes logits as prefill does (hidden_out NULL).
 * prefill and step are this call on an engine of every layer. decode != 0 counts the tokens as
 * decoded rather than prefilled in kvl_stats. On failure the session is rolled back. */
KVL_API kvl_status kvl_session_forward(kvl_session *session, const int32_t *tokens,
                                       const float *hidden_in, int32_t n_tokens,
                                       const float *media_embeds, int32_t n_media,
                                       float *hidden_out, int32_t logits_mode, float *logits,
                                       int32_t decode);
/* Ask a running prefill/step (from another thread) to stop; it returns KVL_ERR_CANCELLED. */
KVL_API void kvl_session_cancel(kvl_session *session);
/* Cancellation by a thread that cannot call into the core while it runs (a Node main thread
 * while a worker drives the engine; it shares only memory with it): prefill/step/forward also
 * stop with KVL_ERR_CANCELLED when *flag != 0, checked where kvl_session_cancel's flag is
 * (before each layer). The core only reads the flag; the caller owns it, clears it before a
 * call, and keeps it alive while it is watched. NULL stops watching. */
KVL_API void kvl_session_watch_cancel(kvl_session *session, const volatile int32_t *flag);

/* Routing override, for measurement only (`kvl bench --routing`; chat and serve never call it).
 * The random-weight test models route nothing like a trained model, so the expert cache, read
 * ahead and disk are measured under other routings: each MoE layer's router runs as usual, then
 * its choice of experts is replaced; everything else (shared experts, the routed experts'
 * products from the chosen extents, attention) is computed as usual, so the tokens that follow
 * are not the model's.
 *   KVL_ROUTING_MODEL: the router's own choice (the default; a session starts so).
 *   KVL_ROUTING_UNIFORM: each token and MoE layer takes topk distinct experts uniformly at random,
 *     a pure function of (seed, the token's position, layer), so every range of a split draws
 *     the same as one engine would; weights are the router's sigmoid scores of those experts,
 *     normalised and scaled as the router's.
 *   KVL_ROUTING_GIVEN: token i of a forward (prefill or step) takes row i of ids/weights (ids in
 *     [0, n_routed), distinct within a row, else the forward fails with KVL_ERR_INVALID_ARG and
 *     is rolled back). A weight row whose first value is NaN takes the router's scores of those
 *     ids as UNIFORM does.
 * ids / weights: caller-owned rows [capacity][n_layers][topk] (int32 / float), indexed by the
 * absolute layer (only this engine's MoE layers are read or written; the caller keeps them
 * alive until the next call or kvl_session_free). Under MODEL and UNIFORM, non-NULL rows receive
 * the routing each forward took (row i = its i-th token), which GIVEN replays bit for bit.
 * A forward of more than capacity tokens then fails with KVL_ERR_INVALID_ARG. Both NULL with
 * capacity 0: nothing is recorded (GIVEN needs them). */
#define KVL_ROUTING_ROWS(X) X(ROUTING_MODEL, 0, "model") X(ROUTING_UNIFORM, 1, "uniform") X(ROUTING_GIVEN, 2, "given")
enum { KVL_ROUTING_ROWS(KVL_CONST_MEMBER) };
KVL_API kvl_status kvl_session_set_routing(kvl_session *session, int32_t mode, uint32_t seed,
                                           int32_t *ids, float *weights, int32_t capacity);

typedef struct kvl_sampler {
    float temperature;             /* <= 0 means greedy */
    int32_t top_k;                 /* 0 = off */
    float top_p;                   /* 0 or >= 1 = off */
    uint64_t rng_state;            /* advanced by each call; seed it with kvl_sampler_seed */
} kvl_sampler;

KVL_API void kvl_sampler_seed(kvl_sampler *sampler, uint64_t seed);
/* Picks a token id from logits (modified in place as scratch). workspace: vocab int32s. */
KVL_API int32_t kvl_sample(kvl_sampler *sampler, float *logits, int32_t vocab, int32_t *workspace);

/* Vision: encode n_images images to text-space embeddings.
 * pixel_values: sum(gh*gw) patches x 3 x patch x patch floats (spec §6 order);
 * grids: n_images x 2 int32 (gh, gw), both multiples of the merge kernel;
 * out: sum(gh*gw/(merge_h*merge_w)) rows x hidden_size floats (FP32, not rounded).
 * Working memory is allocated for the call and released before it returns. */
KVL_API kvl_status kvl_vision_bytes(const kvl_engine *engine, const int32_t *grids,
                                    int32_t n_images, uint64_t *out_bytes);
KVL_API kvl_status kvl_vision_encode(kvl_engine *engine, const float *pixel_values,
                                     const int32_t *grids, int32_t n_images, float *out);

/* Packing: the arithmetic of `kvl pack` and `kvl synth`, in the core so that what the packer
 * writes is bit-identical on every backend and is exactly what the engine reads.
 *
 * kvl_pack_expert writes one Q8_EXPERT extent (docs/FORMAT.md) from the BF16 bits of gate_proj
 * [I, H], up_proj [I, H] and down_proj [H, I]: row-wise symmetric Q8, scale = max|row| / 127
 * (FP32), q = round-half-even(w / scale) clipped to +-127 (0 for an all-zero row), zero padding
 * between sub-blocks. out_bytes must equal kvl_expert_extent_bytes(I, H). A NaN or infinite
 * weight is KVL_ERR_FORMAT (the checkpoint is corrupt). */
KVL_API size_t kvl_expert_extent_bytes(size_t intermediate, size_t hidden);
KVL_API kvl_status kvl_pack_expert(const uint16_t *gate, const uint16_t *up, const uint16_t *down,
                                   size_t intermediate, size_t hidden, uint8_t *out,
                                   size_t out_bytes);
/* kvl_pack_q8_rows writes one Q8_ROWS record (docs/FORMAT.md, `kvl pack --trunk-dtype q8`)
 * from the BF16 bits of a [rows, cols] matrix, with kvl_pack_expert's row quantisation: int8
 * rows at 0, f32 row scales at align64(rows * cols); out_bytes must equal
 * align64(rows * cols) + 4 * rows. A NaN or infinite weight is KVL_ERR_FORMAT. */
KVL_API kvl_status kvl_pack_q8_rows(const uint16_t *w, size_t rows, size_t cols, uint8_t *out,
                                    size_t out_bytes);

/* kvl_pack_expert_q4 writes one Q4_EXPERT extent (docs/FORMAT.md, `kvl pack --expert-dtype q4`)
 * from the same BF16 inputs: per row and group of 32 columns, m = the weight of largest |w| (the
 * first in column order on a tie), scale d = BF16(m / -8) (FP32 division, nearest-even), q =
 * clamp(rint(w / d), -8, 7) (0 when d is 0), stored as q + 8 in nibbles; BF16 scale bits per
 * group; zero padding between sub-blocks. I and H must be nonzero multiples of 32 and out_bytes
 * must equal kvl_expert_q4_extent_bytes(I, H), else KVL_ERR_INVALID_ARG; a NaN or infinite
 * weight is KVL_ERR_FORMAT. kvl_expert_q4_extent_bytes is 0 when I or H is not such a multiple. */
KVL_API size_t kvl_expert_q4_extent_bytes(size_t intermediate, size_t hidden);
KVL_API kvl_status kvl_pack_expert_q4(const uint16_t *gate, const uint16_t *up, const uint16_t *down,
                                      size_t intermediate, size_t hidden, uint8_t *out,
                                      size_t out_bytes);

/* Synthetic weights: numpy's PCG64 generator (128-bit LCG, XSL-RR output), seeded from the four
 * 64-bit words numpy's SeedSequence gives (the host derives them), so a synthesized checkpoint
 * is the same bytes whoever made it. kvl_synth_uniform draws ceil(count / 2) 64-bit outputs
 * (low 32 bits first) and maps each 32-bit value u to
 *   v = (float(1 + (u >> 9) * 2^-23) - 1.5) * (2 * half_width) (+ center when center != 0)
 * in FP32; bf16 != 0 stores round-to-nearest-even BF16 bits (uint16), else FP32. For a stream cut
 * into several calls, every call but the last must have an even count. */
typedef struct kvl_pcg64 {
    uint64_t state_hi, state_lo, inc_hi, inc_lo;
} kvl_pcg64;
KVL_API void kvl_pcg64_seed(kvl_pcg64 *rng, const uint64_t seed_words[4]);
KVL_API void kvl_synth_uniform(kvl_pcg64 *rng, size_t count, float center, float half_width,
                               int bf16, void *out);

/* Kernel sets: what `kvl doctor` reports and the conformance tests run, on every backend.
 * A kernel set is one dispatch table ("scalar", "simd128", "avx2", "avx512", "avx512-bf16").
 * kvl_kernel_set_count/name list the sets compiled into this build (index order);
 * kvl_kernel_set_supported says whether this CPU and OS can run one; kvl_kernel_set_default
 * names the set KVL_KERNELS_AUTO picks here (the KVL_KERNELS environment variable can lower it). */
KVL_API int kvl_kernel_set_count(void);
KVL_API const char *kvl_kernel_set_name(int index); /* NULL past the end */
KVL_API int kvl_kernel_set_supported(const char *name);
KVL_API const char *kvl_kernel_set_default(void);

/* Runs every entry of one kernel set against the scalar reference (matrix products of every
 * weight type and mode on shapes with row, column and token tails; the integer mode; vector
 * ops; BF16 conversions; softmax/GELU) and writes a JSON report to out:
 *   {"set":..., "table":<name of the table whose functions ran>, "checks":[{"kernel":...,
 *    "shape":..., "max_err":..., "bound":..., "ok":true|false}, ...], "failed":N}
 * Returns the number of failed checks (0 = the set conforms), -1 if the set is unknown or not
 * supported here, -2 if out_len is too small for the report. Single-threaded; no files. */
KVL_API int kvl_kernels_conformance(const char *set_name, char *out, size_t out_len);

#ifdef __cplusplus
}
#endif
#endif /* KVL_H */
