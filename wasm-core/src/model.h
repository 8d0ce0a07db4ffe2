/* model.h — the text decoder forward pass (model.c), for engine.c: the session scratch layout and
 * one chunk of tokens through the engine's layers. Not part of the public API. model.c calls only
 * the files below it (engine_errors.h, trunk.h, the caches, kernels and pool; scripts/c-layers.mjs
 * checks).
 */
#ifndef KVL_MODEL_H
#define KVL_MODEL_H

#include "engine_state.h"

/* Scratch layout of one session of the engine (sizes from the hparams, range and modes). */
void kvl_session_layout_compute(const kvl_engine *engine, int max_context, int max_batch,
                                kvl_session_layout *out);
/* Point the session's KV cache and scratch pointers into its arena, laid out as computed. */
void kvl_session_bind(kvl_session *s, const kvl_session_layout *layout);
/* Run n tokens (n <= max_batch) at the session position through the engine's layers: input
 * from tokens (embedding rows; placeholder tokens take the next media row, media +
 * *media_cursor * hidden, when media is not NULL) on the first range, else from hidden_in;
 * output logits for the requested tokens (mode LAST: the chunk's last token only) on the last
 * range, else the hidden states into hidden_out. Advances position on success. */
kvl_status kvl_model_forward(kvl_session *s, const int32_t *tokens, const float *hidden_in, int n,
                             const float *media, int *media_cursor, float *hidden_out,
                             int logits_mode, float *logits);

#endif
