// Module paths as both the agents and the analyzer read them (rundb/module_paths.h).
#include <catch2/catch.hpp>

#include "ampdiag/rundb/module_paths.h"

using ampdiag::rundb::common_module;

TEST_CASE("the module holding two paths is their longest common run of whole components", "[module-paths]") {
  CHECK(common_module("a.b.c", "a.b.d") == "a.b");
  CHECK(common_module("enc.1", "enc.10") == "enc");
  CHECK(common_module("enc.10", "enc.1") == "enc");
}

TEST_CASE("a path holds itself and every path inside it", "[module-paths]") {
  CHECK(common_module("a.b", "a.b") == "a.b");
  CHECK(common_module("a.b.c", "a.b") == "a.b");
  CHECK(common_module("a.b", "a.b.c") == "a.b");
}

TEST_CASE("paths only the model holds have the model's empty path in common", "[module-paths]") {
  CHECK(common_module("enc", "head").empty());
  CHECK(common_module("enc", "encoder").empty());
  CHECK(common_module("", "head").empty());
}
