// Backend names, ids, predicates and every registry rule, on caller-owned registries
// so that no test depends on another's registrations.
#include <doctest/doctest.h>

#include <set>
#include <string>
#include <type_traits>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::echo_policy;

namespace {

const mr::MoeRunnerConfig small_config({.num_experts = 4, .hidden_size = 8, .intermediate_size = 4, .top_k = 2});

// 63 and 64 characters: the longest accepted name and the shortest rejected one.
constexpr char name63[] = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_";
constexpr char name64[] = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_+";
static_assert(sizeof(name63) == 64 && sizeof(name64) == 65);

std::string builtins_list() { return "reference, cuda_fused, cublas_grouped, cuda_fused_fp8"; }

}  // namespace

TEST_CASE("the built-in list has the four documented backends, each with a valid name and a description") {
  static_assert(mr::builtin::all.size() == 4, "a new built-in needs its predicate spelled out in these tests");
  CHECK(mr::builtin::all[0].id.name() == "reference");
  CHECK(mr::builtin::all[1].id.name() == "cuda_fused");
  CHECK(mr::builtin::all[2].id.name() == "cublas_grouped");
  CHECK(mr::builtin::all[3].id.name() == "cuda_fused_fp8");
  std::set<std::string_view> names;
  for (const auto& b : mr::builtin::all) {
    CHECK(mr::backend_name_problem(b.id.name()).empty());
    CHECK_FALSE(b.description.empty());
    CHECK(b.id.is_builtin());
    CHECK(mr::is_builtin_name(b.id.name()));
    names.insert(b.id.name());
  }
  CHECK(names.size() == mr::builtin::all.size());
  CHECK(mr::builtin::reference == mr::builtin::all[0].id);
  CHECK(mr::builtin::cuda_fused == mr::builtin::all[1].id);
  CHECK(mr::builtin::cublas_grouped == mr::builtin::all[2].id);
  CHECK(mr::builtin::cuda_fused_fp8 == mr::builtin::all[3].id);
}

TEST_CASE("exactly one predicate is true for every built-in") {
  for (const auto& b : mr::builtin::all) {
    CAPTURE(b.id.name());
    const int spelled = int(b.id.is_reference()) + int(b.id.is_cuda_fused()) + int(b.id.is_cublas_grouped()) +
                        int(b.id.is_cuda_fused_fp8());
    CHECK(spelled == 1);
    // The same count taken from the X-macro list, so a built-in added there is covered too.
    int generated = 0;
#define MOERUNNER_X(ident, str, doc) generated += int(b.id.is_##ident());
    MOERUNNER_BUILTIN_BACKENDS(MOERUNNER_X)
#undef MOERUNNER_X
    CHECK(generated == 1);
  }
  CHECK(mr::builtin::reference.is_reference());
  CHECK_FALSE(mr::builtin::reference.is_cuda_fused());
  CHECK_FALSE(mr::builtin::reference.is_cublas_grouped());
  CHECK(mr::builtin::cuda_fused.is_cuda_fused());
  CHECK_FALSE(mr::builtin::cuda_fused.is_reference());
  CHECK_FALSE(mr::builtin::cuda_fused.is_cublas_grouped());
  CHECK(mr::builtin::cublas_grouped.is_cublas_grouped());
  CHECK_FALSE(mr::builtin::cublas_grouped.is_reference());
  CHECK_FALSE(mr::builtin::cublas_grouped.is_cuda_fused());
  CHECK(mr::builtin::cuda_fused_fp8.is_cuda_fused_fp8());
  CHECK_FALSE(mr::builtin::cuda_fused_fp8.is_cuda_fused());
  CHECK_FALSE(mr::builtin::cuda_fused.is_cuda_fused_fp8());
  static_assert(mr::builtin::reference.is_reference() && !mr::builtin::reference.is_cuda_fused());
  static_assert(mr::backend_id(std::string_view("cublas_grouped")).is_cublas_grouped());
}

TEST_CASE("a registered backend's id has no built-in predicate") {
  mr::backend_registry reg;
  reg.add<echo_policy<"my_backend">>({"reg.cpp", 1}, mr::registration_kind::new_backend);
  const mr::backend_id id = reg.resolve("my_backend");
  CHECK(id.name() == "my_backend");
  CHECK_FALSE(id.is_builtin());
  CHECK_FALSE(id.is_reference());
  CHECK_FALSE(id.is_cuda_fused());
  CHECK_FALSE(id.is_cublas_grouped());
  CHECK_FALSE(id.is_cuda_fused_fp8());
  // Case matters: a near-spelling of a built-in is a different backend.
  const mr::backend_id upper(std::string_view("Reference"));
  CHECK_FALSE(upper.is_reference());
  CHECK_FALSE(upper.is_builtin());
}

TEST_CASE("backend_id compares by name, equally for built-in and registered ids") {
  const mr::backend_id a(std::string_view("alpha")), a2(std::string_view("alpha")), b(std::string_view("beta"));
  CHECK(a == a2);
  CHECK(a != b);
  CHECK(a < b);
  CHECK(b > a);
  CHECK((a <=> a2) == std::strong_ordering::equal);
  CHECK(mr::backend_id(std::string_view("reference")) == mr::builtin::reference);
  CHECK(mr::builtin::cublas_grouped < mr::builtin::cuda_fused);
  CHECK(mr::builtin::cuda_fused < mr::builtin::reference);
  // A prefix orders first.
  CHECK(mr::backend_id(std::string_view("ref")) < mr::builtin::reference);
  CHECK(mr::backend_id().empty());
  CHECK(mr::backend_id().name().empty());
  std::set<mr::backend_id> ordered{b, a, mr::builtin::reference, a2};
  CHECK(ordered.size() == 3);
  CHECK(ordered.begin()->name() == "alpha");
}

TEST_CASE("backend_name_problem states each rule") {
  CHECK(mr::backend_name_problem("ok_name-1.2").empty());
  CHECK(mr::backend_name_problem(name63).empty());
  CHECK(mr::backend_name_problem("") == "a backend name must not be empty");
  CHECK(mr::backend_name_problem(name64) == "a backend name must be at most 63 characters");
  const std::string_view printable = "a backend name may only hold printable ASCII characters without spaces";
  CHECK(mr::backend_name_problem("a b") == printable);
  CHECK(mr::backend_name_problem("tab\tname") == printable);
  CHECK(mr::backend_name_problem("new\nline") == printable);
  CHECK(mr::backend_name_problem("del\x7f") == printable);
  CHECK(mr::backend_name_problem("caf\xc3\xa9") == printable);
  CHECK(mr::backend_name_problem(std::string_view("nul\0x", 5)) == printable);
  CHECK(mr::backend_name_problem("~!@#$%^&*()_+{}|:<>?").empty());
  static_assert(mr::backend_name_problem("").size() > 0, "usable at compile time by the macros");
}

TEST_CASE("registration rejects malformed names with the name, the site and the rule") {
  mr::backend_registry reg;
  const auto kind = mr::registration_kind::new_backend;
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"">>({"bad.cpp", 10}, kind),
                       "cannot register backend '' at bad.cpp:10: a backend name must not be empty",
                       mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<name64>>({"bad.cpp", 11}, kind),
                       ("cannot register backend '" + std::string(name64) +
                        "' at bad.cpp:11: a backend name must be at most 63 characters")
                           .c_str(),
                       mr::registry_error);
  const std::string printable = "a backend name may only hold printable ASCII characters without spaces";
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"two words">>({"bad.cpp", 12}, kind),
                       ("cannot register backend 'two words' at bad.cpp:12: " + printable).c_str(),
                       mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"tab\tname">>({"bad.cpp", 13}, kind),
                       ("cannot register backend 'tab\\x09name' at bad.cpp:13: " + printable).c_str(),
                       mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"bell\a">>({"bad.cpp", 14}, kind),
                       ("cannot register backend 'bell\\x07' at bad.cpp:14: " + printable).c_str(), mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"caf\xc3\xa9">>({"bad.cpp", 15}, kind),
                       ("cannot register backend 'caf\\xc3\\xa9' at bad.cpp:15: " + printable).c_str(),
                       mr::registry_error);
  // A NUL inside the name must not cut the message short.
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"nul\0name">>({"bad.cpp", 17}, kind),
                       ("cannot register backend 'nul\\x00name' at bad.cpp:17: " + printable).c_str(),
                       mr::registry_error);
  // A malformed name is rejected on the replacement path too, before any other rule.
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<" reference">>({"bad.cpp", 16}, mr::registration_kind::replace_builtin),
                       ("cannot register backend ' reference' at bad.cpp:16: " + printable).c_str(),
                       mr::registry_error);
  CHECK(reg.registered().empty());
  CHECK(reg.deferred_errors().empty());

  // The longest legal name registers and resolves.
  reg.add<echo_policy<name63>>({"ok.cpp", 1}, kind);
  CHECK(reg.resolve(name63).name() == name63);
  REQUIRE(reg.registered().size() == 1);
  CHECK(reg.registered()[0].name() == name63);
}

TEST_CASE("a built-in name cannot be taken through the new-backend path") {
  mr::backend_registry reg;
  for (const auto& site_line : {20, 21}) {
    CHECK_THROWS_WITH_AS(
        reg.add<echo_policy<"reference">>({"clash.cpp", site_line}, mr::registration_kind::new_backend),
        ("cannot register backend 'reference' at clash.cpp:" + std::to_string(site_line) +
         ": the name is built in; to replace the built-in use MOE_REPLACE_BUILTIN_BACKEND")
            .c_str(),
        mr::registry_error);
  }
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"cublas_grouped">>({"clash.cpp", 22}, mr::registration_kind::new_backend),
                       "cannot register backend 'cublas_grouped' at clash.cpp:22: the name is built in; to replace "
                       "the built-in use MOE_REPLACE_BUILTIN_BACKEND",
                       mr::registry_error);
  CHECK(reg.registered().empty());
  CHECK_FALSE(reg.lookup(mr::builtin::reference).has_value());
}

TEST_CASE("only a built-in can be replaced") {
  mr::backend_registry reg;
  CHECK_THROWS_WITH_AS(reg.add<echo_policy<"not_builtin">>({"replace.cpp", 30}, mr::registration_kind::replace_builtin),
                       ("cannot replace backend 'not_builtin' at replace.cpp:30: no built-in has that name; "
                        "built-ins are: " +
                        builtins_list())
                           .c_str(),
                       mr::registry_error);
  // Also when the name is already registered as a new backend.
  reg.add<echo_policy<"mine">>({"replace.cpp", 31}, mr::registration_kind::new_backend);
  CHECK_THROWS_WITH_AS((reg.add<echo_policy<"mine", 8>>({"replace.cpp", 32}, mr::registration_kind::replace_builtin)),
                       ("cannot replace backend 'mine' at replace.cpp:32: no built-in has that name; built-ins are: " +
                        builtins_list())
                           .c_str(),
                       mr::registry_error);
  REQUIRE(reg.registered().size() == 1);
  CHECK(reg.lookup(mr::backend_id(std::string_view("mine")))->site.line == 31);
}

TEST_CASE("a duplicate registration names both sites") {
  mr::backend_registry reg;
  reg.add<echo_policy<"dup">>({"first.cpp", 40}, mr::registration_kind::new_backend);
  SUBCASE("another policy type under the same name") {
    CHECK_THROWS_WITH_AS((reg.add<echo_policy<"dup", 16>>({"second.cpp", 41}, mr::registration_kind::new_backend)),
                         "duplicate registration of backend 'dup': first at first.cpp:40, again at second.cpp:41",
                         mr::registry_error);
  }
  SUBCASE("the same policy type from another site") {
    CHECK_THROWS_WITH_AS(reg.add<echo_policy<"dup">>({"second.cpp", 42}, mr::registration_kind::new_backend),
                         "duplicate registration of backend 'dup': first at first.cpp:40, again at second.cpp:42",
                         mr::registry_error);
  }
  SUBCASE("the same policy type from the same file, another line") {
    CHECK_THROWS_WITH_AS(reg.add<echo_policy<"dup">>({"first.cpp", 43}, mr::registration_kind::new_backend),
                         "duplicate registration of backend 'dup': first at first.cpp:40, again at first.cpp:43",
                         mr::registry_error);
  }
  SUBCASE("another policy type from the very same site") {
    CHECK_THROWS_WITH_AS((reg.add<echo_policy<"dup", 24>>({"first.cpp", 40}, mr::registration_kind::new_backend)),
                         "duplicate registration of backend 'dup': first at first.cpp:40, again at first.cpp:40",
                         mr::registry_error);
  }
  SUBCASE("a second replacement of the same built-in") {
    reg.add<echo_policy<"cuda_fused">>({"first.cpp", 44}, mr::registration_kind::replace_builtin);
    CHECK_THROWS_WITH_AS(
        (reg.add<echo_policy<"cuda_fused", 8>>({"second.cpp", 45}, mr::registration_kind::replace_builtin)),
        "duplicate registration of backend 'cuda_fused': first at first.cpp:44, again at second.cpp:45",
        mr::registry_error);
  }
  // The first registration stays in force after any rejected duplicate.
  const auto rec = reg.lookup(mr::backend_id(std::string_view("dup")));
  REQUIRE(rec.has_value());
  CHECK(rec->type_key == &mr::policy_type_key<echo_policy<"dup">>);
  CHECK(std::string_view(rec->site.file) == "first.cpp");
  CHECK(rec->site.line == 40);
}

TEST_CASE("the same policy registered again from the same site is one registration") {
  mr::backend_registry reg;
  // The file name is compared by content: a header seen by several translation units.
  const std::string other_copy = "shared.hpp";
  for (int i = 0; i < 3; ++i) reg.add<echo_policy<"same_site">>({"shared.hpp", 50}, mr::registration_kind::new_backend);
  reg.add<echo_policy<"same_site">>({other_copy.c_str(), 50}, mr::registration_kind::new_backend);
  CHECK(reg.add_deferred<echo_policy<"same_site">>({"shared.hpp", 50}, mr::registration_kind::new_backend));
  REQUIRE(reg.registered().size() == 1);
  CHECK(reg.registered()[0].name() == "same_site");
  CHECK(reg.deferred_errors().empty());
  CHECK(reg.known_names() == builtins_list() + ", same_site");
}

TEST_CASE("resolve returns built-ins, then registered names") {
  mr::backend_registry reg;
  for (const auto& b : mr::builtin::all) CHECK(reg.resolve(b.id.name()) == b.id);
  reg.add<echo_policy<"custom_a">>({"resolve.cpp", 60}, mr::registration_kind::new_backend);
  reg.add<echo_policy<"custom_b">>({"resolve.cpp", 61}, mr::registration_kind::new_backend);
  CHECK(reg.resolve("custom_a") == mr::backend_id(std::string_view("custom_a")));
  CHECK(reg.resolve("custom_b").name() == "custom_b");
  const auto rec = reg.lookup(reg.resolve("custom_b"));
  REQUIRE(rec.has_value());
  CHECK(rec->kind == mr::registration_kind::new_backend);
  CHECK(rec->type_key == &mr::policy_type_key<echo_policy<"custom_b">>);
  CHECK(rec->site.str() == "resolve.cpp:61");
  // Built-ins without a replacement have no record: the built-in policy implements them.
  CHECK_FALSE(reg.lookup(mr::builtin::reference).has_value());
  // Resolving only looks: it does not freeze built-in replacement (a runner does).
  CHECK(reg.resolve("cuda_fused").is_cuda_fused());
  reg.add<echo_policy<"cuda_fused">>({"resolve.cpp", 62}, mr::registration_kind::replace_builtin);
  CHECK(reg.resolve("cuda_fused") == mr::builtin::cuda_fused);
  CHECK(reg.lookup(mr::builtin::cuda_fused)->kind == mr::registration_kind::replace_builtin);
}

TEST_CASE("an unknown name is an error that lists every known name") {
  mr::backend_registry reg;
  CHECK_THROWS_WITH_AS(reg.resolve("nope"),
                       ("unknown MoE runner backend 'nope': neither built in nor registered; known backends: " +
                        builtins_list())
                           .c_str(),
                       mr::registry_error);
  reg.add<echo_policy<"zeta">>({"u.cpp", 1}, mr::registration_kind::new_backend);
  reg.add<echo_policy<"alpha">>({"u.cpp", 2}, mr::registration_kind::new_backend);
  // A replaced built-in is listed once, as a built-in.
  reg.add<echo_policy<"reference">>({"u.cpp", 3}, mr::registration_kind::replace_builtin);
  const std::string known = builtins_list() + ", zeta, alpha";
  CHECK(reg.known_names() == known);
  CHECK_THROWS_WITH_AS(reg.resolve("Reference"),
                       ("unknown MoE runner backend 'Reference': neither built in nor registered; known backends: " +
                        known)
                           .c_str(),
                       mr::registry_error);
  // A malformed name also says why it can never be registered.
  CHECK_THROWS_WITH_AS(reg.resolve(""),
                       ("unknown MoE runner backend '': neither built in nor registered; known backends: " + known +
                        " (a backend name must not be empty)")
                           .c_str(),
                       mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.resolve("my backend"),
                       ("unknown MoE runner backend 'my backend': neither built in nor registered; known backends: " +
                        known + " (a backend name may only hold printable ASCII characters without spaces)")
                           .c_str(),
                       mr::registry_error);
  CHECK_THROWS_WITH_AS(reg.resolve(name64),
                       ("unknown MoE runner backend '" + std::string(name64) +
                        "': neither built in nor registered; known backends: " + known +
                        " (a backend name must be at most 63 characters)")
                           .c_str(),
                       mr::registry_error);
  // A 64-character name whose first 63 characters are registered is still unknown.
  reg.add<echo_policy<name63>>({"u.cpp", 4}, mr::registration_kind::new_backend);
  CHECK_THROWS_AS(reg.resolve(name64), mr::registry_error);
}

TEST_CASE("an error quotes at most 80 characters of a name it was given, and says how long it was") {
  mr::backend_registry reg;
  const std::string huge(std::size_t{1} << 20, 'x');
  const std::string shown(mr::max_echoed_chars, 'x');
  CHECK_THROWS_WITH_AS(reg.resolve(huge),
                       ("unknown MoE runner backend '" + shown +
                        "... (1048576 characters)': neither built in nor registered; known backends: " +
                        builtins_list() + " (a backend name must be at most 63 characters)")
                           .c_str(),
                       mr::registry_error);
  // Bytes are escaped before the cut, which counts characters of the name, not of the escapes.
  const std::string nuls(200, '\0');
  std::string escaped;
  for (std::size_t i = 0; i < mr::max_echoed_chars; ++i) escaped += "\\x00";
  CHECK(mr::detail::echo(nuls) == escaped + "... (200 characters)");
  // Up to the bound nothing is cut or added.
  CHECK(mr::detail::echo(shown) == shown);
  CHECK(mr::detail::echo(shown + "y") == shown + "... (81 characters)");
  CHECK(mr::detail::echo("") == "");
  // The quant-method mismatch quotes its names the same way.
  CHECK(mr::no_quant_info_message(huge, "reference") ==
        "quant method '" + shown + "... (1048576 characters)' does not expose quant info for backend 'reference'");
}

TEST_CASE("replacing a built-in works before a runner resolved it and is an error after") {
  using replacement = echo_policy<"reference">;
  SUBCASE("before: the runner picks the replacement") {
    mr::backend_registry reg;
    reg.add<replacement>({"repl.cpp", 70}, mr::registration_kind::replace_builtin);
    mr::MoeRunner<mr::reference_policy, replacement> runner("reference", small_config, reg);
    CHECK(runner.runner_backend() == mr::builtin::reference);
    CHECK(runner.policy_index() == 1);
    // A runner that lists only the original built-in refuses rather than mixing the two.
    CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy>("reference", small_config, reg)),
                         "backend 'reference' is registered at repl.cpp:70 but that policy is not in this runner's "
                         "policy list (reference); add it to MoeRunner<...>",
                         mr::registry_error);
  }
  SUBCASE("after: the registry refuses and keeps the built-in") {
    mr::backend_registry reg;
    mr::MoeRunner<mr::reference_policy, replacement> runner("reference", small_config, reg);
    CHECK(runner.policy_index() == 0);
    CHECK_THROWS_WITH_AS(reg.add<replacement>({"repl.cpp", 71}, mr::registration_kind::replace_builtin),
                         "cannot replace built-in backend 'reference' at repl.cpp:71: a runner has already resolved "
                         "it; replace built-ins before constructing runners",
                         mr::registry_error);
    CHECK_FALSE(reg.lookup(mr::builtin::reference).has_value());
    CHECK(reg.registered().empty());
    // The freeze is per name: another built-in can still be replaced.
    reg.add<echo_policy<"cublas_grouped">>({"repl.cpp", 72}, mr::registration_kind::replace_builtin);
    CHECK(reg.lookup(mr::builtin::cublas_grouped).has_value());
    // And the built-in keeps being what later runners get.
    mr::MoeRunner<mr::reference_policy, replacement> later("reference", small_config, reg);
    CHECK(later.policy_index() == 0);
  }
}

TEST_CASE("new names may be registered after runners exist; later runners can pick them") {
  mr::backend_registry reg;
  mr::MoeRunner<mr::reference_policy, echo_policy<"late">> first("reference", small_config, reg);
  CHECK_THROWS_AS((mr::MoeRunner<mr::reference_policy, echo_policy<"late">>("late", small_config, reg)),
                  mr::registry_error);
  reg.add<echo_policy<"late">>({"late.cpp", 80}, mr::registration_kind::new_backend);
  mr::MoeRunner<mr::reference_policy, echo_policy<"late">> second("late", small_config, reg);
  CHECK(second.runner_backend().name() == "late");
  CHECK(second.policy_index() == 1);
  CHECK(first.policy_index() == 0);
}

TEST_CASE("a runner refuses a name whose policy it does not list") {
  mr::backend_registry reg;
  CHECK_THROWS_WITH_AS((mr::MoeRunner<echo_policy<"x">>("reference", small_config, reg)),
                       "backend 'reference' is built in but its policy is not in this runner's policy list (x); add "
                       "it to MoeRunner<...>",
                       mr::registry_error);
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy>("cuda_fused", small_config, reg)),
                       "backend 'cuda_fused' is built in but its policy is not in this runner's policy list "
                       "(reference); add it to MoeRunner<...>",
                       mr::registry_error);
  reg.add<echo_policy<"x">>({"list.cpp", 90}, mr::registration_kind::new_backend);
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy>("x", small_config, reg)),
                       "backend 'x' is registered at list.cpp:90 but that policy is not in this runner's policy list "
                       "(reference); add it to MoeRunner<...>",
                       mr::registry_error);
  // A different policy type with the registered name is not the registered backend.
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy, echo_policy<"x", 4>>("x", small_config, reg)),
                       "backend 'x' is registered at list.cpp:90 but that policy is not in this runner's policy list "
                       "(reference, x); add it to MoeRunner<...>",
                       mr::registry_error);
  mr::MoeRunner<echo_policy<"x", 4>, echo_policy<"x">> ok("x", small_config, reg);
  CHECK(ok.policy_index() == 1);
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy>("unknown", small_config, reg)),
                       ("unknown MoE runner backend 'unknown': neither built in nor registered; known backends: " +
                        builtins_list() + ", x")
                           .c_str(),
                       mr::registry_error);
}

TEST_CASE("errors met during static initialization are stored and re-raised by every resolve") {
  mr::backend_registry reg;
  CHECK(reg.add_deferred<echo_policy<"fine">>({"init.cpp", 1}, mr::registration_kind::new_backend));
  CHECK(reg.resolve("fine").name() == "fine");
  CHECK_FALSE(reg.add_deferred<echo_policy<"reference">>({"init.cpp", 2}, mr::registration_kind::new_backend));
  CHECK_FALSE(reg.add_deferred<echo_policy<"fine", 8>>({"init.cpp", 3}, mr::registration_kind::new_backend));
  const std::string first =
      "cannot register backend 'reference' at init.cpp:2: the name is built in; to replace the built-in use "
      "MOE_REPLACE_BUILTIN_BACKEND";
  const std::string second = "duplicate registration of backend 'fine': first at init.cpp:1, again at init.cpp:3";
  REQUIRE(reg.deferred_errors().size() == 2);
  CHECK(reg.deferred_errors()[0] == first);
  CHECK(reg.deferred_errors()[1] == second);
  const std::string raised =
      "backend registration failed during static initialization:\n  " + first + "\n  " + second;
  for (const char* name : {"reference", "fine", "nope"}) {
    CAPTURE(name);
    CHECK_THROWS_WITH_AS(reg.resolve(name), raised.c_str(), mr::registry_error);
  }
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy>("reference", small_config, reg)), raised.c_str(),
                       mr::registry_error);
  // The successful registration stands; only the failures were deferred.
  CHECK(reg.registered().size() == 1);
}

TEST_CASE("registry policy keys are distinct per policy type") {
  CHECK(&mr::policy_type_key<echo_policy<"k">> != &mr::policy_type_key<echo_policy<"k", 1>>);
  CHECK(&mr::policy_type_key<echo_policy<"k">> == &mr::policy_type_key<echo_policy<"k">>);
  CHECK(&mr::policy_type_key<mr::reference_policy> != &mr::policy_type_key<echo_policy<"reference">>);
  static_assert(mr::runner_backend_of<echo_policy<"k">>() == mr::backend_id(std::string_view("k")));
  static_assert(mr::runner_backend_of<mr::reference_policy>().is_reference());
}
