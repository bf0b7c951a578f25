"""An nn.LSTM language model under torch.autocast("cpu", dtype=torch.float16): oneDNN, torch's
CPU kernels, has no float16 LSTM on the CPUs this was tried on (AMD EPYC, Intel Xeon with
AVX-512 FP16), and the first forward raises "could not create a primitive descriptor for the
LSTM forward propagation primitive". The report said only that the training raised; the agent
now reads the module from the traceback, and the report says to run it in FP32, which trains."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import ampdiag
from conftest import rows


class LstmLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(100, 32), nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 100)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])


def train(db, pin=False, steps=6):
    torch.manual_seed(0)
    model = LstmLM()
    if pin:
        ampdiag.pin_fp32(model.rnn)
    opt, scaler = torch.optim.Adam(model.parameters(), 1e-3), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with ampdiag.attach(model, scaler, db=db):
        for _ in range(steps):
            ids = torch.randint(0, 100, (8, 20), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(ids)
            loss = F.cross_entropy(logits.float().reshape(-1, 100), ids.reshape(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


def refused_run(db):
    try:
        train(db)
    except RuntimeError as error:
        if "could not create a primitive descriptor" not in str(error):
            raise
        return
    pytest.skip("this CPU's oneDNN runs a float16 LSTM")


def test_the_module_a_float16_lstm_refusal_raised_in_is_recorded(tmp_path):
    db = tmp_path / "lstm.db"
    refused_run(db)
    assert rows(db, "SELECT detail FROM events WHERE kind = 'training-raised-in'") == [("rnn (LSTM)",)]


def test_the_report_says_to_run_that_module_in_fp32(tmp_path, ampdiag):
    db = tmp_path / "lstm.db"
    refused_run(db)
    result = ampdiag("report", db)
    assert result.returncode == 2
    assert "no float16 LSTM on this CPU" in result.stderr
    assert "run rnn in FP32 (ampdiag.pin_fp32(model.rnn))" in result.stderr


def test_the_lstm_pinned_to_fp32_trains_healthy(tmp_path, verdict):
    db = tmp_path / "pinned.db"
    train(db, pin=True)
    code, rep = verdict(db)
    assert code == 0, rep["findings"]
