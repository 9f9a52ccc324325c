// The wgmma GEMMs' epilogue: a consumer warpgroup's f32 accumulators of a 64-row block (the PTX
// m64nNk16 D layout) to the output: GEMM1's bias and gated activation into act, GEMM2's bias,
// router weight and routed scaling into rows, slots, the output's token rows (vector reductions)
// or f32 K-split parts. Independent of the tile and the mainloop that filled the accumulators,
// so every wgmma kernel (16-bit and fp8 inputs) stores through it.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_wgmma_epilogue.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"

namespace moerunner::kernels {

template <class T, moe_gemm_kind Kind>
struct wgmma_epilogue {
  // Adds the thread's row (half h) of `Blocks` 8-column blocks from col_base, times t.factor, into
  // t.dst. The four lanes of a quad hold two columns each of every block (see epilogue): a 4 x 4
  // transpose by shuffles gives lane c of the quad all eight columns of blocks 4g + c, each added
  // with one 16-byte vector reduction instead of four packed atomics.
  template <int Blocks, class Value>
  __device__ __forceinline__ static void add_blocks(const down_target<T>& t, int col_base, int n, int h, int lane,
                                                    Value value) {
    static_assert(Blocks % 4 == 0, "blocks go to the quad's lanes four at a time");
    const int c = lane & 3;
    const unsigned quad_mask = 0xfu << (lane & ~3);  // a quad's lanes share a row: same branch
#pragma unroll
    for (int g = 0; g < Blocks / 4; ++g) {
      std::uint32_t w[4], mine[4] = {0, 0, 0, 0};
#pragma unroll
      for (int b = 0; b < 4; ++b)
        w[b] = mma_16816<T>::pack2(value(4 * g + b, 2 * h) * t.factor, value(4 * g + b, 2 * h + 1) * t.factor);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        // Round r: lane c reads lane (c + r) % 4's pair of block 4g + c, and sends its own pair of
        // block 4g + (c - r) % 4 to the lane that reads it. Selects, not indexing: the register
        // arrays stay in registers.
        const int give = (c - r) & 3, from = (c + r) & 3;
        const std::uint32_t send = give == 0 ? w[0] : give == 1 ? w[1] : give == 2 ? w[2] : w[3];
        const std::uint32_t got = __shfl_sync(quad_mask, send, from, 4);
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (from == k) mine[k] = got;
      }
      const int col = col_base + 8 * (4 * g + c);  // n is a multiple of 8: a block is wholly in or out
      if (col < n) atomic_add8(t.dst + col, mine);
    }
  }

  // Stores the thread's part of tile rows [row_base, row_base + 64): `blocks` blocks of 8
  // output columns from `col_base`, where value(j, 2h + q) is the accumulator of the thread's
  // row 16 warp + lane / 4 + 8h and column col_base + 8j + 2(lane % 4) + q, and for gate_up
  // up(j, 2h + q) the up accumulator of the same row and column. With Bias, the tile's expert's
  // bias of each column is added to its sums (GEMM1: after the router weight's scaling).
  template <int Blocks, bool Bias, class Value, class Up>
  __device__ __forceinline__ static void store(const moe_gemm_params<T>& p, const gpu::moe_m_tile& tile,
                                                  int col_base, int split, int row_base, int warp, int lane,
                                                  Value value, Up up) {
    const int rows = tile.row_end - tile.row_begin;
    const int col0 = col_base + 2 * (lane % 4);
    // Sum v of column col's gate (half 0) or up (half 1) row plus that row's bias; v itself
    // without Bias (no addition of zero: the bias-free epilogue is the one without biases).
    const auto biased = [&](float v, int half, int col) {
      if constexpr (Bias) return v + bias_at(p, tile.expert, b_row<Kind>(p, half, col));
      else return v;
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + 16 * warp + lane / 4 + 8 * h;
      if (r >= rows) continue;
      const int row = tile.row_begin + r;
      if constexpr (Kind == moe_gemm_kind::down) {
        if (p.store == down_store::partials) {
          float* part = p.partials + split * p.split_stride + static_cast<std::int64_t>(row) * p.n;
#pragma unroll
          for (int j = 0; j < Blocks; ++j) {
            const int col = col0 + 8 * j;
            if (col < p.n)
              *reinterpret_cast<float2*>(part + col) =
                  make_float2(biased(value(j, 2 * h), 0, col), biased(value(j, 2 * h + 1), 0, col + 1));
          }
          continue;
        }
        const down_target<T> t = down_target<T>::at(p, row);
        if (p.store == down_store::accumulate) {
          if constexpr (Bias)  // add_blocks forms every block's values, past n too: no bias read there
            add_blocks<Blocks>(t, col_base, p.n, h, lane, [&](int j, int i) {
              const int col = col0 + 8 * j + (i & 1);
              return col < p.n ? biased(value(j, i), 0, col) : value(j, i);
            });
          else add_blocks<Blocks>(t, col_base, p.n, h, lane, value);
          continue;
        }
#pragma unroll
        for (int j = 0; j < Blocks; ++j) {
          const int col = col0 + 8 * j;  // n is a multiple of 8: a pair is wholly in or out
          if (col >= p.n) continue;
          const float lo = biased(value(j, 2 * h), 0, col) * t.factor;
          const float hi = biased(value(j, 2 * h + 1), 0, col + 1) * t.factor;
          *reinterpret_cast<std::uint32_t*>(t.dst + col) = mma_16816<T>::pack2(lo, hi);
        }
      } else {
        T* out = p.c + static_cast<std::int64_t>(row) * p.n;
        // act(W (w x) + b) = act(w (W x) + b): the router weight scales the f32 accumulators instead of x.
        const float scale = p.input_weights != nullptr ? p.input_weights[p.row_to_slot[row]] : 1.0f;
        constexpr bool gated = Kind == moe_gemm_kind::gate_up;
        with_activation(p.act, gated, [&](const auto& act) {
#pragma unroll
          for (int j = 0; j < Blocks; ++j) {
            const int col = col0 + 8 * j;
            if (col >= p.n) continue;
            float v[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const float g = biased(value(j, 2 * h + q) * scale, 0, col + q);
              if constexpr (gated) v[q] = act(g, biased(up(j, 2 * h + q) * scale, 1, col + q));
              else v[q] = act(g, 0.0f);
            }
            *reinterpret_cast<std::uint32_t*>(out + col) = mma_16816<T>::pack2(v[0], v[1]);
          }
        });
      }
    }
  }
};

}  // namespace moerunner::kernels
