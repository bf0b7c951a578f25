// Runs SQL statements on a SQLite file (created if absent) behind the writer's back: the
// tests make old formats and damaged files with it.
#pragma once

#include <catch2/catch.hpp>

#include <sqlite3.h>

#include <string>

namespace ampdiag::test {

inline void run_sql(const std::string& path, const char* statements) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  REQUIRE(sqlite3_exec(db, statements, nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(db);
}

}  // namespace ampdiag::test
