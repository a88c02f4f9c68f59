"""GRPO: the loss and its gradient against TRL's `GRPOTrainer` (1.16), which defines them, on
the same tiny random checkpoint and the same completions (each `loss_type`, a KL term, ratios
that clip); a run end to end on the decoding engine (TRL's metric names, the completions
written beside the metrics, an exact resume across `num_iterations`); and every way a reward
function can go wrong refused in one line naming its file and function.

The TRL comparison needs the [hf] extra and trl; the rest runs without them.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import refused, small_vocab, untrained_run
from flax import nnx

import minigpt.optim.grpo as grpo
from minigpt.train import cli, train

pytestmark = pytest.mark.usefixtures("float32_compute")

REWARDS = '''
import math, time

def count_e(prompts, completions, **kwargs):
    return [c.count("e") / 10 for c in completions]

def answer_said(prompts, completions, answer, completion_ids, trainer_state, **kwargs):
    assert len(answer) == len(completions) == len(completion_ids) == len(prompts)
    return [1.0 if a in c else (None if a == "moon" else 0.0) for a, c in zip(answer, completions)]

def raises(prompts, completions, **kwargs):
    raise KeyError("score")

def exits(prompts, completions, **kwargs):
    raise SystemExit(0)

def hangs(prompts, completions, **kwargs):
    time.sleep(30)

def too_few(prompts, completions, **kwargs):
    return [0.0]

def not_a_number(prompts, completions, **kwargs):
    return ["1"] * len(completions)

def nan(prompts, completions, **kwargs):
    return [math.nan] * len(completions)
'''
ANIMALS = ["cat", "dog", "girl", "boy", "tree", "ball", "car", "sun", "moon", "bird", "fish",
           "frog"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An untrained zoo model's run, a prompts file with an answer column, reward functions."""
    root = tmp_path_factory.mktemp("grpo")
    run = untrained_run(root / "init", small_vocab("minigpt-tiny"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Once upon a time there was a {w}",
                                           "answer": w}) + "\n" for w in ANIMALS))
    (root / "rewards.py").write_text(REWARDS)
    return run, prompts, root / "rewards.py"


def _args(setup, out, *extra, reward="count_e", steps=2):
    run, prompts, rewards = setup
    return ["--init-from", str(run), "--objective", "grpo", "--data", str(prompts), "--reward",
            f"{rewards}:{reward}", "--steps", str(steps), "--batch-size", "8", "--out",
            str(out), "--seq-len", "48", "--log-every", "1", "--no-sample", "--preset", "dp",
            "--eval-every", "100", "--set", "train.num_generations=4",
            "--set", "train.max_completion_length=12", "--set", "train.warmup_steps=0",
            "--set", f"data_root={out.parent / 'data'}", *extra]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_grpo_run_logs_trls_metrics_writes_its_completions_and_resumes_exactly(setup,
                                                                               tmp_path):
    """Three steps at once, and two then one more after --resume, each batch of completions
    serving two steps (num_iterations 2: the resumed run goes on with the batch it kept): the
    same metrics. Rewards see the other columns (`answer`) and None leaves a completion
    unscored, as in TRL."""
    extra = ["--set", "train.num_iterations=2", "--set", "train.decay_steps=3",
             "--reward", f"{setup[2]}:answer_said"]
    assert cli.run(_args(setup, tmp_path / "whole", *extra, steps=3), train) == 0
    assert cli.run(_args(setup, tmp_path / "parts", *extra, steps=2), train) == 0
    assert cli.run(_args(setup, tmp_path / "parts", *extra, "--resume", steps=3), train) == 0
    whole, parts = _rows(tmp_path / "whole"), _rows(tmp_path / "parts")
    trained = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in whole
               if "loss" in r]
    assert trained == [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")}
                       for r in parts if "loss" in r]
    first = trained[0]
    for name in ("reward", "reward_std", "rewards/count_e/mean", "rewards/count_e/std",
                 "rewards/answer_said/mean", "completions/mean_length", "clip_ratio/low_mean",
                 "clip_ratio/region_mean", "entropy", "frac_reward_zero_std", "grad_norm"):
        assert math.isfinite(first[name]), name
    # steps 1 and 2 train on one batch of completions: the same rewards, a moved ratio
    assert first["reward"] == trained[1]["reward"] and trained[2]["reward"] != first["reward"]
    samples = [json.loads(line) for line in
               (tmp_path / "whole" / "completions.jsonl").read_text().splitlines()]
    # written when drawn: at steps 1 and 3 (step 2 trains on step 1's)
    assert {s["step"] for s in samples} == {1, 3} and len(samples) == 2 * 8
    assert samples[0]["prompt"].startswith("Once upon a time") and "completion" in samples[0]
    assert set(samples[0]["rewards"]) == {"count_e", "answer_said"}
    resumed = (tmp_path / "parts" / "completions.jsonl").read_text()
    assert resumed == (tmp_path / "whole" / "completions.jsonl").read_text()


BAD_REWARDS = {
    "no-file": ("nowhere.py:count_e", "nowhere.py does not exist"),
    "no-function": ("{rewards}:missing", "defines no function 'missing'"),
    "raises": ("{rewards}:raises", "raised KeyError: 'score'"),
    "exits": ("{rewards}:exits", "raised SystemExit: 0"),
    "wrong-count": ("{rewards}:too_few", "returned 1 rewards for 8 completions"),
    "a-string": ("{rewards}:not_a_number", "returned '1' for completion 0"),
    "nan": ("{rewards}:nan", "returned nan for completion 0"),
    "hangs": ("{rewards}:hangs", "ran past 0.5 s (train.reward_timeout)"),
}


@pytest.mark.parametrize("case", BAD_REWARDS)
def test_a_reward_that_goes_wrong_is_one_line_naming_it(case, setup, tmp_path, capsys):
    spec, message = BAD_REWARDS[case]
    spec = spec.format(rewards=setup[2])
    out = tmp_path / "out"
    args = [*_args(setup, out), "--set", "train.reward_timeout=0.5"]
    args[args.index("--reward") + 1] = spec
    capsys.readouterr()
    if case in ("no-file", "no-function"):  # refused before anything is written
        line = refused(capsys, cli.run(args, train), message)
        assert not out.exists()
    else:  # it stops at its first step (after the progress bar's start, the one error line)
        code, (stdout, stderr) = cli.run(args, train), capsys.readouterr()
        line = stderr.splitlines()[-1]
        assert code == 2 and line.startswith("error: ") and message in line, stderr
        assert "Traceback" not in stdout + stderr
        assert (out / "checkpoints" / "0").is_dir()  # the start is saved: nothing is lost
    assert spec.split(":")[0] in line


def test_the_batch_is_checked_against_the_groups_the_command_line_sets(setup, tmp_path):
    """--batch-size 4 with --set train.num_generations=4 (the default is 8): whole groups."""
    args = _args(setup, tmp_path / "out")
    args[args.index("--batch-size") + 1] = "4"
    _, train_cfg = cli.resolve_configs(cli.build_parser().parse_args(args))
    assert (train_cfg.batch_size, train_cfg.num_generations) == (4, 4)


def test_a_broken_reward_file_is_one_line(setup, tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import nothing_of_the_sort\n")
    args = _args(setup, tmp_path / "out")
    args[args.index("--reward") + 1] = f"{broken}:f"
    refused(capsys, cli.run(args, train),
            f"{broken} does not import: ModuleNotFoundError: No module named 'nothing_of_the_sort'")


def test_advantages_follow_trls_rules():
    """Within each group of 4: the mean taken out and, for "group", its standard deviation
    (Bessel's correction) divided out, 1e-4 added; an unscored completion (NaN) is left out of
    its group's figures and gets advantage 0; a group whose rewards agree has scale 0."""
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0, np.nan, 3.0, 2.0])
    advantages, zero = grpo.advantages(rewards, 4, "group")
    std = np.std([1.0, 0.0, 0.0, 1.0], ddof=1)
    np.testing.assert_allclose(advantages[:4], (rewards[:4] - 0.5) / (std + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(advantages[4:8], 0.0)
    assert advantages[9] == 0.0 and list(zero) == [False] * 4 + [True] * 4 + [False] * 4
    np.testing.assert_allclose(advantages[[8, 10, 11]],
                               (np.array([1.0, 3.0, 2.0]) - 2.0) / (1.0 + 1e-4), rtol=1e-6)
    unscaled, _ = grpo.advantages(rewards, 4, "none")
    np.testing.assert_allclose(unscaled[:4], rewards[:4] - 0.5)


# --- against TRL --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_pair(tmp_path_factory):
    """TRL's trainer on a tiny random SmolLM2-style checkpoint, and minigpt's import of it."""
    torch = pytest.importorskip("torch", reason="torch is the [hf] extra")
    pytest.importorskip("trl", reason="TRL (a test dependency) defines GRPO's numbers")
    datasets = pytest.importorskip("datasets", reason="TRL's trainers read datasets")
    import hf_families as hf
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from minigpt import hub
    from minigpt.runs import load_run

    root = tmp_path_factory.mktemp("trl-grpo")
    ck = hf.write_family("smollm2", root / "hf")
    assert hub.main(["import", str(ck.directory), "--out", str(root / "run")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(ck.directory, dtype=torch.float32)

    def make(loss_type, beta):
        args = GRPOConfig(output_dir=str(root / "trl"), bf16=False, use_cpu=True,
                          report_to="none", num_generations=4, max_completion_length=6,
                          per_device_train_batch_size=8, loss_type=loss_type, beta=beta,
                          epsilon=0.2, save_strategy="no", gradient_checkpointing=False)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(
            completions), args=args, processing_class=ck.tokenizer,
            train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 8))

    return make, model, load_run(root / "run", "fsdp"), torch


CASES = [pytest.param("dapo", 0.0, id="dapo"),
         pytest.param("grpo", 0.04, id="grpo-kl", marks=pytest.mark.slow),
         pytest.param("dr_grpo", 0.0, id="dr_grpo", marks=pytest.mark.slow)]


@pytest.mark.parametrize("loss_type, beta", CASES)
def test_the_loss_and_its_gradient_equal_trls(loss_type, beta, trl_pair):
    make, model, loaded, torch = trl_pair
    trainer = make(loss_type, beta)
    rng = np.random.default_rng(0)
    B, P, C = 8, 5, 6
    prompt = rng.integers(3, 500, (B, P))
    completion = rng.integers(3, 500, (B, C))
    lengths = np.array([6, 6, 3, 1, 6, 4, 2, 5])  # where each completion ends
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.float32)
    advantages = rng.normal(size=B).astype(np.float32)
    # earlier log-probabilities off by up to +-0.5, so some ratios leave the clip range
    with torch.no_grad():
        out = model(torch.tensor(np.concatenate([prompt, completion], 1))).logits[:, P - 1:-1]
        logps = out.log_softmax(-1).gather(-1, torch.tensor(completion)[..., None])[..., 0]
    old = logps.numpy() + rng.uniform(-0.5, 0.5, (B, C)).astype(np.float32)
    reference = logps.numpy() + rng.uniform(-0.3, 0.3, (B, C)).astype(np.float32)
    inputs = {"prompt_ids": torch.tensor(prompt), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.tensor(completion), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(advantages), "old_per_token_logps": torch.tensor(old),
              "ref_per_token_logps": torch.tensor(reference),
              "num_items_in_batch": torch.tensor(mask.sum())}
    model.zero_grad()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what training sets before a step
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                if p.grad is not None)).item()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ids = np.zeros((B, P + C + 1), np.int32)
    ids[:, :P + C] = np.concatenate([prompt, completion], 1)
    full = np.zeros((B, P + C + 1), np.float32)
    full[:, P:P + C] = mask
    wide = np.zeros((B, P + C), np.float32)
    wide[:, P - 1:P + C - 1] = old
    ref_wide = np.zeros((B, P + C), np.float32)
    ref_wide[:, P - 1:P + C - 1] = reference
    batch = {"ids": jnp.asarray(ids), "mask": jnp.asarray(full),
             "weights": jnp.asarray(grpo.token_weights(full, loss_type, C, 1)),
             "advantages": jnp.asarray(advantages), "old": jnp.asarray(wide),
             "reference": jnp.asarray(ref_wide)}
    with loaded.layout.active():
        (loss, metrics), grads = nnx.jit(nnx.value_and_grad(
            lambda m, b: grpo._grpo_loss(m, b, None, epsilon_low=0.2, epsilon_high=0.2,
                                         beta=beta, temperature=1.0), has_aux=True))(
            loaded.model, batch)
    norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    assert float(loss) == pytest.approx(theirs.item(), rel=1e-4, abs=1e-6)
    assert norm == pytest.approx(their_norm, rel=1e-4)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 *(("kl",) if beta else ())):
        assert float(metrics[name]) == pytest.approx(logged[name], rel=1e-4, abs=1e-6), name
    assert 0 < float(metrics["clip_ratio/region_mean"]) < 1  # the clip is exercised


@pytest.mark.parametrize("row, message", [
    ({"answer": "1"}, "prompts.jsonl, line 2 has no prompt"),
    ({"prompt": "after " * 60}, "prompts.jsonl, line 2: the prompt is"),
    ({"prompt": [{"role": "user"}]}, "prompts.jsonl, line 2: prompt must be messages"),
    ({"prompt": "a dog", "completions": "x"}, "prompts.jsonl, line 2: the column 'completions' is"),
], ids=["no-prompt", "too-long", "bad-messages", "reserved-column"])
def test_bad_prompts_are_refused_with_their_line(row, message, setup, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n" + json.dumps(row) + "\n")
    args = _args(setup, tmp_path / "out")
    args[args.index("--data") + 1] = str(prompts)
    capsys.readouterr()
    refused(capsys, cli.run(args, train), message)
    assert not (tmp_path / "out").exists()


def test_a_resume_between_iterations_refuses_a_batch_of_completions_drawn_later(setup,
                                                                                tmp_path,
                                                                                capsys):
    """With num_iterations 2, step 4 trains on step 3's completions; resumed from checkpoint
    3 after step 4 drew new ones (its checkpoint lost), the kept batch is not step 3's: one
    line, not a silent step on the wrong completions."""
    import shutil

    out = tmp_path / "run"
    extra = ["--set", "train.num_iterations=2", "--save-every", "3"]
    assert cli.run(_args(setup, out, *extra, steps=5), train) == 0
    shutil.rmtree(out / "checkpoints" / "5")
    capsys.readouterr()
    code = cli.run(_args(setup, out, *extra, "--resume", steps=5), train)
    assert code == 2 and "holds completions drawn after step 2" in capsys.readouterr().err
