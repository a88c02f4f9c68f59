"""DPO against TRL's `DPOTrainer` (1.16), which defines its numbers: the same tiny random
checkpoints (transformers' own classes and tokenizer converters, `hf_families`), the same pairs,
and the step-1 metrics, computed on the first batch before the first update, equal within
1e-4, in float32, for standard and conversational pairs, with and without a reference run,
under dp and fsdp on 8 simulated devices. Then what a user gets wrong is refused in one line
with its row, and a resumed run continues exactly.

Needs the [hf] extra and trl (a test dependency); skipped, saying why, without them.
"""

import json
import math

import jax
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
trl = pytest.importorskip("trl", reason="TRL (a test dependency) defines DPO's numbers")
datasets = pytest.importorskip("datasets", reason="TRL's trainers read datasets")

import hf_families as hf  # noqa: E402
from conftest import refused  # noqa: E402

from minigpt import hub  # noqa: E402
from minigpt.train import cli, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("float32_compute")

PAIRS = 8  # one batch; 8 simulated devices split it
STORY = "Once upon a time, there was a little cat named Tom."
STANDARD = [
    {"prompt": "Once upon a time, there was a ", "chosen": "little cat named Tom.",
     "rejected": "dog."},
    {"prompt": "Tom liked to", "chosen": " play in the sun.", "rejected": " cry."},
    {"prompt": "The sky was", "chosen": " blue and bright.", "rejected": " green"},
    {"prompt": "Lily said:", "chosen": " I like cats.<|endoftext|>", "rejected": " No"},
    {"prompt": "One day,", "chosen": " the sun came out.", "rejected": " it was sad."},
    {"prompt": "The little girl", "chosen": " smiled.", "rejected": " ran away from home."},
    {"prompt": "Ben had a", "chosen": " red ball.", "rejected": " big box"},
    {"prompt": STORY, "chosen": " He was happy.", "rejected": " He was not."},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": p["prompt"]}],
     "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
     "rejected": [{"role": "assistant", "content": p["rejected"].strip()}]}
    for p in STANDARD[:7]] + [
    {"prompt": [{"role": "system", "content": hf.CHAT_SYSTEM},
                {"role": "user", "content": hf.CHAT_MESSAGE}],
     "chosen": [{"role": "assistant", "content": STORY}],
     "rejected": [{"role": "assistant", "content": "No."}]}]
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`checkpoints(family)`: (policy, reference) folders of that family, the reference the
    policy's weights moved by noise (so rewards are not all 0 at step 1)."""
    root, written = tmp_path_factory.mktemp("dpo"), {}

    def get(family):
        if family not in written:
            policy = hf.write_family(family, root / family)
            moved = transformers.AutoModelForCausalLM.from_pretrained(policy.directory)
            with torch.no_grad():
                generator = torch.Generator().manual_seed(1)
                for p in moved.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=generator))
            moved.save_pretrained(root / f"{family}-ref")
            policy.tokenizer.save_pretrained(root / f"{family}-ref")
            written[family] = policy.directory, root / f"{family}-ref"
        return written[family]

    return get


def _trl_step_one(policy, pairs, out, reference=None) -> dict:
    """TRL's logged metrics of step 1 (float32, one batch of all the pairs, lr irrelevant)."""
    from trl import DPOConfig, DPOTrainer

    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref = None if reference is None else transformers.AutoModelForCausalLM.from_pretrained(
        reference, dtype=torch.float32)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(pairs), max_steps=1,
                     logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
                     save_strategy="no", disable_tqdm=True, gradient_checkpointing=False)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args,
                         train_dataset=datasets.Dataset.from_list(pairs),
                         processing_class=transformers.AutoTokenizer.from_pretrained(policy))
    trainer.train()
    return trainer.state.log_history[0]


def _import(directory, out):
    assert hub.main(["import", str(directory), "--out", str(out)]) == 0
    return out


def _ours(run, pairs, tmp_path, preset, reference=None, *extra) -> dict:
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / f"dpo-{preset}"
    args = ["--init-from", str(run), "--objective", "dpo", "--data", str(data), "--steps", "1",
            "--batch-size", str(len(pairs)), "--seq-len", "127", "--preset", preset, "--out",
            str(out), "--log-every", "1", "--no-sample", "--set", f"data_root={tmp_path / 'data'}",
            "--set", "model.dtype=float32", *extra]
    if reference is not None:
        args += ["--reference", str(reference)]
    assert cli.run(args, train) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["step"] == 1 and "loss" in r)


# The quick suite compares the formulas with a reference under fsdp; -m slow the rest.
CASES = [pytest.param("smollm2", STANDARD, "dp", False, id="standard-dp",
                      marks=pytest.mark.slow),
         pytest.param("smollm2", STANDARD, "fsdp", True, id="standard-reference-fsdp"),
         pytest.param("smollm2-instruct", CONVERSATIONAL, "fsdp", False,
                      id="conversational-fsdp", marks=pytest.mark.slow),
         pytest.param("smollm2-instruct", CONVERSATIONAL, "dp", True,
                      id="conversational-reference-dp", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family, pairs, preset, with_reference", CASES)
def test_step_one_metrics_equal_trl(family, pairs, preset, with_reference, checkpoints,
                                    tmp_path):
    policy, reference = checkpoints(family)
    run = _import(policy, tmp_path / "policy")
    ref_run = _import(reference, tmp_path / "reference") if with_reference else None
    ours = _ours(run, pairs, tmp_path, preset, ref_run)
    theirs = _trl_step_one(policy, pairs, tmp_path / "trl",
                           reference if with_reference else None)
    for key in COMPARED:
        assert math.isclose(ours[key], theirs[key], rel_tol=1e-4, abs_tol=1e-4), (
            key, ours[key], theirs[key])
    if not with_reference:  # the reference is the starting weights: no reward yet
        assert ours["loss"] == pytest.approx(math.log(2), abs=1e-6)
    else:
        assert abs(ours["rewards/margins"]) > 1e-3  # the formulas are exercised


@pytest.fixture(scope="module")
def policy_run(checkpoints, tmp_path_factory):
    return _import(checkpoints("smollm2")[0], tmp_path_factory.mktemp("policy") / "run")


def _pairs_file(path, pairs):
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


BAD_PAIRS = {
    "missing-field": ({"prompt": "Tom", "chosen": " ran."}, "prefs.jsonl, line 3 has no rejected"),
    "empty-reply": ({"prompt": "Tom", "chosen": "  ", "rejected": " ran."},
                    "prefs.jsonl, line 3: the chosen reply is empty"),
    "mixed-formats": ({"prompt": "Tom", "chosen": [{"role": "assistant", "content": "a"}],
                       "rejected": "b"},
                      "prefs.jsonl, line 3: prompt, chosen and rejected must all"),
    "prompt-too-long": ({"prompt": "Once upon a time " * 60, "chosen": " a", "rejected": " b"},
                        "prefs.jsonl, line 3: the prompt is"),
}


@pytest.mark.parametrize("case", BAD_PAIRS)
def test_bad_pairs_are_refused_with_their_line(case, policy_run, tmp_path, capsys):
    row, message = BAD_PAIRS[case]
    data = _pairs_file(tmp_path / "prefs.jsonl", [*STANDARD[:2], row, *STANDARD[2:]])
    out = tmp_path / "out"
    capsys.readouterr()
    refused(capsys, cli.run(["--init-from", str(policy_run), "--objective", "dpo", "--data",
                             str(data), "--steps", "1", "--batch-size", "8", "--seq-len", "127",
                             "--out", str(out), "--set", f"data_root={tmp_path / 'data'}"],
                            train), message)
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--preset", "dp_pp", "--seq-len", "126", "--batch-size", "16"],
     "choose a preset without them"),
    (["--reference", "nowhere"], "--reference nowhere is not a run directory"),
], ids=["pipeline", "no-reference-run"])
def test_what_dpo_cannot_train_is_refused_before_anything_is_written(flags, message, policy_run,
                                                                    tmp_path, capsys):
    data = _pairs_file(tmp_path / "prefs.jsonl", STANDARD * 2)
    out = tmp_path / "out"
    capsys.readouterr()
    refused(capsys, cli.run(["--init-from", str(policy_run), "--objective", "dpo", "--data",
                             str(data), "--steps", "1", "--batch-size", "8", "--seq-len", "127",
                             "--out", str(out), *flags], train), message)
    assert not out.exists()


@pytest.mark.slow
def test_a_resumed_dpo_run_continues_exactly_and_learns_its_pairs(policy_run, tmp_path):
    """Four steps at once, and two then two more after --resume (one schedule, decay_steps):
    the same metrics, the reference read again from the run rather than recomputed from the
    weights it has reached. And the pairs are learned: the held-out figures (here the training
    pairs, as fewer than ten hold none out) go from no preference to the chosen replies."""
    data = _pairs_file(tmp_path / "prefs.jsonl", STANDARD)

    def run(out, steps, *extra):
        assert cli.run(["--init-from", str(policy_run), "--objective", "dpo", "--data",
                        str(data), "--steps", str(steps), "--batch-size", "8", "--seq-len",
                        "127", "--out", str(out), "--lr", "3e-3", "--no-sample",
                        "--eval-every", "100", "--set", "train.warmup_steps=0",
                        "--set", "train.decay_steps=4",
                        "--set", f"data_root={tmp_path / 'data'}", *extra], train) == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "parts", 2)
    parts = run(tmp_path / "parts", 4, "--resume")
    trained = [{k: r[k] for k in COMPARED} for r in whole if "loss" in r]
    assert trained == [{k: r[k] for k in COMPARED} for r in parts if "loss" in r]
    assert [r["step"] for r in whole if "loss" in r] == [1, 2, 3, 4]
    assert trained[0]["rewards/accuracies"] == 0.0  # the reference is the start
    held_out = [r for r in whole if "eval_rewards/accuracies" in r][-1]
    assert held_out["eval_rewards/accuracies"] >= 0.75 and held_out["eval_loss"] < math.log(2)


@pytest.mark.slow
def test_dpo_with_lora_trains_the_adapters_against_the_base_and_exports(policy_run, tmp_path):
    """With LoRA the reference is the base model (the adapters start at zero), so step 1 is
    the run without adapters' step 1; later steps move the adapters alone, and the result
    exports (merged) as a checkpoint transformers loads."""
    import numpy as np

    from minigpt.runs import load_run

    data = _pairs_file(tmp_path / "prefs.jsonl", STANDARD)
    out = tmp_path / "lora"
    assert cli.run(["--init-from", str(policy_run), "--objective", "dpo", "--data", str(data),
                    "--steps", "3", "--batch-size", "8", "--seq-len", "127", "--out", str(out),
                    "--lr", "1e-2", "--no-sample", "--set", "train.lora_rank=4",
                    "--set", "model.dtype=float32", "--set", "train.warmup_steps=0",
                    "--set", f"data_root={tmp_path / 'data'}"], train) == 0
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["logps/chosen"] == pytest.approx(-46.492927, abs=1e-4)  # TRL's, above
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["loss"] < math.log(2)
    base = load_run(policy_run, "dp")
    tuned = load_run(out, "dp", merge_adapters=True)
    moved = [not np.allclose(a, b) for a, b in zip(
        jax.tree.leaves(nnx.state(base.model, nnx.Param)),
        jax.tree.leaves(nnx.state(tuned.model, nnx.Param)))]
    assert any(moved)
    exported = tmp_path / "exported"
    assert hub.main(["export", "--run", str(out), "--out", str(exported)]) == 0
    transformers.AutoModelForCausalLM.from_pretrained(exported)
