// Registration and resolution from many threads at once into one registry. Built
// separately so that CI can also run it under ThreadSanitizer.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <latch>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::echo_policy;
using mr::cpu_test::fixed_string;

namespace {

constexpr int num_threads = 16;

template <int I>
constexpr fixed_string<10> thread_name() {
  fixed_string<10> s("thread_00");
  s.chars[7] = static_cast<char>('0' + I / 10);
  s.chars[8] = static_cast<char>('0' + I % 10);
  return s;
}

template <int I>
using thread_policy = echo_policy<thread_name<I>()>;

// All threads register this one type; exactly one of them may win.
using contended_policy = echo_policy<"contended">;

const mr::MoeRunnerConfig small_config({.num_experts = 4, .hidden_size = 8, .intermediate_size = 4, .top_k = 2});

struct thread_result {
  bool own_ok = false;
  std::string own_error;
  bool contended_ok = false;
  std::string contended_error;
  bool runner_ok = false;
  std::string runner_error;
  bool replace_ok = false;
  std::string replace_error;
  int resolved_others = 0;
  std::vector<std::string> bad;  // anything inconsistent seen while racing
};

template <int I>
void worker(mr::backend_registry& reg, std::latch& start, thread_result& res) {
  const std::array<std::string, num_threads> names = [] {
    std::array<std::string, num_threads> n{};
    for (int j = 0; j < num_threads; ++j) n[j] = "thread_" + std::string(1, char('0' + j / 10)) + char('0' + j % 10);
    return n;
  }();
  start.arrive_and_wait();
  try {
    reg.add<thread_policy<I>>({"threads.cpp", 100 + I}, mr::registration_kind::new_backend);
    res.own_ok = true;
  } catch (const mr::registry_error& e) {
    res.own_error = e.what();
  }
  try {
    reg.add<contended_policy>({"contended.cpp", I}, mr::registration_kind::new_backend);
    res.contended_ok = true;
  } catch (const mr::registry_error& e) {
    res.contended_error = e.what();
  }
  // Half the threads race a runner (which freezes the built-in) against a replacement.
  if (I % 2 == 0) {
    try {
      mr::MoeRunner<mr::reference_policy> runner("reference", small_config, reg);
      if (!runner.runner_backend().is_reference()) res.bad.push_back("runner resolved another backend");
      res.runner_ok = true;
    } catch (const mr::registry_error& e) {
      res.runner_error = e.what();
    }
  } else {
    try {
      reg.add<echo_policy<"reference", I>>({"replace.cpp", I}, mr::registration_kind::replace_builtin);
      res.replace_ok = true;
    } catch (const mr::registry_error& e) {
      res.replace_error = e.what();
    }
  }
  for (int round = 0; round < 20; ++round) {
    for (int j = 0; j < num_threads; ++j) {
      try {
        const mr::backend_id id = reg.resolve(names[j]);
        if (id.name() != names[j]) res.bad.push_back("resolve returned " + std::string(id.name()));
        const auto rec = reg.lookup(id);
        if (!rec || rec->site.line != 100 + j) res.bad.push_back("lookup disagrees with resolve for " + names[j]);
        ++res.resolved_others;
      } catch (const mr::registry_error& e) {
        const std::string what = e.what();
        if (what.rfind("unknown MoE runner backend '" + names[j] + "'", 0) != 0) res.bad.push_back(what);
      }
    }
    const std::string known = reg.known_names();
    if (known.rfind("reference, cuda_fused, cublas_grouped, cuda_fused_fp8", 0) != 0) res.bad.push_back("known names: " + known);
    for (const auto& id : reg.registered())
      if (!reg.lookup(id)) res.bad.push_back("registered but not found: " + std::string(id.name()));
  }
}

template <int... I>
std::vector<std::thread> launch(mr::backend_registry& reg, std::latch& start, std::vector<thread_result>& results,
                                std::integer_sequence<int, I...>) {
  std::vector<std::thread> threads;
  (threads.emplace_back(worker<I>, std::ref(reg), std::ref(start), std::ref(results[I])), ...);
  return threads;
}

template <int... I>
std::array<const void*, num_threads> thread_keys(std::integer_sequence<int, I...>) {
  return {&mr::policy_type_key<thread_policy<I>>...};
}

}  // namespace

TEST_CASE("16 threads registering and resolving concurrently leave a consistent registry") {
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    mr::backend_registry reg;
    std::latch start(num_threads);
    std::vector<thread_result> results(num_threads);
    auto threads = launch(reg, start, results, std::make_integer_sequence<int, num_threads>{});
    for (auto& t : threads) t.join();

    int contended_winner = -1, replace_winner = -1;
    for (int i = 0; i < num_threads; ++i) {
      CAPTURE(i);
      const thread_result& r = results[i];
      CHECK(r.bad.empty());
      for (const auto& b : r.bad) MESSAGE(b);
      CHECK(r.own_ok);
      CHECK(r.own_error.empty());
      if (r.contended_ok) {
        CHECK(contended_winner == -1);
        contended_winner = i;
      }
      if (r.replace_ok) {
        CHECK(replace_winner == -1);
        replace_winner = i;
      }
      // Every thread eventually sees its own name, and it resolves at least its own 20 times.
      CHECK(r.resolved_others >= 20);
    }
    REQUIRE(contended_winner >= 0);
    for (int i = 0; i < num_threads; ++i) {
      if (i == contended_winner) continue;
      CHECK(results[i].contended_error == "duplicate registration of backend 'contended': first at contended.cpp:" +
                                              std::to_string(contended_winner) + ", again at contended.cpp:" +
                                              std::to_string(i));
    }
    // The replacement either landed before every runner (no runner of this registry
    // resolved "reference" yet) or was refused because one had; never both, never neither.
    for (int i = 1; i < num_threads; i += 2) {
      if (i == replace_winner) continue;
      const std::string& err = results[i].replace_error;
      const std::string frozen = "cannot replace built-in backend 'reference' at replace.cpp:" + std::to_string(i) +
                                 ": a runner has already resolved it; replace built-ins before constructing runners";
      const bool is_frozen = err == frozen;
      const bool is_dup = replace_winner >= 0 && err == "duplicate registration of backend 'reference': first at "
                                                        "replace.cpp:" + std::to_string(replace_winner) +
                                                        ", again at replace.cpp:" + std::to_string(i);
      CHECK((is_frozen || is_dup));
    }
    // A runner listing only the original either ran before the replacement (and then the
    // replacement must have been refused) or refuses to run the original once replaced.
    for (int i = 0; i < num_threads; i += 2) {
      if (results[i].runner_ok) {
        CHECK(replace_winner == -1);
        continue;
      }
      REQUIRE(replace_winner >= 0);
      CHECK(results[i].runner_error == "backend 'reference' is registered at replace.cpp:" +
                                           std::to_string(replace_winner) +
                                           " but that policy is not in this runner's policy list (reference); add "
                                           "it to MoeRunner<...>");
    }

    // Exactly the expected records, each once, each with its own type and site.
    const auto ids = reg.registered();
    CHECK(ids.size() == static_cast<std::size_t>(num_threads + 1 + (replace_winner >= 0 ? 1 : 0)));
    std::set<mr::backend_id> unique(ids.begin(), ids.end());
    CHECK(unique.size() == ids.size());
    const auto keys = thread_keys(std::make_integer_sequence<int, num_threads>{});
    for (int i = 0; i < num_threads; ++i) {
      const std::string name = "thread_" + std::string(1, char('0' + i / 10)) + char('0' + i % 10);
      const auto rec = reg.lookup(reg.resolve(name));
      REQUIRE(rec.has_value());
      CHECK(rec->type_key == keys[i]);
      CHECK(rec->site.line == 100 + i);
      CHECK(rec->kind == mr::registration_kind::new_backend);
    }
    const auto contended = reg.lookup(reg.resolve("contended"));
    REQUIRE(contended.has_value());
    CHECK(contended->type_key == &mr::policy_type_key<contended_policy>);
    CHECK(contended->site.line == contended_winner);
    CHECK(reg.lookup(mr::builtin::reference).has_value() == (replace_winner >= 0));
    CHECK(reg.deferred_errors().empty());
  }
}

TEST_CASE("deferred registrations from many threads are all kept and re-raised together") {
  mr::backend_registry reg;
  std::latch start(num_threads);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < num_threads; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      // Every thread tries to take the built-in name through the new-backend path.
      if (!reg.add_deferred<echo_policy<"cuda_fused">>({"deferred.cpp", i}, mr::registration_kind::new_backend))
        failures.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures.load() == num_threads);
  const auto errors = reg.deferred_errors();
  REQUIRE(errors.size() == static_cast<std::size_t>(num_threads));
  std::set<std::string> distinct(errors.begin(), errors.end());
  CHECK(distinct.size() == errors.size());
  for (int i = 0; i < num_threads; ++i)
    CHECK(distinct.count("cannot register backend 'cuda_fused' at deferred.cpp:" + std::to_string(i) +
                         ": the name is built in; to replace the built-in use MOE_REPLACE_BUILTIN_BACKEND") == 1);
  CHECK_THROWS_AS(reg.resolve("reference"), mr::registry_error);
}
