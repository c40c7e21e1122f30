// Host sampling of one decode step's rows: llama.cpp's top-k -> top-p -> min-p -> temperature ->
// dist chain with the numpy batch path's semantics (engine/batch_sampling.py `draw`), rows in
// parallel. Each row draws with the uniform its request's own generator gave, so a seed gives the
// same tokens here as on the numpy path. Why native: at a 128K vocabulary numpy spends ~0.3 ms a
// row on whole-vocabulary passes (20 ms a step at 64 rows on an H200's host). Here one vector pass
// reads the row and keeps the max of each block of 64 logits; the truncations then visit only the
// blocks that reach their threshold, and sort their candidates alone. Tokens at -inf (a grammar's
// mask: nearly the whole vocabulary at some steps of a JSON schema) have no probability and are never
// candidates: a row with fewer allowed tokens than top-k orders only those, not the whole row.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "pflash_ext.h"
#include "simd.h"

namespace {

struct Candidate {
    float logit;
    int32_t id;
};

// Larger logit first, then the lower id (numpy's stable argsort of -logits).
inline bool ahead(const Candidate & a, const Candidate & b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

constexpr float MAX_MARGIN = 1e6f;
constexpr float FINITE = -std::numeric_limits<float>::max();  // the lowest threshold: -inf stays out
constexpr int64_t BLOCK = 8 * LANES;

inline float lanes_max(v8f v) {
    float m = v[0];
    for (int lane = 1; lane < LANES; ++lane) {
        m = std::max(m, v[lane]);
    }
    return m;
}

// One row of logits after its scan: the max of every block of BLOCK logits (the last may be shorter).
struct Row {
    const float * logits = nullptr;
    int64_t n = 0;
    std::vector<float> block_max;
    float peak;
    int32_t argmax;  // the first index of the peak (0 when no logit exceeds -inf)
    bool has_nan;

    int64_t blocks() const { return (int64_t) block_max.size(); }
    int64_t begin(int64_t b) const { return b * BLOCK; }
    int64_t end(int64_t b) const { return std::min(n, (b + 1) * BLOCK); }

    // The max, its first index, NaNs and the block maxima, in one pass 8 lanes at a time.
    void scan(const float * row, int64_t n_vocab) {
        logits = row;
        n = n_vocab;
        block_max.resize((n + BLOCK - 1) / BLOCK);
        peak = -INFINITY;
        has_nan = false;
        int64_t best = 0;
        v8i nan = v8i{};
        for (int64_t b = 0; b < blocks(); ++b) {
            float m;
            if (end(b) - begin(b) == BLOCK) {
                v8f v = load8(row + begin(b));
                nan |= v != v;
                for (int64_t j = begin(b) + LANES; j < end(b); j += LANES) {
                    const v8f x = load8(row + j);
                    nan |= x != x;
                    v = x > v ? x : v;
                }
                m = lanes_max(v);
            } else {
                m = -INFINITY;
                for (int64_t j = begin(b); j < end(b); ++j) {
                    has_nan |= row[j] != row[j];
                    m = std::max(m, row[j]);
                }
            }
            block_max[b] = m;
            if (m > peak) {
                peak = m;
                best = b;
            }
        }
        for (int lane = 0; lane < LANES; ++lane) {
            has_nan |= nan[lane] != 0;
        }
        argmax = (int32_t) begin(best);
        for (int64_t j = begin(best); j < end(best); ++j) {
            if (row[j] == peak) {
                argmax = (int32_t) j;
                break;
            }
        }
    }

    // The tokens with logit >= threshold, in id order.
    void within(float threshold, std::vector<Candidate> & out) const {
        out.clear();
        for (int64_t b = 0; b < blocks(); ++b) {
            if (block_max[b] >= threshold) {
                for (int64_t j = begin(b); j < end(b); ++j) {
                    if (logits[j] >= threshold) {
                        out.push_back({logits[j], (int32_t) j});
                    }
                }
            }
        }
    }

    // The sum of exp(x - peak) over the row, 8 lanes at a time.
    double exp_sum() const {
        v8f sum = v8f{};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            sum += exp8(load8(logits + i) - peak);
        }
        double total = 0.0;
        for (int lane = 0; lane < LANES; ++lane) {
            total += sum[lane];
        }
        for (; i < n; ++i) {
            total += std::exp(logits[i] - peak);
        }
        return total;
    }
};

// Top-k: the k largest, largest first (fewer where fewer are above -inf: the others have no
// probability). The k-th largest block max bounds the k-th largest logit from below (each of the k
// best blocks holds its max), so only the tokens at or above it, in the blocks that reach it, are ordered.
void top_k(const Row & row, int32_t k, std::vector<Candidate> & out) {
    float threshold = FINITE;
    if (k <= row.blocks()) {
        thread_local std::vector<float> maxima;
        maxima.assign(row.block_max.begin(), row.block_max.end());
        std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
        threshold = std::max(maxima[k - 1], FINITE);
    }
    row.within(threshold, out);
    const size_t keep = std::min(out.size(), (size_t) k);
    std::partial_sort(out.begin(), out.begin() + (int64_t) keep, out.end(), ahead);
    out.resize(keep);
}

// The shortest head of `sorted` (largest first) whose float32 cumulative probability reaches
// top_p, as numpy computes it (probabilities over `total`, the candidates' sum of
// exp(logit - first)); -1 when the head never reaches it.
int64_t top_p_head(const std::vector<Candidate> & sorted, float total, float top_p) {
    const float first = sorted[0].logit;
    float cumulative = 0.0f;
    for (size_t i = 0; i < sorted.size(); ++i) {
        cumulative += std::exp(sorted[i].logit - first) / total;
        if (cumulative >= top_p) {
            return (int64_t) i + 1;
        }
    }
    return -1;
}

float exp_sum(const std::vector<Candidate> & c, float peak) {
    double sum = 0.0;
    for (const Candidate & x : c) {
        sum += std::exp(x.logit - peak);
    }
    return (float) sum;
}

// Top-p over the whole row without a full sort: the head lies among the tokens within a margin of
// the peak once their float32 cumulative probability reaches top_p; widened until it does.
void top_p_whole_row(const Row & row, float top_p, std::vector<Candidate> & out) {
    const float total = (float) row.exp_sum();
    for (float margin = 1.0f;; margin *= 4.0f) {
        const bool last = margin >= MAX_MARGIN;
        row.within(last ? FINITE : row.peak - margin, out);
        if (!last && (int64_t) out.size() < row.n && exp_sum(out, row.peak) < top_p * total) {
            continue;  // too little mass within the margin: widen before sorting anything
        }
        std::sort(out.begin(), out.end(), ahead);
        const int64_t keep = top_p_head(out, total, top_p);
        if (keep > 0) {
            out.resize(keep);
            return;
        }
        if (last || (int64_t) out.size() == row.n) {
            return;  // never reached (rounding): every candidate stays
        }
    }
}

// The index in `c` drawn at `uniform` from softmax(logit / temperature): the first whose float64
// cumulative weight reaches uniform x the total.
int64_t draw_index(const std::vector<Candidate> & c, float temperature, double uniform) {
    float best = -INFINITY;
    for (const Candidate & x : c) {
        best = std::max(best, x.logit / temperature);
    }
    thread_local std::vector<double> cumulative;
    cumulative.resize(c.size());
    double sum = 0.0;
    for (size_t i = 0; i < c.size(); ++i) {
        sum += (double) std::exp(c[i].logit / temperature - best);
        cumulative[i] = sum;
    }
    const double target = sum * uniform;
    const int64_t at = std::lower_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin();
    return std::min(at, (int64_t) c.size() - 1);
}

void keep_min_p(std::vector<Candidate> & c, float min_p) {
    float best = -INFINITY;
    for (const Candidate & x : c) {
        best = std::max(best, x.logit);
    }
    const float floor = best + (float) std::log((double) min_p);
    c.erase(std::remove_if(c.begin(), c.end(), [floor](const Candidate & x) { return x.logit < floor; }), c.end());
}

int32_t sample_one(const Row & row, const pfx_sample_row & p, std::vector<Candidate> & c) {
    if (p.temperature <= 0.0f) {
        return row.has_nan ? -1 : row.argmax;
    }
    if (row.has_nan || !std::isfinite(row.peak)) {
        return -1;
    }
    const bool ranked = 0 < p.top_k && p.top_k < row.n;
    if (ranked) {
        top_k(row, p.top_k, c);
    }
    if (p.top_p < 1.0f) {
        if (!ranked) {
            top_p_whole_row(row, p.top_p, c);
        } else if (const int64_t keep = top_p_head(c, exp_sum(c, c[0].logit), p.top_p); keep > 0) {
            c.resize(keep);
        }
    } else if (!ranked) {
        row.within(FINITE, c);
    }
    if (p.min_p > 0.0f) {  // logits within log(min_p) of the best; the best always stays
        keep_min_p(c, p.min_p);
    }
    return c[draw_index(c, p.temperature, p.uniform)].id;
}

}  // namespace

extern "C" int32_t pfx_sample_rows(const float * logits, int64_t n_vocab, const pfx_sample_row * rows,
                                   int32_t n_rows, int32_t * tokens, int32_t n_threads) {
    if (logits == nullptr || rows == nullptr || tokens == nullptr || n_vocab <= 0 || n_rows < 0) {
        return 1;
    }
    const int threads = std::max(1, std::min(n_threads, n_rows));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int32_t r = 0; r < n_rows; ++r) {
        thread_local Row row;
        thread_local std::vector<Candidate> candidates;
        row.scan(logits + rows[r].row * n_vocab, n_vocab);
        tokens[r] = sample_one(row, rows[r], candidates);
    }
    return 0;
}
