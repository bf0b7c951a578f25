"""`ampdiag fp8` on a recorded training run: the vit_overflow model with exponent histograms."""
import json

from test_whatif_rerun import train


def test_fp8_readiness_lists_every_layer_and_e5m2_holds_at_least_what_e4m3_holds(tmp_path, ampdiag):
    db = tmp_path / "hist.db"
    train(65536.0, 10, db=db, histogram=True)
    result = ampdiag("fp8", db, "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 28  # every parameter of the model
    for row in rows:  # both put the largest value in their top binade; E5M2 has 30 binades, E4M3 15
        assert float(row["e5m2_normal_pct"]) >= float(row["e4m3_normal_pct"])
    e5m2 = [float(r["e5m2_normal_pct"]) for r in rows]
    assert e5m2 == sorted(e5m2)  # least ready first
    text = ampdiag("fp8", db).stdout
    assert "layers fit E4M3" in text and "fit E5M2" in text


def test_a_run_without_histograms_is_refused_with_how_to_record_them(tmp_path, ampdiag):
    db = tmp_path / "plain.db"
    train(65536.0, 10, db=db)
    result = ampdiag("fp8", db)
    assert result.returncode == 2
    assert "histogram=True" in result.stderr
