// The GEMM tile selector and the tunings' schedule arithmetic: host-only constexpr code that
// the workspace query and the run both rely on, so it is checked without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
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

g::wgmma_tile tile_at(const bench_shape& s, std::int64_t tokens) { return g::wgmma_tile_for(tokens * s.k, s.e, s.i, sms); }

}  // namespace

TEST_CASE("wgmma tiles by rows per active expert: 64-row at decode, pairs of 128-row CTAs from 512") {
  CHECK(tile_at(mixtral, 1) == g::wgmma_tile::m64);         // GEMM1: 2 experts x 112 N tiles > 66 items
  CHECK(tile_at(mixtral, 64) == g::wgmma_tile::m64);        // 16 rows per expert
  CHECK(tile_at(mixtral, 512) == g::wgmma_tile::m128);      // 128
  CHECK(tile_at(mixtral, 1024) == g::wgmma_tile::m128);     // 256
  CHECK(tile_at(mixtral, 2048) == g::wgmma_tile::m128x2);   // 512: the boundary
  CHECK(tile_at(mixtral, 2047) == g::wgmma_tile::m128);
  CHECK(tile_at(mixtral, 4096) == g::wgmma_tile::m128x2);
  CHECK(tile_at(deepseek, 512) == g::wgmma_tile::m64);      // 16
  CHECK(tile_at(deepseek, 4096) == g::wgmma_tile::m128);    // 128
  CHECK(tile_at(deepseek, 16384) == g::wgmma_tile::m128x2); // 512
  CHECK(tile_at(qwen3, 1) == g::wgmma_tile::m64n128);
  CHECK(tile_at(qwen3, 4096) == g::wgmma_tile::m128);       // 256
  CHECK(tile_at(qwen3, 16384) == g::wgmma_tile::m128x2);    // 1024
  // Fewer rows than experts: only `rows` experts can be active.
  CHECK(g::wgmma_tile_for(300, 512, 2048, sms) == g::wgmma_tile::m64);
  CHECK(g::wgmma_tile_for(0, 8, 2048, sms) == g::wgmma_tile::m64n128);
}

TEST_CASE("a cluster's CTAs share one schedule tile of cluster_m x block_m rows") {
  static_assert(g::sm90_wgmma_m128x2_gemm_policy::tuning.schedule_block_m() == 256);
  static_assert(g::sm90_wgmma_gemm_policy::tuning.schedule_block_m() == 128);
  static_assert(g::sm90_gemm_policy::tuning.schedule_block_m() == 128);
  CHECK(g::wgmma_schedule_block_m(g::wgmma_tile::m128x2) == 256);
  CHECK(g::wgmma_schedule_block_m(g::wgmma_tile::m128) == 128);
  CHECK(g::wgmma_schedule_block_m(g::wgmma_tile::m64) == 64);
  CHECK(g::wgmma_schedule_block_m(g::wgmma_tile::m64n128) == 64);
  CHECK(g::wgmma_cluster_m(g::wgmma_tile::m128x2) == 2);
  CHECK(g::wgmma_cluster_m(g::wgmma_tile::m128) == 1);
  // Every forced wgmma choice is one, and names itself.
  CHECK(g::is_wgmma_choice(g::gemm_tuning_choice::sm90_wgmma_m128x2));
  CHECK(g::gemm_tuning_name(g::gemm_tuning_choice::sm90_wgmma_m128x2) == "sm90_wgmma_m128x2");
  CHECK(g::gemm_tuning_min_arch(g::gemm_tuning_choice::sm90_wgmma_m128x2) == 90);
}
