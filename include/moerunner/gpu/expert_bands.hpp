// Expert bands: an order of the grouped GEMMs' work items in which the M tiles that walk the N
// tiles together are tiles of one expert (at most `band` of them), never of two. With the fixed
// bands of decode_work_item an expert's tiles can straddle two bands, so its weight tiles come
// from HBM once per band, and a band's gathered A rows span experts that share no weights.
// The schedule writer stores each tile's band word in the tile (moe_m_tile::band); a GEMM then
// finds item t's band from the word of tile t / n_tiles: band b's items are [first * n_tiles,
// (first + width) * n_tiles), so that tile lies in the band. Host and device code, so that the
// host test checks the order the kernels walk.
#pragma once

#include <cstdint>

#include "moerunner/core/portable_math.hpp"

namespace moerunner::gpu {

// Bands of at most this many tiles: a word holds a tile's place in its band and the band's width
// in 16 bits each.
inline constexpr int expert_band_max = 0x7fff;

// The band word of tile `tile` of an expert whose tiles are [first, first + count), in a schedule
// whose first `used` tiles are used, for bands of at most `band` tiles (the expert's tiles cut
// in order): the tile's place in its band (low 16 bits) and the band's width (high 16 bits).
MOERUNNER_HD inline std::int32_t expert_band_word(int tile, int first, int count, int used, int band) {
  const int chunk = (tile - first) / band;
  const int begin = first + chunk * band;
  int width = count - chunk * band;
  if (width > band) width = band;
  if (width > used - begin) width = used - begin;  // past `used` the schedule holds no tile
  return (tile - begin) | (width << 16);
}

// Work item t (K splits divided out) of a GEMM with n_tiles N tiles, given the band word of tile
// t / n_tiles: its M tile and N tile (the band's M tiles vary fastest, as in fixed bands).
MOERUNNER_HD inline void expert_band_coords(std::int64_t t, int n_tiles, std::int32_t word, int& m_tile,
                                            int& n_tile) {
  const std::int64_t q = t / n_tiles;
  const int place = word & 0xffff, width = word >> 16;
  const std::int64_t first = q - place;
  const int within = static_cast<int>(t - first * n_tiles);
  n_tile = within / width;
  m_tile = static_cast<int>(first) + within % width;
}

}  // namespace moerunner::gpu
