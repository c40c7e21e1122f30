// Attention mass on the CPU in three parallel phases over a [layer][kv head][key][row] logits buffer:
// (1) logits, register tiles of 3 keys by up to 32 query rows: the kv head's query rows are
// transposed once (tiny), so the inner loop broadcasts a key element and multiply-adds a vector of
// rows, reading keys in place with no transpose and no horizontal sums; (2) per key chunk, each
// row's max and sum of exp, then combined per row; (3) per key, the softmax weights summed over
// rows and the max taken over layers. GCC/Clang vector extensions give SIMD without intrinsics.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "score.h"
#include "simd.h"

namespace {

constexpr int CHUNK_KEYS = 512;       // keys per phase-1 and phase-3 work item

// Runs fn(item) for item in [0, n_items) on n_threads threads (the caller's included). With OpenMP
// (the runtime ggml-cpu already loaded) its pool is reused: starting threads per call cost ~0.1 ms.
template <typename Fn>
void parallel_for(int n_items, int n_threads, Fn fn) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min(n_threads, n_items))
    for (int item = 0; item < n_items; ++item) fn(item);
#else
    std::atomic<int> next{0};
    auto worker = [&] {
        for (int item; (item = next.fetch_add(1)) < n_items;) fn(item);
    };
    std::vector<std::thread> threads;
    for (int t = 1; t < std::min(n_threads, n_items); ++t) threads.emplace_back(worker);
    worker();
    for (auto & th : threads) th.join();
#endif
}

#ifdef __AVX512F__
constexpr int TILE_KEYS = 6;    // keys per register tile: 24 accumulators of 32 vector registers
#else
constexpr int TILE_KEYS = 3;    // keys per register tile: 12 accumulators of 16 vector registers
#endif
constexpr int MAX_VECS = 4;     // row vectors per register tile (32 rows)

struct Problem {
    const pfx_shape & s;
    int group, rows_per_kv, row_vecs;  // row_vecs: rows_per_kv padded to whole vectors
    int chunks;
    size_t key_stride() const { return (size_t)row_vecs * LANES; }
    size_t kv_floats() const { return (size_t)s.n_keys * key_stride(); }
};

// acc[key][vec] over head_dim for keys k_rows[0..nk) and row vectors [v0, v0 + NV) of qt.
template <int NV>
void tile(const Problem & p, const float * qt, int v0, const float * const * k_rows, int nk, float * out) {
    const int d = p.s.head_dim;
    const size_t qt_stride = p.key_stride();
    v8f acc[TILE_KEYS][NV] = {};
    for (int x = 0; x < d; ++x) {
        const float * qx = qt + x * qt_stride + (size_t)v0 * LANES;
        v8f qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = load8(qx + v * LANES);
        for (int jj = 0; jj < TILE_KEYS; ++jj) {
            const float kv = k_rows[jj][x];
            for (int v = 0; v < NV; ++v) acc[jj][v] += qv[v] * kv;
        }
    }
    for (int jj = 0; jj < nk; ++jj)
        for (int v = 0; v < NV; ++v) store8(out + jj * qt_stride + (size_t)(v0 + v) * LANES, acc[jj][v]);
}

// Phase 1: logits [key][row] of kv head g for keys [k0, k1).
void logits_chunk(const Problem & p, const float * q, const float * k, int g, int k0, int k1, float * logits) {
    const pfx_shape & s = p.s;
    const int d = s.head_dim;
    const float scale = 1.0f / std::sqrt((float)d);
    std::vector<float> qt((size_t)d * p.key_stride(), 0.0f);  // [x][row], scaled; padding rows stay 0
    const std::vector<float> zeros(d, 0.0f);
    for (int r = 0; r < p.rows_per_kv; ++r) {
        const int h = g * p.group + r / s.n_query, t = r % s.n_query;
        const float * src = q + ((size_t)t * s.n_head + h) * d;
        for (int x = 0; x < d; ++x) qt[x * p.key_stride() + r] = src[x] * scale;
    }
    for (int j0 = k0; j0 < k1; j0 += TILE_KEYS) {
        const int nk = std::min(TILE_KEYS, k1 - j0);
        const float * k_rows[TILE_KEYS];
        for (int jj = 0; jj < TILE_KEYS; ++jj)  // past the last key: a zero row (no branch in the tile)
            k_rows[jj] = jj < nk ? k + ((size_t)(j0 + jj) * s.n_head_kv + g) * d : zeros.data();
        float * out = logits + (size_t)j0 * p.key_stride();
        for (int v0 = 0; v0 < p.row_vecs; v0 += MAX_VECS) {
            switch (std::min(MAX_VECS, p.row_vecs - v0)) {
                case 4: tile<4>(p, qt.data(), v0, k_rows, nk, out); break;
                case 3: tile<3>(p, qt.data(), v0, k_rows, nk, out); break;
                case 2: tile<2>(p, qt.data(), v0, k_rows, nk, out); break;
                default: tile<1>(p, qt.data(), v0, k_rows, nk, out); break;
            }
        }
    }
}

// Phase 2: each row's max and sum of exp over keys [k0, k1) into m, sum ([row_vecs * LANES]).
// False when a logit is not finite.
bool chunk_stats(const Problem & p, const float * logits, int k0, int k1, float * m, float * sum) {
    v8f bad = {};
    for (int v = 0; v < p.row_vecs; ++v) {
        v8f mv = v8f{} - INFINITY;
        for (int j = k0; j < k1; ++j) {
            const v8f l = load8(logits + j * p.key_stride() + v * LANES);
            bad += l - l;  // NaN once any logit is NaN or infinite
            mv = l > mv ? l : mv;
        }
        v8f sv = {};
        for (int j = k0; j < k1; ++j) sv += exp8(load8(logits + j * p.key_stride() + v * LANES) - mv);
        store8(m + v * LANES, mv);
        store8(sum + v * LANES, sv);
    }
    for (int i = 0; i < LANES; ++i)
        if (bad[i] != 0.0f) return false;
    return true;
}

}  // namespace

int pfx_cpu_attention_mass(const float * const * q, const float * const * k, int n_layers, const pfx_shape & s,
                           int n_threads, float * out, std::string & err) {
    if (s.n_keys < 1 || s.n_query < 1 || s.n_head < 1 || s.n_head_kv < 1 || s.n_head % s.n_head_kv) {
        err = "invalid attention shape";
        return -1;
    }
    const int group = s.n_head / s.n_head_kv, rows_per_kv = group * s.n_query;
    const Problem p{s, group, rows_per_kv, (rows_per_kv + LANES - 1) / LANES, (s.n_keys + CHUNK_KEYS - 1) / CHUNK_KEYS};
    if (n_threads <= 0) n_threads = (int)std::max(1u, std::thread::hardware_concurrency());
    // a thread per ~4M multiply-adds at least: below that, starting threads costs more than it saves
    const double work = (double)n_layers * s.n_head * s.n_query * s.n_keys * s.head_dim;
    n_threads = std::max(1, std::min(n_threads, (int)(work / (1 << 22))));
    const int heads = n_layers * s.n_head_kv;  // (layer, kv head) pairs, each a [key][row] block
    std::vector<float> logits((size_t)heads * p.kv_floats());
    const size_t stat_floats = p.key_stride();
    std::vector<float> chunk_m((size_t)heads * p.chunks * stat_floats), chunk_s(chunk_m.size());
    std::atomic<int> bad{0};
    parallel_for(heads * p.chunks, n_threads, [&](int item) {
        const int chunk = item % p.chunks, head = item / p.chunks, l = head / s.n_head_kv, g = head % s.n_head_kv;
        const int k0 = chunk * CHUNK_KEYS, k1 = std::min(s.n_keys, k0 + CHUNK_KEYS);
        float * block = logits.data() + head * p.kv_floats();
        logits_chunk(p, q[l], k[l], g, k0, k1, block);
        const size_t at = ((size_t)head * p.chunks + chunk) * stat_floats;
        if (!chunk_stats(p, block, k0, k1, chunk_m.data() + at, chunk_s.data() + at)) bad = 1;
    });
    // per (layer, kv head, row): the max, and the weight 1/sum (0 for padding rows)
    std::vector<float> row_m((size_t)heads * stat_floats), row_w(row_m.size());
    for (int head = 0; head < heads; ++head) {
        for (size_t r = 0; r < stat_floats; ++r) {
            float m = -INFINITY, sum = 0.0f;
            for (int c = 0; c < p.chunks; ++c) m = std::max(m, chunk_m[((size_t)head * p.chunks + c) * stat_floats + r]);
            for (int c = 0; c < p.chunks; ++c) {
                const size_t at = ((size_t)head * p.chunks + c) * stat_floats + r;
                sum += chunk_s[at] * std::exp(chunk_m[at] - m);
            }
            const bool real = (int)r < rows_per_kv;
            if (real && !(sum > 0.0f && std::isfinite(sum))) bad = 1;
            row_m[(size_t)head * stat_floats + r] = real ? m : 0.0f;
            row_w[(size_t)head * stat_floats + r] = real ? 1.0f / sum : 0.0f;
        }
    }
    const float norm = 1.0f / (float)(s.n_head * s.n_query);
    parallel_for(p.chunks, n_threads, [&](int chunk) {
        const int j0 = chunk * CHUNK_KEYS, j1 = std::min(s.n_keys, j0 + CHUNK_KEYS);
        for (int j = j0; j < j1; ++j) {
            float best = 0.0f;
            for (int l = 0; l < n_layers; ++l) {
                v8f acc = {};
                for (int g = 0; g < s.n_head_kv; ++g) {
                    const int head = l * s.n_head_kv + g;
                    const float * row = logits.data() + head * p.kv_floats() + j * p.key_stride();
                    const float * m = row_m.data() + (size_t)head * stat_floats;
                    const float * w = row_w.data() + (size_t)head * stat_floats;
                    for (int v = 0; v < p.row_vecs; ++v)
                        acc += exp8(load8(row + v * LANES) - load8(m + v * LANES)) * load8(w + v * LANES);
                }
                float total = 0.0f;
                for (int i = 0; i < LANES; ++i) total += acc[i];
                total *= norm;
                best = l == 0 || total > best ? total : best;
            }
            if (!std::isfinite(best)) bad = 1;
            out[j] = best;
        }
    });
    return bad.load();
}
