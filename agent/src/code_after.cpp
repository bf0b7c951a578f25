#include "code_after.h"

#include <ATen/ops/isfinite.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "agent_setup.h"
#include "gradient_graph.h"

namespace ampdiag::agent {

using torch::autograd::Node;

namespace {

// "Mm" for "MmBackward0", as the Python agent's op_name(); other nodes by their own name.
std::string op_name(const Node& node) {
  std::string name = node.name();
  if (const std::size_t colon = name.rfind("::"); colon != std::string::npos) name.erase(0, colon + 2);
  std::size_t end = name.size();
  while (end > 0 && std::isdigit(static_cast<unsigned char>(name[end - 1])) != 0) --end;
  if (end >= 8 && name.compare(end - 8, 8, "Backward") == 0 && end > 8) name.erase(end - 8);
  return name;
}

// The nodes on a path from `top` (the loss's) down to `target` (a module output's), in forward
// order (nearest the output first); empty where none joins them or the walk passes `limit`.
std::vector<Node*> path_nodes(Node* top, const Node* target, std::size_t limit) {
  std::vector<Node*> order;
  if (top == nullptr || target == nullptr || top == target) return order;
  std::unordered_map<const Node*, bool> on_path;  // whether target is reached through it
  std::vector<std::pair<Node*, bool>> stack{{top, false}};
  std::size_t visited = 0;
  while (!stack.empty()) {
    auto [node, expanded] = stack.back();
    stack.pop_back();
    if (expanded) {
      bool reached = false;
      for (const auto& edge : node->next_edges()) {
        const Node* child = edge.function.get();
        if (child == target || (child != nullptr && on_path[child])) reached = true;
      }
      on_path[node] = reached;
      if (reached) order.push_back(node);  // children first: forward order
      continue;
    }
    if (on_path.count(node) > 0) continue;
    if (++visited > limit) return {};
    on_path[node] = false;  // in progress
    stack.push_back({node, true});
    for (const auto& edge : node->next_edges()) {
      Node* child = edge.function.get();
      if (child != nullptr && child != target && on_path.count(child) == 0) stack.push_back({child, false});
    }
  }
  return order;
}

// "Mul(1e+06)" for a product by one number (a C++ Scalar, or a one-value host tensor), a
// division by one, a power with a number exponent, or nll_loss with its reduction, as the
// Python agent's op_name() writes them: the analyzer needs the number to tell a loss factor
// or a temperature from a product of tensors. Read before backward frees what the node saved;
// its name alone where it has none.
std::string numbered_name(Node& node) {
  namespace generated = torch::autograd::generated;
  const std::string name = op_name(node);
  std::optional<double> number;
  const auto one_value = [&](const torch::autograd::SavedVariable& saved) -> std::optional<double> {
    try {
      const at::Tensor t = saved.unpack(node.getptr());
      if (t.defined() && t.numel() == 1 && t.dim() == 0 && t.device().is_cpu() && !t.is_complex()) return t.item<double>();
    } catch (const c10::Error&) {
      // Freed by a backward: the name alone.
    }
    return std::nullopt;
  };
  // nll_loss is 0/0 only as a mean over a total target weight of 0 (every target ignore_index):
  // "NllLoss(none)", "NllLoss(mean of 0)", as the Python agent's _nll_name().
  const auto nll = [&](std::int64_t reduction, const torch::autograd::SavedVariable& total) {
    static const char* const kReductions[] = {"none", "mean", "sum"};
    if (reduction < 0 || reduction > 2) return name;
    if (reduction != 1) return name + "(" + kReductions[reduction] + ")";
    const std::optional<double> weight = one_value(total);
    if (!weight) return name + "(mean)";
    char text[48];
    std::snprintf(text, sizeof text, "(mean of %g)", *weight);
    return name + text;
  };
  if (const auto* loss = dynamic_cast<const generated::NllLossBackward0*>(&node))
    return nll(loss->reduction, loss->total_weight_);
  if (const auto* loss = dynamic_cast<const generated::NllLoss2DBackward0*>(&node))
    return nll(loss->reduction, loss->total_weight_);
  if (const auto* mul = dynamic_cast<const generated::MulBackward1*>(&node)) number = mul->other.toDouble();
  else if (const auto* div = dynamic_cast<const generated::DivBackward1*>(&node)) number = div->other.toDouble();
  else if (const auto* pow = dynamic_cast<const generated::PowBackward0*>(&node)) number = pow->exponent.toDouble();
  else if (const auto* mul0 = dynamic_cast<const generated::MulBackward0*>(&node)) number = one_value(mul0->other_);
  else if (const auto* div0 = dynamic_cast<const generated::DivBackward0*>(&node)) number = one_value(div0->other_);
  if (!number) return name;
  char text[32];
  std::snprintf(text, sizeof text, "%g", *number);
  return name + "(" + text + ")";
}

std::string described(const std::vector<Node*>& nodes, bool numbers = false, std::size_t limit = CodeAfter::kNamed) {
  std::string out;
  for (std::size_t i = 0; i < nodes.size() && i < limit; ++i)
    out += (i ? ", " : "") + (numbers ? numbered_name(*nodes[i]) : op_name(*nodes[i])) + ":" + made_dtype(*nodes[i]);
  return out;
}

constexpr int kSideHops = 4;  // operations between a parameter and the code it feeds (exp, a cast, a clamp)

// "logit_scale: 11.5 (float32, 1 value), read by Exp; ..." for each of `params` that reaches
// a node of `nodes` through at most kSideHops nodes that are not in `nodes`, nor under
// `stop` (the module's output), as the Python agent's parameters_beside(); by name.
std::string parameters_beside(const std::vector<Node*>& nodes, const Node* stop,
                              const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::unordered_map<const c10::TensorImpl*, const std::pair<std::string, at::Tensor>*> by_impl;
  for (const auto& p : params) by_impl.emplace(p.second.unsafeGetTensorImpl(), &p);
  std::unordered_set<const Node*> seen(nodes.begin(), nodes.end());
  seen.insert(stop);
  std::map<std::string, std::pair<const at::Tensor*, const Node*>> found;  // name -> (parameter, reader)
  for (Node* reader : nodes) {
    struct Todo {
      Node* node;
      int hops;
      const Node* by;
    };
    std::vector<Todo> todo{{reader, 0, reader}};
    while (!todo.empty()) {
      Todo t = todo.back();
      todo.pop_back();
      const Node* by = t.by;
      if (t.node != reader) {
        if (const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(t.node)) {
          if (const auto p = by_impl.find(accumulate->variable.unsafeGetTensorImpl()); p != by_impl.end())
            found.emplace(p->second->first, std::make_pair(&p->second->second, by));
          continue;
        }
        if (t.hops > kSideHops) continue;
        if (op_name(*t.node) != "ToCopy") by = t.node;  // the operation reading it, past autocast's cast
      }
      for (const auto& edge : t.node->next_edges())
        if (edge.function && seen.insert(edge.function.get()).second) todo.push_back({edge.function.get(), t.hops + 1, by});
    }
  }
  std::string out;
  for (const auto& [name, read] : found) {
    const at::Tensor& p = *read.first;
    if (!p.device().is_cpu()) continue;  // its value would wait for the device
    char value[48];
    const at::Tensor v = p.detach();
    if (p.numel() == 1)
      std::snprintf(value, sizeof value, "%.4g", v.item<double>());
    else
      std::snprintf(value, sizeof value, "|x| up to %.4g", v.abs().max().item<double>());
    const std::string count = p.numel() == 1 ? "1 value" : std::to_string(p.numel()) + " values";
    out += (out.empty() ? "" : "; ") + name + ": " + value + " (" + dtype_name(p.scalar_type()) + ", " + count + "), read by " +
           op_name(*read.second);
  }
  return out;
}

bool any_nonfinite(const torch::autograd::variable_list& grads) {
  for (const auto& g : grads)
    if (g.defined() && g.device().is_cpu() && g.layout() == at::kStrided && at::isFloatingType(g.scalar_type()) &&
        !at::isfinite(g).all().item<bool>())
      return true;
  return false;
}

}  // namespace

NodeMark mark_of(const at::Tensor& t) {
  const Node* node = t.defined() ? t.grad_fn().get() : nullptr;
  return node == nullptr ? NodeMark{nullptr, 0} : NodeMark{node, node->sequence_nr()};
}

std::string code_under(const at::Tensor& y, const std::vector<NodeMark>& stops) {
  std::unordered_map<const Node*, std::uint64_t> ends;
  for (const auto& [node, sequence] : stops)
    if (node != nullptr) ends.emplace(node, sequence);
  // Marks of nodes since freed may share an address with a live one, never its number.
  const auto is_end = [&](const Node* n) {
    const auto at = ends.find(n);
    return at != ends.end() && at->second == n->sequence_nr();
  };
  Node* top = y.defined() ? y.grad_fn().get() : nullptr;
  if (top == nullptr || is_end(top)) return "";
  std::unordered_set<const Node*> done;
  std::vector<Node*> order;
  std::vector<std::pair<Node*, bool>> stack{{top, false}};
  while (!stack.empty() && done.size() < 4 * kOwnNodes) {
    auto [node, expanded] = stack.back();
    stack.pop_back();
    if (expanded) {
      order.push_back(node);  // children first: forward order
      continue;
    }
    if (!done.insert(node).second) continue;
    stack.push_back({node, true});
    for (const auto& edge : node->next_edges()) {
      Node* child = edge.function.get();
      if (child != nullptr && !is_end(child) && done.count(child) == 0 &&
          dynamic_cast<const torch::autograd::AccumulateGrad*>(child) == nullptr)
        stack.push_back({child, false});
    }
  }
  if (order.size() > kOwnNodes) order.erase(order.begin(), order.end() - kOwnNodes);
  return described(order, true, kOwnNodes);
}

struct CodeAfter::Shared {
  std::mutex mutex;
  c10::intrusive_ptr<Node> loss;    // this step's
  std::set<std::string> read;     // modules whose code was read
  std::string tracing;            // the module whose code's origin a later backward looks for
  int left = 0;                   // steps that trace has left
  c10::intrusive_ptr<Node> output;  // this step's output node of the traced module
  std::vector<c10::intrusive_ptr<Node>> nodes;          // this step's traced nodes
  std::vector<std::pair<Node*, std::uintptr_t>> hooks;  // with their hooks' keys
  std::atomic<int> origin{-1};    // index in nodes of the one that made them
  std::vector<EntryWatches::Event> events;
  std::vector<std::pair<std::string, at::Tensor>> own;  // the model's own parameters
  bool first_read = false;                 // event "loss-code-first" made (or none could be)
  c10::intrusive_ptr<Node> last_output;    // this step's last probed output's node
  bool code_read = false;                  // this step's "loss-code" made
  int code_looks = 0;                      // "loss-code" events, a run
};

namespace {

struct OriginHook : torch::autograd::FunctionPostHook {
  OriginHook(std::shared_ptr<std::atomic<int>> origin, int index) : origin_(std::move(origin)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    if (origin_->load() < 0 && any_nonfinite(outputs) && !any_nonfinite(inputs)) {
      int none = -1;
      origin_->compare_exchange_strong(none, index_);
    }
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<int>> origin_;
  int index_;
};

}  // namespace

CodeAfter::CodeAfter() : shared_(std::make_shared<Shared>()) {}

CodeAfter::~CodeAfter() { step_ended(); }

void CodeAfter::loss(const at::Tensor& loss, bool nonfinite) {
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.loss = loss.grad_fn();
  const bool look = nonfinite && !s.code_read && s.code_looks < kLossCodeLooks;
  if ((!s.first_read || look) && s.loss && s.last_output) {
    // Read before backward, its numbers still saved: the run's first, and a NaN/Inf loss's.
    const std::vector<Node*> nodes = path_nodes(s.loss.get(), s.last_output.get(), kWalkNodes);
    const std::string code = nodes.empty() ? "" : described(nodes, true);
    if (!s.first_read && !code.empty()) s.events.push_back({"loss-code-first", code});
    s.first_read = true;
    if (look && !code.empty()) {
      s.code_read = true;
      ++s.code_looks;
      s.events.push_back({"loss-code", code});
    }
  }
  if (s.tracing.empty() || !s.output || !s.hooks.empty() || !s.loss) return;
  const std::vector<Node*> nodes = path_nodes(s.loss.get(), s.output.get(), kWalkNodes);
  if (nodes.empty() || nodes.size() > kTraceNodes) return;
  s.origin = -1;
  // The index lands in a counter each hook shares; the Shared one is read as the step ends.
  auto origin = std::shared_ptr<std::atomic<int>>(shared_, &s.origin);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    s.nodes.push_back(nodes[i]->getptr());
    s.hooks.emplace_back(nodes[i], nodes[i]->add_post_hook(std::make_unique<OriginHook>(origin, int(i))));
  }
}

void CodeAfter::own_parameters(std::vector<std::pair<std::string, at::Tensor>> params) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->own = std::move(params);
}

void CodeAfter::output(const std::string& path, const at::Tensor& y) {
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (y.defined() && y.grad_fn()) s.last_output = y.grad_fn();
  if (s.tracing == path && !s.output && y.defined() && y.device().is_cpu() && y.grad_fn()) s.output = y.grad_fn();
}

std::function<void(const at::Tensor&)> CodeAfter::on_gradient(const std::string& path, const at::Tensor& y) {
  c10::weak_intrusive_ptr<Node> node(y.grad_fn());  // weak: the hook lives in that node's graph
  return [shared = shared_, path, node](const at::Tensor&) {
    Shared& s = *shared;
    std::lock_guard<std::mutex> lock(s.mutex);
    const c10::intrusive_ptr<Node> target = node.lock();
    if (!target || !s.loss || s.read.count(path) > 0 || s.read.size() >= std::size_t(kLooks)) return;
    s.read.insert(path);
    const std::vector<Node*> nodes = path_nodes(s.loss.get(), target.get(), kWalkNodes);
    if (nodes.empty()) return;
    s.events.push_back({"output-code", path + ": " + described(nodes)});
    if (!s.own.empty())
      if (const std::string used = parameters_beside(nodes, target.get(), s.own); !used.empty())
        s.events.push_back({"output-parameters", path + ": " + used});
    if (s.tracing.empty()) {
      s.tracing = path;
      s.left = kTraceSteps;
    }
  };
}

std::vector<EntryWatches::Event> CodeAfter::step_ended() {
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const auto& [node, key] : s.hooks) node->del_post_hook(key);
  const int origin = s.hooks.empty() ? -1 : s.origin.load();
  if (!s.tracing.empty()) {
    --s.left;
    if (origin >= 0) {
      // The traced nodes under the one that made them: those between the output and it.
      const Node* made = s.nodes[std::size_t(origin)].get();
      std::unordered_set<const Node*> under, in_code;
      for (const auto& n : s.nodes) in_code.insert(n.get());
      std::vector<const Node*> todo{made};
      while (!todo.empty()) {
        const Node* n = todo.back();
        todo.pop_back();
        for (const auto& edge : n->next_edges())
          if (edge.function && in_code.count(edge.function.get()) > 0 && under.insert(edge.function.get()).second)
            todo.push_back(edge.function.get());
      }
      std::vector<Node*> between;
      for (const auto& n : s.nodes)
        if (under.count(n.get()) > 0) between.push_back(n.get());
      between.push_back(s.nodes[std::size_t(origin)].get());
      s.events.push_back({"output-code-origin", s.tracing + ": " + described(between)});
    }
    if (origin >= 0 || s.left <= 0) s.tracing.clear();
  }
  s.hooks.clear();
  s.nodes.clear();
  s.output.reset();
  s.loss.reset();
  s.last_output.reset();
  s.code_read = false;
  std::vector<EntryWatches::Event> events;
  events.swap(s.events);
  return events;
}

}  // namespace ampdiag::agent
