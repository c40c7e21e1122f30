// pflash_ext: native PFlash scoring for llama.cpp drafters.
//
// A capture object is installed as a llama.cpp context's eval callback (cb_eval = pfx_eval_callback,
// cb_eval_user_data = the capture). It keeps the scoring layers' K (keys before the query) and the
// query rows of Q, on the host or on the GPU that computed them, and stops each ubatch's graph after
// the last scoring layer. pfx_capture_score then computes the attention mass that the query rows
// pay every earlier token (softmax per head and query, mean over heads and queries, max over
// layers, grouped-query aware): only one float per prompt token comes back to the host.
#pragma once
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;
typedef struct pfx_capture pfx_capture;

typedef struct pfx_stats {
    int64_t nodes_seen;        // graph nodes offered to the callback
    int64_t ubatches_stopped;  // ubatches whose graph stopped after the last scoring layer
    double capture_ms;         // time spent copying Q/K inside the callback
    double score_ms;           // time of the last pfx_capture_score
} pfx_stats;

// "cpu", "cuda" or "hip": the GPU backend this library was built with ("cpu" when none).
const char * pfx_build_backend(void);
// Number of GPUs the GPU backend sees (0 for a CPU build or when no device is usable).
int pfx_gpu_count(void);

// rope_pre: capture Q/K before RoPE (the last same-named node before the ROPE op) instead of after.
// use_gpu: keep captures and score on GPU `device` (ignored by a CPU build: check pfx_capture_on_gpu).
pfx_capture * pfx_capture_new(const int32_t * layers, int32_t n_layers, int32_t head_dim, int32_t n_head,
                              int32_t n_head_kv, bool rope_pre, bool use_gpu, int32_t device,
                              int32_t n_threads);
void pfx_capture_free(pfx_capture * cap);
bool pfx_capture_on_gpu(const pfx_capture * cap);
// Begin a prompt: keys [0, query_start) and queries [query_start, query_end) will be kept.
// Returns false (see pfx_capture_error) when storage cannot be allocated.
bool pfx_capture_reset(pfx_capture * cap, int32_t query_start, int32_t query_end);
// The prompt positions of the next ubatches' rows, in row order: segment j is counts[j] rows from
// positions[j] on (a lane's window, out of the prompt's order). n_segments 0: each ubatch
// continues where the last one ended. pfx_capture_reset clears it. False on a negative value.
bool pfx_capture_layout(pfx_capture * cap, const int32_t * positions, const int32_t * counts, int32_t n_segments);
// Lanes: `lane` (another context's capture, same layers and device) writes its rows into `lead`'s
// stores, where pfx_capture_score(lead) counts them; a lane is reset with the lead's query, after it,
// and is given a layout for every ubatch (its windows are not in prompt order). False on a mismatch.
bool pfx_capture_follow(pfx_capture * lane, pfx_capture * lead);
// enabled false: the callback asks for no node, so ubatches nobody scores (a lane's copy of the sink)
// run whole and keep nothing. pfx_capture_reset enables.
void pfx_capture_enable(pfx_capture * cap, bool enabled);
// Remember the capture's progress before a decode, and return to it when that decode was aborted.
void pfx_capture_checkpoint(pfx_capture * cap);
void pfx_capture_rollback(pfx_capture * cap);
// The eval callback (ggml_backend_sched_eval_callback); user_data is the capture.
bool pfx_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);
// The first error (empty string when none); once set, the callback stops every graph.
const char * pfx_capture_error(const pfx_capture * cap);
void pfx_capture_get_stats(const pfx_capture * cap, pfx_stats * out);
// Attention mass of keys [0, query_start) into out[query_start]. Returns 0, 1 when a logit or a
// mass is not finite, -1 on another error (see pfx_capture_error).
int pfx_capture_score(pfx_capture * cap, float * out);
// Copy captured rows of scoring layer index `i` to the host, as float32: kind 'K' gives keys
// [0, query_start) ([rows, n_head_kv, head_dim]), 'Q' the query rows ([rows, n_head, head_dim]).
bool pfx_capture_read(pfx_capture * cap, int32_t i, char kind, float * out);

// The same attention mass on host arrays q [n_tokens, n_head, head_dim] and k [n_tokens, n_head_kv,
// head_dim] (float32, contiguous), on the CPU (use_gpu false) or the GPU. Returns as pfx_capture_score.
int pfx_attention_mass(const float * q, const float * k, int32_t n_tokens, int32_t n_head, int32_t n_head_kv,
                       int32_t head_dim, int32_t query_start, int32_t query_end, bool use_gpu, int32_t n_threads,
                       float * out);

// One row of a decode step to sample on the host (sample_cpu.cpp): llama.cpp's top-k -> top-p ->
// min-p -> temperature -> dist, or the argmax where temperature <= 0.
typedef struct pfx_sample_row {
    int64_t row;        // the row of the step's logits
    double uniform;     // in [0, 1): the draw, from the request's own generator
    float temperature;  // <= 0: greedy
    float top_p;        // >= 1: off
    float min_p;        // <= 0: off
    int32_t top_k;      // <= 0 or >= n_vocab: off
} pfx_sample_row;

// tokens[r] for each of rows (logits [*, n_vocab] float32, contiguous), on up to n_threads threads;
// -1 where a greedy row holds a NaN or a sampled row's max is not finite (the caller decides).
// Returns 0, or 1 on invalid arguments.
int32_t pfx_sample_rows(const float * logits, int64_t n_vocab, const pfx_sample_row * rows, int32_t n_rows,
                        int32_t * tokens, int32_t n_threads);

// Structured output's masks (mask_cpu.cpp): in each of rows of logits [*, n_vocab] (float32,
// contiguous), -inf where bit t of its mask (masks [*, mask_words] uint32, row mask_rows[r]) is 0.
// Returns 0, or 1 on invalid arguments.
int32_t pfx_apply_bitmask(float * logits, int64_t n_vocab, const int64_t * rows, const uint32_t * masks,
                          int64_t mask_words, const int64_t * mask_rows, int32_t n_rows, int32_t n_threads);

// The log filter (log_filter.cpp): llama.cpp's, ggml's and libmtmd's log callback, which hands a line
// to `forward` (the Python callback, llama/log.py) only at `min_level` or above (ggml_log_level:
// DEBUG 1, INFO 2, WARN 3, ERROR 4; NONE 0 counts as INFO; CONT 5 continues the last line and goes
// where it went, per thread). A Python callback takes the GIL for each line, and on a busy process
// that waits out the switch interval (5 ms): libmtmd writes 5 debug lines an image as it reads one.
typedef void (*pfx_log_callback)(int32_t level, const char * text, void * user_data);
void pfx_log_forward(pfx_log_callback forward, int32_t min_level);
void pfx_log_filter(int32_t level, const char * text, void * user_data);

#ifdef __cplusplus
}
#endif
