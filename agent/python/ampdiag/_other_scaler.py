"""A loop that scales its losses with another GradScaler than the one given to attach(): one
made after it, typically inside a function called once per epoch
(`def train_one_epoch(): scaler = torch.amp.GradScaler()`). The attached scaler never
scales a loss or updates, so no step ever ends and the run.db holds none, which
`ampdiag report` could only call a training that never reached scaler.update().

Once BACKWARDS backwards have reached the model while the attached scaler has scaled no
loss, event "scaler-unused" (once) and one line on stderr say so; the report's error for a
run without steps quotes it. A backward of another scaler after the attached one has been
used is a second network's (a GAN's generator through the attached discriminator), not this.
"""
import sys

EVENT = "scaler-unused"
BACKWARDS = 8


def backward_reached(handle):
    """A backward reached the model while the attached scaler had scaled no loss."""
    handle._backwards_without_scale += 1
    if handle._backwards_without_scale != BACKWARDS:
        return
    detail = (f"{BACKWARDS} backwards reached the model and the GradScaler given to attach() has scaled no loss: "
              "if the loop scales its losses, it does so with another GradScaler (one made after attach(), as in a "
              "function called once per epoch); make the GradScaler once and give that one to attach()")
    handle._event(EVENT, detail)
    print(f"ampdiag: {detail}", file=sys.stderr)
