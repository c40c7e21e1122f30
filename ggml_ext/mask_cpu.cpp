// Structured output's token masks applied to a step's logits (engine/constraints.py): llguidance
// writes one bit per token (1: allowed), 32 tokens a 32-bit word, and every forbidden logit becomes
// -inf before the host sampler reads the row. Why native: at a 128K-262K vocabulary numpy unpacks
// and selects about 0.15-0.5 ms a row; here a word of 32 allowed tokens is skipped whole, a word of
// none is one run of stores, and the rows go in parallel.
#include <algorithm>
#include <cmath>

#include "pflash_ext.h"

extern "C" int32_t pfx_apply_bitmask(float * logits, int64_t n_vocab, const int64_t * rows, const uint32_t * masks,
                                     int64_t mask_words, const int64_t * mask_rows, int32_t n_rows,
                                     int32_t n_threads) {
    if (logits == nullptr || rows == nullptr || masks == nullptr || mask_rows == nullptr || n_vocab <= 0 ||
        mask_words <= 0 || n_rows < 0) {
        return 1;
    }
    const int threads = std::max(1, std::min(n_threads, n_rows));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int32_t r = 0; r < n_rows; ++r) {
        float * row = logits + rows[r] * n_vocab;
        const uint32_t * mask = masks + mask_rows[r] * mask_words;
        for (int64_t base = 0, w = 0; base < n_vocab; base += 32, ++w) {
            const uint32_t bits = w < mask_words ? mask[w] : 0u;  // past the mask: no token allowed
            if (bits == 0xFFFFFFFFu) {
                continue;
            }
            const int64_t end = std::min<int64_t>(base + 32, n_vocab);
            if (bits == 0u) {
                std::fill(row + base, row + end, -INFINITY);
                continue;
            }
            for (int64_t t = base; t < end; ++t) {
                if (!((bits >> (t - base)) & 1u)) {
                    row[t] = -INFINITY;
                }
            }
        }
    }
    return 0;
}
