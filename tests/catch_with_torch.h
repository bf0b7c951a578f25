// Catch2 for the tests that include LibTorch. c10's logging header defines a glog-style
// CHECK(condition), which aborts on failure unseen by Catch, and the definition that comes
// last wins: LibTorch's headers came after Catch's in these tests, so every CHECK in them
// was c10's (a passing one was never counted, a failing one aborted the binary). Include
// this instead of <catch2/catch.hpp>, before any LibTorch header.
#pragma once

#include <c10/util/Logging.h>
#undef CHECK
#include <catch2/catch.hpp>
