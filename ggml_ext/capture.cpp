// The capture object and the eval callback: picks the scoring layers' Q/K nodes by name, copies
// the rows scoring needs to host or GPU storage, and stops each ubatch's graph after the last
// scoring layer, with no Python call per node.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "pflash_ext.h"
#include "score.h"

namespace {

enum Kind { Q = 0, K = 1 };

// A float32 array on the host or on a GPU, grown as prompts get longer.
struct Store {
    bool gpu = false;
    int device = 0;
    std::vector<float> host;
    float * dev = nullptr;
    size_t capacity = 0;

    float * data() { return gpu ? dev : host.data(); }

    bool reserve(size_t n, std::string & err) {
        if (!gpu) {
            if (host.size() < n) host.resize(n);
            return true;
        }
#ifdef PFX_GPU
        if (n <= capacity) return true;
        pfx_gpu_free(dev, device);
        dev = (float *)pfx_gpu_alloc(n * sizeof(float), device, err);
        capacity = dev ? n : 0;
        return dev != nullptr;
#else
        err = "this build has no GPU backend";
        return false;
#endif
    }

    void release() {
#ifdef PFX_GPU
        if (gpu) pfx_gpu_free(dev, device);
#endif
        dev = nullptr;
        capacity = 0;
        host.clear();
    }
};

// "Qcur-12" / "Kcur_normed-12" -> (kind, layer); false for any other name.
bool parse_name(const char * name, Kind & kind, int & layer) {
    if ((name[0] != 'Q' && name[0] != 'K') || std::strncmp(name + 1, "cur", 3) != 0) return false;
    const char * rest = name + 4;
    if (std::strncmp(rest, "_normed", 7) == 0) rest += 7;
    if (rest[0] != '-' || rest[1] < '0' || rest[1] > '9') return false;
    char * end = nullptr;
    long value = std::strtol(rest + 1, &end, 10);
    if (*end != '\0') return false;
    kind = name[0] == 'Q' ? Q : K;
    layer = (int)value;
    return true;
}

}  // namespace

struct pfx_capture {
    std::vector<int> layers;
    std::vector<int> index_of;  // layer -> scoring-layer index, or -1
    int head_dim, n_head, n_head_kv;
    bool rope_pre, on_gpu;
    int device, n_threads;
    int query_start = 0, query_end = 0;
    std::vector<Store> stores[2];     // per kind, per scoring layer
    std::vector<int64_t> rows[2];     // tokens seen per kind, per scoring layer
    std::vector<int64_t> saved[2];    // rows at the last checkpoint
    std::vector<int64_t> layout;      // (position, count) pairs of the next ubatches' rows; empty: in order
    bool last_done[2] = {false, false};
    bool enabled = true;              // false: the callback asks for no node (ubatches nobody scores)
    pfx_capture * lead = nullptr;     // a lane's: whose stores its rows go to (pfx_capture_follow)
    std::vector<pfx_capture *> lanes; // a lead's: the captures whose rows land in its stores
    pfx_stats stats{};
    std::string error;

    int heads(Kind kind) const { return kind == Q ? n_head : n_head_kv; }

    // Floats kept per scoring layer: K of the keys before the query, Q of the query rows.
    size_t store_floats(Kind kind) const {
        const int64_t rows = kind == K ? query_start : query_end - query_start;
        return (size_t)rows * heads(kind) * head_dim;
    }

    // Index of the scoring layer whose Q/K this node is, or -1.
    int match(const ggml_tensor * t, Kind & kind) const {
        int layer;
        if (!parse_name(t->name, kind, layer) || layer < 0 || layer >= (int)index_of.size()) return -1;
        const int i = index_of[layer];
        if (i < 0 || t->ne[0] != head_dim || t->ne[1] != heads(kind) || t->ne[3] != 1) return -1;
        return i;
    }

    // Copies the rows of node t that scoring needs: keys before the query, the query rows. Without a
    // layout the ubatch's rows are the prompt positions after those seen; with one, its segments.
    bool copy(const ggml_tensor * t, Kind kind, int i) {
        if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) {
            error = std::string("captured tensor ") + t->name + " has unsupported type " + ggml_type_name(t->type);
            return false;
        }
        if (!ggml_is_contiguous(t)) {
            error = std::string("captured tensor ") + t->name + " is not contiguous";
            return false;
        }
        const int64_t n = t->ne[2];
        if (layout.empty()) return copy_rows(t, kind, i, 0, rows[kind][i], n);
        int64_t laid = 0;
        for (size_t j = 0; j < layout.size(); j += 2) laid += layout[j + 1];
        if (laid != n) {
            error = std::string("the ubatch layout covers ") + std::to_string(laid) + " rows, but " + t->name +
                    " has " + std::to_string(n);
            return false;
        }
        int64_t src = 0;
        for (size_t j = 0; j < layout.size(); j += 2) {
            if (!copy_rows(t, kind, i, src, layout[j], layout[j + 1])) return false;
            src += layout[j + 1];
        }
        return true;
    }

    // Copies rows [src, src + n) of node t, the prompt positions [pos, pos + n), where scoring needs them.
    bool copy_rows(const ggml_tensor * t, Kind kind, int i, int64_t src, int64_t pos, int64_t n) {
        const int64_t lo = kind == K ? pos : std::max<int64_t>(pos, query_start);
        const int64_t hi = kind == K ? std::min<int64_t>(pos + n, query_start) : std::min<int64_t>(pos + n, query_end);
        if (lo >= hi) return true;
        const size_t row_elems = (size_t)head_dim * heads(kind);
        const int64_t dst_row = kind == K ? lo : lo - query_start;
        float * dst = (lead ? lead : this)->stores[kind][i].data() + dst_row * row_elems;
        const size_t elems = (size_t)(hi - lo) * row_elems, elem_size = ggml_type_size(t->type);
        const size_t offset = (size_t)(src + lo - pos) * row_elems * elem_size;
        const bool f16 = t->type == GGML_TYPE_F16;
#ifdef PFX_GPU
        if (on_gpu) return pfx_gpu_copy(dst, (const char *)t->data + offset, elems, f16, device, error);
#endif
        if (!f16 && ggml_backend_buffer_is_host(t->buffer)) {
            std::memcpy(dst, (const char *)t->data + offset, elems * sizeof(float));
        } else if (!f16) {
            ggml_backend_tensor_get(t, dst, offset, elems * sizeof(float));
        } else {
            std::vector<ggml_fp16_t> staging(elems);
            ggml_backend_tensor_get(t, staging.data(), offset, elems * sizeof(ggml_fp16_t));
            ggml_fp16_to_fp32_row(staging.data(), dst, (int64_t)elems);
        }
        return true;
    }

    // ask=false for a wanted node; returns false to stop the graph.
    bool on_ready(const ggml_tensor * t, Kind kind, int i) {
        if (t->op != GGML_OP_ROPE) {
            // pre-RoPE (the only mode that asks for these): every same-named node before the RoPE
            // op is copied, the last one wins; the RoPE node then commits the rows
            return copy(t, kind, i);
        }
        if (!rope_pre && !copy(t, kind, i)) return false;
        rows[kind][i] += t->ne[2];
        if (i != (int)layers.size() - 1) return true;
        last_done[kind] = true;
        if (!(last_done[Q] && last_done[K])) return true;
        last_done[Q] = last_done[K] = false;
        stats.ubatches_stopped++;
        return false;  // nothing after the last scoring layer is needed
    }
};

extern "C" {

const char * pfx_build_backend(void) {
#ifdef PFX_GPU
    return PFX_GPU_BACKEND;
#else
    return "cpu";
#endif
}

int pfx_gpu_count(void) {
#ifdef PFX_GPU
    return pfx_gpu_device_count();
#else
    return 0;
#endif
}

pfx_capture * pfx_capture_new(const int32_t * layers, int32_t n_layers, int32_t head_dim, int32_t n_head,
                              int32_t n_head_kv, bool rope_pre, bool use_gpu, int32_t device, int32_t n_threads) {
    if (n_layers < 1 || head_dim < 1 || n_head < 1 || n_head_kv < 1 || n_head % n_head_kv) return nullptr;
    auto * cap = new pfx_capture();
    cap->layers.assign(layers, layers + n_layers);
    std::sort(cap->layers.begin(), cap->layers.end());
    cap->index_of.assign(cap->layers.back() + 1, -1);
    for (int i = 0; i < n_layers; ++i) cap->index_of[cap->layers[i]] = i;
    cap->head_dim = head_dim;
    cap->n_head = n_head;
    cap->n_head_kv = n_head_kv;
    cap->rope_pre = rope_pre;
    cap->on_gpu = use_gpu && pfx_gpu_count() > device;
    cap->device = device;
    cap->n_threads = n_threads;
    for (auto & per_kind : cap->stores) {
        per_kind.resize(n_layers);
        for (auto & store : per_kind) {
            store.gpu = cap->on_gpu;
            store.device = device;
        }
    }
    for (int kind = 0; kind < 2; ++kind) cap->rows[kind].assign(n_layers, 0), cap->saved[kind].assign(n_layers, 0);
    return cap;
}

void pfx_capture_free(pfx_capture * cap) {
    if (!cap) return;
    if (cap->lead) {
        auto & lanes = cap->lead->lanes;
        lanes.erase(std::remove(lanes.begin(), lanes.end(), cap), lanes.end());
    }
    for (pfx_capture * lane : cap->lanes) lane->lead = nullptr;
    for (auto & per_kind : cap->stores)
        for (auto & store : per_kind) store.release();
    delete cap;
}

bool pfx_capture_on_gpu(const pfx_capture * cap) { return cap->on_gpu; }

bool pfx_capture_reset(pfx_capture * cap, int32_t query_start, int32_t query_end) {
    cap->error.clear();
    cap->stats = pfx_stats{};
    cap->last_done[Q] = cap->last_done[K] = false;
    if (query_start < 1 || query_end <= query_start) {
        cap->error = "the query must follow at least one key";
        return false;
    }
    cap->query_start = query_start;
    cap->query_end = query_end;
    cap->layout.clear();
    cap->enabled = true;
    for (int kind = 0; kind < 2; ++kind) {
        std::fill(cap->rows[kind].begin(), cap->rows[kind].end(), 0);
        std::fill(cap->saved[kind].begin(), cap->saved[kind].end(), 0);
        if (cap->lead) continue;  // a lane writes into its lead's stores, which the lead's reset reserved
        for (auto & store : cap->stores[kind])
            if (!store.reserve(cap->store_floats((Kind)kind), cap->error)) return false;
    }
    return true;
}

bool pfx_capture_follow(pfx_capture * lane, pfx_capture * lead) {
    if (lane == lead || lead->lead || !lane->lanes.empty() || lane->on_gpu != lead->on_gpu ||
        lane->device != lead->device || lane->layers != lead->layers || lane->head_dim != lead->head_dim ||
        lane->n_head != lead->n_head || lane->n_head_kv != lead->n_head_kv) {
        lane->error = "a lane must follow a lead capture of the same layers, shapes and device";
        return false;
    }
    lane->lead = lead;
    lead->lanes.push_back(lane);
    return true;
}

void pfx_capture_enable(pfx_capture * cap, bool enabled) { cap->enabled = enabled; }

bool pfx_capture_layout(pfx_capture * cap, const int32_t * positions, const int32_t * counts, int32_t n_segments) {
    cap->layout.clear();
    for (int32_t j = 0; j < n_segments; ++j) {
        if (positions[j] < 0 || counts[j] < 0) {
            cap->error = "a ubatch layout segment has a negative position or count";
            return false;
        }
        cap->layout.push_back(positions[j]);
        cap->layout.push_back(counts[j]);
    }
    return true;
}

void pfx_capture_checkpoint(pfx_capture * cap) {
    for (int kind = 0; kind < 2; ++kind) cap->saved[kind] = cap->rows[kind];
    cap->last_done[Q] = cap->last_done[K] = false;
}

void pfx_capture_rollback(pfx_capture * cap) {
    for (int kind = 0; kind < 2; ++kind) cap->rows[kind] = cap->saved[kind];
    cap->last_done[Q] = cap->last_done[K] = false;
}

bool pfx_eval_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * cap = (pfx_capture *)user_data;
    Kind kind;
    const int i = cap->match(t, kind);
    if (ask) {
        cap->stats.nodes_seen++;
        return cap->enabled && i >= 0 && (cap->rope_pre || t->op == GGML_OP_ROPE);
    }
    if (i < 0) return true;
    if (!cap->error.empty()) return false;
    const auto start = std::chrono::steady_clock::now();
    const bool go_on = cap->on_ready(t, kind, i) && cap->error.empty();
    cap->stats.capture_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return go_on;
}

const char * pfx_capture_error(const pfx_capture * cap) { return cap->error.c_str(); }

void pfx_capture_get_stats(const pfx_capture * cap, pfx_stats * out) { *out = cap->stats; }

int pfx_capture_score(pfx_capture * cap, float * out) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < cap->layers.size(); ++i) {
        int64_t keys = cap->rows[K][i], queries = cap->rows[Q][i];  // rows seen, its lanes' included
        for (const pfx_capture * lane : cap->lanes) keys += lane->rows[K][i], queries += lane->rows[Q][i];
        if (keys < cap->query_start || queries < cap->query_end) {
            cap->error = "captured Q/K do not cover every prompt token of layer " + std::to_string(cap->layers[i]);
            return -1;
        }
    }
    std::vector<const float *> q, k;
    for (size_t i = 0; i < cap->layers.size(); ++i) {
        q.push_back(cap->stores[Q][i].data());
        k.push_back(cap->stores[K][i].data());
    }
    const pfx_shape shape{cap->query_start, cap->query_end - cap->query_start, cap->n_head, cap->n_head_kv, cap->head_dim};
    int status;
#ifdef PFX_GPU
    if (cap->on_gpu)
        status = pfx_gpu_attention_mass(q.data(), k.data(), (int)q.size(), shape, cap->device, out, cap->error);
    else
#endif
        status = pfx_cpu_attention_mass(q.data(), k.data(), (int)q.size(), shape, cap->n_threads, out, cap->error);
    cap->stats.score_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return status;
}

bool pfx_capture_read(pfx_capture * cap, int32_t i, char kind, float * out) {
    if (i < 0 || i >= (int)cap->layers.size() || (kind != 'Q' && kind != 'K')) return false;
    const Kind k = kind == 'Q' ? Q : K;
    const size_t n = cap->store_floats(k);
#ifdef PFX_GPU
    if (cap->on_gpu) return pfx_gpu_read(out, cap->stores[k][i].data(), n, cap->device, cap->error);
#endif
    std::memcpy(out, cap->stores[k][i].data(), n * sizeof(float));
    return true;
}

int pfx_attention_mass(const float * q, const float * k, int32_t n_tokens, int32_t n_head, int32_t n_head_kv,
                       int32_t head_dim, int32_t query_start, int32_t query_end, bool use_gpu, int32_t n_threads,
                       float * out) {
    if (query_start < 1 || query_end <= query_start || query_end > n_tokens) return -1;
    const pfx_shape shape{query_start, query_end - query_start, n_head, n_head_kv, head_dim};
    const float * q_rows = q + (size_t)query_start * n_head * head_dim;
    std::string err;
#ifdef PFX_GPU
    if (use_gpu && pfx_gpu_device_count() > 0) {
        const size_t nq = (size_t)shape.n_query * n_head * head_dim, nk = (size_t)query_start * n_head_kv * head_dim;
        auto * qd = (float *)pfx_gpu_alloc(nq * sizeof(float), 0, err);
        auto * kd = (float *)pfx_gpu_alloc(nk * sizeof(float), 0, err);
        int status = -1;
        if (qd && kd && pfx_gpu_copy(qd, q_rows, nq, false, 0, err) && pfx_gpu_copy(kd, k, nk, false, 0, err)) {
            const float * qp = qd, * kp = kd;
            status = pfx_gpu_attention_mass(&qp, &kp, 1, shape, 0, out, err);
        }
        pfx_gpu_free(qd, 0);
        pfx_gpu_free(kd, 0);
        return status;
    }
#else
    (void)use_gpu;
#endif
    return pfx_cpu_attention_mass(&q_rows, &k, 1, shape, n_threads, out, err);
}

}  // extern "C"
