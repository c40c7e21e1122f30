// Vectors of 8 floats by GCC/Clang vector extensions (SIMD without intrinsics), for the scorer and
// the sampler.
#pragma once
#include <cstring>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
constexpr int LANES = 8;

inline v8f load8(const float * p) {
    v8f v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store8(float * p, v8f v) { std::memcpy(p, &v, sizeof v); }

// e^x for x <= 0 (relative error < 2e-7): x = n ln2 + f with |f| <= ln2/2, degree-7 Taylor for e^f.
inline v8f exp8(v8f x) {
    const v8f lo = v8f{} - 87.0f;
    x = x < lo ? lo : x;
    v8f t = x * 1.44269504088896341f - 0.5f;  // round to nearest for t <= 0: truncate t - 0.5
    v8i n = __builtin_convertvector(t, v8i);
    v8f f = x - __builtin_convertvector(n, v8f) * 0.693147180559945309f;
    v8f p = v8f{} + 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    v8i bits = (n + 127) << 23;
    v8f scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

}  // namespace
