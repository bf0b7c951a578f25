"""attach(): ampdiag's agent in a PyTorch training loop.

It wraps a real torch.amp.GradScaler *instance* (its unscale, scale and update), so the
fused statistics pass runs between backward and the unscale, registers a forward hook on
every module (activation statistics, forward order, the first module whose output is
non-finite) and a gradient hook on every trainable parameter (arrival order in backward),
and streams everything to a run.db through the C++ engine. It changes no number of the
training: with fused unscale on, the gradients are unscaled with the same bits as
torch._amp_foreach_non_finite_check_and_unscale_ writes.
"""
import math
import os
import sys
import time
import weakref

import torch

from . import _ampdiag, _loss, _other_scaler, _outside_scaler, _rank, _replaced_optimizer
from ._pin import is_pinned, pin_fp32, unpin_fp32
from ._profile import ProfileRanges
from ._amp_dtype import learn_amp_dtype
from ._autopin import AutoPinner
from ._dropped import DroppedForwards
from ._evaluation import Evaluations
from ._layers import Layers, source_of
from ._fused_momentum import FusedMomentumProbe
from ._forward import compiled_in_place, forward_hook, input_hook, output_hook, outside_compiled_graph
from ._looks import look_at_loss_code, look_at_parameters
from ._loss_code import read_first_loss_code
from ._names import clean, named_modules, named_parameters
from ._parameters import finite_buffers, nonfinite_parameters
from ._uncaught import ended_by, unwatch, watch
from ._unreached import UnreachedParameters
from ._options import check_options, check_watched, default_amp_dtype, trains_fp16_parameters
from ._backward_replay import BackwardReplayer
from ._gradient_entry import GradientEntries
from ._grad_reads import optimizer_gradients, post_stats
from ._precision import PrecisionChecker
from ._replay import Replayer
from ._weights import WeightSampler
from ._scaler import disabled_scaler_detail, wrap_disabled_scaler, wrap_scaler
from ._step_end import end_step
from ._updates import UpdateProbe, holds_half_parameters
from ._tensors import bounded_by_input, describe_inputs, is_or_views

_ATTACHED = "_ampdiag_handle"


# The run.db files this process has opened (real paths): a second attach() to one is
# most likely attach() inside the epoch loop.
_RECORDED = set()


class AttachHandle:
    """What attach() returns. Also a context manager: leaving it closes the handle."""

    def __init__(self, model, scaler, optimizer, db, every, activations, activation_every, pins, fused_unscale,
                 context_steps, histogram, overwrite, replay, queue_capacity, threads, amp_dtype, run_id, profile, autopin,
                 precision_budget):
        root, scaler, disabled, optimizer, params = check_watched(model, scaler, optimizer, activations, _ATTACHED)
        db = check_options(db, every, context_steps, queue_capacity, threads, amp_dtype, run_id, autopin, replay,
                           activations, activation_every, precision_budget)

        self.model, self.scaler, self.optimizer = model, scaler, optimizer
        self._held_scaler = scaler if scaler is not None else disabled  # marked as attached, enabled or not
        self._watched_model = root
        self._db, self._run_id = db, run_id
        self._fused = fused_unscale
        self._closed = False
        self._raised = False  # the with-block was left by an exception
        self._stopped = False  # recording stopped, hooks inert: the run.db could not be created
        # Closed, or recording stopped: the hooks do nothing and torch's own methods run. A
        # plain attribute, set with either, since every hook reads it.
        self._inert = False
        self._in_cycle = False  # the session's optimizer cycle is open (Python's copy of it)
        self._live = False      # in a cycle, recording, no replay running: hooks take their fast path
        self._hooks = []
        # torch.compile'd before attach(), or Module.compile()d in place: see _forward.py
        self._compiled = root is not model or compiled_in_place(root)
        self._traced_by_compile = False     # a hook found itself traced: compiled after attach()
        self._restore = []
        self._pinned = []
        self._last_step_skipped = False
        self._replayer = Replayer(self._record_replay, self._forward_hook_as_run) if replay else None
        self._backward_replayer = BackwardReplayer(self, self._replayer) if replay else None
        self._gradient_entries = GradientEntries(self) if replay else None
        self._autopin = AutoPinner(self, int(autopin)) if autopin else None
        self._updates = UpdateProbe(self, every) if holds_half_parameters(params) else None
        # Without a scaler: the optimizers whose step() ends a step (weakly: a replaced one's
        # state is the user's to free), and the parameters they held.
        self._stepped_optimizers = weakref.WeakSet()
        self._stepped_params = set()  # id()s
        self._gradient_probe = None  # _stale_gradients.GradientProbe, set with the layers
        self._fused_momentum = FusedMomentumProbe(self)
        self._accumulation_probe = None  # _accumulation.AccumulationProbe, set with the layers
        self._own_backward = False  # the backward under way is the loss's (with a scaler: from scale()'s output)
        self._grad_calls = self._grad_calls_before = 0
        self._per_sample = None  # _per_sample.PerSampleGradients, made with the scaler's wrap
        self._scaler_scaled = False  # the attached scaler's scale() has run: see _other_scaler.py
        self._backwards_without_scale = 0
        self._root_inputs = None  # (args, kwargs) of the model's last forward in this cycle
        self._in_root_forward = False  # the model's own forward is running (its pre-hook ran, its hook not yet)
        self._optimizers = weakref.WeakSet()  # those whose steps the agent saw: their settings are evidence
        # Additions to _optimizers and _stepped_optimizers so far: the weight sampler looks at
        # those sets only when it moved (a WeakSet's methods are Python calls, every step).
        self._optimizer_adds = 0
        self._last_unscaled = None  # weakref to the optimizer the last unscale added
        if optimizer is not None:
            self._optimizers.add(optimizer)
            self._optimizer_adds += 1
        self._parameters_nonfinite = False  # found once: every NaN/Inf after it is theirs, no replay
        self._loss_code_looks = 0  # loss-code events written (see _looks.look_at_loss_code)
        self._model_code_looks = 0  # model-code events written (see _forward.look_at_model_output)
        self._module_code_read = set()  # (event kind, module) of the code _looks.py read
        self._output_nodes, self._loss_code_outputs = [], []  # the last training forward's outputs' grad_fn (_forward.py)
        self._dropped = DroppedForwards()
        self._evaluations = Evaluations(self)
        self._loss_nodes = []    # the grad_fn of this cycle's losses
        self._fp32_gradients_read = False  # _fp32_gradients.record() has read a loss's graph
        self._first_loss_code = None  # the loss code at the first scale(), its numbers still saved
        self._new_scale_said = False  # event "update-new-scale" written
        self._unreached = UnreachedParameters(self)
        self._scaled = []
        self._has_scaler = scaler is not None
        self._in_scaler_step = False  # inside scaler.step(): its optimizer step is the normal path
        self._scaler_stepped = False
        self._bypass = None
        self._python_ns = 0
        self._precision = None
        self._weights = None
        rank = _rank.known_rank()
        if rank is None:
            # A spawned worker before init_process_group(): the run.db is created when the
            # first step starts. The path's directory is checked now.
            directory = os.path.dirname(os.path.abspath(db))
            if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
                raise _ampdiag.RunDbError(f"{db}: cannot create it: {directory} is not a writable directory")
        # The session keeps what is posted until the file is opened.
        self._session = _ampdiag.Session(overwrite, queue_capacity, every, context_steps, threads, histogram, profile,
                                         activation_every)
        self.db_path = db
        if rank is not None:
            self._open_session(*rank)
        self._finalizer = weakref.finalize(self, self._session.close)
        watch(self)  # an exception that ends the program closes it as the with-block would
        try:
            guessed = amp_dtype or default_amp_dtype(scaler, params)
            self._write_meta(scaler, every, context_steps, fused_unscale, histogram, guessed, params)
            # NaN/Inf found before any optimizer step came with the model only where it held them
            # now: else code that writes the parameters in place put them there (SAM's first_step).
            self._session.set_meta("parameters_at_attach", "finite" if nonfinite_parameters(
                named_parameters(root)) is None else "nonfinite")
            self._finite_buffers = finite_buffers(root)  # an Inf in them later is a step's, not a mask
            if amp_dtype is None and not trains_fp16_parameters(params):
                self._hooks.append(learn_amp_dtype(self, root, params[0].device.type, guessed, params))
            self._activations_on = activations
            self._watched_modules = weakref.WeakSet()  # the modules whose outputs have a hook
            self._layers = Layers(self, root)
            self._layer_id = self._layers.layer_id  # bound once: read for every gradient of every step
            sharding = _rank.fsdp1_sharding(root)
            self._weights = WeightSampler(self, self._layers.registered, sharded=sharding is not None)
            watched = [(path, module) for path, module in named_modules(root) if path and not bounded_by_input(module)]
            if activations:
                self._hooks.append(root.register_forward_pre_hook(self._forward_hook_as_run(input_hook(self, root)),
                                                                  with_kwargs=True))
                self._hooks.append(root.register_forward_hook(self._forward_hook_as_run(output_hook(self, root)),
                                                              with_kwargs=True))
                for path, module in watched:
                    self._watch_output(path, module, root)
            self._profile = ProfileRanges(self, watched) if profile else None
            # FP32 comparisons need the replay's copies and a module's call in a training step.
            self._precision = (PrecisionChecker(self, watched, precision_budget)
                               if activations and replay and precision_budget > 0 else None)
            if self._profile is not None and optimizer is not None:
                self._profile.watch_optimizer(optimizer)
            for path in pins:
                try:
                    module = model.get_submodule(path)
                except AttributeError:
                    raise ValueError(f"pins: the model has no module {path!r}") from None
                pin_fp32(module)
                self._pinned.append(module)
            # Wrappers too: `pins` reaches a path through FSDP1's wrapper, and pins the wrapper
            # (named_modules() gives its name to the module it wraps).
            pinned = {clean(path) for path, module in root.named_modules() if path and is_pinned(module)}
            for path in sorted(pinned - {""}):  # by `pins`, or by the user's own pin_fp32() before attach()
                # The analyzer offers no pin that the run already had.
                self._event("pinned-fp32", path)
            if sharding is not None:
                # The analyzer then compares no ranks layer by layer (as for FSDP2's DTensors).
                self._event("sharded-parameters", sharding, key=("sharded",))
            if scaler is not None:
                wrap_scaler(self, scaler)
                _loss.watch_grad(self)
                _loss.watch(self)  # only to see a backward started from the unscaled loss
                self._hooks.extend(_outside_scaler.watch(self, scaler))
            else:
                if optimizer is not None:
                    self._watch_optimizer(optimizer)
                    if disabled is None:
                        self._hooks.append(_replaced_optimizer.watch(self))
                if disabled is not None:
                    self._event("scaler-disabled",
                                disabled_scaler_detail(disabled, params[0].device.type if params else None))
                    wrap_disabled_scaler(self, disabled)
                _loss.watch(self)
            setattr(root, _ATTACHED, weakref.ref(self))
            if self._held_scaler is not None:
                setattr(self._held_scaler, _ATTACHED, weakref.ref(self))
        except BaseException:
            self.close()
            raise

    # --- public --------------------------------------------------------------------

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last scaler.step() skipped the optimizer (torch itself does not say).
        On CUDA this reads found_inf from the device: it waits for the step to finish."""
        return bool(self._last_step_skipped)

    @property
    def status(self) -> dict:
        """Steps seen, rows written, records dropped, write errors, and the db path."""
        return dict(self._session.status(), db_path=self.db_path)

    def log_loss(self, loss) -> None:
        """Records `loss` (a scalar tensor or number) as this step's loss; several calls in
        one step are summed. Without it the loss is what scaler.scale() received, or,
        without a scaler, what backward() was called on."""
        if self._inert:
            return
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"log_loss() takes a scalar, not a tensor of shape {tuple(loss.shape)}")
            loss = loss.detach()
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = torch.tensor(float(loss))
        else:
            raise TypeError(f"log_loss() takes a scalar tensor or a number, not {type(loss).__name__}")
        if self._begin_cycle():
            self._logged_losses.append(loss)

    def close(self) -> None:
        """Detaches every hook and wrapper and finishes the run.db. Idempotent."""
        if self._closed:
            return
        if not self._inert and not self._raised:
            # A guard on the loss that dropped the loop's last batch: no step ends after it.
            for kind, detail in self._dropped.step_ended():
                self._session.event(kind, detail)
        self._closed = self._inert = True
        self._live = False
        unwatch(self)
        _loss.unwatch(self)
        _loss.unwatch_grad(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._precision is not None:
            self._precision.close()
        for obj, name in self._restore:
            obj.__dict__.pop(name, None)  # the class's method shows through again
        self._restore.clear()
        for module in self._pinned:
            unpin_fp32(module)
        for owner in (self._watched_model, self._held_scaler):
            if owner is not None and owner.__dict__.get(_ATTACHED) is not None and owner.__dict__[_ATTACHED]() is self:
                del owner.__dict__[_ATTACHED]
        if self._replayer is not None and self._session.opened:
            self._replayer.close()
            self._backward_replayer.close()
        if self._gradient_entries is not None:
            self._gradient_entries.close()
        for probe in (self._updates, self._gradient_probe, self._fused_momentum, self._per_sample):
            if probe is not None:
                probe.flush()
        self._unreached.close()
        if self._weights is not None:
            self._weights.flush()
        self._finalizer()

    detach = close

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        ended_by(self, kind, error)  # a training that raised: the report says so
        return False

    # --- setup ---------------------------------------------------------------------

    def _open_session(self, rank, world):
        path = _ampdiag.rank_db_path(self._db, rank, world)
        # Creating the file is where a bad path fails.
        try:
            self._session.open(path, rank, world, self._run_id or "")
        except _ampdiag.RunDbError as error:
            if os.path.realpath(path) in _RECORDED and os.path.exists(path):
                # attach() inside the epoch loop: overwriting, as the error offers, loses the epochs before.
                raise _ampdiag.RunDbError(f"{error}. An earlier attach() in this process recorded it: attach once, "
                                          "before the epoch loop, to record every epoch in one run.db "
                                          "(overwrite=True would replace the epochs it holds)") from None
            raise
        _RECORDED.add(os.path.realpath(path))
        self.db_path = path

    def _write_meta(self, scaler, every, context_steps, fused, histogram, amp_dtype, params):
        settings = None
        if scaler is not None:
            settings = (float(scaler.get_scale()), float(scaler.get_growth_factor()),
                        float(scaler.get_backoff_factor()), int(scaler.get_growth_interval()))
        self._session.write_meta("ampdiag Python agent", torch.__version__, str(params[0].device),
                                 amp_dtype,
                                 " ".join([sys.executable] + sys.argv), bool(fused), settings)

    def _event(self, kind, detail, key=None, step=None):
        self._session.event_once(repr(key or (kind, detail)), kind, detail, step)

    # --- per optimizer cycle -----------------------------------------------------------

    def _reset_cycle(self):
        """Per-cycle state: every hook calls _begin_cycle() before it reads any of it."""
        self._losses = []         # what scale() received, or backward() was called on (no scaler)
        self._logged_losses = []  # log_loss(): wins over the automatic ones
        self._taken_losses = []   # scaler.scale() outputs given to torch.autograd.grad: see _gradients_taken
        self._micro_batch = 0
        self._backward_seen = False       # a backward reached the model since the last forward
        self._batch_grad_calls = self._grad_calls  # gradients seen when this micro-batch began
        self._first_nonfinite = None
        self._forward_nonfinite = False  # a watched output held NaN/Inf in this cycle
        self._escalating = False
        self._inputs_checked = False      # whether the model's inputs were looked at for NaN
        self._input_nan = False           # they held NaN: the data's, no replay
        self._last_output = None          # weakref to the last output given statistics
        self._last_output_path = None     # the module that made it
        self._last_version = 0            # its version counter then (in-place changes bump it)
        self._last_node = None            # its grad_fn: where the model's own code after it begins
        self._module_nodes = []           # the grad_fn of every module output given statistics
        self._last_nonfinite = False      # whether it held NaN/Inf
        self._bf16_found = False
        self._gradients_probed = False  # see _stale_gradients.py
        self._output_gradient_seen = False  # an output-gradient-nonfinite event in this cycle
        self._loss_code_seen = False        # a loss-code look in this cycle
        self._loss_nodes = []
        # (scaler.scale()'s output, its loss in _losses, the loss it was given) in this cycle
        self._scaled = []
        self._scaler_stepped = False  # scaler.step() ran in this cycle
        self._bypass = None  # an optimizer stepped outside scaler.step(): see _outside_scaler.py
        self._dropped.step_ended()  # a previous cycle's, if it ended without _step_end._before_step_end()

    @property
    def _standing_aside(self):
        """Inert, or an FP32 replay is running: the model's and autograd's hooks do nothing."""
        return self._inert or (self._replayer is not None and self._replayer.busy)

    def _begin_cycle(self) -> bool:
        """The first hook of an optimizer cycle: the step before it is recorded now (it
        may have had an extra update() since it ended). Returns whether recording goes on:
        False once it has stopped, the caller then does nothing."""
        if self._inert:
            return False
        if self._in_cycle:  # every hook of a step asks: answered without the session
            return True
        if not self._session.opened:
            try:
                self._open_session(*_rank.rank_now_or_single())
            except _ampdiag.RunDbError as e:
                # Training has started: the log never stops it. Every hook goes inert and
                # the scaler's own methods run, so the numbers are torch's.
                self._stopped = self._inert = True
                self._session.failed(str(e))
                print(f"ampdiag: cannot record this run, training goes on without it: {e}", file=sys.stderr)
                return False
        if self._session.begin_cycle():
            self._reset_cycle()
            if self._autopin is not None:
                self._autopin.announce()
            if self._precision is not None:
                self._precision.step_began()
            if self._weights is not None:
                self._weights.step_began(self._session.step)
        self._in_cycle = True
        self._live = True
        return True

    def _begin_forward_cycle(self) -> bool:
        """_begin_cycle() for a forward: one with gradients off (an evaluation between steps,
        under no_grad or inference_mode) begins no cycle and is not recorded; once a cycle
        is open, every forward belongs to it."""
        return (self._in_cycle or torch.is_grad_enabled()) and self._begin_cycle()

    def _begin_part_cycle(self, root) -> bool:
        """_begin_forward_cycle() for a watched submodule's forward: also one the loop calls
        itself under no_grad while the model trains (`root` in training mode, its own forward
        not running) is part of the training step and begins its cycle: a frozen teacher or
        text encoder attached with the trained model in one ModuleDict, whose output the
        step's loss takes. An evaluation has the model in eval mode."""
        if self._begin_forward_cycle():
            return True
        return root.training and not self._in_root_forward and self._begin_cycle()

    def _watch_added_modules(self, root):
        """Modules added to the model since attach(), found through a parameter of theirs:
        their outputs are watched from their next call, as attach() watches the others'."""
        if not self._activations_on:
            return
        for path, module in named_modules(root):
            if path and module not in self._watched_modules and not bounded_by_input(module):
                self._watch_output(path, module, root)

    def _watch_output(self, path, module, root):
        self._watched_modules.add(module)
        self._hooks.append(module.register_forward_hook(self._forward_hook_as_run(
            forward_hook(self, path, module, root)), with_kwargs=True))

    def _arrival_hook(self, layer):
        arrived = self._session.arrived  # bound once: this runs for every gradient of every step

        def hook(grad):
            if not self._live and (self._standing_aside or not self._begin_cycle()):
                return
            self._grad_calls += 1
            self._backward_seen = True
            arrived(layer)

        return hook

    def _keep_loss_nodes(self, roots):
        """Where the loss code ends (the grad_fn of these roots, a list of tensors), should
        it go NaN/Inf (_looks.look_at_loss_code)."""
        for root in roots:
            node = root.grad_fn
            if node is not None:
                self._loss_nodes.append(node)

    def _scaled_gradients_differentiated(self):
        # create_graph=True from scaler.scale()'s output: the gradients of the scaled loss
        # are differentiable, and a loss built from them (a gradient penalty) holds the
        # scale: Inf where the scaled gradients overflow, which the scaler's skip answers
        # like any overflow.
        self._event("scaled-gradients-in-loss", "a backward with create_graph=True from scaler.scale()'s output: "
                    "a loss built from its gradients depends on the loss scale")

    def _gradients_taken(self, outputs, create_graph):
        """torch.autograd.grad() received `outputs`: a scaler.scale() output among them gives
        its gradients back, and is not the step's loss while a backward gives one (a gradient
        penalty); it is where none does (per-task gradients combined by hand into .grad)."""
        if self._inert:
            return
        self._session.backward_began()  # its own backward: what it reaches is ordered anew
        taken = [loss for t, loss, _ in self._scaled if any(t is o for o in _loss.tensors(outputs))]
        if taken and create_graph:
            self._scaled_gradients_differentiated()
        elif create_graph and self._live:  # MAML's inner step: its meta-backward differentiates the model's
            self._event("gradients-differentiated", "torch.autograd.grad with create_graph=True on a loss "
                        "scaler.scale() did not make: a backward through those gradients also differentiates "
                        "the model's backward", key=("gradients-differentiated",))
        if taken:
            self._taken_losses.extend(taken)  # the step's loss where no backward follows (gradient surgery)
            self._losses = [loss for loss in self._losses if not any(loss is t for t in taken)]
            self._scaled = [entry for entry in self._scaled if not any(entry[1] is x for x in taken)]

    def _before_backward(self, roots, create_graph):
        if self._inert:
            return
        self._grad_calls_before = self._grad_calls
        self._session.backward_began()  # a second loss's backward orders what it reaches anew
        if self._has_scaler:
            self._own_backward = _loss.check_scaled_roots(self, roots)
            if self._own_backward and create_graph:
                self._scaled_gradients_differentiated()
            return
        self._roots = _loss.scalar_losses(roots)
        self._own_backward = True  # without a scaler, any backward that reaches the model is the loss's
        self._keep_loss_nodes(_loss.tensors(roots))
        read_first_loss_code(self)
        self._look_before_backward(self._roots)

    def _look_before_backward(self, losses):
        """A host loss already NaN/Inf when backward is about to start: the loss code is
        looked at now, while its saved tensors (the targets it was given) are alive. And the
        code after a module that received NaN/Inf is hooked (_code_after.py)."""
        if self._gradient_entries is not None and self._gradient_entries.watching:
            self._gradient_entries.before_backward()
        for t in losses:  # (a loop: a generator is a call per loss, every step)
            if t.is_cpu and not math.isfinite(t.item()):
                look_at_loss_code(self)
                return

    def _after_backward(self):
        self._own_backward = False
        if self._accumulation_probe is not None:
            self._accumulation_probe.backward_ended()
        if self._inert:
            return
        if self._has_scaler:
            if not self._scaler_scaled and self._grad_calls > self._grad_calls_before:
                _other_scaler.backward_reached(self)
            return
        if self._grad_calls > self._grad_calls_before:  # this backward reached the model
            self._losses.extend(self._roots)
        self._roots = []

    def _watch_optimizer(self, optimizer, ends_step=True):
        """Without a scaler: `optimizer`'s gradients are final at its step(), which ends the
        step where `ends_step` (once per optimizer)."""
        if optimizer in self._stepped_optimizers:
            return
        self._stepped_optimizers.add(optimizer)
        self._optimizer_adds += 1
        self._stepped_params |= _replaced_optimizer.params_of(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        if ends_step:
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        if self._updates is not None:
            self._updates.watch(optimizer)

    def _before_optimizer_step(self, optimizer, args, kwargs):
        t0 = time.perf_counter_ns()
        if not self._begin_cycle():
            return
        if self._accumulation_probe is not None:
            self._accumulation_probe.gradients_read()
        layers, grads, _ = optimizer_gradients(self, optimizer)
        # |=: a disabled scaler's cycle may step several optimizers before update() ends it.
        self._bf16_found |= post_stats(self, layers, grads)
        if self._bf16_found and not self._inputs_checked:
            self._inputs_checked = True  # no output went NaN/Inf first (or none is watched)
            look_at_parameters(self)
        self._python_ns += time.perf_counter_ns() - t0

    def _after_optimizer_step(self, optimizer, args, kwargs):
        end_step(self, 1.0, 1.0, self._bf16_found, skipped=False)

    # --- forward -------------------------------------------------------------------

    def _module_id(self, path, module, args):
        made = self._last_output() if self._last_output is not None else None
        given = args[0] if args else None
        if path and made is not None and given is not None and is_or_views(given, made):
            # Its first argument is the output of the module that ran before it, unchanged or
            # viewed: its backward sends that output its gradient (overflow-origin names it).
            self._event("module-input-from", f"{path}: {self._last_output_path}")
        return self._session.module_id(path, type(module).__name__, source_of(module), describe_inputs(args))

    def _forward_hook_as_run(self, hook):
        """A forward hook as this model runs it: outside the graph if it is compiled."""
        return outside_compiled_graph(hook) if self._compiled else hook

    def _record_replay(self, path, outcome, absmax, reason):
        self._session.add_replay(path, outcome, absmax, reason)


def attach(model: torch.nn.Module, scaler: "torch.amp.GradScaler | None" = None,
           optimizer: "torch.optim.Optimizer | None" = None, db="run.db", every: int = 1, activations: bool = True,
           activation_every: int = 10, pins=(), fused_unscale: bool = True, context_steps: int = 2, histogram: bool = False,
           overwrite: bool = False, replay: bool = True, queue_capacity: int = 1 << 15, threads: int = 0,
           amp_dtype: "str | None" = None, run_id: "str | None" = None, profile: bool = False,
           autopin: "bool | int" = False, precision_budget: float = 0.005) -> AttachHandle:
    """Attaches ampdiag to a training loop and returns a handle (also a context manager).

    model:          the torch.nn.Module being trained (a DDP wrapper is fine).
    scaler:         the torch.amp.GradScaler ("cpu" or "cuda") of an fp16 run.
    optimizer:      for bf16 runs without a scaler: statistics are taken before its step(). A
                    framework's wrapper (Accelerate, Lightning) is watched through its .optimizer.
    db:             the run.db to write; under torchrun each rank writes NAME.rank{N}.db.
    every:          record per-layer statistics every N steps (overflows, scale changes and
                    `context_steps` steps around them are always recorded).
    activations:    forward hooks on every module: output statistics, forward order, the first
                    module whose output is NaN/Inf.
    activation_every: full output statistics on one recorded step in N; on the others a CPU
                    output is only checked for NaN/Inf (a row only when it holds one).
    pins:           module paths to run in FP32 while attached (see pin_fp32()).
    fused_unscale:  do the scaler's unscale inside ampdiag's pass (same bits as torch's).
    replay:         re-run the first module with a non-finite output once in FP32, on copies of
                    the module and its inputs, and record whether that fixes it.
    overwrite:      replace an existing db file instead of refusing.
    amp_dtype:      "float16" or "bfloat16"; default: float16 with a scaler or fp16 parameters,
                    else bfloat16, then the first training forward's autocast dtype where it
                    differs (fp32 parameters only). Half-precision parameters also get their stalled updates
                    counted on sampled steps (no FP32 master weights: see docs/PYTHON.md).
    run_id:         the id shared by every rank of this run (default: derived from the launcher,
                    random for one process); `ampdiag report` merges only ranks of one run.
    autopin:        True (one module) or N: pin to FP32, from the next step on, each module (at most N)
                    whose FP32 replay confirmed it as a forward NaN/Inf's origin; the report says so.
    precision_budget: the share of training time (0 to 1) the precision checks may take: one module
                    at a time, its call in fp16/bf16 compared with the same call in FP32 (copies of
                    its inputs and state), which finds precision lost without NaN/Inf; 0: none.
    profile:        on a CUDA device, record each module's device time by precision and phase on
                    sampled steps (CUPTI); where that is unavailable, one event says why.
    """
    return AttachHandle(model, scaler, optimizer, db, every, activations, activation_every, tuple(pins), fused_unscale,
                        context_steps, histogram, overwrite, replay, queue_capacity, threads, amp_dtype, run_id, profile,
                        autopin, precision_budget)
