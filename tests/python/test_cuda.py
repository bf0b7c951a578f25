"""The Python agent on CUDA: training is bit-identical with and without it, the loop with
a fused optimizer makes no host sync with the agent attached (torch's sync debug mode set
to "error" stays silent), the run.db holds the scaler's own trajectory (read back from the
device a step late), and a model with CPU and CUDA parameters is recorded whole. Skipped
without a CUDA device."""
import sqlite3

import pytest
import torch

import ampdiag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1)).to(device)


def train(steps, db=None, fused=False, no_sync=False, device="cuda", init_scale=2.0 ** 40, **options):
    """Trains the tiny model for `steps` steps (the default scale overflows at first), with
    ampdiag attached (with `options`) when `db` is given."""
    model = make_model(device)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=4)
    handle = ampdiag.attach(model, scaler, db=db, overwrite=True, **options) if db else None
    x = torch.randn(64, 16, device=device)
    y = torch.randn(64, 1, device=device)
    losses, scales = [], []
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach().double())
            scales.append(scaler._scale.double().clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if handle:
        handle.close()
    params = [p.detach().cpu() for p in model.parameters()]
    return params, [float(t) for t in losses], [float(t) for t in scales]


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_training_is_bit_identical_with_the_agent(tmp_path, fused):
    without, _, _ = train(20, fused=fused)
    with_agent, _, _ = train(20, db=tmp_path / "run.db", fused=fused)
    for a, b in zip(with_agent, without):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_fused_optimizer_loop_makes_no_host_sync_with_the_agent(tmp_path):
    train(12, db=tmp_path / "run.db", fused=True, no_sync=True)  # raises on the first sync


def test_the_cuda_run_db_holds_the_scalers_trajectory(tmp_path):
    _, losses, scales = train(12, db=tmp_path / "run.db", fused=True)
    with sqlite3.connect(tmp_path / "run.db") as c:
        rows = c.execute("SELECT loss, scale_before, scale_after, found_inf, skipped FROM steps ORDER BY step").fetchall()
        assert c.execute("SELECT value FROM meta WHERE key = 'dropped_steps'").fetchone()[0] == "0"
        assert c.execute("SELECT COUNT(*) FROM events WHERE kind = 'slow-path'").fetchone()[0] == 0
    assert len(rows) == 12
    assert rows[0][1] == 2.0 ** 40
    for i, (loss, before, after, found, skipped) in enumerate(rows):
        assert loss == pytest.approx(losses[i], rel=0, abs=0)
        assert after == scales[i]
        assert found == skipped
        if i:
            assert before == rows[i - 1][2]
    assert any(found for *_, found, _ in rows)


def test_a_model_with_cpu_and_cuda_parameters_is_recorded_whole(tmp_path):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1).cuda()
    model = torch.nn.ModuleDict({"first": first, "second": second})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    with ampdiag.attach(model, scaler, db=tmp_path / "run.db", overwrite=True):
        for _ in range(3):
            opt.zero_grad()
            h = first(torch.randn(4, 8)).cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = second(h).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with sqlite3.connect(tmp_path / "run.db") as c:
        assert c.execute("SELECT COUNT(DISTINCT layer_id) FROM grad_stats").fetchone()[0] == 4
        assert c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 3


def test_bf16_on_cuda_without_a_scaler_makes_no_host_sync_and_records_its_losses(tmp_path):
    model = make_model("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    losses = []
    with ampdiag.attach(model, optimizer=opt, db=tmp_path / "run.db", overwrite=True):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach().double())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with sqlite3.connect(tmp_path / "run.db") as c:
        recorded = [r[0] for r in c.execute("SELECT loss FROM steps ORDER BY step")]
    assert recorded == [float(t) for t in losses]

