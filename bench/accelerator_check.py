"""The accelerator check: one call that shows what minigpt does on a GPU (or a TPU).

    python bench/accelerator_check.py --out DIR [--wheels WHEELS] [--data FILE ...]
    python bench/accelerator_check.py --out DIR --dry-run    # the same code path on a CPU

It runs these steps in turn, each in a process of its own with a time budget (`BUDGETS`: 470 s
in all, and no step may run past `TOTAL_S`, so the call fits in 8 minutes), so that one that
fails or runs out of time is recorded and the rest still run:

- environment: versions, devices, cuDNN, what `auto` picks (kernels, compute dtype);
- tests: the quick tests that need no simulated devices, on the accelerator (MINIGPT_TEST_DEVICES
  =native); the files that simulate 8 CPU devices or start several processes are left out,
  each with its reason (`DEVICE_BOUND`); the dry run runs a very small selection;
- mfu: train-step MFU in bfloat16 and float32 for gpt2-small at batch 16 x 1024 and llama-15m
  and minigpt at their shapes, with the fused attention and with XLA's, against the chip's
  data-sheet peak and a matmul measured in the same process; tokens/s beside modded-nanogpt's;
  first the steps the speed comparison needs alone (`accelerator_speed.STEP_RUNS`);
- parity: 20 train steps of llama-15m on the accelerator (float32, and `auto`'s dtype and
  kernels) beside the same steps on the machine's CPU: the losses, and the largest relative gap;
- peer: a nanoGPT-style PyTorch gpt2-small (`bench/peer_nanogpt.py`), its train step's tokens/s;
- trainer: `python -m minigpt.train` on gpt2-small with no --set, with the best settings found,
  and with FP8 too: tokens/s and MFU as the trainer logs them (`bench/accelerator_speed.py`);
- stories: `--recipe stories-gpu` for 45 seconds: held-out loss and bits per byte, tokens/s;
- generation: KV-cache tokens/s at batch 1 and 16, and a story from the stories run's model;
  gpt2-small's greedy decoding at batch 1 and 16;
- notebooks: each notebook's first code cell as Colab runs it (`accelerator_steps.notebooks`).

DIR receives report.json (everything, with `comparison`: the trainer's runs over the peer and over
their steps alone, decoding; `accelerator_speed.compare`), summary.txt (a few lines), logs/ (each
step's output) and the runs the steps make; `--record` also appends the summary to
bench/RESULTS.md. `--wheels` installs what the machine lacks (grain, tensorboardX, the test tools,
...) with pip from that folder alone, never downloading. The machine has no network, so give the
stories' text with `--data` (a few MB of TinyStories). `--dry-run` runs the same steps with tiny
shapes and budgets on a CPU; CI runs it (tests/test_accelerator_check.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import accelerator_speed  # noqa: E402
from bench import report as bench_report  # noqa: E402

# Seconds each step may take on an accelerator, and in the dry run (hard limits: a step past
# its budget is stopped and recorded as such).
# The peer and the trainer's three runs (issue 55) took their time from the tests, mfu and
# stories steps (100, 130 and 130 s before); not yet run on a GPU, so not yet measured to fit.
BUDGETS = {"environment": 15, "tests": 50, "mfu": 80, "parity": 30, "peer": 55, "trainer": 100,
           "stories": 70, "generation": 40, "notebooks": 30}
# No step runs past this many seconds from the start: a step gets what is left of it, if less
# than its budget (the call's limit is 8 minutes, and starting up takes some of it).
TOTAL_S = 470
# The dry run's budgets are loose: it checks that each step works, on a CI runner whose two cores
# run another test beside it (its generation step once took 27 s there).
DRY_BUDGETS = {"environment": 60, "tests": 120, "mfu": 240, "parity": 120, "peer": 120,
               "trainer": 300, "stories": 150, "generation": 150, "notebooks": 60}
# The quick tests that cannot run on one accelerator: they simulate 8 CPU devices (presets that
# split over several) or start several processes. Every other test file runs.
DEVICE_BOUND = {
    "test_checkpoint.py": "restores checkpoints across presets (dp_pp) on 8 simulated devices",
    "test_cli.py": "trains under the pp preset on 8 simulated devices",
    "test_context_parallel.py": "splits sequences over simulated devices (the cp presets)",
    "test_documents.py": "checks documents under cp and fsdp_tp on 8 simulated devices",
    "test_generate.py": "generates under dp_tp on 8 simulated devices",
    "test_hub.py": "imports checkpoints under dp_tp on 8 simulated devices",
    "test_install.py": "builds and installs a wheel (slow set)",
    "test_lora.py": "trains adapters under dp_tp and fsdp_tp on 8 simulated devices",
    "test_moe.py": "expert parallelism (ep, fsdp_ep) on 8 simulated devices",
    "test_multihost.py": "multi-process jobs of simulated CPU devices",
    "test_muon.py": "Muon under dp_tp and fsdp on 8 simulated devices",
    "test_notebooks.py": "runs the notebooks on 8 simulated devices (this check runs their "
                         "first cells itself)",
    "test_pipeline.py": "pipeline presets on 8 simulated devices",
    "test_plan.py": "plans and compiles presets for 8 simulated devices",
    "test_readme.py": "runs the quickstart with simulated devices (slow set)",
    "test_recovery.py": "counts the checkpoint shards of 8 devices",
    "test_sharding.py": "every preset's layout on 8 simulated devices",
    "test_steps.py": "one step under every preset against one device, on 8 simulated devices",
    "test_train.py": "trains under fsdp, dp_tp and fsdp_tp on 8 simulated devices",
    "test_hostile_run_folders.py": "the cp preset on 8 simulated devices",
    "test_eval.py": "evaluates under fsdp, tp, dp_tp, dp_pp and cp on 8 simulated devices",
    "test_execution.py": "lays out dp_tp (data 4 x model 2) on 8 simulated devices",
    "test_windows.py": "sliding windows under dp_cp and dp_pp on 8 simulated devices",
    "test_zoo.py": "the zoo under fsdp_tp on 8 simulated devices",
}
DRY_TESTS = tuple(f"tests/test_attention_dispatch.py::{name}" for name in (
    "test_auto_means_each_backends_own_kernels_and_dtype",
    "test_splash_refuses_what_does_not_fit_its_blocks"))
# What the tests need beyond the package's own dependencies, and the [hub] extra notebook 04's
# first cell installs.
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "tensorboard>=2.15",
              "safetensors>=0.4", "huggingface_hub>=0.24")


def requirements() -> list[str]:
    """The package's dependencies (pyproject.toml) and the test tools, as pip specifiers."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *TEST_TOOLS]


def install_missing(wheels: str) -> dict:
    """Install, from the wheels folder alone, each requirement not installed here or installed
    in a version it does not accept."""
    from packaging.requirements import Requirement

    missing = []
    for spec in requirements():
        wanted = Requirement(spec)
        try:
            if not wanted.specifier.contains(importlib.metadata.version(wanted.name),
                                             prereleases=True):
                missing.append(spec)
        except importlib.metadata.PackageNotFoundError:
            missing.append(spec)
    found = {"folder": wheels, "missing": missing, "installed": [], "failed": {}}
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
           wheels]
    for spec in missing:  # one at a time, so that one absent wheel does not stop the others
        done = subprocess.run([*pip, spec], capture_output=True, text=True, check=False)
        if done.returncode:
            found["failed"][spec] = (done.stderr.strip().splitlines() or ["?"])[-1]
        else:
            found["installed"].append(spec)
    return found


def step_environment() -> dict[str, str]:
    """The environment the steps run in: the checkout importable, the machine's own devices
    (no simulated ones; the tests too: MINIGPT_TEST_DEVICES=native)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["MINIGPT_TEST_DEVICES"] = "native"
    return env


def tests_command(dry_run: bool) -> list[str]:
    """pytest over the quick tests that need no simulated devices (the dry run: a few)."""
    files = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob("test_*.py"))
             if p.name not in DEVICE_BOUND]
    workers = ["-n", "8", "--dist", "loadfile"] if not dry_run and _has("xdist") else []
    return [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "not slow", "-p",
            "no:cacheprovider", "-v", *workers, *(DRY_TESTS if dry_run else files)]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def read_test_log(text: str) -> dict:
    """Each test's outcome from pytest's verbose output (also when it was stopped midway)."""
    outcomes = {}
    for line in text.splitlines():
        status = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        test = re.search(r"(tests/\S+::\S+)", line)
        if status and test:
            outcomes[test.group(1)] = status.group(1)
    counts = {s.lower(): sum(v == s for v in outcomes.values())
              for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return {**counts, "failures": sorted(t for t, s in outcomes.items() if s in
                                         ("FAILED", "ERROR")),
            "summary": next((line.strip("= ") for line in reversed(text.splitlines())
                             if re.search(r"\d+ (passed|failed)", line)), None)}


def run_step(name: str, settings: dict, budget: float) -> dict:
    """One step in a process of its own, stopped (SIGINT, then SIGKILL) past its budget."""
    out = Path(settings["out"])
    log = out / "logs" / f"{name}.log"
    if name == "tests":
        command = tests_command(settings["dry_run"])
    else:
        command = [sys.executable, __file__, "--step", name, "--settings",
                   str(out / "settings.json")]
    env = dict(settings["env"])
    if name == "tests" and not settings["dry_run"]:  # test workers share the accelerator
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    began = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, timed_out = process.wait(timeout=budget), False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGINT)  # pytest still prints what it has
            try:
                code = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
    entry = {"seconds": round(time.monotonic() - began, 1), "budget_s": budget,
             "timed_out": timed_out, "exit": code, "log": str(log)}
    text = log.read_text(errors="replace")
    if name == "tests":
        entry.update(read_test_log(text), complete=not timed_out)
        entry["skipped_files"] = DEVICE_BOUND if not settings["dry_run"] else {
            "all but a few": "the dry run runs a very small selection"}
        entry["ok"] = (code in (0, 1) or timed_out) and entry["passed"] > 0
    else:
        result = out / "steps" / f"{name}.json"
        entry["ok"] = code == 0 and not timed_out and result.exists()
        if result.exists():
            entry["result"] = json.loads(result.read_text())
    if not entry["ok"]:
        entry["error"] = "\n".join(text.strip().splitlines()[-15:])
    return entry


def default_data(out: Path, dry_run: bool) -> list[str]:
    """The stories' text: TinyStories (downloaded on first use); in the dry run, a slice of the
    offline copy where MINIGPT_ASSETS has one."""
    head = Path(os.environ.get("MINIGPT_ASSETS", REPO.parent / "shared" / "assets"),
                "tinystories", "TinyStories-train-head.txt")
    if not dry_run or not head.is_file():
        return ["tinystories"]
    text = head.read_bytes()[:300_000].rsplit(b"<|endoftext|>", 1)[0] + b"<|endoftext|>\n"
    (out / "data").mkdir(exist_ok=True)
    (out / "data" / "stories.txt").write_bytes(text)
    return [str(out / "data" / "stories.txt")]


def summary_lines(report: dict) -> list[str]:
    """A few lines of the report for a reader."""
    lines = [f"accelerator check{' (dry run)' if report['dry_run'] else ''}, "
             f"{report['started']}: {'all steps ok' if report['ok'] else 'NOT all steps ok'}"]
    for name, step in report["steps"].items():
        head = f"{name}: {'ok' if step['ok'] else 'FAILED'} in {step['seconds']} s"
        result = step.get("result", {})
        if name == "environment" and result:
            head += (f"; {result['backend']} {result['devices'][0]}, jax {result['jax']}, "
                     f"auto: kernels {result['auto_kernels']}, {result['auto_dtype']}")
        if name == "tests":
            head += f"; {step.get('summary')}" + ("" if step.get("complete") else
                                                  " (stopped by its budget)")
        lines.append(head)
        for run in result.get("runs", []) if name == "mfu" else []:
            lines.append(f"  {run['label']}: " + (run["error"] if "error" in run else (
                f"{run['tokens_per_s']:,.0f} tokens/s, MFU "
                + (f"{run['mfu_data_sheet']:.3f} of the data sheet, " if run[
                    'mfu_data_sheet'] is not None else "")
                + f"{run['mfu_matmul']:.3f} of a measured matmul"
                + (", fell back to XLA" if run["fallbacks"] else ""))))
        if name == "parity" and result:
            lines.append(f"  {result['model']} {result['batch']}x{result['seq']}, "
                         f"{result['steps']} steps against the CPU's float32: " + ", ".join(
                             f"{label} within {gap:.1e}" + ("" if result["within_tolerance"][
                                 label] else f" (over {result['tolerance']:.0e})")
                             for label, gap in result["max_relative_difference"].items()))
        if name == "stories" and result:
            speed = result["tokens_per_s"]
            lines.append(f"  {result['steps']} steps, "
                         + (f"{speed:,.0f} tokens/s" if speed else "no step timed")
                         + f", held out {result['eval_loss']:.4f} nats/token, "
                         f"{result['eval_bits_per_byte']:.3f} bits/byte")
        if name == "generation" and result:
            lines.append("  " + ", ".join(f"batch {b}: {v:,.0f} tokens/s"
                                          for b, v in result["tokens_per_s"].items()))
            lines.append(f"  story: {result['story'][:400]}")
        if name == "trainer" and result:
            for label, run in result["runs"].items():
                if "error" in run:
                    lines.append(f"  {label}: {run['error'][-300:]}")
        if not step["ok"]:
            lines.append("  " + step.get("error", "").replace("\n", "\n  ")[-600:])
    lines.append("speed, side by side:")
    lines += accelerator_speed.summary_lines(report.get("comparison", {}))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for report.json, summary.txt and logs (needed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on a CPU with tiny shapes and budgets")
    parser.add_argument("--wheels", help="install missing packages from this folder (pip, "
                                         "no index)")
    parser.add_argument("--data", nargs="+", help="text for the stories step (default: "
                                                  "TinyStories; the dry run: a slice of it)")
    parser.add_argument("--record", action="store_true",
                        help="also append the summary to bench/RESULTS.md")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        from bench.accelerator_steps import run_step as run_one

        run_one(args.step, json.loads(Path(args.settings).read_text()))
        return 0
    if not args.out:
        parser.error("give --out DIR: where the report goes")
    out = Path(args.out).resolve()
    for sub in ("steps", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report = {"check": "minigpt accelerator check", "dry_run": args.dry_run,
              "command": "python " + " ".join(sys.argv),
              "started": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
              "machine": bench_report.machine(),
              "wheels": install_missing(args.wheels) if args.wheels else None, "steps": {}}
    settings = {"out": str(out), "dry_run": args.dry_run, "wheels": args.wheels,
                "data": args.data or default_data(out, args.dry_run),
                "env": step_environment()}
    budgets = DRY_BUDGETS if args.dry_run else BUDGETS
    for name, budget in budgets.items():
        if not args.dry_run:
            budget = max(1, min(budget, round(TOTAL_S - (time.monotonic() - began))))
        (out / "settings.json").write_text(json.dumps({**settings, "budget_s": budget}))
        report["steps"][name] = run_step(name, settings, budget)
        print(f"{name}: {'ok' if report['steps'][name]['ok'] else 'FAILED'} in "
              f"{report['steps'][name]['seconds']} s", flush=True)
    report["ok"] = all(step["ok"] for step in report["steps"].values())
    report["comparison"] = accelerator_speed.compare(report["steps"])
    report["seconds"] = round(time.monotonic() - began, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = summary_lines(report)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    if args.record:
        where = report["steps"]["environment"].get("result", {}).get("devices", ["?"])[0]
        bench_report.append_section(
            f"accelerator check{' (dry run)' if args.dry_run else ''} on {where}",
            [f"{report['seconds']} s in all; the full report: {out / 'report.json'}"],
            ["```", *lines[1:], "```"])
    else:
        print("\n".join(lines))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
