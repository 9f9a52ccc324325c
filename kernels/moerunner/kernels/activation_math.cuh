// The gated activations in f32 on the device, shared by the activation kernel and
// the GEMM epilogues so that every backend computes the same function.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/activation_math.cuh needs nvcc: include it from a .cu file"
#endif

#include "moerunner/core/config.hpp"

namespace moerunner::kernels {

// x / (1 + e^-g) through the SFU: ex2 and an approximate reciprocal, within 2 + 1.16|g| ulp
// of f32 (below 2e-5 relative), far under the 16-bit output's rounding, at a fraction of the
// cost of expf and an IEEE division (GEMM1's epilogue runs it on every output while the
// tensor cores wait; see bench/NOTES.md, round 4). g = -inf gives NaN, as the division did;
// a denominator past 2^126 (g < -87.3) gives 0, where silu's true value is under 2e-36 in
// magnitude.
__device__ __forceinline__ float sigmoid_mul(float x, float g) { return __fdividef(x, 1.0f + __expf(-g)); }

__device__ __forceinline__ float silu(float g) { return sigmoid_mul(g, g); }

// Exact (erf) GELU, as the reference defines it; erfc(-x) = 1 + erf(x) without the cancellation
// that costs 1 + erff its relative accuracy for negative inputs.
__device__ __forceinline__ float gelu(float g) { return 0.5f * g * erfcf(-g * 0.70710678118654752f); }

// Comparisons written as std::min/std::clamp do, so a NaN input stays NaN (fminf would drop it).
__device__ __forceinline__ float swiglu_clamped(float gate, float up, float alpha, float limit) {
  const float g = limit < gate ? limit : gate;
  const float u = up < -limit ? -limit : (limit < up ? limit : up);
  return sigmoid_mul((u + 1.0f) * g, alpha * g);
}

// gate/up -> one intermediate value; `up` is unused when !gated.
__device__ __forceinline__ float apply_activation(const activation& a, bool gated, float gate, float up) {
  switch (a.kind) {
    case activation_kind::silu: return gated ? silu(gate) * up : silu(gate);
    case activation_kind::gelu: return gated ? gelu(gate) * up : gelu(gate);
    case activation_kind::swiglu_clamped: return swiglu_clamped(gate, up, a.alpha, a.limit);
  }
  return 0.0f;
}

}  // namespace moerunner::kernels
