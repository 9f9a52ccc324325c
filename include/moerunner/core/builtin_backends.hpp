// The one list of built-in backends. Predicates, the name table, name-clash checks
// and the README's table are all derived from it; the policy type list in
// <moerunner/policies/builtin_policies.cuh> is checked against it at compile time.
//
// It is a macro list, not a type list, because backend names must be usable in
// host-only translation units that cannot include the CUDA policy headers.
#pragma once

// X(identifier, "name", "what it is")
#define MOERUNNER_BUILTIN_BACKENDS(X)                                                        \
  X(reference, "reference", "CPU oracle: the whole pipeline on the host, f32 math with f64 sums") \
  X(cuda_fused, "cuda_fused", "fused CUDA kernels: grouped tensor-core GEMMs with fused activation") \
  X(cublas_grouped, "cublas_grouped", "cuBLAS grouped GEMM for both GEMMs, project kernels for the rest") \
  X(cuda_fused_fp8, "cuda_fused_fp8", "fused CUDA kernels in fp8 e4m3 with 128x128 block scales (Hopper wgmma, sm_90a)")
