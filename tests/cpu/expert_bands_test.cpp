// Expert bands (gpu/expert_bands.hpp): the band words the schedule writer stores and the item
// order the wgmma GEMMs decode from them, checked on the host with the same functions.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "moerunner/gpu/expert_bands.hpp"

namespace g = moerunner::gpu;

namespace {

// A schedule's tiles per expert and the words of its first `used` tiles, as write_m_tiles
// computes them (each tile's expert found from the exclusive prefix of the counts).
struct banded_schedule {
  std::vector<int> first;   // [E + 1] exclusive prefix of the tile counts
  std::vector<int> expert;  // [used] each tile's expert
  std::vector<std::int32_t> words;
  int used = 0;

  banded_schedule(const std::vector<int>& counts, int capacity, int band) : first(counts.size() + 1, 0) {
    for (std::size_t e = 0; e < counts.size(); ++e) first[e + 1] = first[e] + counts[e];
    used = first.back() < capacity ? first.back() : capacity;
    for (int e = 0; e < static_cast<int>(counts.size()); ++e)
      for (int i = first[e]; i < first[e + 1] && i < used; ++i) {
        expert.push_back(e);
        words.push_back(g::expert_band_word(i, first[e], counts[e], used, band));
      }
  }
};

// Walks every item of a GEMM with n_tiles N tiles and checks the order: each (M tile, N tile)
// once; the M tiles of an item's band all of one expert, at most `band` of them, each word
// naming the same band; within a band the M tiles vary fastest, as in fixed bands. Counts the
// broken rules (one CHECK each at the end: the walks are long).
void check_order(const banded_schedule& s, int n_tiles, int band) {
  const auto word = [&](std::int64_t tile) { return s.words[static_cast<std::size_t>(tile)]; };
  const auto expert = [&](std::int64_t tile) { return s.expert[static_cast<std::size_t>(tile)]; };
  int bad_band = 0;
  for (int i = 0; i < s.used; ++i) {
    const int place = word(i) & 0xffff, width = word(i) >> 16, begin = i - place;
    bool ok = width >= 1 && width <= band && place < width && begin >= 0 && begin + width <= s.used;
    for (int j = begin; ok && j < begin + width; ++j)
      ok = expert(j) == expert(i) && (word(j) >> 16) == width && (word(j) & 0xffff) == j - begin;
    bad_band += ok ? 0 : 1;
  }
  CHECK(bad_band == 0);
  const std::int64_t items = static_cast<std::int64_t>(s.used) * n_tiles;
  std::vector<int> seen(static_cast<std::size_t>(items), 0);
  int out_of_range = 0, other_expert = 0, out_of_order = 0;
  int prev_m = -1, prev_n = -1;
  for (std::int64_t t = 0; t < items; ++t) {
    int m = -1, n = -1;
    g::expert_band_coords(t, n_tiles, word(t / n_tiles), m, n);
    if (m < 0 || m >= s.used || n < 0 || n >= n_tiles) {
      ++out_of_range;
      prev_m = -1;
      continue;
    }
    ++seen[static_cast<std::size_t>(m) * n_tiles + n];
    other_expert += expert(m) != expert(t / n_tiles) ? 1 : 0;
    // M tiles fastest: after the band's last tile comes its first on the next N tile, after the
    // band's last item the next band's first tile on N tile 0.
    const int begin = m - (word(m) & 0xffff);
    if (prev_m >= 0) {
      const int prev_begin = prev_m - (word(prev_m) & 0xffff), prev_width = word(prev_m) >> 16;
      bool ok;
      if (prev_m + 1 < prev_begin + prev_width) ok = m == prev_m + 1 && n == prev_n;
      else if (prev_n + 1 < n_tiles) ok = m == prev_begin && n == prev_n + 1;
      else ok = m == prev_begin + prev_width && m == begin && n == 0;
      out_of_order += ok ? 0 : 1;
    }
    prev_m = m;
    prev_n = n;
  }
  CHECK(out_of_range == 0);
  CHECK(other_expert == 0);
  CHECK(out_of_order == 0);
  int not_once = 0;
  for (const int c : seen) not_once += c == 1 ? 0 : 1;
  CHECK(not_once == 0);
}

}  // namespace

TEST_CASE("expert bands: an expert's tiles cut in order into bands of at most `band`") {
  // Three experts of 5, 0 and 2 tiles, bands of 2: [0, 1] [2, 3] [4] | (none) | [5, 6].
  const banded_schedule s({5, 0, 2}, 100, 2);
  REQUIRE(s.used == 7);
  const int place[] = {0, 1, 0, 1, 0, 0, 1}, width[] = {2, 2, 2, 2, 1, 2, 2};
  for (int i = 0; i < 7; ++i) {
    CAPTURE(i);
    CHECK((s.words[static_cast<std::size_t>(i)] & 0xffff) == place[i]);
    CHECK((s.words[static_cast<std::size_t>(i)] >> 16) == width[i]);
  }
  // Items of 3 N tiles: band [0, 1] first (0,0) (1,0) (0,1) (1,1) (0,2) (1,2), then [2, 3].
  const int want_m[] = {0, 1, 0, 1, 0, 1, 2, 3}, want_n[] = {0, 0, 1, 1, 2, 2, 0, 0};
  for (int t = 0; t < 8; ++t) {
    int m = -1, n = -1;
    g::expert_band_coords(t, 3, s.words[static_cast<std::size_t>(t / 3)], m, n);
    CHECK(m == want_m[t]);
    CHECK(n == want_n[t]);
  }
  check_order(s, 3, 2);
}

TEST_CASE("expert bands: a schedule cut at its capacity ends its last band there") {
  // 4 + 6 tiles with room for 7: the second expert's band [4, 8) keeps only [4, 7).
  const banded_schedule s({4, 6}, 7, 4);
  REQUIRE(s.used == 7);
  CHECK((s.words[4] >> 16) == 3);
  CHECK((s.words[6] & 0xffff) == 2);
  for (int n_tiles : {1, 2, 5}) check_order(s, n_tiles, 4);
}

TEST_CASE("expert bands: every item once, in one expert's bands, over random schedules") {
  std::mt19937 rng(1234);
  for (int round = 0; round < 40; ++round) {
    const int experts = std::uniform_int_distribution<int>(1, 300)(rng);
    const int most = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 20 : 4;
    std::vector<int> counts(static_cast<std::size_t>(experts));
    int total = 0;
    for (int& c : counts) total += c = std::uniform_int_distribution<int>(0, most)(rng);
    const int capacity = round % 4 == 3 ? total / 2 + 1 : total + 1;
    for (int band : {1, 2, 3, 8, 16}) {
      const banded_schedule s(counts, capacity, band);
      for (int n_tiles : {1, 3, 28}) {
        CAPTURE(round);
        CAPTURE(band);
        CAPTURE(n_tiles);
        check_order(s, n_tiles, band);
      }
    }
  }
}
