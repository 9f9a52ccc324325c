// The GEMM tile selector and the tunings' schedule arithmetic: host-only constexpr code that
// the workspace query and the run both rely on, so it is checked without a GPU.
#include <doctest/doctest.h>

#include <cstdint>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"

namespace g = moerunner::gpu;

namespace {

struct bench_shape {
  const char* name;
  int e, k, i;
};

// The benchmark's shapes (experts, top-k, intermediate size) on a 132-SM part.
constexpr bench_shape mixtral{"Mixtral-8x7B", 8, 2, 14336}, deepseek{"DeepSeek-V3", 256, 8, 2048},
    qwen3{"Qwen3-30B-A3B", 128, 8, 768};
constexpr int sms = 132;

g::sm90_tile tile_at(const bench_shape& s, std::int64_t tokens) { return g::sm90_tile_for(tokens * s.k, s.e, s.i, sms); }

}  // namespace

TEST_CASE("sm_90a tiles by rows per active expert: stream GEMMs at decode, pairs of 128-row CTAs from 512") {
  CHECK(tile_at(mixtral, 1) == g::sm90_tile::stream);      // 1 row per active expert
  CHECK(tile_at(mixtral, 8) == g::sm90_tile::stream);      // 2
  CHECK(tile_at(mixtral, 16) == g::sm90_tile::stream);     // 4: the boundary
  CHECK(tile_at(mixtral, 17) == g::sm90_tile::m64);        // GEMM1: 8 experts x 112 N tiles > 66 items
  CHECK(tile_at(mixtral, 64) == g::sm90_tile::m64);        // 16
  CHECK(tile_at(mixtral, 512) == g::sm90_tile::m128);      // 128
  CHECK(tile_at(mixtral, 1024) == g::sm90_tile::m128);     // 256
  CHECK(tile_at(mixtral, 2048) == g::sm90_tile::m128x2);   // 512: the boundary
  CHECK(tile_at(mixtral, 2047) == g::sm90_tile::m128);
  CHECK(tile_at(mixtral, 4096) == g::sm90_tile::m128x2);
  CHECK(tile_at(deepseek, 1) == g::sm90_tile::stream);
  CHECK(tile_at(deepseek, 64) == g::sm90_tile::stream);    // 512 rows over 256 experts
  CHECK(tile_at(deepseek, 512) == g::sm90_tile::m64);      // 16
  CHECK(tile_at(deepseek, 4096) == g::sm90_tile::m128);    // 128
  CHECK(tile_at(deepseek, 16384) == g::sm90_tile::m128x2); // 512
  CHECK(tile_at(qwen3, 1) == g::sm90_tile::stream);
  CHECK(tile_at(qwen3, 8) == g::sm90_tile::stream);        // 1
  CHECK(tile_at(qwen3, 64) == g::sm90_tile::stream);       // 4
  CHECK(tile_at(qwen3, 512) == g::sm90_tile::m64);         // 32
  CHECK(tile_at(qwen3, 4096) == g::sm90_tile::m128);       // 256
  CHECK(tile_at(qwen3, 16384) == g::sm90_tile::m128x2);    // 1024
  // Fewer rows than experts: only `rows` experts can be active.
  CHECK(g::sm90_tile_for(300, 512, 2048, sms) == g::sm90_tile::stream);
  CHECK(g::sm90_tile_for(2100, 512, 2048, sms) == g::sm90_tile::m64);
  // 64 x 128 where GEMM1's 64 x 256 items fill at most half the SMs: 2 experts x 6 N tiles.
  CHECK(g::sm90_tile_for(32, 2, 768, sms) == g::sm90_tile::m64n128);
  CHECK(g::sm90_tile_for(32, 2, 14336, sms) == g::sm90_tile::m64);
  // Without the stream GEMMs (batch-invariant): the 64-row tiles where they would run, the same
  // wgmma tiles elsewhere.
  for (const bench_shape& s : {mixtral, deepseek, qwen3})
    for (const std::int64_t tokens : {1, 8, 16, 17, 64, 512, 4096}) {
      CAPTURE(tokens);
      const g::sm90_tile any = tile_at(s, tokens), wgmma = g::sm90_tile_for(tokens * s.k, s.e, s.i, sms, false);
      if (any == g::sm90_tile::stream) CHECK((wgmma == g::sm90_tile::m64 || wgmma == g::sm90_tile::m64n128));
      else CHECK(wgmma == any);
    }
}

TEST_CASE("a cluster's CTAs share one schedule tile of cluster_m x block_m rows") {
  static_assert(g::sm90_wgmma_m128x2_gemm_policy::tuning.schedule_block_m() == 256);
  static_assert(g::sm90_wgmma_gemm_policy::tuning.schedule_block_m() == 128);
  static_assert(g::sm90_gemm_policy::tuning.schedule_block_m() == 128);
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::m128x2) == 256);
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::m128) == 128);
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::m64) == 64);
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::m64n128) == 64);
  CHECK(g::sm90_cluster_m(g::sm90_tile::m128x2) == 2);
  CHECK(g::sm90_cluster_m(g::sm90_tile::m128) == 1);
  // Every forced wgmma choice is one, and names itself.
  CHECK(g::is_wgmma_choice(g::gemm_tuning_choice::sm90_wgmma_m128x2));
  CHECK(g::gemm_tuning_name(g::gemm_tuning_choice::sm90_wgmma_m128x2) == "sm90_wgmma_m128x2");
  CHECK(g::gemm_tuning_min_arch(g::gemm_tuning_choice::sm90_wgmma_m128x2) == 90);
}

TEST_CASE("the stream GEMMs: 8-row schedule tiles, any sm_80+ code, not a wgmma choice") {
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::stream) == 8);
  CHECK(g::sm90_cluster_m(g::sm90_tile::stream) == 1);
  static_assert(g::moe_gemm_min_block_m == g::stream_gemm_policy::tuning.schedule_block_m());
  CHECK_FALSE(g::is_wgmma_choice(g::gemm_tuning_choice::stream));
  CHECK(g::gemm_tuning_name(g::gemm_tuning_choice::stream) == "stream");
  CHECK(g::gemm_tuning_min_arch(g::gemm_tuning_choice::stream) == 80);
  // Its form with K in order: one warp per CTA walks all of K.
  CHECK(g::sm90_schedule_block_m(g::sm90_tile::stream_ordered) == 8);
  CHECK(g::sm90_cluster_m(g::sm90_tile::stream_ordered) == 1);
  static_assert(g::stream_gemm_ordered_policy::tuning.warps == 1);
  CHECK_FALSE(g::is_wgmma_choice(g::gemm_tuning_choice::stream_ordered));
  CHECK(g::gemm_tuning_name(g::gemm_tuning_choice::stream_ordered) == "stream_ordered");
  CHECK(g::gemm_tuning_min_arch(g::gemm_tuning_choice::stream_ordered) == 80);
  // Three CTAs of 4 warps with 3 stages of 32 weight rows and 8 token rows fit an SM.
  static_assert(g::stream_gemm_policy::tuning.smem_bytes() == 4 * 3 * 40 * 128);
}
