// ampdiag::GradScaler: a C++ dynamic loss scaler with the semantics of Python's
// torch.amp.GradScaler (same ops, same numbers, step for step), plus the hook the agent
// needs: the moment between backward and unscale.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace ampdiag {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;    // must be > 1
  double backoff_factor = 0.5;   // must be < 1
  std::int64_t growth_interval = 2000;
  bool enabled = true;
};

// What state_dict() returns and load_state_dict() takes (Python's five entries).
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::int64_t growth_tracker = 0;
};

// The gradients unscale_() is about to unscale, as the observer sees them.
struct UnscaleBatch {
  std::vector<at::Tensor> params;  // the parameters whose gradients follow
  std::vector<at::Tensor> grads;   // dense gradients, or the values of sparse ones
  at::Tensor found_inf;            // float, one element, on the scale's device
  at::Tensor inv_scale;            // float, one element, on the scale's device
};

// The scaler at an update(), as tensors on the scale's device: nothing is read to the host,
// so observing a CUDA run adds no device synchronisation.
struct ScaleUpdate {
  at::Tensor scale_before;  // float 0-dim: the scale this cycle's gradients were multiplied by
  at::Tensor scale_after;   // float 0-dim: the scale from now on (a copy, not the live tensor)
  // float 0-dim, > 0 when a gradient checked since the last update() was non-finite;
  // undefined for an update(new_scale) with no checks since the last update().
  at::Tensor found_inf;
};

// Implemented by the agent. Callbacks run on the training thread.
class ScalerObserver {
 public:
  virtual ~ScalerObserver() = default;
  virtual void on_scale(const at::Tensor& outputs) = 0;
  // Before the gradients are unscaled. Return true if the observer has unscaled them in
  // place and set found_inf itself (exactly as torch's op would); false to let the scaler
  // run torch._amp_foreach_non_finite_check_and_unscale_.
  virtual bool on_unscale(UnscaleBatch& batch) = 0;
  virtual void on_step(bool skipped) = 0;
  // Around the optimizer's step() inside step() (only when it runs).
  virtual void on_optimizer(const torch::optim::Optimizer& optimizer, bool starting) {
    (void)optimizer;
    (void)starting;
  }
  virtual void on_update(const ScaleUpdate& update) = 0;
};

class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});  // throws std::invalid_argument

  // outputs * scale (outputs unchanged when disabled).
  at::Tensor scale(const at::Tensor& outputs);
  // Unscales the optimizer's gradients in place and checks them for Inf/NaN.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Unscales if not done yet, then runs optimizer.step() unless a gradient was non-finite.
  // Returns true if the optimizer step ran.
  bool step(torch::optim::Optimizer& optimizer);
  // Backs the scale off after a skipped step, grows it after growth_interval good ones.
  // Neither update() reads the device: the scale stays a device tensor, as in torch.
  void update();
  void update(double new_scale);

  double get_scale() const;  // 1.0 when disabled; reads the device value (a sync on CUDA)
  std::int64_t growth_tracker() const;
  // The live 0-dim float scale on its device (undefined before the first scale() or when
  // disabled): copy it to keep a step's value, read it only where waiting is fine.
  const at::Tensor& scale_tensor() const { return scale_; }
  bool is_enabled() const { return enabled_; }
  // Whether the last step() skipped the optimizer (torch's own scaler does not say).
  bool last_step_skipped() const { return last_step_skipped_; }

  double get_growth_factor() const { return growth_factor_; }
  double get_backoff_factor() const { return backoff_factor_; }
  std::int64_t get_growth_interval() const { return growth_interval_; }
  void set_growth_factor(double f) { growth_factor_ = f; }
  void set_backoff_factor(double f) { backoff_factor_ = f; }
  void set_growth_interval(std::int64_t n) { growth_interval_ = n; }

  GradScalerState state_dict() const;
  void load_state_dict(const GradScalerState& state);

  // At most one observer (the agent); null detaches.
  void set_observer(ScalerObserver* observer) { observer_ = observer; }
  ScalerObserver* observer() const { return observer_; }

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    std::vector<at::Tensor> found_inf_per_device;
  };

  void check_initialized(const char* function) const;
  void lazy_init(const at::Device& device);
  // found_inf summed over optimizers and devices, on the scale's device; undefined when
  // no unscale ran since the last update().
  at::Tensor combined_found_inf() const;
  void notify_update(const at::Tensor& scale_before, const at::Tensor& found_inf);
  std::vector<at::Tensor> unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale,
                                        const at::Tensor& found_inf);

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  std::int64_t growth_interval_;
  std::int64_t init_growth_tracker_ = 0;
  at::Tensor scale_;           // float32 0-dim, created by the first scale()
  at::Tensor growth_tracker_;  // int32 0-dim
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
  bool last_step_skipped_ = false;
  ScalerObserver* observer_ = nullptr;
};

}  // namespace ampdiag
