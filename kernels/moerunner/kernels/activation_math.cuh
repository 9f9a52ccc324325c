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

// The activation of one kind as a callable (gate, up) -> value; `up` is unused when !gated.
template <activation_kind Kind>
struct activation_fn {
  bool gated;
  float alpha, limit;  // swiglu_clamped's
  __device__ __forceinline__ float operator()(float gate, float up) const {
    if constexpr (Kind == activation_kind::silu) return gated ? silu(gate) * up : silu(gate);
    else if constexpr (Kind == activation_kind::gelu) return gated ? gelu(gate) * up : gelu(gate);
    else return swiglu_clamped(gate, up, alpha, limit);
  }
};

// Any kind, chosen per value: a branch on the kind around each one.
struct activation_any {
  activation a;
  bool gated;
  __device__ __forceinline__ float operator()(float gate, float up) const {
    switch (a.kind) {
      case activation_kind::silu: return activation_fn<activation_kind::silu>{gated, a.alpha, a.limit}(gate, up);
      case activation_kind::gelu: return activation_fn<activation_kind::gelu>{gated, a.alpha, a.limit}(gate, up);
      case activation_kind::swiglu_clamped:
        return activation_fn<activation_kind::swiglu_clamped>{gated, a.alpha, a.limit}(gate, up);
    }
    return 0.0f;
  }
};

// Calls f(fn) with a callable for a's kind, so that a loop over many values inside f has no
// branch on the kind per value: ptxas does not hoist the switch out of an unrolled loop, and
// GEMM1's wgmma epilogues carried a three-way branch around every value (bench/NOTES.md, round
// 16). gelu keeps the per-value branch (activation_any): its erfcf evaluated over many values
// at once spilled beside the wgmma kernels' accumulators, and the branch keeps one live.
template <class F>
__device__ __forceinline__ void with_activation(const activation& a, bool gated, F&& f) {
  switch (a.kind) {
    case activation_kind::silu: f(activation_fn<activation_kind::silu>{gated, a.alpha, a.limit}); return;
    case activation_kind::swiglu_clamped:
      f(activation_fn<activation_kind::swiglu_clamped>{gated, a.alpha, a.limit});
      return;
    case activation_kind::gelu: f(activation_any{a, gated}); return;
  }
}

// gate/up -> one intermediate value; `up` is unused when !gated.
__device__ __forceinline__ float apply_activation(const activation& a, bool gated, float gate, float up) {
  return activation_any{a, gated}(gate, up);
}

}  // namespace moerunner::kernels
