"""The agent's reads of device values (_device_reads.py), on host tensors taken as device
ones (conftest's device_copies_on_the_host: their events land at the third look)."""
import pytest
import torch

from ampdiag._device_reads import DeviceReads


def test_values_are_handed_on_once_landed_in_the_order_sent(device_copies_on_the_host):
    got = []
    reads = DeviceReads(lambda values, what: got.append((what, values)))
    reads.send(torch.tensor([1.0]), "a")
    reads.send(torch.tensor([2.0]), "b")
    assert reads.poll() is False and got == []  # (first look)
    assert reads.poll() is False and got == []
    assert reads.poll() is True
    assert got == [("a", [1.0]), ("b", [2.0])]


def test_a_delivery_that_raises_is_not_repeated_and_the_ones_after_it_are_kept(device_copies_on_the_host):
    got = []

    def deliver(values, what):
        if what == "a":
            raise RuntimeError("the writer is closed")
        got.append(what)

    reads = DeviceReads(deliver)
    for what in ("a", "b", "c"):
        reads.send(torch.tensor([0.0]), what)
    with pytest.raises(RuntimeError, match="the writer is closed"):
        reads.poll(wait=True)
    assert reads.pending and got == []
    assert reads.poll(wait=True) is True
    assert got == ["b", "c"]
