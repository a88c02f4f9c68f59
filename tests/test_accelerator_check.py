"""bench/accelerator_check.py: the one prepared device check. Its dry run (the same code path on a
CPU, tiny shapes and budgets) writes a report whose every step is ok; the tests it leaves out on
an accelerator exist and say why; it reads pytest's outcomes even from a stopped run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import accelerator_check as check

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
    assert list(report["steps"]) == ["environment", "tests", "mfu", "parity", "stories",
                                     "generation", "notebooks"]
    assert [name for name, step in report["steps"].items() if not step["ok"]] == []
    steps = {name: step.get("result") for name, step in report["steps"].items()}
    assert steps["environment"]["backend"] == "cpu"
    assert report["steps"]["tests"]["passed"] == len(check.DRY_TESTS)
    runs = steps["mfu"]["runs"]
    assert [(r["dtype"], r["kernels"]) for r in runs] == [("bfloat16", "cudnn"),
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
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines()[0].endswith("all steps ok") and "fell back to XLA" in summary
