// Float functions that give the same bits on the host and on the GPU.
//
// Routing must pick the same experts on both sides, including near-ties, so the
// reference and the routing kernel share these: only IEEE-exact operations (fma,
// add, multiply, divide, rint, ldexp), never the libraries' exp, whose last-bit
// rounding differs between glibc and CUDA.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define MOERUNNER_HD __host__ __device__
#else
#define MOERUNNER_HD
#endif

namespace moerunner::portable {

MOERUNNER_HD inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MOERUNNER_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);  // never contracted into an fma
#else
  return a + b;
#endif
}

MOERUNNER_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOERUNNER_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// exp(x) within 1 ulp of the correctly rounded result (checked over every float), bit-identical
// on host and device.
MOERUNNER_HD inline float exp(float x) {
  if (x != x) return x;
  if (x > 88.72283f) return std::numeric_limits<float>::infinity();
  if (x < -103.97208f) return 0.0f;
  // x = n ln2 + r with |r| <= ln2/2; ln2 split in two so r is exact enough.
  const float n = rintf(mul_rn(x, 1.44269504f));
  float r = fma_rn(-n, 0.693145752f, x);
  r = fma_rn(-n, 1.42860677e-06f, r);
  // Degree-7 Taylor/Horner for e^r on |r| <= 0.347: truncation error below 2^-27
  // (degree 6 leaves 2^-23, which puts some results 3 ulp off).
  float p = 1.0f / 5040.0f;
  p = fma_rn(p, r, 1.0f / 720.0f);
  p = fma_rn(p, r, 1.0f / 120.0f);
  p = fma_rn(p, r, 1.0f / 24.0f);
  p = fma_rn(p, r, 1.0f / 6.0f);
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.0f);
  p = fma_rn(p, r, 1.0f);
  // Scale by 2^n in two exact steps so subnormal results stay correct.
  const int ni = static_cast<int>(n);
  const int half = ni / 2;
  return ldexpf(ldexpf(p, half), ni - half);
}

MOERUNNER_HD inline float sigmoid(float x) { return div_rn(1.0f, add_rn(1.0f, exp(-x))); }

}  // namespace moerunner::portable
