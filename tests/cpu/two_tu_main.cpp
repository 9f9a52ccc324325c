// The two-TU test: two translation units each register a backend by macro and both
// include a header that registers a third; main sees exactly those three records.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "moerunner/moerunner.hpp"
#include "two_tu_shared.hpp"

namespace mr = moerunner;

namespace {
bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
}  // namespace

TEST_CASE("both translation units' backends resolve, and the registry holds exactly the expected records") {
  auto& reg = mr::backend_registry::global();
  CHECK(reg.deferred_errors().empty());
  CHECK(reg.resolve("two_tu_a").name() == "two_tu_a");
  CHECK(reg.resolve("two_tu_b").name() == "two_tu_b");
  CHECK(reg.resolve("two_tu_shared").name() == "two_tu_shared");

  auto ids = reg.registered();
  std::sort(ids.begin(), ids.end());
  REQUIRE(ids.size() == 3);
  CHECK(ids[0].name() == "two_tu_a");
  CHECK(ids[1].name() == "two_tu_b");
  CHECK(ids[2].name() == "two_tu_shared");

  const auto a = reg.lookup(ids[0]), b = reg.lookup(ids[1]), shared = reg.lookup(ids[2]);
  REQUIRE((a && b && shared));
  CHECK(ends_with(a->site.file, "two_tu_a.cpp"));
  CHECK(ends_with(b->site.file, "two_tu_b.cpp"));
  // Registered from both TUs, recorded once, at the header's line.
  CHECK(ends_with(shared->site.file, "two_tu_shared.hpp"));
  CHECK(shared->site.line == two_tu::shared_registration_line);
  CHECK(shared->type_key == &mr::policy_type_key<two_tu::shared_header_policy>);
  for (const auto* r : {&*a, &*b, &*shared}) CHECK(r->kind == mr::registration_kind::new_backend);
  const std::string known = reg.known_names();
  CHECK(known.find("two_tu_a") != std::string::npos);
  CHECK(known.find("two_tu_b") != std::string::npos);
  CHECK(known.find("two_tu_shared") != std::string::npos);
}

TEST_CASE("the translation units share one registry, one key per policy type, and one copy of the templates") {
  const two_tu::tu_report ra = two_tu::report_a(), rb = two_tu::report_b();
  CHECK(ra.registry == &mr::backend_registry::global());
  CHECK(rb.registry == &mr::backend_registry::global());
  CHECK(ra.shared_key == &mr::policy_type_key<two_tu::shared_header_policy>);
  CHECK(rb.shared_key == ra.shared_key);
  CHECK(ra.own_key != rb.own_key);
  CHECK(ra.own_name == "two_tu_a");
  CHECK(rb.own_name == "two_tu_b");
  const auto& reg = mr::backend_registry::global();
  CHECK(reg.lookup(mr::backend_id(ra.own_name))->type_key == ra.own_key);
  CHECK(reg.lookup(mr::backend_id(rb.own_name))->type_key == rb.own_key);
  CHECK(ra.runs_reference_equal);
  CHECK(rb.runs_reference_equal);
}
