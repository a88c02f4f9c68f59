"""The steps of the accelerator check (`bench/accelerator_check.py`), each a function run in a
process of its own: it gets the check's settings and returns what it measured, a JSON-ready dict.

Every step runs the same code on a CPU (`--dry-run`: tiny shapes, a tiny time budget) and on an
accelerator; only the sizes in `Sizes` differ. Steps that time things pay their compilation
before they start the clock.
The speed steps (the PyTorch peer, the trainer's runs, gpt2-small's decoding) and the
comparison of them are `bench/accelerator_speed.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import accelerator_speed as speed

REPO = Path(__file__).resolve().parent.parent
# modded-nanogpt's speedrun record, as its authors report it: GPT-2 small (124M) trained at about
# 675k tokens/s per H100, with FP8 matmuls, Muon, and every other trick in the book. A reference
# point for our tokens/s, not a like-for-like comparison.
MODDED_NANOGPT_TOKENS_PER_S = 675_000
# How far the accelerator's losses may stray from the CPU's over the parity steps, relative:
# about bfloat16's precision (2**-7), which float32 with TF32 matmuls also meets.
PARITY_TOLERANCE = 1e-2
# What a recipe's step alone takes from its [train] table: the optimizer and its settings.
RECIPE_OPTIMIZER_FIELDS = ("optimizer", "lr", "muon_lr", "muon_momentum", "weight_decay",
                           "beta1", "beta2", "grad_clip")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each step runs: the accelerator's real shapes, or the dry run's tiny ones."""

    mfu_runs: tuple[tuple[str, int, int, dict], ...]  # (model, batch, sequence, changes)
    # Which (dtype, attention) pairs each model runs with; None: every dtype with every one.
    mfu_pairs: tuple[tuple[str, str], ...] | None
    timed_steps: int
    matmul_size: int
    stories_args: tuple[str, ...]
    generate_new: int
    parity_run: tuple[str, int, int, dict]  # (model, batch, sequence, changes)
    parity_steps: int = 20
    generate_batches: tuple[int, ...] = (1, 16)


TINY = dict(num_layers=1, embed_dim=64, num_heads=4, num_kv_heads=2, mlp_dim=128)
DEVICE = Sizes(
    mfu_runs=(("gpt2-small", 16, 1024, {}), ("llama-15m", 32, 256, {}), ("minigpt", 32, 256, {})),
    mfu_pairs=None, timed_steps=10, matmul_size=8192,
    stories_args=("--time-budget", "45s", "--no-sample"), generate_new=256,
    parity_run=("llama-15m", 4, 128, {}))
DRY = Sizes(
    mfu_runs=(("llama-cpu", 2, 64, TINY),), timed_steps=2, matmul_size=256,
    mfu_pairs=(("bfloat16", "fused"), ("float32", "reference")),  # each dtype, each attention
    stories_args=("--time-budget", "12s", "--no-sample", "--batch-size", "4", "--seq-len", "64",
                  *[f"--set=model.{k}={v}" for k, v in TINY.items()],
                  "--set=train.eval_batches=1", "--set=train.eval_every=1000"),
    generate_new=8, generate_batches=(1, 4), parity_run=("llama-cpu", 2, 32, TINY),
    parity_steps=3)


def environment(settings: dict) -> dict:
    """The software and the devices: versions, backend, device kind, what `auto` picks."""
    import flax
    import jax

    import minigpt.models.kernels as kernels
    from minigpt.models import flops

    device = jax.devices()[0]
    sheet = next((peaks for name, peaks in flops.KNOWN_PEAKS.items()
                  if device.device_kind.startswith(name)), None)
    found = {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "flax": flax.__version__,
             "python": sys.version.split()[0], "backend": jax.default_backend(),
             "devices": [d.device_kind for d in jax.devices()], "data_sheet_peaks": sheet,
             "auto_kernels": kernels.kernel_set("auto"),
             "auto_dtype": kernels.compute_dtype("auto")}
    try:
        from jax._src.lib import cuda_versions
        found["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except (ImportError, AttributeError):
        found["cudnn"] = None
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False) \
        if _which("nvidia-smi") else None
    found["nvidia_smi"] = smi.stdout.strip() if smi else None
    return found


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def mfu(settings: dict) -> dict:
    """Train-step MFU for each model x dtype x attention implementation, against the data
    sheet's dense peak and against a matmul measured here, with tokens/s beside modded-nanogpt's
    reference; runs in priority order until the step's time budget is spent."""
    import jax

    import minigpt.models.kernels as kernels
    from minigpt.models import execution, flops

    sizes = DRY if settings["dry_run"] else DEVICE
    fused = "splash" if jax.default_backend() == "tpu" else "cudnn"
    deadline = time.monotonic() + settings["budget_s"] * 0.85
    matmul = {d: flops.measure_matmul_peak(d, size=sizes.matmul_size) for d in
              ("bfloat16", "float32")}
    kind = jax.devices()[0].device_kind
    sheet = next((p for n, p in flops.KNOWN_PEAKS.items() if kind.startswith(n)), None)
    pairs = sizes.mfu_pairs or [(d, a) for d in ("bfloat16", "float32")
                                for a in ("fused", "reference")]
    # bfloat16 first (the headline), float32 with XLA's attention before float32 with the
    # fused kernel (cuDNN refuses float32: that run shows the fallback, at XLA's speed)
    plan = sorted([(m, b, t, ch, dtype, attend) for m, b, t, ch in sizes.mfu_runs
                   for dtype, attend in pairs],
                  key=lambda run: (run[4] != "bfloat16", run[4] == "float32" and run[5] == "fused"))
    plan = [(*run[:5], fused if run[5] == "fused" else run[5], None) for run in plan]
    # First the steps the speed comparison sets beside the trainer, named
    # (bench.accelerator_speed.STEP_RUNS), in the dtype and with the kernels `auto` picks here,
    # as the trainer runs them (bfloat16 and the fused attention on an accelerator).
    auto = (execution.compute_dtype("auto"), execution.kernel_set("auto"))
    named = [(m, b, t, ch, *auto, name)
             for name, m, b, t, ch in speed.STEP_RUNS["dry" if settings["dry_run"] else "device"]]
    plan = named + [run for run in plan if run[:6] not in [n[:6] for n in named]]
    runs, skipped, last = [], [], 0.0
    for model, batch, seq, changes, dtype, impl, name in plan:
        label = f"{model} {batch}x{seq} {dtype} {impl}" + (f" ({name})" if name else "")
        if time.monotonic() + last > deadline:
            skipped.append(label)
            continue
        began = time.monotonic()
        kernels.FALLBACKS.clear()  # each run says its own fallbacks
        try:
            run = _time_train_step(model, batch, seq, changes, dtype, impl, sizes.timed_steps)
        except Exception as error:  # noqa: BLE001 - recorded, and the next one runs
            runs.append({"label": label, "name": name,
                         "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        last = time.monotonic() - began
        achieved = run["flops_per_step"] / run["step_s"]
        run.update(label=label, name=name, fallbacks=list(kernels.FALLBACKS),
                   achieved_tflops=achieved / 1e12,
                   mfu_data_sheet=achieved / sheet[dtype] if sheet else None,
                   mfu_matmul=achieved / matmul[dtype],
                   vs_modded_nanogpt=run["tokens_per_s"] / MODDED_NANOGPT_TOKENS_PER_S)
        runs.append(run)
    return {"matmul_tflops": {d: v / 1e12 for d, v in matmul.items()},
            "data_sheet_tflops": {d: v / 1e12 for d, v in sheet.items()} if sheet else None,
            "modded_nanogpt_tokens_per_s": MODDED_NANOGPT_TOKENS_PER_S,
            "modded_nanogpt_note": "theirs: GPT-2 small per H100 with FP8 matmuls and every "
                                   "trick of the speedrun record; a reference point only",
            "runs": runs, "skipped_for_time": skipped}


def _time_train_step(model: str, batch: int, seq: int, changes: dict, dtype: str, impl: str,
                     repeats: int) -> dict:
    """One compiled train step of a zoo model on one device, timed after a warm-up call."""
    from bench.report import timed
    from minigpt.models.flops import flops_per_token

    cfg, place, step, _ = _train_step(model, batch, seq, changes, dtype, impl)
    data = place(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32))
    began = time.perf_counter()
    times, reported = timed(lambda: step(data), repeats)
    # The warm-up call compiled the step and ran it once: what it took beyond a step.
    compile_s = time.perf_counter() - began - sum(times) - statistics.median(times)
    step_s = statistics.median(times)
    return {"model": model, "batch": batch, "seq": seq, "dtype": dtype, "kernels": impl,
            "compile_s": compile_s, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
            "flops_per_step": flops_per_token(cfg, seq) * batch * seq,
            "loss": float(reported["loss"])}


def _train_step(model: str, batch: int, seq: int, changes: dict, dtype: str, impl: str):
    """A zoo model and its optimizer on one device (preset dp), born from seed 0; returns its
    config, `place(tokens)`, which puts a [batch, seq + 1] array of token ids on the device as
    a batch, `step(batch)`, which runs one train step on it and returns what the step reports,
    and the model it trains. `model` "recipe:NAME" is a recipe's model with its fields and its
    optimizer settings (`RECIPE_OPTIMIZER_FIELDS`)."""
    import jax
    from flax import nnx

    from minigpt import sharding
    from minigpt.config import TrainConfig
    from minigpt.models import build_model, get_config, replaced
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    optimizer_fields = {}
    if model.startswith("recipe:"):
        from minigpt.runs.overrides import load_recipe

        recipe = load_recipe(model.removeprefix("recipe:"))
        model, changes = recipe.model, {**recipe.model_fields, **changes}
        optimizer_fields = {k: v for k, v in recipe.train_fields.items()
                            if k in RECIPE_OPTIMIZER_FIELDS}
    cfg = replaced(get_config(model), context_len=max(seq, 1), dtype=dtype, kernels=impl,
                   **changes)
    # A short schedule, so that the parity steps' losses move (the rate is the peak by step 2)
    train_cfg = TrainConfig(batch_size=batch, preset="dp", steps=20, warmup_steps=2,
                            **optimizer_fields)
    layout = sharding.Layout.make("dp")

    def build():
        built = build_model(cfg, rngs=nnx.Rngs(0))
        return built, nnx.Optimizer(built, make_optimizer(train_cfg), wrt=nnx.Param)

    model_state, optimizer = sharding.create_sharded(build, layout)
    rates, rng = lr_schedule.lr_schedule(train_cfg), jax.random.key(0)

    def place(tokens):
        with layout.active():
            return layout.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})

    def step(data):
        with layout.active():
            return steps.train_step(model_state, optimizer, data, rng, rates)

    return cfg, place, step, model_state


def parity(settings: dict) -> dict:
    """The same train steps (same initial weights, same batches) on the accelerator, in
    float32 and in `auto`'s dtype with its kernels, and on this machine's CPU in float32 with
    the reference kernels: the losses step by step and their largest relative difference from
    the CPU's. On a CPU (the dry run) both sides are the CPU: the path is what is checked."""
    import jax

    sizes = DRY if settings["dry_run"] else DEVICE
    model, batch, seq, changes = sizes.parity_run
    found = {"model": model, "batch": batch, "seq": seq, "steps": sizes.parity_steps,
             "tolerance": PARITY_TOLERANCE, "backend": jax.default_backend(), "losses": {}}
    for label, dtype, impl in (("float32", "float32", "reference"), ("auto", "auto", "auto")):
        found["losses"][label] = _losses(model, batch, seq, changes, dtype, impl,
                                         sizes.parity_steps)
    call = (f"import json; from bench.accelerator_steps import _losses; "
            f"print(json.dumps(_losses({model!r}, {batch}, {seq}, {changes!r}, 'float32', "
            f"'reference', {sizes.parity_steps})))")
    done = subprocess.run([sys.executable, "-c", call], cwd=REPO, capture_output=True, text=True,
                          check=True, env={**settings["env"], "JAX_PLATFORMS": "cpu"})
    cpu = found["losses"]["cpu float32"] = json.loads(done.stdout.strip().splitlines()[-1])
    found["max_relative_difference"] = {
        label: max(abs(a - b) / abs(b) for a, b in zip(losses, cpu, strict=True))
        for label, losses in found["losses"].items() if label != "cpu float32"}
    found["within_tolerance"] = {label: gap <= PARITY_TOLERANCE
                                 for label, gap in found["max_relative_difference"].items()}
    return found


def _losses(model: str, batch: int, seq: int, changes: dict, dtype: str, impl: str,
            count: int) -> list[float]:
    """The loss of each of `count` train steps on batches drawn from seed 0."""
    import minigpt.models.kernels as kernels

    if dtype == "auto":
        dtype = kernels.compute_dtype("auto")
    cfg, place, step, _ = _train_step(model, batch, seq, changes, dtype, impl)
    draw = np.random.default_rng(0)
    return [float(step(place(draw.integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)))[
        "loss"]) for _ in range(count)]


def stories(settings: dict) -> dict:
    """`--recipe stories-gpu` as a user runs it, for a short time budget: held-out loss and
    bits per byte, tokens/s (its story is told by the generation step, which compiles the
    decoding loop once for both)."""
    sizes = DRY if settings["dry_run"] else DEVICE
    out = Path(settings["out"]) / "stories"
    command = [sys.executable, "-m", "minigpt.train", "--recipe", "stories-gpu", "--out",
               str(out), "--data", *settings["data"], *sizes.stories_args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False,
                          env=settings["env"])
    (Path(settings["out"]) / "logs" / "stories-train.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"training exited {done.returncode}: {done.stderr.strip()[-800:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    held_out = [r for r in records if "eval_loss" in r]
    return {"command": " ".join(command[1:]), "steps": max(r["step"] for r in records),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "eval_loss": held_out[-1]["eval_loss"] if held_out else None,
            "eval_bits_per_byte": held_out[-1].get("eval_bits_per_byte") if held_out else None,
            "first_lines": [line for line in done.stdout.splitlines()
                            if line.startswith("preset ")][:1]}


def generation(settings: dict) -> dict:
    """KV-cache generation tokens/s at each batch size (every row "Once upon a time" and
    sampled to the full length), and the story of the first row at batch 1: the stories run's
    model where the stories step left one, else the recipe's untrained (the speed is the
    same)."""
    import jax
    from flax import nnx

    from minigpt.generate import generate_tokens
    from minigpt.models import build_model, get_config, replaced
    from minigpt.runs import load_run
    from minigpt.runs.overrides import load_recipe
    from minigpt.tokenizer import load_tokenizer

    sizes = DRY if settings["dry_run"] else DEVICE
    run_dir = Path(settings["out"]) / "stories"
    if (run_dir / "checkpoints").is_dir():
        run = load_run(run_dir)
        model, tokenizer, source = run.model, run.tokenizer, f"the stories run ({run_dir})"
    else:
        recipe = load_recipe("stories-gpu")
        cfg = replaced(get_config(recipe.model), **recipe.model_fields)
        if settings["dry_run"]:
            cfg = dataclasses.replace(cfg, **TINY)
        model, source = build_model(cfg, rngs=nnx.Rngs(0)), "stories-gpu, untrained"
        tokenizer = load_tokenizer(cfg.tokenizer)
    prompt = tokenizer.encode_prompt("Once upon a time")
    found = {"model": source, "new_tokens": sizes.generate_new, "tokens_per_s": {}}
    for batch in sizes.generate_batches:
        def call(prompts=[prompt] * batch):  # noqa: B006 - read, never changed
            return generate_tokens(model, prompts, max_new_tokens=sizes.generate_new,
                                   temperature=0.8, top_k=50, rng=jax.random.key(0))

        call()  # compiles
        began = time.perf_counter()
        rows = call()
        found["tokens_per_s"][str(batch)] = sum(map(len, rows)) / (time.perf_counter() - began)
        found.setdefault("story", "Once upon a time" + tokenizer.decode(rows[0]))
    found["greedy"] = speed.greedy_decoding(settings)  # gpt2-small's, at batch 1 and 16
    return found


def notebooks(settings: dict) -> dict:
    """Each notebook's first code cell as Colab runs it on a fresh runtime: in an empty folder,
    with minigpt not importable, so the cell clones the repository and installs it (`pip install
    -e`); offline, the clone comes from a snapshot of this checkout (git's url.insteadOf) and pip
    finds nothing but what is installed and the wheels folder. A fresh virtual environment
    borrows the installed packages, so the machine's own environment is left as it was."""
    import shutil

    work = Path(settings["out"]) / "colab"
    source = _snapshot(work / "source", settings["env"])
    names = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    found = {}
    for name in names[:1] if settings["dry_run"] else names:
        cell = next(c for c in json.loads((REPO / "notebooks" / name).read_text())["cells"]
                    if c["cell_type"] == "code")
        home = work / name.removesuffix(".ipynb")
        shutil.rmtree(home, ignore_errors=True)
        (home / "content").mkdir(parents=True)
        python = _fresh_python(home / "venv")
        url = re.search(r'REPO = "([^"]+)"', "".join(cell["source"])).group(1)
        env = {**settings["env"], "GIT_CONFIG_COUNT": "1",
               "GIT_CONFIG_KEY_0": f"url.file://{source}.insteadOf", "GIT_CONFIG_VALUE_0": url,
               # pip reads PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation (setuptools is
               # borrowed from this environment: there is no index to fetch it from)
               "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PYTHONPATH": ""}
        if settings.get("wheels"):
            env["PIP_FIND_LINKS"] = settings["wheels"]
        check = "\nimport minigpt; print('minigpt imported from', minigpt.__file__)\n"
        began = time.perf_counter()
        done = subprocess.run([str(python), "-c", "".join(cell["source"]) + check],
                              cwd=home / "content", env=env, capture_output=True, text=True,
                              check=False, timeout=settings["budget_s"])
        where = re.search(r"minigpt imported from (\S+)", done.stdout)
        found[name] = {"exit": done.returncode, "seconds": time.perf_counter() - began,
                       "imported_from": where.group(1) if where else None,
                       "output": (done.stdout + done.stderr)[-1500:]}
        if done.returncode or not where or str(home / "content") not in where.group(1):
            raise RuntimeError(f"{name}'s first cell failed: {found[name]['output'][-600:]}")
    return found


def _snapshot(path: Path, env: dict) -> Path:
    """A git repository holding this checkout's files as they are (what a clone would get)."""
    import shutil

    anywhere = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info",
                                      ".pytest_cache", ".ruff_cache")

    def ignore(folder, names):  # and the checkout's own runs and data, which git ignores
        top = {"runs", "data", "bench-stories"} if Path(folder) == REPO else set()
        return set(anywhere(folder, names)) | (top & set(names))

    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(REPO, path, ignore=ignore)
    quiet = {"cwd": path, "env": env, "check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q"], **quiet)
    subprocess.run(["git", "add", "-A"], **quiet)
    subprocess.run(["git", "-c", "user.name=check", "-c", "user.email=check@localhost", "commit",
                    "-q", "-m", "snapshot"], **quiet)
    return path


def _fresh_python(path: Path) -> Path:
    """A new virtual environment that sees this one's installed packages through a .pth line
    of plain paths (their own .pth files, such as an editable install of minigpt, stay unread,
    so minigpt is not importable there until the cell installs it); its python."""
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    borrowed = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "_borrowed.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    return python


STEPS = {"environment": environment, "mfu": mfu, "parity": parity, "peer": speed.peer,
         "trainer": speed.trainer, "stories": stories, "generation": generation,
         "notebooks": notebooks}


def run_step(name: str, settings: dict) -> None:
    """Run one step and write its result where the check collects it."""
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    result = STEPS[name](settings)
    Path(settings["out"], "steps", f"{name}.json").write_text(json.dumps(result, indent=1))
