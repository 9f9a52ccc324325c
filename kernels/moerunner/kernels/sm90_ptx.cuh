// PTX wrappers of the sm_90a instructions the Hopper wgmma grouped GEMM runs on: wgmma and its
// fences, setmaxnreg, the shared-memory matrix descriptor, and the mbarrier and cluster
// operations that cuda::ptx does not spell as used here. Each compiles to nothing (or a trap)
// in code for other architectures, whose kernels never call them.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_ptx.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// wgmma, setmaxnreg and the 128-byte-swizzle descriptors exist only in sm_90a code.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOERUNNER_WGMMA_COMPILED 1
#else
#define MOERUNNER_WGMMA_COMPILED 0
#endif

namespace moerunner::kernels {

namespace sm90_detail {
__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
}  // namespace sm90_detail

// One m64n256k16 wgmma, A and B from shared memory (descriptors), D += A*B in f32;
// ab_type is the PTX spelling of the 16-bit input type.
#define MOERUNNER_WGMMA_M64N256K16(ab_type) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." ab_type "." ab_type " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
        "%128, %129, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "r"(1));

template <class T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma inputs here are bf16 or f16");
#if MOERUNNER_WGMMA_COMPILED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    MOERUNNER_WGMMA_M64N256K16("bf16")
  } else {
    MOERUNNER_WGMMA_M64N256K16("f16")
  }
#else
  (void)d, (void)desc_a, (void)desc_b;
  __trap();
#endif
}

#undef MOERUNNER_WGMMA_M64N256K16

// One m64n64k16 wgmma: as above with 32 accumulators per thread.
#define MOERUNNER_WGMMA_M64N64K16(ab_type) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." ab_type "." ab_type " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
        "%32, %33, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b), "r"(1));

template <class T>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], std::uint64_t desc_a, std::uint64_t desc_b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma inputs here are bf16 or f16");
#if MOERUNNER_WGMMA_COMPILED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    MOERUNNER_WGMMA_M64N64K16("bf16")
  } else {
    MOERUNNER_WGMMA_M64N64K16("f16")
  }
#else
  (void)d, (void)desc_a, (void)desc_b;
  __trap();
#endif
}

#undef MOERUNNER_WGMMA_M64N64K16

// One m64n128k32 wgmma on fp8 e4m3 A and B (both K-major in shared memory, the only layout fp8
// takes), D = A*B + (scale_d ? D : 0) in f32: scale_d 0 starts a fresh sum without zeroing D.
// The tensor cores sum fp8 products with fewer mantissa bits than f32 keeps; callers add each
// 128-K block's sum into f32 registers themselves (see sm90_kernel_grouped_gemm_wgmma_fp8.cuh).
// con is the accumulators' constraint: "+f" (D read and written), or "=f" for a sum's first wgmma
// (scale-d 0): D declared written only, so a sum's registers are free from its last read to the
// next sum's first wgmma (with "+f" they stay live through whatever lies between, an epilogue
// included). scale is the scale-d operand.
#define MOERUNNER_WGMMA_M64N128K32_E4M3(con, scale) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
        "%64, %65, p, 1, 1;\n}\n" \
        : con(d[0]), con(d[1]), con(d[2]), con(d[3]), con(d[4]), con(d[5]), con(d[6]), con(d[7]), \
          con(d[8]), con(d[9]), con(d[10]), con(d[11]), con(d[12]), con(d[13]), con(d[14]), con(d[15]), \
          con(d[16]), con(d[17]), con(d[18]), con(d[19]), con(d[20]), con(d[21]), con(d[22]), con(d[23]), \
          con(d[24]), con(d[25]), con(d[26]), con(d[27]), con(d[28]), con(d[29]), con(d[30]), con(d[31]), \
          con(d[32]), con(d[33]), con(d[34]), con(d[35]), con(d[36]), con(d[37]), con(d[38]), con(d[39]), \
          con(d[40]), con(d[41]), con(d[42]), con(d[43]), con(d[44]), con(d[45]), con(d[46]), con(d[47]), \
          con(d[48]), con(d[49]), con(d[50]), con(d[51]), con(d[52]), con(d[53]), con(d[54]), con(d[55]), \
          con(d[56]), con(d[57]), con(d[58]), con(d[59]), con(d[60]), con(d[61]), con(d[62]), con(d[63]) \
        : "l"(desc_a), "l"(desc_b), scale);

__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                                      int scale_d) {
#if MOERUNNER_WGMMA_COMPILED
  MOERUNNER_WGMMA_M64N128K32_E4M3("+f", "r"(scale_d))
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
  __trap();
#endif
}

// The first of a sum's wgmma: scale-d 0, D written only.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_fresh(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b) {
#if MOERUNNER_WGMMA_COMPILED
  MOERUNNER_WGMMA_M64N128K32_E4M3("=f", "n"(0))
#else
  (void)d, (void)desc_a, (void)desc_b;
  __trap();
#endif
}

#undef MOERUNNER_WGMMA_M64N128K32_E4M3

// One m64nNk32 wgmma on e4m3 A and B (K-major in shared memory) for N = 8, 16 or 32 (N / 2
// accumulators per thread, the same D layout as the wider shapes): D = A*B + (scale_d ? D : 0).
// The narrow decode tiles put 64 weight rows in A and N tokens in B.
template <int N>
__device__ __forceinline__ void wgmma_m64nk32_e4m3(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b,
                                                   int scale_d) {
  static_assert(N == 8 || N == 16 || N == 32, "narrow wgmma shapes: n8, n16 or n32");
#if MOERUNNER_WGMMA_COMPILED
  if constexpr (N == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
  __trap();
#endif
}

// One m64nNk16 wgmma on 16-bit A and B (bf16 or f16, K-major in shared memory) for N = 8, 16 or
// 32: D = A*B + (scale_d ? D : 0), the D layout of the wider shapes. The 16-bit narrow decode
// tiles put 64 weight rows in A and N tokens in B.
#define MOERUNNER_WGMMA_M64NK16(shape, ab_type, pred, ...) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " pred ", 0;\n" \
                 "wgmma.mma_async.sync.aligned." shape ".f32." ab_type "." ab_type " " __VA_ARGS__)
template <class T, int N>
__device__ __forceinline__ void wgmma_m64nk16(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b,
                                              int scale_d) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma inputs here are bf16 or f16");
  static_assert(N == 8 || N == 16 || N == 32, "narrow wgmma shapes: n8, n16 or n32");
#if MOERUNNER_WGMMA_COMPILED
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 8) {
#define MOERUNNER_N8(ab) \
    MOERUNNER_WGMMA_M64NK16("m64n8k16", ab, "%6", "{%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n" \
                            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
                            : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (bf16) MOERUNNER_N8("bf16");
    else MOERUNNER_N8("f16");
#undef MOERUNNER_N8
  } else if constexpr (N == 16) {
#define MOERUNNER_N16(ab) \
    MOERUNNER_WGMMA_M64NK16("m64n16k16", ab, "%10", "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n" \
                            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
                              "+f"(d[7]) \
                            : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (bf16) MOERUNNER_N16("bf16");
    else MOERUNNER_N16("f16");
#undef MOERUNNER_N16
  } else {
#define MOERUNNER_N32(ab) \
    MOERUNNER_WGMMA_M64NK16("m64n32k16", ab, "%18", \
                            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, " \
                            "0, 0;\n}\n" \
                            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
                              "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
                              "+f"(d[14]), "+f"(d[15]) \
                            : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (bf16) MOERUNNER_N32("bf16");
    else MOERUNNER_N32("f16");
#undef MOERUNNER_N32
  }
#else
  (void)d, (void)desc_a, (void)desc_b, (void)scale_d;
  __trap();
#endif
}

#undef MOERUNNER_WGMMA_M64NK16

__device__ __forceinline__ void wgmma_fence() {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of the accumulators across a wgmma wait:
// the asm operands of an issued wgmma look written at issue, but are written at retirement.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}

template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: rows of
// 128 bytes (64 elements of K), 8-row groups 1024 bytes apart (stride byte offset), the group
// base 1024-byte aligned (base offset 0); the leading byte offset is unused because one wgmma
// reads K 16 elements = 32 bytes, inside a row. Stepping K by 16 inside the 64-element row
// adds 32 bytes to the start address: the hardware applies the XOR swizzle to the full address.
__device__ __forceinline__ std::uint64_t sw128_kmajor_desc(std::uint32_t smem_addr) {
  constexpr std::uint64_t leading_byte_offset = 16 >> 4;
  constexpr std::uint64_t stride_byte_offset = 1024 >> 4;
  constexpr std::uint64_t swizzle_128b = 1;
  return static_cast<std::uint64_t>((smem_addr & 0x3ffff) >> 4) | (leading_byte_offset << 16) |
         (stride_byte_offset << 32) | (swizzle_128b << 62);
}

// Arrives on `bar` once every cp.async this thread issued before has landed; counts as one of
// the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(sm90_detail::shared_address(bar))
               : "memory");
}

// One box of a 4D tensor map (coordinates innermost first) into shared memory at `dst`, its bytes
// counted on `bar`; with Cluster > 1 multicast into the same offset, and onto the same barrier, of
// every CTA of the cluster.
template <int Cluster>
__device__ __forceinline__ void tma_load_box(void* dst, const void* map, const std::int32_t (&coords)[4],
                                             std::uint64_t* bar) {
  if constexpr (Cluster == 1)
    cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords, bar);
  else
    cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, dst, map, coords, bar,
                                    static_cast<std::uint16_t>((1u << Cluster) - 1));
}

// With MOERUNNER_BARRIER_WATCHDOG defined (a debugging build: meson setup
// -Dcuda_args=-DMOERUNNER_BARRIER_WATCHDOG), a wait whose phase has not completed after 2^33
// cycles (seconds) prints the barrier's shared-memory address, the parity, the block, thread and
// cluster rank, and traps: a protocol hang then fails and says where it stalled.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, std::uint32_t parity) {
#if defined(MOERUNNER_BARRIER_WATCHDOG)
  const long long start = clock64();
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
    if (clock64() - start > (1ll << 33)) {
      printf("moerunner: mbarrier wait stalled: smem 0x%x parity %u block %u thread %u cluster rank %u\n",
             sm90_detail::shared_address(bar), parity, blockIdx.x, threadIdx.x, cuda::ptx::get_sreg_cluster_ctarank());
      __trap();
    }
  }
#else
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

// Arrives on the mbarrier at `bar`'s offset in the shared memory of the cluster's CTA `rank`,
// with the default (CTA-scope release) semantics: what the arrival orders is this warp's
// wgmma reads of the stage, retired before it, against the peer's TMA overwriting it. A
// cluster-scope release would also wait for the warp's earlier global stores (the epilogue's).
__device__ __forceinline__ void mbarrier_arrive_cluster(std::uint64_t* bar, std::uint32_t rank) {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(sm90_detail::shared_address(bar)),
      "r"(rank)
      : "memory");
#else
  (void)bar, (void)rank;
#endif
}

// One arrival on this CTA's `bar` (and with Peer on the same barrier of cluster CTA `rank`), made
// by the threads where `p` holds as predicated instructions: ptxas counts a branch as a divergent
// path, and serializes wgmma whose groups are in flight across one.
template <bool Peer>
__device__ __forceinline__ void mbarrier_arrive_where(bool p, std::uint64_t* bar, std::uint32_t rank) {
#if MOERUNNER_WGMMA_COMPILED
  if constexpr (Peer)
    asm volatile(
        "{\n.reg .pred p;\n.reg .b32 remote;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "mapa.shared::cluster.u32 remote, %0, %2;\n"
        "@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(sm90_detail::shared_address(bar)),
        "r"(static_cast<std::uint32_t>(p)), "r"(rank)
        : "memory");
  else
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(sm90_detail::shared_address(bar)),
        "r"(static_cast<std::uint32_t>(p))
        : "memory");
#else
  (void)p, (void)bar, (void)rank;
#endif
}

// Every thread of every CTA of the cluster: arrive, then wait for all (release / acquire).
__device__ __forceinline__ void cluster_sync() {
#if MOERUNNER_WGMMA_COMPILED
  cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_release);
  cuda::ptx::barrier_cluster_wait();
#endif
}

}  // namespace moerunner::kernels
