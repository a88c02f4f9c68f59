"""Metrics: model FLOPs by hand count, the peak an MFU is taken against and where it comes from,
the metrics log and the loss plot."""

import json

import pytest
from conftest import tensorboard_scalars

from minigpt.models import flops, get_config
from minigpt.train import metrics


def test_flops_per_token_matches_a_hand_count_for_minigpt():
    # D = F = 256, 8 layers, vocabulary 50257, context 256.
    per_layer = 4 * 256 * 256 + 2 * 256 * 256  # query, key, value, output; up and down
    head = 256 * 50257
    attention = 12 * 8 * 256 * 256  # scores and weighted sum, forward and backward
    assert flops.flops_per_token(get_config("minigpt"), 256) == 6 * (
        8 * per_layer + head) + attention == 102_360_576


def test_flops_per_token_counts_grouped_kv_heads_and_the_swiglu_gate():
    # llama-15m: D = 128, 4 KV heads of 16 (64 wide), F = 384, 8 layers, context 256.
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384
    assert flops.flops_per_token(get_config("llama-15m"), 256) == (
        6 * (8 * per_layer + 128 * 50257) + 12 * 8 * 128 * 256) == 51_180_288


def test_peak_comes_from_the_table_for_known_chips_and_is_measured_once_per_machine(
        monkeypatch, tmp_path):
    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(flops.jax, "devices", lambda: [Device()])
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    flops.device_peak.cache_clear()
    peak = flops.device_peak("bfloat16")
    assert (peak.flops, peak.source, peak.key) == (989e12, "NVIDIA H100 80GB HBM3 data sheet",
                                                   None)
    Device.device_kind = "cpu"
    measured = []
    monkeypatch.setattr(flops, "measure_matmul_peak",
                        lambda dtype: measured.append(dtype) or 1.5e11)
    sources = []
    for _ in range(2):  # a second process (the cache cleared) reads the kept figure
        flops.device_peak.cache_clear()
        peak = flops.device_peak("float32")
        sources.append(peak.source)
        assert peak.flops == 1.5e11 and f"| cpu x{flops.jax.device_count()} | float32" in peak.key
    assert measured == ["float32"]
    assert sources == [f"cpu: float32 matmul measured {when}, kept in {tmp_path / 'peaks.json'}"
                       for when in ("now", "on this machine")]
    assert json.loads((tmp_path / "peaks.json").read_text()) == {peak.key: 1.5e11}
    flops.device_peak.cache_clear()


def test_an_mfu_above_one_is_impossible(monkeypatch, tmp_path):
    """A step faster than the peak proves the peak low: MFU is at most 1, the peak rises to the
    rate seen (said once) and the raised figure is kept for later runs."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    ticks = iter([0.0, 1.0, 1.5, 2.5])  # steps of 1.0, 0.5 and 1.0 s
    peak = flops.Peak(100.0, "a measured matmul", key="this machine | float32")
    recorder = metrics.Recorder(tmp_path / "metrics.jsonl", tmp_path / "tb", enabled=True,
                                step=0, total=4, tokens_per_step=10, flops_per_token=6.0,
                                peak=peak, devices=1, log_every=1)
    recorder.timer.clock = lambda: next(ticks)
    with pytest.warns(UserWarning, match="reached 0.0 GFLOP/s per device, above the peak") as said:
        for step in range(1, 5):
            recorder.record(step, {"loss": 1.0, "grad_norm": 1.0})
    recorder.close()
    mfus = [r["mfu"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl") if "mfu" in r]
    assert mfus == [pytest.approx(0.6), 1.0, pytest.approx(0.5)]  # 60, 120 (over 100), 60 FLOP/s
    assert len(said) == 1 and peak.flops == 120.0
    assert json.loads((tmp_path / "peaks.json").read_text()) == {"this machine | float32": 120.0}


def test_the_measured_peak_is_the_fastest_of_the_timed_matmuls(monkeypatch):
    # Three timed runs of a 256 x 256 matmul (2 * 256^3 FLOPs) taking 0.4, 0.2 and 0.3 s.
    ticks = iter([10.0, 10.4, 11.0, 11.2, 12.0, 12.3])
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(ticks))
    assert flops.measure_matmul_peak(size=256, repeats=3) == pytest.approx(2 * 256**3 / 0.2)
    assert next(ticks, None) is None  # each run was timed, and nothing else


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


RECORDS = [{"step": 1, "loss": 5.0, "grad_norm": 1.5, "lr": 1e-4},
           {"step": 2, "loss": 4.5, "grad_norm": 1.2, "lr": 2e-4, "tokens_per_s": 900.0,
            "mfu": 0.25},
           {"step": 2, "eval_loss": 4.25, "eval_bits_per_byte": 1.5, "eval_perplexity": 70.1},
           {"step": 3, "loss": 4.0, "grad_norm": 1.0, "lr": 3e-4, "tokens_per_s": 1000.0,
            "mfu": 0.5}]


def expected(records):
    by_tag = {}
    for r in records:
        for key, tag in metrics.TENSORBOARD_TAGS.items():
            if key in r:
                by_tag.setdefault(tag, []).append((r["step"], pytest.approx(r[key], rel=1e-6)))
    return by_tag


def test_tensorboard_shows_every_metric_at_every_step_and_a_restart_replaces_the_rest(tmp_path):
    board = metrics.TensorBoard(tmp_path / "tb")
    for record in RECORDS:
        board.write(record)
    board.close()
    assert tensorboard_scalars(tmp_path / "tb") == expected(RECORDS)
    assert set(expected(RECORDS)) == set(metrics.TENSORBOARD_TAGS.values())
    # A resume from step 2 starts from the records kept; step 3 is written again, once.
    (tmp_path / "tb" / "plugins" / "profile").mkdir(parents=True)  # a trace stays put
    board = metrics.TensorBoard(tmp_path / "tb", RECORDS[:3])
    again = {"step": 3, "loss": 3.9, "grad_norm": 0.9, "lr": 3e-4}
    board.write(again)
    board.close()
    assert tensorboard_scalars(tmp_path / "tb") == expected(RECORDS[:3] + [again])
    assert (tmp_path / "tb" / "plugins" / "profile").is_dir()


def test_training_seconds_adds_up_step_times_after_the_first():
    # 1,000 tokens a step: 500 tokens/s is 2 s a step, 1,000 is 1 s; the eval record and the
    # first step after a resume (no speed) add nothing.
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "tokens_per_s": 500.0},
               {"step": 2, "eval_loss": 4.1}, {"step": 3, "loss": 3.5, "tokens_per_s": 1000.0},
               {"step": 4, "loss": 3.4}]
    assert metrics.training_seconds(records, 1000, first_step_s=9.0) == {
        1: 9.0, 2: 11.0, 3: 12.0, 4: 12.0}


def test_a_run_directory_gives_its_training_seconds(tmp_path):
    # 8 x 32 tokens a step (seq_len 0: the model's context), a first step of compilation 5 s
    # plus the fitted 0.5 s, later steps at 512 tokens/s (0.5 s each).
    (tmp_path / "config.json").write_text(json.dumps({
        "model": {"context_len": 32}, "train": {"batch_size": 8, "seq_len": 0},
        "time_budget": {"compile_s": 5.0, "fit1": {"at_step": 2, "s_per_step": 0.5}}}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "tokens_per_s": 512.0},
        {"step": 3, "loss": 3.0, "tokens_per_s": 512.0}]))
    assert metrics.run_training_seconds(tmp_path) == {1: 5.5, 2: 6.0, 3: 6.5}
