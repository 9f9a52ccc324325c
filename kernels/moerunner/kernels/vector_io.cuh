// Loads and stores of VEC consecutive elements as f32, in one 16-byte access (two for f32
// stores of 8) when VEC == 8, element by element otherwise. Callers guarantee the alignment.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/vector_io.cuh needs nvcc: include it from a .cu file"
#endif

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moerunner::kernels {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return v;
}

// L2Only: ld.global.cg, past L1 (data other CTAs of the running kernel wrote: L1 is not
// coherent with them); 16-byte vectors only.
template <int VEC, bool L2Only = false, class T>
__device__ __forceinline__ void load_f32(const T* p, float (&v)[VEC]) {
  static_assert(!L2Only || VEC == 8, "the loads through L2 are 16-byte vectors");
  if constexpr (VEC == 8 && sizeof(T) == 2) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    const uint4 raw = L2Only ? __ldcg(q) : *q;
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
  } else if constexpr (VEC == 8 && std::is_same_v<T, float>) {
    const float4* q = reinterpret_cast<const float4*>(p);
    const float4 a = L2Only ? __ldcg(q) : q[0], b = L2Only ? __ldcg(q + 1) : q[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(p[i]);
  }
}

template <int VEC, class T>
__device__ __forceinline__ void store_f32(T* p, const float (&v)[VEC]) {
  if constexpr (VEC == 8 && sizeof(T) == 2) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_f32<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (VEC == 8 && std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = from_f32<T>(v[i]);
  }
}

}  // namespace moerunner::kernels
