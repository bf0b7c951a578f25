// Module paths as run.db records them (layers.module_path, modules.path): torch's dotted
// names, "" for the model itself. Here because both sides of the file reason about them:
// the agents name a skipped step's module while training (to look closer at it), and the
// analyzer names it again from the file; one definition keeps the two verdicts the same.
#pragma once

#include <string>

namespace ampdiag::rundb {

// The innermost module holding both paths, by whole components ("enc.1" and "enc.10" ->
// "enc"; "a.b.c" and "a.b" -> "a.b"); "" where only the model does.
std::string common_module(const std::string& a, const std::string& b);
// Whether module `path` is `outer` or inside it, by whole components ("enc.1" is in "enc",
// "enc10" is not); nothing is inside "" but "" itself.
bool within(const std::string& path, const std::string& outer);
// The module that holds `path` directly ("enc.1.fc" -> "enc.1"); "" for a top-level one.
std::string parent_of(const std::string& path);

}  // namespace ampdiag::rundb
