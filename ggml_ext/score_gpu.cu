// Attention mass on a GPU (CUDA, or HIP from the same source through gpu_compat.h).
//
// Rows are (query head, query token) pairs; keys are the prompt tokens before the query. Three
// passes per layer, none storing the [rows x keys] logits: (1) per key tile, each row's max and sum
// of exp; (2) per row, the tiles combined; (3) per key, the sum over rows of the softmax weight,
// recomputing the logits (dot products are cheap next to a [rows x keys] buffer at 128K keys).
// One thread per key; the tile's query rows sit in shared memory, ROWS at a time.
#include <cmath>
#include <string>

#define PFX_GPU 1  // this file is the GPU backend
#include "gpu_compat.h"
#include "score.h"

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_fp16.h>
#endif

namespace {

constexpr int THREADS = 256;
constexpr int ROWS = 16;  // query rows per pass over a key tile
constexpr int MAX_WARPS = THREADS / 32;

struct Dims {
    int n_keys, n_query, n_head, n_head_kv, head_dim, group, rows_per_kv;
    float scale;
};

__device__ inline float warp_max(float v) {
    for (int m = warpSize / 2; m > 0; m >>= 1) v = fmaxf(v, PFX_SHFL_XOR(v, m));
    return v;
}

__device__ inline float warp_sum(float v) {
    for (int m = warpSize / 2; m > 0; m >>= 1) v += PFX_SHFL_XOR(v, m);
    return v;
}

// Loads rows [r0, r0 + ROWS) of kv head g (scaled) into shared memory; returns how many exist.
__device__ int load_rows(const float * q, const Dims & d, int g, int r0, float * q_sh) {
    const int rows = min(ROWS, d.rows_per_kv - r0);
    for (int i = threadIdx.x; i < rows * d.head_dim; i += blockDim.x) {
        const int b = i / d.head_dim, x = i % d.head_dim, r = r0 + b;
        const int h = g * d.group + r / d.n_query, t = r % d.n_query;
        q_sh[i] = q[((size_t)t * d.n_head + h) * d.head_dim + x] * d.scale;
    }
    __syncthreads();
    return rows;
}

__device__ void row_logits(const float * q_sh, const float * kj, int rows, int head_dim, float * acc) {
#pragma unroll
    for (int b = 0; b < ROWS; ++b) acc[b] = 0.0f;
    for (int x = 0; x < head_dim; ++x) {
        const float kv = kj[x];
#pragma unroll
        for (int b = 0; b < ROWS; ++b)
            if (b < rows) acc[b] += q_sh[b * head_dim + x] * kv;
    }
}

// Pass 1: per (key tile, kv head), each row's max and sum of exp over the tile's keys.
__global__ void tile_stats(const float * q, const float * k, Dims d, float * tile_max, float * tile_sum, int * bad) {
    extern __shared__ float q_sh[];
    __shared__ float red[MAX_WARPS][ROWS];
    __shared__ float row_max[ROWS];
    const int g = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    const bool valid = j < d.n_keys;
    const int warp = threadIdx.x / warpSize, lane = threadIdx.x % warpSize, n_warps = blockDim.x / warpSize;
    const int total_rows = d.n_head * d.n_query;
    const float * kj = k + ((size_t)(valid ? j : 0) * d.n_head_kv + g) * d.head_dim;
    for (int r0 = 0; r0 < d.rows_per_kv; r0 += ROWS) {
        const int rows = load_rows(q, d, g, r0, q_sh);
        float acc[ROWS];
        row_logits(q_sh, kj, rows, d.head_dim, acc);
        for (int b = 0; b < rows; ++b) {
            if (valid && !isfinite(acc[b])) atomicOr(bad, 1);
            float m = warp_max(valid ? acc[b] : -INFINITY);
            if (lane == 0) red[warp][b] = m;
        }
        __syncthreads();
        if (threadIdx.x < rows) {
            float m = -INFINITY;
            for (int w = 0; w < n_warps; ++w) m = fmaxf(m, red[w][threadIdx.x]);
            row_max[threadIdx.x] = m;
        }
        __syncthreads();
        for (int b = 0; b < rows; ++b) {
            float s = warp_sum(valid ? expf(acc[b] - row_max[b]) : 0.0f);
            if (lane == 0) red[warp][b] = s;
        }
        __syncthreads();
        if (threadIdx.x < rows) {
            float s = 0.0f;
            for (int w = 0; w < n_warps; ++w) s += red[w][threadIdx.x];
            const size_t row = (size_t)g * d.rows_per_kv + r0 + threadIdx.x;
            tile_max[(size_t)blockIdx.x * total_rows + row] = row_max[threadIdx.x];
            tile_sum[(size_t)blockIdx.x * total_rows + row] = s;
        }
        __syncthreads();
    }
}

// Pass 2: per row, the tiles' (max, sum) combined into the row's max and 1 / sum.
__global__ void combine_rows(const float * tile_max, const float * tile_sum, int n_tiles, int total_rows,
                             float * row_max, float * row_inv_sum) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= total_rows) return;
    float m = -INFINITY;
    for (int t = 0; t < n_tiles; ++t) m = fmaxf(m, tile_max[(size_t)t * total_rows + r]);
    float s = 0.0f;
    for (int t = 0; t < n_tiles; ++t) s += tile_sum[(size_t)t * total_rows + r] * expf(tile_max[(size_t)t * total_rows + r] - m);
    row_max[r] = m;
    row_inv_sum[r] = 1.0f / s;
}

// Pass 3: per key and kv head, the sum over that kv head's rows of the softmax weight.
__global__ void key_mass(const float * q, const float * k, Dims d, const float * row_max, const float * row_inv_sum,
                         float * partial) {
    extern __shared__ float q_sh[];
    const int g = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    const bool valid = j < d.n_keys;
    const float * kj = k + ((size_t)(valid ? j : 0) * d.n_head_kv + g) * d.head_dim;
    float mass = 0.0f;
    for (int r0 = 0; r0 < d.rows_per_kv; r0 += ROWS) {
        const int rows = load_rows(q, d, g, r0, q_sh);
        float acc[ROWS];
        row_logits(q_sh, kj, rows, d.head_dim, acc);
        const size_t base = (size_t)g * d.rows_per_kv + r0;
        for (int b = 0; b < rows; ++b) mass += expf(acc[b] - row_max[base + b]) * row_inv_sum[base + b];
        __syncthreads();
    }
    if (valid) partial[(size_t)g * d.n_keys + j] = mass;
}

// Pass 4: the kv heads summed and normalised; the max over layers kept in out.
__global__ void finish_layer(const float * partial, Dims d, float norm, bool first, float * out, int * bad) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d.n_keys) return;
    float v = 0.0f;
    for (int g = 0; g < d.n_head_kv; ++g) v += partial[(size_t)g * d.n_keys + j];
    v *= norm;
    if (!isfinite(v)) atomicOr(bad, 1);
    out[j] = first ? v : fmaxf(out[j], v);
}

__global__ void half_to_float(const __half * src, float * dst, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __half2float(src[i]);
}

// Runs fn on `device` with a private non-blocking stream, restoring the caller's device.
struct DeviceScope {
    int previous = -1;
    cudaStream_t stream = nullptr;
    cudaError_t status = cudaSuccess;
    explicit DeviceScope(int device) {
        if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
        status = cudaSetDevice(device);
        if (status == cudaSuccess) status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    }
    ~DeviceScope() {
        if (stream) (void)cudaStreamDestroy(stream);
        if (previous >= 0) (void)cudaSetDevice(previous);
    }
};

bool check(cudaError_t status, const char * what, std::string & err) {
    if (status == cudaSuccess) return true;
    err = std::string(what) + ": " + cudaGetErrorString(status);
    return false;
}

struct Scratch {
    void * ptr = nullptr;
    int device;
    explicit Scratch(int dev) : device(dev) {}
    ~Scratch() { pfx_gpu_free(ptr, device); }
};

}  // namespace

int pfx_gpu_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky "no device" error
        return 0;
    }
    return n;
}

void * pfx_gpu_alloc(size_t bytes, int device, std::string & err) {
    DeviceScope scope(device);
    void * ptr = nullptr;
    if (!check(scope.status, "selecting the GPU", err)) return nullptr;
    if (!check(cudaMalloc(&ptr, bytes ? bytes : 1), "allocating GPU memory for PFlash captures", err)) return nullptr;
    return ptr;
}

void pfx_gpu_free(void * ptr, int device) {
    if (!ptr) return;
    DeviceScope scope(device);
    (void)cudaFree(ptr);
}

bool pfx_gpu_copy(float * dst, const void * src, size_t n, bool src_f16, int device, std::string & err) {
    DeviceScope scope(device);
    if (!check(scope.status, "selecting the GPU", err)) return false;
    if (!src_f16) {
        return check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDefault, scope.stream), "copying a capture", err) &&
               check(cudaStreamSynchronize(scope.stream), "copying a capture", err);
    }
    Scratch staging(device);
    staging.ptr = pfx_gpu_alloc(n * sizeof(__half), device, err);
    if (!staging.ptr) return false;
    if (!check(cudaMemcpyAsync(staging.ptr, src, n * sizeof(__half), cudaMemcpyDefault, scope.stream), "copying a capture", err))
        return false;
    half_to_float<<<(unsigned)((n + THREADS - 1) / THREADS), THREADS, 0, scope.stream>>>((const __half *)staging.ptr, dst, n);
    return check(cudaGetLastError(), "converting a capture", err) &&
           check(cudaStreamSynchronize(scope.stream), "converting a capture", err);
}

bool pfx_gpu_read(float * host_dst, const float * src, size_t n, int device, std::string & err) {
    DeviceScope scope(device);
    if (!check(scope.status, "selecting the GPU", err)) return false;
    return check(cudaMemcpyAsync(host_dst, src, n * sizeof(float), cudaMemcpyDefault, scope.stream), "reading a capture", err) &&
           check(cudaStreamSynchronize(scope.stream), "reading a capture", err);
}

int pfx_gpu_attention_mass(const float * const * q, const float * const * k, int n_layers, const pfx_shape & s,
                           int device, float * out, std::string & err) {
    if (s.n_keys < 1 || s.n_query < 1 || s.n_head < 1 || s.n_head_kv < 1 || s.n_head % s.n_head_kv) {
        err = "invalid attention shape";
        return -1;
    }
    DeviceScope scope(device);
    if (!check(scope.status, "selecting the GPU", err)) return -1;
    Dims d{s.n_keys, s.n_query, s.n_head, s.n_head_kv, s.head_dim, s.n_head / s.n_head_kv,
           (s.n_head / s.n_head_kv) * s.n_query, 1.0f / sqrtf((float)s.head_dim)};
    const int n_tiles = (s.n_keys + THREADS - 1) / THREADS;
    const size_t total_rows = (size_t)s.n_head * s.n_query;
    // tile stats, row stats, per-kv-head partial mass, the result, and the non-finite flag
    const size_t floats = 2 * n_tiles * total_rows + 2 * total_rows + (size_t)s.n_head_kv * s.n_keys + s.n_keys;
    Scratch scratch(device);
    scratch.ptr = pfx_gpu_alloc(floats * sizeof(float) + sizeof(int), device, err);
    if (!scratch.ptr) return -1;
    float * tile_max = (float *)scratch.ptr;
    float * tile_sum = tile_max + n_tiles * total_rows;
    float * row_max = tile_sum + n_tiles * total_rows;
    float * row_inv_sum = row_max + total_rows;
    float * partial = row_inv_sum + total_rows;
    float * result = partial + (size_t)s.n_head_kv * s.n_keys;
    int * bad = (int *)(result + s.n_keys);
    if (!check(cudaMemsetAsync(bad, 0, sizeof(int), scope.stream), "scoring", err)) return -1;
    const size_t shared = (size_t)ROWS * s.head_dim * sizeof(float);
    const dim3 tiles(n_tiles, s.n_head_kv);
    const float norm = 1.0f / (float)total_rows;
    for (int l = 0; l < n_layers; ++l) {
        tile_stats<<<tiles, THREADS, shared, scope.stream>>>(q[l], k[l], d, tile_max, tile_sum, bad);
        combine_rows<<<(unsigned)((total_rows + THREADS - 1) / THREADS), THREADS, 0, scope.stream>>>(
            tile_max, tile_sum, n_tiles, (int)total_rows, row_max, row_inv_sum);
        key_mass<<<tiles, THREADS, shared, scope.stream>>>(q[l], k[l], d, row_max, row_inv_sum, partial);
        finish_layer<<<n_tiles, THREADS, 0, scope.stream>>>(partial, d, norm, l == 0, result, bad);
        if (!check(cudaGetLastError(), "launching the scoring kernels", err)) return -1;
    }
    int flag = 0;
    if (!check(cudaMemcpyAsync(out, result, s.n_keys * sizeof(float), cudaMemcpyDefault, scope.stream), "reading scores", err) ||
        !check(cudaMemcpyAsync(&flag, bad, sizeof(int), cudaMemcpyDefault, scope.stream), "reading scores", err) ||
        !check(cudaStreamSynchronize(scope.stream), "scoring", err))
        return -1;
    return flag ? 1 : 0;
}
