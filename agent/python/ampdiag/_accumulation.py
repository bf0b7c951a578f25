"""Gradients cleared inside gradient accumulation: optimizer.zero_grad() in the loop over
micro-batches instead of once per optimizer step, so each step applies only the last
micro-batch's gradients and the others are computed and thrown away. Nothing overflows and
the loss still goes down, on a fraction of the data; only the gradients show it.

The probe is the stale-gradient probe's parameter (the smallest trainable one). After a
backward of this run's loss accumulated into its .grad, the next such backward of the same
optimizer step must find that .grad still there: None (zero_grad()'s default) or all zeros
written in place since (set_to_none=False) means it was cleared in between. A second
network's backward reaching the model (a GAN's generator loss through its discriminator)
adds gradients that the model's own zero_grad() rightly clears: with a scaler only
backwards started from scaler.scale()'s output count, and with or without one, any
optimizer's step() in between (the generator's) ends what the earlier backward started.
Two loops clear between backwards on purpose and are not counted either: a two-step
optimizer (SAM moves the weights with the first gradient, clears it, and steps with the
second: the parameter's version counter moved in between), and gradients combined by hand
(per-task gradients each after its own zero_grad(), their combination set as .grad: where
the gradients are read, the .grad is not the one the last backward left). Nor is a backward
whose forward took a tensor made to receive its own gradient, or made from one (adversarial
training: FGSM's `x.requires_grad_()` or PGD's `x + delta`, backwards for that gradient,
zero_grad(), then the step's own backward on the perturbed batch): clearing after it is the
loop's design.

Event "accumulated-gradients-cleared" at each step where it happened, the first
MAX_EVENTS: the analyzer tells a loop that does it every step from a batch dropped on
purpose now and then. A CUDA .grad zeroed in place is not read (that would wait for the
device); set to None, it is seen on any device.
"""
import weakref

import torch

from ._tensors import float_tensors

EVENT = "accumulated-gradients-cleared"
MAX_EVENTS = 64

graph_task = torch._C._current_graph_task_id


class AccumulationProbe:
    def __init__(self, handle, param: torch.Tensor, name: str, optimized):
        self._handle = handle
        self._param = weakref.ref(param)
        self._name = name
        self._optimized = optimized   # whether an optimizer the agent saw holds the parameter
        self._events = 0
        self._reset()

    def _reset(self):
        self._task = None       # the graph task of the last backward that accumulated into .grad this step
        self._grad_version = None  # that .grad's version counter then: zeroing it in place moves it
        self._micro_batches = 0  # this step's backwards that accumulated into .grad
        self._version = None     # the parameter's version counter then: an optimizer's own step changes it
        self._grad = None        # weakref to the .grad it accumulated into
        self._as_accumulated = None  # whether that .grad was in place where the gradients were read
        self._in_backward = False    # a backward under way accumulated into .grad
        self._cleared = []       # (micro-batch, how): after which of this step's micro-batches .grad was cleared
        self._for_input = set()  # this step's micro-batches whose forward took an input that receives its gradient
        self._step = None

    def hook(self, arrival):
        """`arrival`, the parameter's gradient hook (before accumulation), followed by the
        look at what the step's earlier backwards left in .grad."""
        handle = self._handle

        def hook(grad):
            arrival(grad)
            if not handle._live or not handle._own_backward or self._task is None:
                return
            task = graph_task()
            if task == self._task or self._cleared and self._cleared[-1][0] == self._micro_batches:
                return
            p = self._param()
            if p is None or p._version != self._version:
                return  # the parameters moved in between: a two-step optimizer (SAM), not accumulation
            if self._micro_batches in self._for_input:
                return  # that backward was for its input's gradient (an adversarial example's)
            grad = p.grad
            if grad is None:
                how = "set to None"
            elif self._zeroed(grad):
                how = "zeroed"
            else:
                return
            self._cleared.append((self._micro_batches, how))
            self._step = handle._session.step

        return hook

    def accumulated(self, param):
        """The post-accumulate hook: this backward's gradient is in .grad."""
        handle = self._handle
        if not handle._live or not handle._own_backward:
            return
        task = graph_task()
        if task != self._task:
            self._task = task
            self._micro_batches += 1
            if _input_receives_gradient(handle._root_inputs, self._optimized):
                self._for_input.add(self._micro_batches)
        self._version = param._version
        self._left(param.grad)
        self._in_backward = True

    def _left(self, grad):
        self._grad = None if grad is None else weakref.ref(grad)
        self._grad_version = None if grad is None else grad._version

    def _zeroed(self, grad) -> bool:
        """Whether `grad`, found where the last backward left its .grad, was zeroed since:
        all zeros, and written in place since (or another tensor). Read only then: a
        reduction every step cost ~30 µs inside a training loop, for a look that matters
        only in a step of several backwards."""
        if grad.is_cuda:
            return False
        same = self._grad is not None and self._grad() is grad
        return not (same and grad._version == self._grad_version) and not bool(grad.any())

    def backward_ended(self):
        """The backward() call has returned: the .grad it leaves (DistributedDataParallel's
        reducer rebinds it to its bucket at the end of a synchronising backward)."""
        if self._in_backward:
            self._in_backward = False
            p = self._param()
            if p is not None and p.grad is not None:
                self._left(p.grad)

    def step_ended(self):
        p = self._param()
        if self._cleared and self._events < MAX_EVENTS and self._as_accumulated and self._optimized(p):
            self._events += 1
            cleared = [m for m, _ in self._cleared]
            kept = list(range(cleared[-1] + 1, self._micro_batches + 1))
            how = " or ".join(sorted({h for _, h in self._cleared}))
            self._handle._event(EVENT, f"{self._name}'s gradient was {how} after {_batches(cleared)} of "
                                f"{self._micro_batches}, before the next one's backward: the optimizer step applied "
                                f"the gradients of {_batches(kept)} alone", key=(EVENT, self._step), step=self._step)
        self._reset()

    def step_hook(self):
        """The global optimizer step hook: any optimizer's step() means a backward before it
        is not one the next backward accumulates with (what this step found stays). It holds
        the probe weakly: torch's global hooks must not keep an unclosed handle alive."""
        ref = weakref.ref(self)

        def stepped(optimizer, args, kwargs):
            probe = ref()
            if probe is not None:
                probe._task = None

        return stepped

    def gradients_read(self):
        """The scaler's unscale, or the optimizer's step() without one, reads the gradients:
        whether they are what the step's last backward left, not a .grad set by hand after
        it (per-task gradients combined into .grad, each computed after its own zero_grad())."""
        if self._as_accumulated is None:
            p = self._param()
            self._as_accumulated = p is not None and self._grad is not None and self._grad() is p.grad


_INPUT_WALK = 64  # autograd nodes walked back from an input that requires grad, looking for its leaves


def _input_receives_gradient(inputs, optimized) -> bool:
    """Whether the model's forward took, among `inputs` (args, kwargs), a tensor made from one
    the user made to receive its own gradient: a leaf that requires grad, is not a parameter
    and no optimizer holds (FGSM's `x.requires_grad_()`; PGD's perturbation, given as
    `x + delta`). Not a soft prompt (a Parameter, trained as the model's are), nor a
    generator's output given to its discriminator (made from the generator's parameters)."""
    if inputs is None:
        return False
    for tensor in float_tensors(inputs):
        if not tensor.requires_grad:
            continue
        if tensor.is_leaf:
            if _made_to_receive(tensor, optimized):
                return True
            continue
        todo, walked = [tensor.grad_fn], 0
        while todo and walked < _INPUT_WALK:
            node = todo.pop()
            walked += 1
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node's
            if leaf is not None:
                if _made_to_receive(leaf, optimized):
                    return True
                continue
            todo.extend(child for child, _ in node.next_functions if child is not None)
    return False


def _made_to_receive(leaf, optimized) -> bool:
    return not isinstance(leaf, torch.nn.Parameter) and not optimized(leaf)


def _batches(numbers) -> str:
    return ("micro-batch " if len(numbers) == 1 else "micro-batches ") + ", ".join(map(str, numbers))
