// RAII SQLite handles; see sqlite.h.
#include "sqlite.h"

#include <sqlite3.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace ampdiag::rundb {

Database::Database(const std::string& path, Mode mode) : path_(path) {
  const int flags = mode == Mode::kCreate ? (SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) : SQLITE_OPEN_READONLY;
  const int rc = sqlite3_open_v2(path.c_str(), &db_, flags | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    const std::string why = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
    sqlite3_close(db_);
    db_ = nullptr;
    throw RunDbError(path + ": cannot open: " + why);
  }
  sqlite3_extended_result_codes(db_, 1);
  // A reader can meet a writer mid-commit: wait briefly instead of failing at once.
  sqlite3_busy_timeout(db_, 2000);
}

Database::~Database() { sqlite3_close_v2(db_); }

namespace {
constexpr int kProgressPeriod = 10000;  // VM instructions between two progress calls
}

int Database::on_progress(void* self) {
  auto* db = static_cast<Database*>(self);
  db->work_ += kProgressPeriod;
  return db->work_exhausted() ? 1 : 0;
}

void Database::bound_work(std::uint64_t instructions) {
  budget_ = instructions;
  work_ = 0;
  sqlite3_progress_handler(db_, instructions ? kProgressPeriod : 0, instructions ? &Database::on_progress : nullptr, this);
}

void Database::fail(const std::string& what) const {
  throw RunDbError(path_ + ": " + what + ": " + sqlite3_errmsg(db_) + system_error());
}

std::string Database::system_error() const {
  // SQLite says "disk I/O error" for a full quota and a file-size limit alike; errno tells.
  const int error = sqlite3_system_errno(db_);
  return error ? std::string(" (") + std::strerror(error) + ")" : std::string();
}

void Database::exec(const char* sql) {
  char* error = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) != SQLITE_OK) {
    const std::string why = error ? error : "unknown error";
    sqlite3_free(error);
    throw RunDbError(path_ + ": " + why + system_error());
  }
}

Statement::Statement(Database& db, const char* sql, std::string what) : db_(db), what_(std::move(what)) {
  if (sqlite3_prepare_v3(db.handle(), sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt_, nullptr) != SQLITE_OK)
    fail("cannot prepare a statement");
}

void Statement::fail(const std::string& what) const {
  if (db_.work_exhausted())
    throw RunDbError(db_.path() + ": reading " + (what_.empty() ? "it" : what_) +
                     " takes SQLite far more work than a run.db of this size can need (a view or a damaged "
                     "b-tree?): corrupt run.db, not read");
  if (what_.empty()) db_.fail(what);
  throw RunDbError(db_.path() + ": reading " + what_ + " failed: " + sqlite3_errmsg(db_.handle()) +
                   " (truncated or corrupted?)");
}

Statement::~Statement() { sqlite3_finalize(stmt_); }

Statement& Statement::bind(int index, std::int64_t value) {
  sqlite3_bind_int64(stmt_, index, value);
  return *this;
}

Statement& Statement::bind(int index, double value) {
  // SQLite stores NaN as NULL; keep that explicit so readers map NULL back to NaN.
  if (std::isnan(value))
    sqlite3_bind_null(stmt_, index);
  else
    sqlite3_bind_double(stmt_, index, value);
  return *this;
}

Statement& Statement::bind(int index, const std::string& value) {
  sqlite3_bind_text(stmt_, index, value.data(), int(value.size()), SQLITE_TRANSIENT);
  return *this;
}

Statement& Statement::bind_blob(int index, const void* data, int bytes) {
  sqlite3_bind_blob(stmt_, index, data, bytes, SQLITE_TRANSIENT);
  return *this;
}

Statement& Statement::bind_null(int index) {
  sqlite3_bind_null(stmt_, index);
  return *this;
}

void Statement::run() {
  const int rc = sqlite3_step(stmt_);
  sqlite3_reset(stmt_);
  if (rc != SQLITE_DONE) fail("write failed");
}

bool Statement::next() {
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  fail("read failed");
}

std::int64_t Statement::int64(int column) const { return sqlite3_column_int64(stmt_, column); }

double Statement::real(int column) const {
  if (sqlite3_column_type(stmt_, column) == SQLITE_NULL) return std::numeric_limits<double>::quiet_NaN();
  return sqlite3_column_double(stmt_, column);
}

std::string Statement::text(int column) const {
  const auto* p = sqlite3_column_text(stmt_, column);
  return p ? std::string(reinterpret_cast<const char*>(p), std::size_t(sqlite3_column_bytes(stmt_, column))) : std::string();
}

const void* Statement::blob(int column, int* bytes) const {
  const void* p = sqlite3_column_blob(stmt_, column);
  *bytes = sqlite3_column_bytes(stmt_, column);
  return p;
}

}  // namespace ampdiag::rundb
