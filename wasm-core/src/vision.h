/* vision.h — what engine.c calls of the vision tower (vision.c) besides the public
 * kvl_vision_encode / kvl_vision_bytes of kvl_core.h. Not part of the public API.
 */
#ifndef KVL_VISION_H
#define KVL_VISION_H

#include "engine_state.h"

/* Validate every vision/projector tensor against engine->vision.hp (no data read); engine.c calls it
 * at open when load_vision = 1. A failure is kvl_engine_fail (engine->last_error). */
kvl_status kvl_vision_check(kvl_engine *engine);

#endif
