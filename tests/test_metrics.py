"""Metrics: model FLOPs by hand count, the peak an MFU is taken against and where it comes from,
the metrics log and the loss plot."""

import json

import pytest

from minigpt import metrics
from minigpt.models import get_config


def test_flops_per_token_matches_a_hand_count_for_minigpt():
    # D = F = 256, 8 layers, vocabulary 50257, context 256.
    per_layer = 4 * 256 * 256 + 2 * 256 * 256  # query, key, value, output; up and down
    head = 256 * 50257
    attention = 12 * 8 * 256 * 256  # scores and weighted sum, forward and backward
    assert metrics.flops_per_token(get_config("minigpt"), 256) == 6 * (
        8 * per_layer + head) + attention == 102_360_576


def test_flops_per_token_counts_grouped_kv_heads_and_the_swiglu_gate():
    # llama-15m: D = 128, 4 KV heads of 16 (64 wide), F = 384, 8 layers, context 256.
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384
    assert metrics.flops_per_token(get_config("llama-15m"), 256) == (
        6 * (8 * per_layer + 128 * 50257) + 12 * 8 * 128 * 256) == 51_180_288


def test_peak_comes_from_the_table_for_known_chips_and_is_measured_otherwise(monkeypatch):
    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(metrics.jax, "devices", lambda: [Device()])
    metrics.device_peak.cache_clear()
    assert metrics.device_peak("bfloat16") == (989e12, "NVIDIA H100 80GB HBM3 data sheet")
    Device.device_kind = "cpu"
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda dtype: 1.5e11)
    metrics.device_peak.cache_clear()
    assert metrics.device_peak("float32") == (1.5e11, "cpu: measured float32 matmul (an estimate)")
    metrics.device_peak.cache_clear()


def test_measured_peak_is_a_plausible_flop_rate():
    assert 1e8 < metrics.measure_matmul_peak(size=256, repeats=2) < 1e14


def test_log_appends_one_json_object_per_line_and_the_plot_is_a_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = metrics.MetricsLog(path)
    log.write({"step": 1, "loss": 5.0})
    log.write({"step": 1, "eval_loss": 4.5})
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 5.0}, {"step": 1, "eval_loss": 4.5}]
    records = metrics.read_metrics(path)
    assert records[0] == {"step": 1, "loss": 5.0}
    metrics.MetricsLog(tmp_path / "other.jsonl", enabled=False).write({"step": 1})
    assert not (tmp_path / "other.jsonl").exists()  # processes other than 0 write nothing
    metrics.plot_losses(records + [{"step": 2, "loss": 4.0}], tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pytest.approx(4.5) == records[1]["eval_loss"]
