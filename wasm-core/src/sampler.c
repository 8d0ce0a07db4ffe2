/* sampler.c — kvl_sampler_seed / kvl_sample of kvl_core.h.
 *
 * Owns: token selection from one logits vector: greedy (temperature <= 0, lowest index on
 * ties) or temperature -> top-k -> softmax -> top-p (nucleus) -> one seeded draw.
 * Does not own: logits computation (model.c) or any state beyond the caller's kvl_sampler.
 * No allocation: the caller's workspace (vocab int32s) holds the candidate heap.
 */
#include <math.h>

#include "kvl_core.h"

/* splitmix64: the whole generator state is the one 64-bit word of kvl_sampler */
static uint64_t next_u64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double next_unit(uint64_t *state) /* uniform in [0, 1) */
{
    return (double)(next_u64(state) >> 11) * (1.0 / 9007199254740992.0);
}

void kvl_sampler_seed(kvl_sampler *sampler, uint64_t seed)
{
    if (!sampler) return;
    sampler->rng_state = seed;
    (void)next_u64(&sampler->rng_state); /* decorrelate nearby seeds */
}

/* total order: larger value first, lower index first on ties (so top_k = 1 equals greedy) */
static int before(const float *v, int32_t a, int32_t b)
{
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

static void sift_down(int32_t *heap, int32_t n, int32_t i, const float *v)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, best = i;
        if (l < n && before(v, heap[l], heap[best])) best = l;
        if (r < n && before(v, heap[r], heap[best])) best = r;
        if (best == i) return;
        int32_t t = heap[i]; heap[i] = heap[best]; heap[best] = t;
        i = best;
    }
}

int32_t kvl_sample(kvl_sampler *sampler, float *logits, int32_t vocab, int32_t *workspace)
{
    if (!sampler || !logits || vocab <= 0) return 0;
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    if (!(sampler->temperature > 0.0f) || !workspace) return best;

    /* temperature softmax numerators, computed in place */
    const float inv_t = 1.0f / sampler->temperature;
    const float m = logits[best];
    double total = 0.0;
    for (int32_t i = 0; i < vocab; i++) {
        logits[i] = expf((logits[i] - m) * inv_t);
        total += logits[i];
    }
    int32_t k = sampler->top_k > 0 && sampler->top_k < vocab ? sampler->top_k : vocab;
    int use_p = sampler->top_p > 0.0f && sampler->top_p < 1.0f;
    double u = next_unit(&sampler->rng_state);

    if (k == vocab && !use_p) {
        double target = u * total, acc = 0.0;
        for (int32_t i = 0; i < vocab; i++) {
            acc += logits[i];
            if (acc > target && logits[i] > 0.0f) return i;
        }
        return best;
    }

    /* max-heap of every index; popping yields candidates in descending order, stored from the
     * end of the workspace backwards (the i-th largest at workspace[vocab-1-i]) */
    for (int32_t i = 0; i < vocab; i++) workspace[i] = i;
    for (int32_t i = vocab / 2 - 1; i >= 0; i--) sift_down(workspace, vocab, i, logits);
    int32_t heap_n = vocab, popped = 0;
    double kept_mass = 0.0;
#define POP()                                                                                 \
    do {                                                                                      \
        int32_t top = workspace[0];                                                           \
        workspace[0] = workspace[heap_n - 1];                                                 \
        workspace[heap_n - 1] = top;                                                          \
        heap_n--;                                                                             \
        sift_down(workspace, heap_n, 0, logits);                                              \
        popped++;                                                                             \
        kept_mass += logits[top];                                                             \
    } while (0)
    if (k < vocab) {
        while (popped < k) POP();
    }
    double topk_mass = k < vocab ? kept_mass : total;
    int32_t n_keep = k;
    if (use_p) {
        /* nucleus: the smallest prefix whose share of the top-k mass reaches top_p */
        double need = (double)sampler->top_p * topk_mass, acc = 0.0;
        int32_t i = 0;
        for (;; i++) {
            if (i == popped) POP();
            acc += logits[workspace[vocab - 1 - i]];
            if (acc >= need || i + 1 == k) break;
        }
        n_keep = i + 1;
        topk_mass = acc;
    }
#undef POP
    double target = u * topk_mass, acc = 0.0;
    for (int32_t i = 0; i < n_keep; i++) {
        int32_t id = workspace[vocab - 1 - i];
        acc += logits[id];
        if (acc > target) return id;
    }
    return workspace[vocab - n_keep]; /* rounding fell off the end: the smallest kept one */
}
