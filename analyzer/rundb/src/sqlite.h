// Thin RAII owners of SQLite handles: errors become RunDbError naming the file.
#pragma once

#include <cstdint>
#include <string>

#include "ampdiag/rundb/rows.h"

struct sqlite3;
struct sqlite3_stmt;

namespace ampdiag::rundb {

class Database {
 public:
  enum class Mode { kCreate, kReadOnly };
  Database(const std::string& path, Mode mode);
  ~Database();
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  void exec(const char* sql);
  sqlite3* handle() const { return db_; }
  const std::string& path() const { return path_; }
  [[noreturn]] void fail(const std::string& what) const;  // throws with SQLite's message
  std::string system_error() const;  // " (strerror of the last OS error)", or empty

  // Interrupts any statement once the connection has run about `instructions` SQLite VM
  // instructions in all: no file (a recursive view, a damaged b-tree) can make a reader
  // work without end. 0: no bound.
  void bound_work(std::uint64_t instructions);
  bool work_exhausted() const { return budget_ != 0 && work_ > budget_; }

 private:
  static int on_progress(void* self);

  sqlite3* db_ = nullptr;
  std::string path_;
  std::uint64_t work_ = 0, budget_ = 0;
};

class Statement {
 public:
  // `what` names what a failed read was reading ("table steps"), for the error message.
  Statement(Database& db, const char* sql, std::string what = "");
  ~Statement();
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int index, std::int64_t value);
  Statement& bind(int index, double value);
  Statement& bind(int index, const std::string& value);
  Statement& bind_blob(int index, const void* data, int bytes);
  Statement& bind_null(int index);
  // Runs an insert/update to completion and resets the statement for reuse.
  void run();
  // Steps a query: true while a row is available.
  bool next();

  std::int64_t int64(int column) const;
  double real(int column) const;  // NULL reads as NaN
  std::string text(int column) const;
  const void* blob(int column, int* bytes) const;
  // For the one loop hot enough to read columns itself (grad_stats, 10 M rows).
  sqlite3_stmt* handle() const { return stmt_; }

 private:
  [[noreturn]] void fail(const std::string& what) const;

  Database& db_;
  std::string what_;
  sqlite3_stmt* stmt_ = nullptr;
};

}  // namespace ampdiag::rundb
