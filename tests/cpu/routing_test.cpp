// Routing invariants of reference::topk, checked against scores computed here in double,
// and the host exp the routing arithmetic is built on.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

struct routed {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  bool scaling_applied = false;
};

routed route(const std::vector<float>& logits, int m, int e, const mr::topk_config& cfg,
             const std::vector<float>* bias = nullptr) {
  const int slots = mr::reference::topk_slots(cfg);
  host_tensor l(mr::dtype::f32, {m, e}), w(mr::dtype::f32, {m, slots}), ids(mr::dtype::i32, {m, slots});
  std::copy(logits.begin(), logits.end(), l.ptr<float>());
  host_tensor b(mr::dtype::f32, {e});
  if (bias) std::copy(bias->begin(), bias->end(), b.ptr<float>());
  mr::TopKOutput out{w.view, ids.view};
  mr::reference::topk(l.view, bias ? &b.view : nullptr, cfg, out);
  routed r;
  r.ids.assign(ids.ptr<std::int32_t>(), ids.ptr<std::int32_t>() + m * slots);
  r.weights.assign(w.ptr<float>(), w.ptr<float>() + m * slots);
  r.scaling_applied = out.routed_scaling_applied;
  return r;
}

// Scores written from the definitions, in double.
std::vector<double> softmax(const float* l, int e) {
  double mx = -INFINITY;
  for (int i = 0; i < e; ++i) mx = std::max(mx, double(l[i]));
  std::vector<double> p(e);
  double sum = 0.0;
  for (int i = 0; i < e; ++i) sum += p[i] = std::exp(double(l[i]) - mx);
  for (double& v : p) v /= sum;
  return p;
}
std::vector<double> sigmoid(const float* l, int e) {
  std::vector<double> p(e);
  for (int i = 0; i < e; ++i) p[i] = 1.0 / (1.0 + std::exp(-double(l[i])));
  return p;
}
std::vector<double> scores_of(const float* l, int e, mr::scoring_func f) {
  return f == mr::scoring_func::softmax ? softmax(l, e) : sigmoid(l, e);
}

// Logits that are a shuffled ladder: distinct by far more than rounding, so every
// selection and group ranking below has one right answer.
std::vector<float> ladder_logits(int m, int e, std::mt19937& rng, float step = 0.03f) {
  std::vector<float> l(static_cast<std::size_t>(m) * e);
  std::vector<int> perm(e);
  for (int t = 0; t < m; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < e; ++i) l[t * e + i] = step * float(perm[i] - e / 2);
  }
  return l;
}

std::uint32_t ulp_distance(float a, float b) {
  const auto ia = std::bit_cast<std::int32_t>(a), ib = std::bit_cast<std::int32_t>(b);
  const std::int64_t oa = ia < 0 ? std::int64_t(INT32_MIN) - ia : ia, ob = ib < 0 ? std::int64_t(INT32_MIN) - ib : ib;
  return static_cast<std::uint32_t>(std::llabs(oa - ob));
}

}  // namespace

TEST_CASE("ids are distinct, in range, the true top-k, ordered by score; weights are their scores") {
  std::mt19937 rng(2024);
  for (int e : {1, 2, 5, 16, 33, 64, 256, 512}) {
    for (int k : {1, 2, 4, 8, 16}) {
      if (k > e) continue;
      for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
        CAPTURE(e);
        CAPTURE(k);
        CAPTURE(static_cast<int>(f));
        const int m = 24;
        std::vector<float> l(static_cast<std::size_t>(m) * e);
        std::uniform_real_distribution<float> d(-4.0f, 4.0f);
        for (float& v : l) v = d(rng);
        const routed r = route(l, m, e, {.top_k = k, .scoring = f, .renormalize = false});
        CHECK_FALSE(r.scaling_applied);
        for (int t = 0; t < m; ++t) {
          const std::vector<double> p = scores_of(&l[t * e], e, f);
          std::set<int> seen;
          double min_selected = INFINITY;
          for (int j = 0; j < k; ++j) {
            const int id = r.ids[t * k + j];
            const float w = r.weights[t * k + j];
            REQUIRE(id >= 0);
            REQUIRE(id < e);
            CHECK(seen.insert(id).second);
            CHECK(std::fabs(w - p[id]) <= 4e-7 * p[id] + 1e-30);
            min_selected = std::min(min_selected, p[id]);
            if (j > 0) {
              const float prev = r.weights[t * k + j - 1];
              CHECK((prev > w || (prev == w && r.ids[t * k + j - 1] < id)));
            }
          }
          // No expert left out scores above the weakest one taken (up to rounding of the scores).
          for (int i = 0; i < e; ++i)
            if (!seen.count(i)) CHECK(p[i] <= min_selected * (1 + 1e-6));
        }
      }
    }
  }
}

TEST_CASE("renormalized weights sum to 1 and keep the scores' ratios") {
  std::mt19937 rng(7);
  for (int e : {4, 16, 64, 512}) {
    for (int k : {1, 2, 8, 16}) {
      if (k > e) continue;
      for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
        const int m = 16;
        std::vector<float> l(static_cast<std::size_t>(m) * e);
        std::normal_distribution<float> d(0.0f, 2.0f);
        for (float& v : l) v = d(rng);
        const routed raw = route(l, m, e, {.top_k = k, .scoring = f, .renormalize = false});
        const routed norm = route(l, m, e, {.top_k = k, .scoring = f, .renormalize = true});
        CHECK(raw.ids == norm.ids);
        for (int t = 0; t < m; ++t) {
          double sum = 0.0, raw_sum = 0.0;
          for (int j = 0; j < k; ++j) {
            sum += norm.weights[t * k + j];
            raw_sum += raw.weights[t * k + j];
          }
          CHECK(std::fabs(sum - 1.0) <= 1e-6);
          for (int j = 0; j < k; ++j)
            CHECK(std::fabs(norm.weights[t * k + j] - raw.weights[t * k + j] / raw_sum) <= 2e-7);
        }
      }
    }
  }
}

TEST_CASE("grouped top-k picks only from the best topk_group groups") {
  std::mt19937 rng(99);
  const int m = 32;
  for (int e : {16, 64, 256}) {
    for (int groups : {4, 8}) {
      for (int topk_group : {1, 2, 3}) {
        for (int k : {1, 2, 4, 6}) {
          const int per = e / groups;
          if (topk_group * per < k) continue;
          for (bool with_bias : {false, true}) {
            for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
              CAPTURE(e);
              CAPTURE(groups);
              CAPTURE(topk_group);
              CAPTURE(k);
              CAPTURE(with_bias);
              const std::vector<float> l = ladder_logits(m, e, rng, f == mr::scoring_func::softmax ? 0.03f : 0.011f);
              std::vector<float> bias(e);
              // Bias spaced on a coarser ladder than the scores, so no two keys tie.
              std::vector<int> perm(e);
              std::iota(perm.begin(), perm.end(), 0);
              std::shuffle(perm.begin(), perm.end(), rng);
              for (int i = 0; i < e; ++i) bias[i] = with_bias ? 0.0173f * float(perm[i]) / float(e) : 0.0f;
              const mr::topk_config cfg{.top_k = k, .scoring = f, .renormalize = false, .num_expert_group = groups,
                                        .topk_group = topk_group};
              const routed r = route(l, m, e, cfg, with_bias ? &bias : nullptr);
              for (int t = 0; t < m; ++t) {
                const std::vector<double> p = scores_of(&l[t * e], e, f);
                std::vector<double> key(e);
                for (int i = 0; i < e; ++i) key[i] = p[i] + (with_bias ? bias[i] : 0.0);
                // Group score: best key, or with a bias the sum of the best two.
                std::vector<double> gscore(groups);
                for (int g = 0; g < groups; ++g) {
                  std::vector<double> ks(key.begin() + g * per, key.begin() + (g + 1) * per);
                  std::sort(ks.rbegin(), ks.rend());
                  gscore[g] = with_bias && per >= 2 ? ks[0] + ks[1] : ks[0];
                }
                std::vector<int> order(groups);
                std::iota(order.begin(), order.end(), 0);
                std::sort(order.begin(), order.end(), [&](int a, int b) { return gscore[a] > gscore[b]; });
                if (topk_group < groups)
                  REQUIRE(gscore[order[topk_group - 1]] - gscore[order[topk_group]] > 1e-6);
                std::set<int> kept(order.begin(), order.begin() + topk_group);
                // The expected ids: the best k keys among experts of the kept groups.
                std::vector<int> allowed;
                for (int i = 0; i < e; ++i)
                  if (kept.count(i / per)) allowed.push_back(i);
                std::sort(allowed.begin(), allowed.end(), [&](int a, int b) { return key[a] > key[b]; });
                std::set<int> groups_used;
                for (int j = 0; j < k; ++j) {
                  const int id = r.ids[t * k + j];
                  CHECK(kept.count(id / per) == 1);
                  groups_used.insert(id / per);
                  CHECK(id == allowed[j]);
                  // The weight is the expert's unbiased score.
                  CHECK(std::fabs(r.weights[t * k + j] - p[id]) <= 4e-7 * p[id]);
                }
                CHECK(groups_used.size() <= static_cast<std::size_t>(topk_group));
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("grouped top-k with a bias ranks groups by the sum of their best two keys, not the best one") {
  // Group 0 holds the single best key; group 1 the better pair.
  const std::vector<float> l = {2.0f, -4.0f, -4.0f, -4.0f, 1.5f, 1.4f, -4.0f, -4.0f};
  const std::vector<float> zero(8, 0.0f);
  const mr::topk_config cfg{.top_k = 1, .scoring = mr::scoring_func::sigmoid, .renormalize = false,
                            .num_expert_group = 2, .topk_group = 1};
  const routed with_bias = route(l, 1, 8, cfg, &zero);
  CHECK(with_bias.ids[0] == 4);
  const routed without = route(l, 1, 8, cfg);
  CHECK(without.ids[0] == 0);
}

TEST_CASE("a correction bias changes the selection but the weights stay the unbiased scores") {
  std::mt19937 rng(5);
  const int e = 16, k = 4, m = 8;
  for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
    const std::vector<float> l = ladder_logits(m, e, rng, 0.2f);
    // All sixteen scores, by id.
    const routed all = route(l, m, e, {.top_k = e, .scoring = f, .renormalize = false});
    const routed plain = route(l, m, e, {.top_k = k, .scoring = f, .renormalize = false});
    for (int t = 0; t < m; ++t) {
      std::vector<float> score(e);
      for (int j = 0; j < e; ++j) score[all.ids[t * e + j]] = all.weights[t * e + j];
      // Boost the four weakest experts of this token far above the rest.
      std::vector<int> by_score(e);
      std::iota(by_score.begin(), by_score.end(), 0);
      std::sort(by_score.begin(), by_score.end(), [&](int a, int b) { return score[a] < score[b]; });
      std::vector<float> bias(e, 0.0f);
      for (int j = 0; j < k; ++j) bias[by_score[j]] = 10.0f + float(j);
      const routed row = route(std::vector<float>(l.begin() + t * e, l.begin() + (t + 1) * e), 1, e,
                               {.top_k = k, .scoring = f, .renormalize = false}, &bias);
      const routed row_norm = route(std::vector<float>(l.begin() + t * e, l.begin() + (t + 1) * e), 1, e,
                                    {.top_k = k, .scoring = f, .renormalize = true}, &bias);
      std::set<int> chosen(row.ids.begin(), row.ids.end()), boosted(by_score.begin(), by_score.begin() + k);
      CHECK(chosen == boosted);
      std::set<int> unbiased(plain.ids.begin() + t * k, plain.ids.begin() + (t + 1) * k);
      CHECK(chosen != unbiased);
      // Ordered by key (largest bias first), weighted by the unbiased score, bit for bit.
      for (int j = 0; j < k; ++j) {
        CHECK(row.ids[j] == by_score[k - 1 - j]);
        CHECK(row.weights[j] == score[row.ids[j]]);
      }
      double sum = 0.0;
      for (int j = 0; j < k; ++j) sum += score[row.ids[j]];
      for (int j = 0; j < k; ++j) CHECK(std::fabs(row_norm.weights[j] - score[row.ids[j]] / sum) <= 2e-7);
    }
  }
}

TEST_CASE("sigmoid and softmax scoring give their own scores") {
  const std::vector<float> l = {-3.0f, -0.5f, 0.0f, 0.25f, 1.0f, 2.0f, 4.0f, 8.0f};
  const routed sm = route(l, 1, 8, {.top_k = 8, .scoring = mr::scoring_func::softmax, .renormalize = false});
  const routed sg = route(l, 1, 8, {.top_k = 8, .scoring = mr::scoring_func::sigmoid, .renormalize = false});
  const std::vector<double> psm = softmax(l.data(), 8), psg = sigmoid(l.data(), 8);
  double sum = 0.0;
  for (int j = 0; j < 8; ++j) {
    CHECK(sm.ids[j] == 7 - j);
    CHECK(sg.ids[j] == 7 - j);
    CHECK(std::fabs(sm.weights[j] - psm[sm.ids[j]]) <= 4e-7 * psm[sm.ids[j]]);
    CHECK(std::fabs(sg.weights[j] - psg[sg.ids[j]]) <= 4e-7 * psg[sg.ids[j]]);
    sum += sm.weights[j];
  }
  CHECK(std::fabs(sum - 1.0) <= 1e-6);
  CHECK(sg.weights[5] == 0.5f);  // sigmoid(0), expert 2
  // Softmax is shift invariant; sigmoid is not.
  std::vector<float> shifted = l;
  for (float& v : shifted) v += 3.0f;
  const routed sm2 = route(shifted, 1, 8, {.top_k = 8, .scoring = mr::scoring_func::softmax, .renormalize = false});
  const routed sg2 = route(shifted, 1, 8, {.top_k = 8, .scoring = mr::scoring_func::sigmoid, .renormalize = false});
  for (int j = 0; j < 8; ++j) CHECK(std::fabs(sm2.weights[j] - sm.weights[j]) <= 1e-6 * sm.weights[j]);
  CHECK(sg2.weights[7] > sg.weights[7] * 1.5f);
}

TEST_CASE("routed scaling is folded into the weights only when asked, and says so") {
  std::mt19937 rng(11);
  const int e = 32, k = 4, m = 10;
  std::vector<float> l(m * e);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  for (float& v : l) v = d(rng);
  for (bool renorm : {false, true}) {
    const routed base = route(l, m, e, {.top_k = k, .renormalize = renorm, .routed_scaling_factor = 2.5f});
    CHECK_FALSE(base.scaling_applied);
    const routed scaled = route(l, m, e,
                                {.top_k = k, .renormalize = renorm, .routed_scaling_factor = 2.5f,
                                 .apply_routed_scaling_factor_on_weights = true});
    CHECK(scaled.scaling_applied);
    CHECK(scaled.ids == base.ids);
    for (int i = 0; i < m * k; ++i) CHECK(scaled.weights[i] == base.weights[i] * 2.5f);
    // A factor of 1 folded in changes nothing.
    const routed one = route(l, m, e, {.top_k = k, .renormalize = renorm, .apply_routed_scaling_factor_on_weights = true});
    CHECK(one.weights == base.weights);
  }
}

TEST_CASE("ties go to the lower expert index, and to the lower group index") {
  const std::vector<float> flat(8, 0.75f);
  const routed r = route(flat, 1, 8, {.top_k = 3, .renormalize = false});
  CHECK(r.ids == std::vector<std::int32_t>{0, 1, 2});
  for (float w : r.weights) CHECK(w == 0.125f);
  const routed rn = route(flat, 1, 8, {.top_k = 3, .renormalize = true});
  for (float w : rn.weights) CHECK(std::fabs(w - 1.0f / 3.0f) <= 1e-7f);

  const std::vector<float> partial = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f, -1.0f};
  CHECK(route(partial, 1, 6, {.top_k = 2}).ids == std::vector<std::int32_t>{1, 3});
  CHECK(route(partial, 1, 6, {.top_k = 4, .scoring = mr::scoring_func::sigmoid}).ids ==
        std::vector<std::int32_t>{1, 3, 4, 2});

  // Groups {0,1}, {2,3}, {4,5} with equal best scores: the lowest groups are kept.
  const std::vector<float> g = {0.5f, 2.0f, 2.0f, 0.1f, 2.0f, 1.9f};
  const mr::topk_config cfg{.top_k = 2, .renormalize = false, .num_expert_group = 3, .topk_group = 2};
  CHECK(route(g, 1, 6, cfg).ids == std::vector<std::int32_t>{1, 2});
  const mr::topk_config cfg1{.top_k = 2, .renormalize = false, .num_expert_group = 3, .topk_group = 1};
  CHECK(route(g, 1, 6, cfg1).ids == std::vector<std::int32_t>{1, 0});
}

TEST_CASE("a NaN logit is never selected over a finite one") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid}) {
    CAPTURE(static_cast<int>(f));
    for (int pos = 0; pos < 6; ++pos) {
      CAPTURE(pos);
      std::vector<float> l = {0.1f, -0.2f, 0.3f, 0.05f, -1.0f, 0.2f};
      l[pos] = nan;
      const routed r = route(l, 1, 6, {.top_k = 5, .scoring = f, .renormalize = true});
      std::vector<std::int32_t> expect;
      for (int id : {2, 5, 0, 3, 1, 4})
        if (id != pos) expect.push_back(id);
      CHECK(r.ids == expect);
      double sum = 0.0;
      for (float w : r.weights) {
        CHECK(std::isfinite(w));
        sum += w;
      }
      CHECK(std::fabs(sum - 1.0) <= 1e-6);
      // Grouped: the NaN expert's group ranks by its finite member, and the kept groups
      // hold enough finite experts, so the NaN one is still never taken.
      const routed grouped =
          route(l, 1, 6, {.top_k = 3, .scoring = f, .renormalize = false, .num_expert_group = 3, .topk_group = 2});
      for (int id : grouped.ids) CHECK(id != pos);
    }
    // A NaN ranks below every finite score, even when its neighbours are tiny.
    const std::vector<float> l2 = {nan, -60.0f, -70.0f, 5.0f};
    const routed r2 = route(l2, 1, 4, {.top_k = 3, .scoring = f, .renormalize = false});
    CHECK(r2.ids == std::vector<std::int32_t>{3, 1, 2});
    // With nothing finite left, the token is routed to nothing.
    const std::vector<float> all_nan(4, nan);
    const routed none = route(all_nan, 1, 4, {.top_k = 2, .scoring = f});
    CHECK(none.ids == std::vector<std::int32_t>{-1, -1});
    CHECK(none.weights == std::vector<float>{0.0f, 0.0f});
    // NaN in one token does not reach another.
    std::vector<float> two = {nan, 1.0f, 2.0f, 3.0f, 0.5f, 1.0f, 2.0f, 3.0f};
    const routed r3 = route(two, 2, 4, {.top_k = 2, .scoring = f});
    CHECK(r3.ids == std::vector<std::int32_t>{3, 2, 3, 2});
    for (float w : r3.weights) CHECK(std::isfinite(w));
  }
}

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) return false;
  return true;
}

// Random logits in [-4, 4] with NaN, +inf and -inf sprinkled in, and some rows with no finite
// logit at all.
std::vector<float> nonfinite_logits(int m, int e, std::mt19937& rng) {
  std::vector<float> l(static_cast<std::size_t>(m) * e);
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  std::uniform_int_distribution<int> pct(0, 99);
  for (int t = 0; t < m; ++t) {
    const int kind = t % 6;  // 0: finite; 1: sprinkled; 2: many -inf; 3: +inf twice; 4: no finite; 5: all NaN
    for (int i = 0; i < e; ++i) {
      float& v = l[static_cast<std::size_t>(t) * e + i];
      v = d(rng);
      const int r = pct(rng);
      if (kind == 1) v = r < 5 ? nan_value : r < 8 ? inf : r < 15 ? -inf : v;
      if (kind == 2 && r < 80) v = -inf;
      if (kind == 4) v = r < 50 ? -inf : nan_value;
      if (kind == 5) v = nan_value;
    }
    if (kind == 3) {
      l[static_cast<std::size_t>(t) * e + pct(rng) % e] = inf;
      l[static_cast<std::size_t>(t) * e + pct(rng) % e] = inf;
    }
  }
  return l;
}

// Every option of the routing over E = 16 (groups of 4, two kept), for the sweeps below.
std::vector<mr::topk_config> every_option(int k) {
  std::vector<mr::topk_config> cfgs;
  for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid})
    for (bool renorm : {false, true})
      for (bool grouped : {false, true})
        for (bool scaled : {false, true})
          for (int shared : {0, 2})
            cfgs.push_back({.top_k = k, .scoring = f, .renormalize = renorm, .num_expert_group = grouped ? 4 : 0,
                            .topk_group = grouped ? 2 : 0, .routed_scaling_factor = 2.5f,
                            .apply_routed_scaling_factor_on_weights = scaled, .num_fused_shared_experts = shared,
                            .fused_shared_expert_weight = 1.0f});
  return cfgs;
}

}  // namespace

TEST_CASE("non-finite logits: NaN routes as -inf and +inf as the largest finite float, bit for bit") {
  std::mt19937 rng(mr::test::test_seed());
  const int m = 36, e = 16;
  for (int k : {1, 4, 6})
    for (const mr::topk_config& cfg : every_option(k))
      for (bool with_bias : {false, true}) {
        CAPTURE(k);
        CAPTURE(static_cast<int>(cfg.scoring));
        CAPTURE(cfg.renormalize);
        CAPTURE(cfg.num_expert_group);
        CAPTURE(with_bias);
        const std::vector<float> l = nonfinite_logits(m, e, rng);
        std::vector<float> mapped = l;
        for (float& v : mapped) v = std::isnan(v) ? -inf : v == inf ? std::numeric_limits<float>::max() : v;
        std::vector<float> bias(e);
        for (int i = 0; i < e; ++i) bias[i] = 0.05f * float(i % 5);
        const routed r = route(l, m, e, cfg, with_bias ? &bias : nullptr);
        const routed want = route(mapped, m, e, cfg, with_bias ? &bias : nullptr);
        CHECK(r.ids == want.ids);
        CHECK(same_bits(r.weights, want.weights));
        for (float w : r.weights) CHECK(std::isfinite(w));
      }
}

TEST_CASE("non-finite logits: every weight is finite, ids are eligible and distinct, filtered slots come last") {
  std::mt19937 rng(mr::test::test_seed());
  const int m = 36, e = 16;
  for (int k : {1, 4, 6, 16})
    for (const mr::topk_config& cfg : every_option(k)) {
      if (cfg.num_expert_group > 0 && k > 8) continue;  // two kept groups of 4 hold 8 experts
      CAPTURE(k);
      CAPTURE(static_cast<int>(cfg.scoring));
      CAPTURE(cfg.renormalize);
      CAPTURE(cfg.num_expert_group);
      const std::vector<float> l = nonfinite_logits(m, e, rng);
      std::vector<float> bias(e);
      for (int i = 0; i < e; ++i) bias[i] = i % 3 == 0 ? 9.0f : 0.0f;  // large on some: never overrides eligibility
      const routed r = route(l, m, e, cfg, &bias);
      const int slots = k + cfg.num_fused_shared_experts;
      for (int t = 0; t < m; ++t) {
        CAPTURE(t);
        int eligible = 0;
        for (int i = 0; i < e; ++i) eligible += std::isnan(l[t * e + i]) || l[t * e + i] == -inf ? 0 : 1;
        std::set<int> seen;
        double sum = 0.0;
        bool filtered = false;
        for (int j = 0; j < k; ++j) {
          const int id = r.ids[t * slots + j];
          const float w = r.weights[t * slots + j];
          CHECK(std::isfinite(w));
          CHECK(w >= 0.0f);
          if (id == -1) {
            filtered = true;
            CHECK(w == 0.0f);
            continue;
          }
          CHECK_FALSE(filtered);  // nothing selected after a filtered slot
          REQUIRE(id >= 0);
          REQUIRE(id < e);
          CHECK_FALSE(std::isnan(l[t * e + id]));
          CHECK(l[t * e + id] != -inf);
          CHECK(seen.insert(id).second);
          sum += w;
        }
        // Ungrouped, exactly the eligible experts fill the slots, up to k.
        if (cfg.num_expert_group == 0) CHECK(static_cast<int>(seen.size()) == std::min(k, eligible));
        if (eligible == 0) CHECK(seen.empty());
        if (cfg.renormalize && sum > 0.0) {
          const double want = cfg.apply_routed_scaling_factor_on_weights ? cfg.routed_scaling_factor : 1.0;
          CHECK(std::fabs(sum - want) <= 2e-6 * want);
        }
        for (int s = 0; s < cfg.num_fused_shared_experts; ++s) CHECK(r.ids[t * slots + k + s] == e + s);
      }
    }
}

TEST_CASE("non-finite logits: one +inf takes the whole softmax weight, two share it, sigmoid gives it 1") {
  using v = std::vector<float>;
  using ids = std::vector<std::int32_t>;
  const mr::topk_config softmax2{.top_k = 2, .renormalize = false};
  // exp(x - FLT_MAX) is 0 for every finite x: the others tie at 0 and go by index.
  const routed one = route({0.5f, inf, 1.0f, -0.3f}, 1, 4, softmax2);
  CHECK(one.ids == ids{1, 0});
  CHECK(one.weights == v{1.0f, 0.0f});
  CHECK(route({0.5f, inf, 1.0f, -0.3f}, 1, 4, {.top_k = 2, .renormalize = true}).weights == v{1.0f, 0.0f});
  const routed two = route({inf, 0.5f, inf, 1.0f}, 1, 4, {.top_k = 3, .renormalize = false});
  CHECK(two.ids == ids{0, 2, 1});
  CHECK(two.weights == v{0.5f, 0.5f, 0.0f});
  const routed sig = route({0.5f, inf, 1.0f, -0.3f}, 1, 4, {.top_k = 2, .scoring = mr::scoring_func::sigmoid,
                                                             .renormalize = false});
  CHECK(sig.ids == ids{1, 2});
  CHECK(sig.weights[0] == 1.0f);
  CHECK(sig.weights[1] == mr::portable::sigmoid(1.0f));
  // +inf, -inf and NaN in one row: only the +inf and the finite logit are taken.
  const routed mixed = route({-inf, inf, nan_value, 2.0f}, 1, 4, {.top_k = 3, .renormalize = false});
  CHECK(mixed.ids == ids{1, 3, -1});
  CHECK(mixed.weights == v{1.0f, 0.0f, 0.0f});
}

TEST_CASE("non-finite logits: -inf and NaN experts are never selected, whatever their bias; spare slots are filtered") {
  const std::vector<float> l = {-inf, 0.2f, nan_value, -0.1f, -inf, -inf};
  const std::vector<float> bias = {100.0f, 0.0f, 100.0f, 0.0f, 100.0f, 100.0f};
  for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid})
    for (bool renorm : {false, true})
      for (bool scaled : {false, true}) {
        CAPTURE(static_cast<int>(f));
        CAPTURE(renorm);
        CAPTURE(scaled);
        const mr::topk_config cfg{.top_k = 4, .scoring = f, .renormalize = renorm, .routed_scaling_factor = 2.5f,
                                  .apply_routed_scaling_factor_on_weights = scaled};
        for (const std::vector<float>* b : {static_cast<const std::vector<float>*>(nullptr), &bias}) {
          const routed r = route(l, 1, 6, cfg, b);
          CHECK(r.ids == std::vector<std::int32_t>{1, 3, -1, -1});
          CHECK(r.weights[2] == 0.0f);
          CHECK(r.weights[3] == 0.0f);
          const std::vector<double> p = scores_of(l.data(), 6, f);  // NaN/-inf give 0 or NaN: only 1 and 3 read
          double s1 = f == mr::scoring_func::softmax ? std::exp(0.2) / (std::exp(0.2) + std::exp(-0.1)) : p[1];
          double s3 = f == mr::scoring_func::softmax ? std::exp(-0.1) / (std::exp(0.2) + std::exp(-0.1)) : p[3];
          if (renorm) {
            const double sum = s1 + s3;
            s1 /= sum;
            s3 /= sum;
          }
          const double scale = scaled ? 2.5 : 1.0;
          CHECK(std::fabs(r.weights[0] - s1 * scale) <= 1e-6 * scale);
          CHECK(std::fabs(r.weights[1] - s3 * scale) <= 1e-6 * scale);
        }
      }
}

TEST_CASE("non-finite logits: a token with no finite logit is routed to nothing, with every option") {
  const int e = 16;
  std::vector<float> bias(e);
  for (int i = 0; i < e; ++i) bias[i] = 0.1f * float(i);
  for (const std::vector<float>& l :
       {std::vector<float>(e, -inf), std::vector<float>(e, nan_value), [] {
          std::vector<float> mix(e, -inf);
          for (int i = 0; i < e; i += 3) mix[i] = nan_value;
          return mix;
        }()})
    for (const mr::topk_config& cfg : every_option(4))
      for (bool with_bias : {false, true}) {
        CAPTURE(static_cast<int>(cfg.scoring));
        CAPTURE(cfg.renormalize);
        CAPTURE(cfg.num_expert_group);
        CAPTURE(with_bias);
        const routed r = route(l, 1, e, cfg, with_bias ? &bias : nullptr);
        std::vector<std::int32_t> want_ids(4, -1);
        std::vector<float> want_w(4, 0.0f);
        const float shared = cfg.apply_routed_scaling_factor_on_weights ? 1.0f : 1.0f / 2.5f;
        for (int s = 0; s < cfg.num_fused_shared_experts; ++s) {
          want_ids.push_back(e + s);  // shared experts do not depend on the logits
          want_w.push_back(shared);
        }
        CHECK(r.ids == want_ids);
        CHECK(same_bits(r.weights, want_w));
      }
}

TEST_CASE("non-finite logits: grouped top-k ranks a group without eligible experts last") {
  // Group 0 has only -inf and NaN logits and the largest bias: the two groups kept are 1 and 2.
  const std::vector<float> l = {-inf, nan_value, -1.0f, -2.0f, -1.5f, -3.0f, -4.0f, -5.0f};
  const std::vector<float> bias = {50.0f, 50.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (auto f : {mr::scoring_func::softmax, mr::scoring_func::sigmoid})
    for (bool with_bias : {false, true}) {
      CAPTURE(static_cast<int>(f));
      CAPTURE(with_bias);
      const mr::topk_config cfg{.top_k = 4, .scoring = f, .renormalize = false, .num_expert_group = 4,
                                .topk_group = 2};
      const routed r = route(l, 1, 8, cfg, with_bias ? &bias : nullptr);
      CHECK(r.ids == std::vector<std::int32_t>{2, 4, 3, 5});
    }
}

TEST_CASE("renormalization of selected scores that all underflow gives zeros, not NaN") {
  const std::vector<float> l(8, -200.0f);  // sigmoid(-200) is 0 in f32
  const routed r = route(l, 1, 8, {.top_k = 2, .scoring = mr::scoring_func::sigmoid, .renormalize = true});
  CHECK(r.ids == std::vector<std::int32_t>{0, 1});
  CHECK(r.weights == std::vector<float>{0.0f, 0.0f});
  // Softmax: the kept group holds no expert near the max.
  const std::vector<float> g = {3e38f, 0.0f, 0.0f, 0.0f, -3e38f, -3e38f, -3e38f, -3e38f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const routed s = route(g, 1, 8, {.top_k = 2, .renormalize = true, .num_expert_group = 2, .topk_group = 1}, &bias);
  CHECK(s.ids == std::vector<std::int32_t>{4, 5});
  CHECK(s.weights == std::vector<float>{0.0f, 0.0f});
}

TEST_CASE("fused shared experts: slots k.. hold ids E.. and the fixed weight; the routed slots are unchanged") {
  std::mt19937 rng(mr::test::test_seed());
  const int m = 12, e = 16;
  for (int k : {1, 4, 8})
    for (const mr::topk_config& base : every_option(k))
      for (int n : {1, 2, 3})
        for (float weight : {1.0f, 0.5f}) {
          if (base.num_fused_shared_experts != 0) continue;
          CAPTURE(k);
          CAPTURE(n);
          CAPTURE(weight);
          CAPTURE(static_cast<int>(base.scoring));
          CAPTURE(base.renormalize);
          CAPTURE(base.num_expert_group);
          CAPTURE(base.apply_routed_scaling_factor_on_weights);
          mr::topk_config cfg = base;
          cfg.num_fused_shared_experts = n;
          cfg.fused_shared_expert_weight = weight;
          const std::vector<float> l = ladder_logits(m, e, rng, 0.05f);
          std::vector<float> bias(e);
          for (int i = 0; i < e; ++i) bias[i] = 0.01f * float((i * 7) % e);
          const routed plain = route(l, m, e, base, &bias);
          const routed fused = route(l, m, e, cfg, &bias);
          CHECK(fused.scaling_applied == plain.scaling_applied);
          // Stored so that the runner's routed scaling (when it applies it) brings it to `weight`.
          const float stored = cfg.apply_routed_scaling_factor_on_weights ? weight : weight / cfg.routed_scaling_factor;
          if (!cfg.apply_routed_scaling_factor_on_weights)
            CHECK(std::fabs(stored * cfg.routed_scaling_factor - weight) <= 1e-7f);
          for (int t = 0; t < m; ++t) {
            for (int j = 0; j < k; ++j) {
              CHECK(fused.ids[t * (k + n) + j] == plain.ids[t * k + j]);
              CHECK(std::bit_cast<std::uint32_t>(fused.weights[t * (k + n) + j]) ==
                    std::bit_cast<std::uint32_t>(plain.weights[t * k + j]));
            }
            for (int s = 0; s < n; ++s) {
              CHECK(fused.ids[t * (k + n) + k + s] == e + s);
              CHECK(fused.weights[t * (k + n) + k + s] == stored);
            }
          }
        }
}

TEST_CASE("fused shared experts through the reference runner: the shared expert's output gets its weight") {
  // Runner over E + 1 experts with k + 1 slots == the routed experts alone (routed scaling
  // applied) + the shared expert times fused_shared_expert_weight.
  std::mt19937 rng(mr::test::test_seed());
  const int m = 6, e = 8, k = 2, h = 16, inter = 8;
  const float rsf = 2.5f;
  host_tensor logits(mr::dtype::f32, {m, e}), x(mr::dtype::f32, {m, h}), w13(mr::dtype::f32, {e + 1, 2 * inter, h}),
      w2(mr::dtype::f32, {e + 1, h, inter});
  mr::cpu_test::fill_uniform(logits, rng, -2.0f, 2.0f);
  mr::cpu_test::fill_uniform(x, rng, -1.0f, 1.0f);
  mr::cpu_test::fill_uniform(w13, rng, -0.3f, 0.3f);
  mr::cpu_test::fill_uniform(w2, rng, -0.3f, 0.3f);
  // Runs the reference over E + 1 experts with `slots` slots per token, routed scaling `scaling`.
  auto moe = [&](const host_tensor& w, const host_tensor& ids, int slots, float scaling, bool applied) {
    mr::MoeRunner<mr::reference_policy> runner(
        "reference", mr::MoeRunnerConfig({.num_experts = e + 1, .hidden_size = h, .intermediate_size = inter,
                                          .top_k = slots, .routed_scaling_factor = scaling}));
    host_tensor out(mr::dtype::f32, {m, h});
    runner.run(mr::DispatchOutput{x.view, {}, {w.view, ids.view, applied}}, mr::unquantized_quant_info{w13.view, w2.view},
               out.view, {}, {});
    return std::vector<float>(out.ptr<float>(), out.ptr<float>() + m * h);
  };
  for (bool applied : {false, true})
    for (float shared_weight : {1.0f, 0.75f}) {
      CAPTURE(applied);
      CAPTURE(shared_weight);
      const mr::topk_config routed_cfg{.top_k = k, .scoring = mr::scoring_func::sigmoid, .routed_scaling_factor = rsf,
                                       .apply_routed_scaling_factor_on_weights = applied};
      mr::topk_config fused_cfg = routed_cfg;
      fused_cfg.num_fused_shared_experts = 1;
      fused_cfg.fused_shared_expert_weight = shared_weight;
      host_tensor fw(mr::dtype::f32, {m, k + 1}), fids(mr::dtype::i32, {m, k + 1}), rw(mr::dtype::f32, {m, k}),
          rids(mr::dtype::i32, {m, k}), sw(mr::dtype::f32, {m, 1}), sids(mr::dtype::i32, {m, 1});
      mr::TopKOutput fused{fw.view, fids.view}, routed_only{rw.view, rids.view};
      mr::reference::topk(logits.view, nullptr, fused_cfg, fused);
      mr::reference::topk(logits.view, nullptr, routed_cfg, routed_only);
      for (int t = 0; t < m; ++t) {
        sw.ptr<float>()[t] = shared_weight;
        sids.ptr<std::int32_t>()[t] = e;
      }
      const std::vector<float> got = moe(fw, fids, k + 1, rsf, applied);
      const std::vector<float> routed_out = moe(rw, rids, k, rsf, applied);
      const std::vector<float> shared_out = moe(sw, sids, 1, 1.0f, false);
      double num = 0.0, den = 0.0;
      for (int i = 0; i < m * h; ++i) {
        const double want = double(routed_out[i]) + double(shared_out[i]);
        num += (got[i] - want) * (got[i] - want);
        den += want * want;
      }
      CHECK(std::sqrt(num / den) <= 1e-6);
    }
}

TEST_CASE("fused shared experts: the option is checked and the outputs must be [M, k + n]") {
  host_tensor l(mr::dtype::f32, {2, 16});
  for (int i = 0; i < 32; ++i) l.ptr<float>()[i] = 0.1f * float(i % 7);
  auto run = [&](const mr::topk_config& cfg, int width) {
    host_tensor w(mr::dtype::f32, {2, width}), ids(mr::dtype::i32, {2, width});
    mr::TopKOutput out{w.view, ids.view};
    mr::reference::topk(l.view, nullptr, cfg, out);
  };
  CHECK_NOTHROW(run({.top_k = 4, .num_fused_shared_experts = 1}, 5));
  CHECK_NOTHROW(run({.top_k = 16, .num_fused_shared_experts = mr::max_top_k - 16}, mr::max_top_k));
  CHECK_THROWS_AS(run({.top_k = 4, .num_fused_shared_experts = 1}, 4), mr::invalid_argument_error);
  CHECK_THROWS_AS(run({.top_k = 4, .num_fused_shared_experts = -1}, 3), mr::invalid_argument_error);
  CHECK_THROWS_AS(run({.top_k = 16, .num_fused_shared_experts = mr::max_top_k - 15}, mr::max_top_k + 1),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(run({.top_k = 4, .num_fused_shared_experts = 1, .fused_shared_expert_weight = inf}, 5),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(run({.top_k = 4, .num_fused_shared_experts = 1, .fused_shared_expert_weight = nan_value}, 5),
                  mr::invalid_argument_error);
  // Finite, but not once divided by the routed scaling the runner applies later.
  CHECK_THROWS_AS(run({.top_k = 4, .routed_scaling_factor = 1e-3f, .num_fused_shared_experts = 1,
                       .fused_shared_expert_weight = 3e38f},
                      5),
                  mr::invalid_argument_error);
  CHECK_NOTHROW(run({.top_k = 4, .routed_scaling_factor = 1e-3f, .apply_routed_scaling_factor_on_weights = true,
                     .num_fused_shared_experts = 1, .fused_shared_expert_weight = 3e38f},
                    5));
}

TEST_CASE("half-precision logits route exactly like their f32 values") {
  std::mt19937 rng(3);
  const int m = 16, e = 64, k = 6;
  for (auto t : {mr::dtype::bf16, mr::dtype::f16}) {
    host_tensor l(t, {m, e});
    mr::cpu_test::fill_uniform(l, rng, -3.0f, 3.0f);
    std::vector<float> as_f32(m * e);
    for (int i = 0; i < m * e; ++i) as_f32[i] = static_cast<float>(mr::cpu_test::decode(l.view, i));
    host_tensor w(mr::dtype::f32, {m, k}), ids(mr::dtype::i32, {m, k});
    mr::TopKOutput out{w.view, ids.view};
    mr::reference::topk(l.view, nullptr, {.top_k = k}, out);
    const routed expect = route(as_f32, m, e, {.top_k = k});
    CHECK(std::vector<std::int32_t>(ids.ptr<std::int32_t>(), ids.ptr<std::int32_t>() + m * k) == expect.ids);
    CHECK(std::vector<float>(w.ptr<float>(), w.ptr<float>() + m * k) == expect.weights);
  }
}

TEST_CASE("zero tokens route to nothing and write nothing") {
  host_tensor l(mr::dtype::f32, {0, 8}), w(mr::dtype::f32, {0, 2}), ids(mr::dtype::i32, {0, 2});
  mr::TopKOutput out{w.view, ids.view};
  mr::reference::topk(l.view, nullptr, {.top_k = 2}, out);
  mr::tensor_view null_logits = l.view, null_w = w.view, null_ids = ids.view;
  null_logits.data = null_w.data = null_ids.data = nullptr;
  mr::TopKOutput null_out{null_w, null_ids};
  CHECK_NOTHROW(mr::reference::topk(null_logits, nullptr, {.top_k = 2}, null_out));
}

TEST_CASE("portable::exp is within 1 ulp of the correctly rounded exp over its whole range") {
  std::uint32_t worst = 0;
  float worst_x = 0.0f;
  std::int64_t checked = 0;
  // Every 127th float between -104 and 89 (about 17 million values), both signs.
  for (float start : {0.0f, -0.0f}) {
    const float end = std::signbit(start) ? -104.0f : 89.0f;
    for (std::uint32_t b = std::bit_cast<std::uint32_t>(start); ; b += 127) {
      const float x = std::bit_cast<float>(b);
      if (std::fabs(x) > std::fabs(end) || std::isnan(x)) break;
      const float got = mr::portable::exp(x);
      const float want = static_cast<float>(std::exp(static_cast<double>(x)));
      if (std::isinf(want) || want == 0.0f) {
        // Past the ends the result saturates; the ends themselves may round either way.
        if (x > 88.8f) CHECK(std::isinf(got));
        if (x < -104.0f) CHECK(got == 0.0f);
        continue;
      }
      const std::uint32_t d = ulp_distance(got, want);
      if (d > worst) {
        worst = d;
        worst_x = x;
      }
      ++checked;
    }
  }
  CAPTURE(worst_x);
  CHECK(checked > 16'000'000);
  CHECK(worst <= 1);

  // Every float in [-1, 1] a step of 2^-22 apart, where the reduction switches between n = 0 and 1,
  // and the special values.
  std::uint32_t worst_near_zero = 0;
  for (int i = -(1 << 22); i <= (1 << 22); ++i) {
    const float x = std::ldexp(static_cast<float>(i), -22);
    worst_near_zero = std::max(worst_near_zero, ulp_distance(mr::portable::exp(x), float(std::exp(double(x)))));
  }
  CHECK(worst_near_zero <= 1);
  CHECK(mr::portable::exp(0.0f) == 1.0f);
  CHECK(mr::portable::exp(-0.0f) == 1.0f);
  CHECK(std::isnan(mr::portable::exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(mr::portable::exp(INFINITY) == INFINITY);
  CHECK(mr::portable::exp(-INFINITY) == 0.0f);
  CHECK(mr::portable::exp(88.8f) == INFINITY);
  CHECK(ulp_distance(mr::portable::exp(88.7f), float(std::exp(double(88.7f)))) <= 1);
  CHECK(mr::portable::exp(-105.0f) == 0.0f);
  // Subnormal results keep their value.
  CHECK(ulp_distance(mr::portable::exp(-100.0f), float(std::exp(-100.0))) <= 1);
  CHECK(mr::portable::exp(-100.0f) > 0.0f);
  CHECK(mr::portable::sigmoid(0.0f) == 0.5f);
  for (float x : {-20.0f, -3.0f, -0.1f, 0.7f, 5.0f, 30.0f})
    CHECK(std::fabs(mr::portable::sigmoid(x) - 1.0 / (1.0 + std::exp(-double(x)))) <=
          3e-7 / (1.0 + std::exp(-double(x))));
}
