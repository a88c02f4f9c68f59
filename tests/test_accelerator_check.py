"""bench/accelerator_check.py: the one prepared device check. Its dry run (the same code path on a
CPU, tiny shapes and budgets) writes a report whose every step is ok; the tests it leaves out on
an accelerator exist and say why; it reads pytest's outcomes even from a stopped run; its steps
fit the call's 8 minutes; the speed comparison (bench/accelerator_speed.py) reads the trainer's
logged steps, names the runs' settings and computes its ratios; the PyTorch peer trains."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import accelerator_check as check
from bench import accelerator_speed as speed
from bench import accelerator_steps

REPO = Path(__file__).resolve().parent.parent


def test_the_tests_left_out_on_an_accelerator_exist_and_say_why():
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert set(check.DEVICE_BOUND) <= files
    assert all("devices" in why or "slow set" in why or "processes" in why
               for why in check.DEVICE_BOUND.values())
    command = check.tests_command(dry_run=False)
    assert "tests/test_attention_dispatch.py" in command and "tests/test_sharding.py" not in command
    assert check.tests_command(dry_run=True)[-2:] == list(check.DRY_TESTS)


def test_pytest_outcomes_are_read_from_its_verbose_lines_also_when_stopped():
    log = "\n".join([
        "tests/test_a.py::test_one PASSED                    [ 10%]",
        "[gw1] [ 20%] FAILED tests/test_b.py::test_two[x-1]",
        "[gw0] [ 30%] SKIPPED tests/test_c.py::test_three",
        "!!!!!!! KeyboardInterrupt !!!!!!!"])
    assert check.read_test_log(log) == {
        "passed": 1, "failed": 1, "error": 0, "skipped": 1,
        "failures": ["tests/test_b.py::test_two[x-1]"], "summary": None}


@pytest.mark.slow
def test_the_dry_run_reports_every_step_ok(tmp_path, small_stories):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "accelerator_check.py"),
                           "--dry-run", "--out", str(out), "--data", str(small_stories)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] and report["ok"] and report["wheels"] is None
    assert list(report["steps"]) == ["environment", "tests", "mfu", "parity", "peer", "trainer",
                                     "stories", "generation", "notebooks"]
    assert [name for name, step in report["steps"].items() if not step["ok"]] == []
    steps = {name: step.get("result") for name, step in report["steps"].items()}
    assert steps["environment"]["backend"] == "cpu"
    assert report["steps"]["tests"]["passed"] == len(check.DRY_TESTS)
    runs = steps["mfu"]["runs"]
    # First the steps alone the comparison needs, named; then the MFU table's runs.
    assert [r["name"] for r in runs[:3]] == [name for name, *_ in speed.STEP_RUNS["dry"]]
    assert [(r["dtype"], r["kernels"]) for r in runs[3:]] == [("bfloat16", "cudnn"),
                                                              ("float32", "reference")]
    for run in runs:
        assert run["tokens_per_s"] > 0 and run["mfu_matmul"] > 0
        assert run["mfu_data_sheet"] is None  # a CPU has no data sheet
        assert bool(run["fallbacks"]) == (run["kernels"] == "cudnn")  # no cuDNN on a CPU
    parity = steps["parity"]  # on a CPU both sides are the CPU: float32 gives the same losses
    assert set(parity["losses"]) == {"float32", "auto", "cpu float32"}
    assert parity["losses"]["float32"] == parity["losses"]["cpu float32"]
    assert len(parity["losses"]["auto"]) == parity["steps"] == 3
    assert len(set(parity["losses"]["cpu float32"])) == 3  # steps trained on batches of their own
    assert parity["within_tolerance"] == {"float32": True, "auto": True}
    stories = steps["stories"]
    assert stories["eval_loss"] > 0 and stories["eval_bits_per_byte"] > 0
    assert "computing in float32" in stories["first_lines"][0]
    assert set(steps["generation"]["tokens_per_s"]) == {"1", "4"}
    assert steps["generation"]["model"].startswith("the stories run")
    assert steps["generation"]["story"].startswith("Once upon a time")
    assert str(out / "colab") in steps["notebooks"]["01_train_minigpt.ipynb"]["imported_from"]
    assert steps["peer"]["tokens_per_s"] > 0 and steps["peer"]["compile_backend"] == "aot_eager"
    assert steps["peer"]["parameters"] > 0 and steps["peer"]["device"] == "cpu"
    trainer = steps["trainer"]["runs"]
    assert list(trainer) == ["default", "best", "fp8"]
    assert trainer["default"]["set"] == [] and "model.fp8=true" in trainer["fp8"]["set"]
    for run in trainer.values():
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and run["steps"] == 6
    assert set(steps["generation"]["greedy"]["tokens_per_s"]) == {"1", "4"}
    comparison = report["comparison"]
    for label, run in comparison["trainer"].items():
        assert run["vs_peer"] == pytest.approx(trainer[label]["tokens_per_s"]
                                               / steps["peer"]["tokens_per_s"])
        assert run["vs_step_alone"] > 0
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines()[0].endswith("all steps ok") and "fell back to XLA" in summary
    assert "x the peer" in summary and "greedy decoding: batch 1" in summary


def test_the_steps_fit_the_calls_eight_minutes_and_the_dry_run_runs_them_all():
    assert sum(check.BUDGETS.values()) <= check.TOTAL_S <= 8 * 60
    assert list(check.DRY_BUDGETS) == list(check.BUDGETS)
    assert set(check.BUDGETS) - {"tests"} == set(accelerator_steps.STEPS)


def test_the_trainer_runs_as_users_run_it_with_their_settings(tmp_path):
    settings = {"out": str(tmp_path), "dry_run": False, "data": ["stories.txt"]}
    commands = {label: speed.trainer_command(settings, label, changes)
                for label, changes in speed.TRAINER_RUNS}
    assert list(commands) == ["default", "best", "fp8"]
    assert [c.count("--set") for c in commands.values()] == [1, 2, 3]  # eval_batches, +1, +2
    assert commands["default"][commands["default"].index("--set") + 1] == "train.eval_batches=1"
    assert "model.scan_layers=false" in commands["best"]
    assert {"model.scan_layers=false", "model.fp8=true"} <= set(commands["fp8"])
    default = commands["default"]
    assert default[default.index("--model") + 1] == "gpt2-small"
    assert default[default.index("--batch-size") + 1] == "16"
    assert default[default.index("--seq-len") + 1] == "1024"


def test_the_trainers_speed_is_its_median_step_after_warm_up(tmp_path):
    lines = [{"step": 1, "loss": 10.0}]
    lines += [{"step": s, "loss": 10.0 - s, "tokens_per_s": t, "mfu": t / 1e6}
              for s, t in zip(range(2, 9), [10.0, 20.0, 30.0, 300.0, 100.0, 200.0, 400.0])]
    lines.append({"step": 8, "eval_loss": 3.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    found = speed.read_speed(tmp_path / "metrics.jsonl")
    # Steps 1-3 compile and warm up; the median of steps 4..8: 30, 300, 100, 200, 400.
    assert found == {"steps": 8, "tokens_per_s": 200.0, "mfu": 200.0 / 1e6, "timed_steps": 5,
                     "last_loss": 2.0}


def test_the_comparison_sets_each_run_beside_the_peer_and_its_step_alone():
    def run(name, tokens_per_s):
        return {"name": name, "tokens_per_s": tokens_per_s, "batch": 16, "seq": 1024,
                "flops_per_step": 16 * 1024 * 8.0e8}

    steps = {
        "mfu": {"result": {"runs": [run("gpt2-small default", 400_000.0),
                                    run("gpt2-small best", 450_000.0),
                                    run("gpt2-small fp8", 600_000.0),
                                    run("stories-gpu", 1_600_000.0),
                                    run(None, 1.0)]}},
        "peer": {"result": {"tokens_per_s": 438_125.0}},
        "trainer": {"result": {"runs": {
            "default": {"tokens_per_s": 392_000.0, "mfu": 0.32},
            "best": {"tokens_per_s": 441_000.0, "mfu": 0.36},
            "fp8": {"error": "exit 2: model.fp8 needs FP8 matrix units"}}}},
        "stories": {"result": {"tokens_per_s": 1_552_000.0}},
        "generation": {"result": {"greedy": {"tokens_per_s": {"1": 1044.0, "16": 9000.0}}}},
    }
    found = speed.compare(steps)
    default, best, fp8 = (found["trainer"][k] for k in ("default", "best", "fp8"))
    assert default["vs_peer"] == pytest.approx(392_000 / 438_125)
    assert default["vs_step_alone"] == pytest.approx(0.98)
    assert best["vs_step_alone"] == pytest.approx(0.98)
    assert default["flops_per_token"] == 8.0e8
    assert fp8["tokens_per_s"] is None and fp8["vs_peer"] is None
    assert fp8["step_alone_tokens_per_s"] == 600_000.0
    assert found["peer_mfu"] == pytest.approx(0.32 * 438_125 / 392_000)
    assert found["stories_trainer_vs_step_alone"] == pytest.approx(0.97)
    assert found["decoding_tokens_per_s"] == {"1": 1044.0, "16": 9000.0}
    lines = speed.summary_lines(found)
    assert lines[0].startswith("  peer (nanoGPT-style PyTorch): 438,125 tokens/s, MFU 0.358")
    assert "trainer default: 392,000 tokens/s, MFU 0.320, 0.89x the peer, 0.980 of its step " \
           "alone" in lines[1]
    assert lines[3] == "  trainer fp8: not measured"
    assert "greedy decoding: batch 1: 1,044 tokens/s, batch 16: 9,000 tokens/s" in lines[-1]
    assert speed.compare({})["trainer"] == {}  # nothing ran: nothing to compare


def test_the_pytorch_peer_trains_on_a_cpu():
    pytest.importorskip("torch", reason="the peer needs torch (the hf extra)")
    from bench import peer_nanogpt

    found = peer_nanogpt.time_train_step(peer_nanogpt.TINY, batch=2, seq=32, steps=2,
                                         device="cpu", backend=None)
    assert found["tokens_per_s"] > 0 and found["step_s"] > 0
    # Random tokens of a 50,304-token vocabulary at initialisation: about log(50304) = 10.8.
    assert 10.0 < found["loss"] < 11.5
    import torch

    with torch.device("meta"):  # shapes alone
        gpt2_small = peer_nanogpt.GPT(peer_nanogpt.GPT2_SMALL)
    assert sum(p.numel() for p in gpt2_small.parameters()) == 124_439_808 + 47 * 768  # padding
