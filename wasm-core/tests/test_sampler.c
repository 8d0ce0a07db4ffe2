/* test_sampler.c — checks kvl_sample / kvl_sampler_seed (sampler.c).
 * Greedy picks the argmax (lowest index on ties); top_k = 1 equals greedy; seeded draws over a
 * known distribution match its probabilities within a 5-sigma binomial bound; top-k and top-p
 * never return excluded tokens; the same seed gives the same sequence.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvl_core.h"
#include "test_check.h"

#define V 8

static int32_t draw(kvl_sampler *s, const float *logits)
{
    float tmp[V];
    int32_t ws[V];
    memcpy(tmp, logits, sizeof tmp);
    return kvl_sample(s, tmp, V, ws);
}

int main(void)
{
    const float logits[V] = {0.5f, 2.0f, -1.0f, 1.0f, 2.0f, 0.0f, -3.0f, 1.5f};
    kvl_sampler s;

    /* greedy: argmax, lowest index among the tied maxima (1 and 4) */
    memset(&s, 0, sizeof s);
    kvl_sampler_seed(&s, 1);
    CHECK(draw(&s, logits) == 1, "greedy should pick index 1");
    s.temperature = -1.0f;
    CHECK(draw(&s, logits) == 1, "negative temperature is greedy");

    /* top_k = 1 at any temperature equals greedy */
    s.temperature = 5.0f;
    s.top_k = 1;
    for (int i = 0; i < 200; i++) CHECK(draw(&s, logits) == 1, "top_k=1 must equal greedy");

    /* frequencies of a seeded draw (temperature 1, no truncation) vs softmax probabilities */
    {
        double p[V], z = 0.0;
        for (int i = 0; i < V; i++) z += exp(logits[i]);
        for (int i = 0; i < V; i++) p[i] = exp(logits[i]) / z;
        memset(&s, 0, sizeof s);
        s.temperature = 1.0f;
        kvl_sampler_seed(&s, 12345);
        const int N = 200000;
        int count[V] = {0};
        for (int i = 0; i < N; i++) count[draw(&s, logits)]++;
        for (int i = 0; i < V; i++) {
            double sigma = sqrt(N * p[i] * (1 - p[i]));
            CHECK(fabs(count[i] - N * p[i]) <= 5 * sigma + 1, "token %d: %d draws, expected %.1f",
                  i, count[i], N * p[i]);
        }
    }

    /* top-k = 3 keeps exactly {1, 4, 7} with renormalised probabilities */
    {
        memset(&s, 0, sizeof s);
        s.temperature = 1.0f;
        s.top_k = 3;
        kvl_sampler_seed(&s, 7);
        const int N = 60000;
        int count[V] = {0};
        for (int i = 0; i < N; i++) count[draw(&s, logits)]++;
        double z = exp(2.0) * 2 + exp(1.5);
        int kept[3] = {1, 4, 7};
        for (int i = 0; i < V; i++) {
            int in = i == 1 || i == 4 || i == 7;
            if (!in) CHECK(count[i] == 0, "top_k=3 drew excluded token %d", i);
        }
        for (int j = 0; j < 3; j++) {
            double p = exp(logits[kept[j]]) / z, sigma = sqrt(N * p * (1 - p));
            CHECK(fabs(count[kept[j]] - N * p) <= 5 * sigma + 1, "top_k token %d: %d vs %.1f",
                  kept[j], count[kept[j]], N * p);
        }
    }

    /* top-p: probabilities p1=p4=0.27.., p7=0.16..; top_p 0.5 keeps {1, 4} (cum 0.54 >= 0.5) */
    {
        memset(&s, 0, sizeof s);
        s.temperature = 1.0f;
        s.top_p = 0.5f;
        kvl_sampler_seed(&s, 99);
        int count[V] = {0};
        for (int i = 0; i < 20000; i++) count[draw(&s, logits)]++;
        for (int i = 0; i < V; i++)
            if (i != 1 && i != 4) CHECK(count[i] == 0, "top_p=0.5 drew excluded token %d", i);
        CHECK(count[1] > 9000 && count[4] > 9000, "top_p=0.5 should split evenly: %d %d",
              count[1], count[4]);
    }

    /* same seed, same sequence; different seed, different sequence */
    {
        kvl_sampler a, b, c;
        memset(&a, 0, sizeof a);
        a.temperature = 1.5f;
        a.top_k = 5;
        a.top_p = 0.9f;
        b = a;
        c = a;
        kvl_sampler_seed(&a, 42);
        kvl_sampler_seed(&b, 42);
        kvl_sampler_seed(&c, 43);
        int same = 1, differs = 0;
        for (int i = 0; i < 100; i++) {
            int32_t x = draw(&a, logits), y = draw(&b, logits), z = draw(&c, logits);
            same &= x == y;
            differs |= x != z;
        }
        CHECK(same, "same seed must give the same sequence");
        CHECK(differs, "a different seed should give a different sequence");
    }

    printf("test_sampler: %d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
