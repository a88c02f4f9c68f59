"""`python -m minigpt.eval`: a run's scores on the harness's tasks, or its loss on any text.

    python -m minigpt.eval --run RUN --tasks hellaswag,arc_easy [--num-fewshot K] [--limit N]
        [--batch-size B] [--preset P --devices N] [--include-path DIR] [--log-samples]
        [--out DIR]
    python -m minigpt.eval --run RUN --text FILE... [--stride S] [--json]

`--tasks` runs lm-evaluation-harness with the run as its `minigpt` model and writes what the
harness's own `--output_path` and `--log_samples` write, in its layout
(DIR/<run>/results_<date>.json and samples_<task>_<date>.jsonl), then prints its table.
`--text` prints the loss in nats per token and the bits per byte of each file and of all of them
(`minigpt.eval.text`). A mistake of the user's (a run or a file that is not there, a task the
harness does not know) is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from minigpt.config import DTYPES
from minigpt.errors import exit_code
from minigpt.eval.loading import EvalError, load
from minigpt.eval.text import score_texts
from minigpt.runs import RunDir
from minigpt.runtime import plain_warnings, set_simulated_devices

INSTALL = "lm-evaluation-harness is the [eval] extra: pip install \"minigpt[eval]\""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minigpt.eval",
        description="Score a run on lm-evaluation-harness tasks, or measure its loss and bits "
                    "per byte on any text.")
    p.add_argument("--run", required=True, help="run directory (a training run's --out, or "
                                                "python -m minigpt.hub import's)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--tasks", help="harness tasks, comma-separated (hellaswag,arc_easy,...)")
    what.add_argument("--text", nargs="+", metavar="FILE", help="text files to score")
    p.add_argument("--num-fewshot", type=int, help="examples before each question")
    p.add_argument("--limit", type=float,
                   help="documents per task (below 1: that fraction of them)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per batch")
    p.add_argument("--preset", default="dp", help="how to lay the model out on the devices")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="what the model computes in: float32 (the harness's numbers to 5e-5), "
                        "bfloat16 or auto (bfloat16 on an accelerator)")
    p.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--include-path", metavar="DIR", help="a folder of task YAML files, as the "
                                                         "harness's --include_path")
    p.add_argument("--log-samples", action="store_true",
                   help="write every request and answer (samples_<task>_*.jsonl) with --out")
    p.add_argument("--out", metavar="DIR", help="where the harness's results files go")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render prompts with the run's chat template")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="with --apply-chat-template: each example a turn of the chat")
    p.add_argument("--system-instruction", help="a system message before each prompt")
    p.add_argument("--seed", type=int, default=0, help="for tasks that sample")
    p.add_argument("--stride", type=int, help="--text: tokens between windows of a long "
                                              "document (default: half the context)")
    p.add_argument("--json", action="store_true", help="--text: print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return exit_code(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    if args.devices:
        set_simulated_devices(args.devices)
    RunDir(args.run).read()  # a run that is not there is said before anything loads
    with plain_warnings():
        return _text(args) if args.text else _tasks(args)


def _text(args: argparse.Namespace) -> int:
    for file in args.text:
        if Path(file).is_dir():
            raise EvalError(f"--text {file} is a folder, not a text file: give the files in it "
                            f"(--text {Path(file) / '*.txt'})")
        if not Path(file).is_file():
            raise EvalError(f"--text {file}: no such file")
    evaluated = load(args.run, args.preset, dtype=args.dtype)
    files, total = score_texts(evaluated, args.text, stride=args.stride,
                               batch_size=args.batch_size, progress=not args.json)
    run = evaluated.run
    if args.json:
        print(json.dumps({"run": str(run.path), "step": run.step, "context": evaluated.context,
                          "stride": args.stride or max(1, evaluated.context // 2),
                          "files": [f.as_dict() for f in files], "total": total.as_dict()}))
        return 0
    width = max(len(f.name) for f in [*files, total])
    print(f"{'file':<{width}}  {'documents':>9}  {'tokens':>10}  {'bytes':>11}  "
          f"{'nats/token':>10}  {'bits/byte':>9}")
    for score in [*files, total] if len(files) > 1 else files:
        print(f"{score.name:<{width}}  {score.documents:>9,}  {score.tokens:>10,}  "
              f"{score.bytes:>11,}  {score.loss:>10.4f}  {score.bits_per_byte:>9.4f}")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    try:
        import lm_eval
        from lm_eval.loggers import EvaluationTracker
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        import minigpt.eval.harness  # noqa: F401 - registers the harness's `minigpt`
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "lm_eval":
            raise
        raise EvalError(f"--tasks needs {INSTALL}") from None
    if args.include_path and not Path(args.include_path).is_dir():
        raise EvalError(f"--include-path {args.include_path} is not a folder of task YAML files")
    if args.limit is not None and not args.limit > 0:
        raise EvalError(f"--limit must be a number of documents (1 or more) or a fraction of "
                        f"them (between 0 and 1), got {args.limit:g}")
    if args.include_path:
        _check_json_lines(Path(args.include_path))
    if args.log_samples and not args.out:
        raise EvalError("--log-samples writes its files into --out DIR: give one")
    if args.out:
        _check_writable(Path(args.out))
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # Tasks all found in --include-path need not wait for the harness to index its own 14,000
    # task files (10 s and more).
    manager = args.include_path and TaskManager(include_path=args.include_path,
                                                include_defaults=False)
    if not manager or not all(manager.match_tasks([n]) for n in names):
        manager = TaskManager(include_path=args.include_path)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown or not names:
        near = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
        hints = "; ".join(f"{n} (did you mean {', '.join(m)}?)" if m else n
                          for n, m in near.items())
        raise EvalError(f"unknown task {hints or '(none given)'}: `lm_eval ls tasks` lists the "
                        f"harness's; --include-path DIR adds a folder of your own")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    tracker = EvaluationTracker(output_path=args.out) if args.out else None
    # The run is the harness's `pretrained`, which names its output folder, as the hf model's.
    results = _harness_failures(lambda: lm_eval.simple_evaluate(
        model="minigpt", model_args={"pretrained": args.run, "preset": args.preset,
                                     "seed": args.seed},
        tasks=manager.match_tasks(names), num_fewshot=args.num_fewshot, limit=limit,
        batch_size=args.batch_size, log_samples=args.log_samples, task_manager=manager,
        evaluation_tracker=tracker, apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn or None,
        system_instruction=args.system_instruction))
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def _harness_failures(evaluate):
    """Run the harness, its failures to reach a task's data said in one line: the real tasks'
    data come from the Hugging Face Hub, which an offline machine cannot reach."""
    try:
        return evaluate()
    except OSError as error:
        # datasets raises the built-in ConnectionError; the Hub client and requests their own.
        hub = type(error).__module__.startswith(("requests", "huggingface_hub", "datasets",
                                                  "urllib3"))
        if not (hub or isinstance(error, ConnectionError)):
            raise
        detail = (str(error).splitlines() or [""])[0][:160]
        raise EvalError(f"cannot fetch a task's data ({type(error).__name__}: {detail}): the "
                        f"harness downloads its tasks' data from the Hugging Face Hub; offline, "
                        f"give tasks of your own with --include-path") from None


def _check_json_lines(folder: Path) -> None:
    """Every JSON-lines file of a task folder parses, line by line: the harness's reader says
    only "Expected object or value at position 37", naming neither the file nor the line."""
    for path in sorted(folder.rglob("*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise EvalError(f"{path} cannot be read as UTF-8 text ({error})") from None
        for number, line in enumerate(lines, 1):
            try:
                if line.strip():
                    json.loads(line)
            except ValueError as error:
                raise EvalError(f"{path}:{number} is not a JSON object per line ({error}): fix "
                                f"or remove that line of the task's data") from None


def _check_writable(out: Path) -> None:
    """--out can hold the results (the harness only warns when it cannot write them)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".minigpt-write-check-"):
            pass
    except OSError as error:
        raise EvalError(f"--out {out} cannot be written ({error.strerror or error}): choose "
                        f"a folder you can write") from None


if __name__ == "__main__":
    sys.exit(main())
