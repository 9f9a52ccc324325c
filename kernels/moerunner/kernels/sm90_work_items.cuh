// Work items of a persistent wgmma grouped GEMM handed out at run time (sm_90a only), shared by
// the 16-bit and fp8 kernels.
//
// In fixed turns cluster c runs items c, c + C, c + 2C, ... (C clusters). The clusters that
// share a weight tile then run it together only as long as they keep pace; a cluster that falls
// behind re-reads its tiles from HBM once the others have moved on (DeepSeek-V3 fp8 at 16384
// tokens: 33% L2 hits in GEMM1, bench/NOTES.md round 18). Handed out, a cluster runs item c
// first and then whichever item is next when it asks, so the clusters stay on neighbouring
// items and each weight tile is read from HBM about once per band of M tiles.
//
// One thread per cluster, the taker (thread 0 of rank 0), asks a global counter for the next
// item (atomicAdd) when its cluster starts an item, so the atomic's latency hides behind the
// item's loads, and publishes the answer once the producer has issued that item's last K tile:
// into a small ring in shared memory, completing the slot's `full` barrier (and into the peer's
// ring by an asynchronous store that completes the peer's barrier as a TMA load would). Every
// warp of the cluster that walks the items reads the slot and then arrives on the taker's
// `empty` barrier of that slot, which the taker waits on before it writes that slot again. The
// barriers are used as the stages' are (CTA-scope waits, releases as arrivals). The producer
// publishes ahead of the consumers (it runs stages K tiles ahead), so a consumer never waits for
// an item it could not start anyway.
//
// The counter counts asks: every cluster with a first item asks once per item it runs (the last
// answer is past the end), so there are exactly `work` asks, and the one answered work - 1 sets
// the counter back to 0 for the next launch. The schedule writers zero it too, for a workspace's
// first use (kernel_tile_schedule.cuh).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_work_items.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda/ptx>

#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/sm90_cluster_tiles.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"

namespace moerunner::kernels {

struct work_item_ring {
  // Deeper than any kernel's stages: the producer, at most `stages` K tiles ahead of the
  // consumers, never waits for a slot to be read.
  static constexpr int depth = 16;
  std::int32_t item[depth];
  std::uint64_t full[depth];   // one arrival: the taker's (the peer's: with the item's 4 bytes)
  std::uint64_t empty[depth];  // rank 0's counts every reading warp of the cluster
};

// Thread 0 of each CTA, before the kernel's mbarrier-init fence and cluster barrier. `readers`:
// the warps of one CTA that read every item (all CTAs of a cluster alike).
template <int Cluster>
__device__ __forceinline__ void init_work_item_ring(work_item_ring& r, int readers) {
  for (int s = 0; s < work_item_ring::depth; ++s) {
    cuda::ptx::mbarrier_init(&r.full[s], 1);
    cuda::ptx::mbarrier_init(&r.empty[s], readers * Cluster);
  }
}

namespace work_items_detail {

// Writes v into the peer's slot `item` (this CTA's offset, in cluster CTA `rank`) and arrives on
// the peer's barrier `bar` of that slot expecting the 4 bytes, which the store completes: the
// shared-memory store with a transaction count, as a TMA load lands, so that the peer's readers
// wait as for a stage (a cluster-scope acquire instead put an L1 invalidation after every wait).
__device__ __forceinline__ void send_to_peer(std::int32_t* item, std::uint64_t* bar, std::uint32_t rank,
                                             std::int32_t v) {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile(
      "{\n.reg .b32 remote_item, remote_bar;\n"
      "mapa.shared::cluster.u32 remote_item, %0, %2;\n"
      "mapa.shared::cluster.u32 remote_bar, %1, %2;\n"
      "mbarrier.arrive.expect_tx.shared::cluster.b64 _, [remote_bar], 4;\n"
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [remote_item], %3, [remote_bar];\n}\n" ::"r"(
          smem_address(item)),
      "r"(smem_address(bar)), "r"(rank), "r"(v)
      : "memory");
#else
  (void)item, (void)bar, (void)rank, (void)v;
#endif
}

}  // namespace work_items_detail

// The items one role of a CTA walks (every thread of the role holds one): in fixed turns, or
// (HandOut) from the ring. Use: for (w = first(); w < work; w = next_warp(w)); the producer
// calls ask() as its item starts and publish() after its last K tile, before next(). Item
// numbers are 64-bit in fixed turns and 32-bit handed out (the launch checks that they fit).
// Every thread of a reading warp calls next_warp(), or a role of one thread next_thread().
template <bool HandOut, int Cluster>
struct item_loop {
  using index = std::conditional_t<HandOut, std::int32_t, std::int64_t>;
  cta_place me;
  index work;
  work_item_ring* ring = nullptr;
  std::int32_t* counter = nullptr;
  std::uint32_t seq = 0;   // items read so far (the first is not read)
  std::int32_t asked = 0;  // the taker's last answer

  __device__ __forceinline__ index first() const { return me.first; }

  // Whether this thread asks for the items: thread 0 of rank 0.
  __device__ __forceinline__ bool taker() const { return HandOut && threadIdx.x == 0 && me.rank == 0; }

  // Nothing reads the answer before publish(): the taker's warp, which also issues the item's
  // loads, must not wait for the atomic's round trip as the item starts. In pairs (where the
  // compiler cannot tell that one lane asks) an add of 1 became a warp-aggregated atomic whose
  // shuffle of the answer waited for it at once; the taker adds threadIdx.x + 1 (it is thread 0),
  // which is not the same in every lane and so not aggregated.
  __device__ __forceinline__ void ask() {
    if constexpr (HandOut) {
      if (taker()) asked = atomicAdd(counter, static_cast<int>(threadIdx.x) + 1);
    }
  }

  // The taker: the answer of its last ask() into the next slot of every ring of the cluster.
  __device__ __forceinline__ void publish() {
    if constexpr (HandOut) {
      if (!taker()) return;
      if (asked == work - 1) *counter = 0;  // the launch's last ask: see the top
      const int slot = static_cast<int>(seq % work_item_ring::depth);
      const std::uint32_t round = seq / work_item_ring::depth;
      // Every reader of the slot's previous round has read it (a fresh barrier passes parity 1).
      mbarrier_wait(&ring->empty[slot], (round & 1) ^ 1);
      const std::int32_t item = asked + me.stride;
      ring->item[slot] = item;
      cuda::ptx::mbarrier_arrive(&ring->full[slot]);  // release: the store comes first
      if constexpr (Cluster == 2) work_items_detail::send_to_peer(&ring->item[slot], &ring->full[slot], 1, item);
    }
  }

  // The item after w. HandOut: waits for its slot, and once the reading warp has read it (or,
  // for a role of one thread, counted as one warp: that thread), tells the taker's CTA so with
  // one arrival on its `empty` barrier of the slot, as a stage is released.
  __device__ __forceinline__ index next_warp(index w) { return next<true>(w); }
  __device__ __forceinline__ index next_thread(index w) { return next<false>(w); }

 private:
  template <bool WholeWarp>
  __device__ __forceinline__ index next(index w) {
    if constexpr (!HandOut) {
      return w + me.stride;
    } else {
      const int slot = static_cast<int>(seq % work_item_ring::depth);
      const std::uint32_t round = seq / work_item_ring::depth;
      ++seq;
      mbarrier_wait(&ring->full[slot], round & 1);
      const std::int32_t item = *static_cast<volatile std::int32_t*>(&ring->item[slot]);
      if constexpr (WholeWarp) __syncwarp();
      if (!WholeWarp || threadIdx.x % 32 == 0) {
        if (Cluster == 1 || me.rank == 0) cuda::ptx::mbarrier_arrive(&ring->empty[slot]);
        else mbarrier_arrive_cluster(&ring->empty[slot], 0);
      }
      return item;
    }
  }
};

// The loop over `tiles` M tiles times n_tiles times k_splits items.
template <bool HandOut, int Cluster>
__device__ __forceinline__ item_loop<HandOut, Cluster> make_item_loop(int tiles, int n_tiles, int k_splits,
                                                                      work_item_ring* ring, std::int32_t* counter) {
  using index = typename item_loop<HandOut, Cluster>::index;
  item_loop<HandOut, Cluster> l;
  l.me = cluster_place<Cluster>();
  l.work = static_cast<index>(tiles) * n_tiles * k_splits;
  l.ring = ring;
  l.counter = counter;
  return l;
}

}  // namespace moerunner::kernels
