// One GPU source for CUDA and HIP: the CUDA runtime names, mapped to HIP on AMD.
#pragma once
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaGetErrorString hipGetErrorString
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDefault hipMemcpyDefault
#define cudaMemsetAsync hipMemsetAsync
#define cudaStream_t hipStream_t
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamDestroy hipStreamDestroy
#define cudaGetLastError hipGetLastError
#define PFX_SHFL_XOR(v, m) __shfl_xor(v, m)
#define PFX_GPU_NAME "hip"
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define PFX_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, v, m)
#define PFX_GPU_NAME "cuda"
#endif
