// What every rule test file includes and names: Catch2, a temporary directory, a run.db
// written row by row (RunFixture), the analyzer and its renderers, and the checks that
// find a rule's finding in a report.
#pragma once

#include <catch2/catch.hpp>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/render.h"
#include "rule_checks.h"
#include "run_fixture.h"

using namespace ampdiag;
using namespace ampdiag::analyzer;
using namespace ampdiag::test::rule_checks;
using ampdiag::test::RunFixture;
using ampdiag::test::TempDir;

// The report's finding of `rule`, required: the test case stops where there is none.
inline const Finding& required(const Report& r, const std::string& rule) {
  const Finding* f = find(r, rule);
  REQUIRE(f != nullptr);
  return *f;
}
const Finding& required(Report&& r, const std::string& rule) = delete;
