"""Without a scaler a step ends at the step() of the optimizer given to attach(). A loop that
makes a new optimizer over the same parameters (a backbone unfrozen after a few epochs and
a fresh AdamW over the whole model, a restart at another learning rate) steps that one from
then on, and the rest of the run went unrecorded: the report showed the first steps as the
whole run.

A global optimizer step pre-hook sees it: an optimizer not watched that holds a parameter
some watched optimizer held replaces it, and is watched from that step on (torch runs an
optimizer's own step hooks that a global pre-hook registers in the same step() call), with
event "optimizer-replaced" once. An optimizer over other parameters (a GAN's generator, a
second optimizer beside the first: Muon for the matrices, AdamW for the rest) is no
replacement. Each optimizer is judged once, at its first step.
"""
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

EVENT = "optimizer-replaced"


def params_of(optimizer) -> set:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def watch(handle):
    """Registers the global pre-hook for this handle (held weakly); returns its removable handle."""
    ref = weakref.ref(handle)
    judged = weakref.WeakSet()  # optimizers looked at once: watched, or no replacement

    def before(optimizer, args, kwargs):
        h = ref()
        if h is None or h._inert or optimizer in judged:
            return
        judged.add(optimizer)
        if optimizer in h._stepped_optimizers or not params_of(optimizer) & h._stepped_params:
            return
        h._watch_optimizer(optimizer)
        h.optimizer = optimizer  # the replaced one's state (AdamW's moments: twice the model) is the user's to free
        h._event(EVENT, f"{type(optimizer).__name__}.step() ran on parameters of the optimizer given to attach(), "
                        "which it replaces (made after attach(): a new optimizer over an unfrozen model): its steps "
                        "are recorded from this one on", key=(EVENT, id(optimizer)))

    return register_optimizer_step_pre_hook(before)
