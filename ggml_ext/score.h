// Internal interface between the capture (capture.cpp) and the attention-mass kernels.
#pragma once
#include <cstddef>
#include <string>

// One scoring layer's inputs: q holds the query rows [n_query][n_head][head_dim], k the keys
// [n_keys][n_head_kv][head_dim], both float32 and contiguous.
struct pfx_shape {
    int n_keys, n_query, n_head, n_head_kv, head_dim;
};

// Attention mass of every key, max over layers, into out[n_keys]. 0: ok; 1: a logit or a mass is
// not finite; -1: another error (in err).
int pfx_cpu_attention_mass(const float * const * q, const float * const * k, int n_layers, const pfx_shape & shape,
                           int n_threads, float * out, std::string & err);

#ifdef PFX_GPU
// Device helpers (CUDA or HIP, one source). Pointers may be host or device memory (unified
// addressing); every call finishes its work before it returns.
int pfx_gpu_device_count();
void * pfx_gpu_alloc(size_t bytes, int device, std::string & err);
void pfx_gpu_free(void * ptr, int device);
// dst (device, float32) <- src (host or device, float32 or float16), n elements.
bool pfx_gpu_copy(float * dst, const void * src, size_t n, bool src_f16, int device, std::string & err);
bool pfx_gpu_read(float * host_dst, const float * src, size_t n, int device, std::string & err);
int pfx_gpu_attention_mass(const float * const * q, const float * const * k, int n_layers, const pfx_shape & shape,
                           int device, float * out, std::string & err);
#endif
