"""GRPO beside TRL's GRPOTrainer: the same checkpoint, reward, prompts and settings, their reward
curves and their steps per second, in one run.

    python bench/bench_post_training.py [--steps 30] [--lr 1e-2]

The checkpoint is a tiny random Llama (width 32, 2 layers; transformers' own class, saved with
`save_pretrained`) over a character tokenizer of 31 tokens, so that a random policy draws its
end token and the letters alike; the reward is the number of "a"s in a completion (`count_a`),
which a policy learns by drawing "a" more often. 4 prompts of 4 completions a step (16), at
most 8 tokens each, temperature 1, AdamW without weight decay, betas (0.9, 0.999), gradient
clipping at 1, a constant learning rate, `loss_type` dapo, beta 0, float32 on the CPU. TRL runs
first (`GRPOTrainer`, no vLLM); minigpt imports the checkpoint (`python -m minigpt.hub import`)
and trains with `--objective grpo` on one device (`--preset dp`, `--devices 1` as it runs
here). The reward rise is the mean of the last five steps' `reward` less that of the first
five; steps per second leave out each side's first step (compilation, warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REWARD = '''
def count_a(prompts, completions, **kwargs):
    return [float(c.count("a")) for c in completions]
'''
PROMPTS = ["a cat", "the sun", "hello there", "one day"]


def write_checkpoint(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz .!?")
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    inner.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def run_trl(directory: Path, work: Path, steps: int, lr: float) -> list[dict]:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    namespace: dict = {}
    exec(REWARD, namespace)
    args = GRPOConfig(output_dir=str(work / "trl"), bf16=False, use_cpu=True, report_to="none",
                      logging_steps=1, max_steps=steps, per_device_train_batch_size=16,
                      num_generations=4, max_completion_length=8, learning_rate=lr,
                      lr_scheduler_type="constant", weight_decay=0.0, adam_beta2=0.999,
                      max_grad_norm=1.0, save_strategy="no", seed=0,
                      gradient_checkpointing=False, disable_tqdm=True)
    trainer = GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32),
        reward_funcs=namespace["count_a"], args=args,
        processing_class=transformers.AutoTokenizer.from_pretrained(directory),
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS] * steps))
    times = []
    callback = type("Clock", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: times.append(time.perf_counter())})
    trainer.add_callback(callback())
    trainer.train()
    rows = [r for r in trainer.state.log_history if "reward" in r]
    for row, seconds in zip(rows[1:], [b - a for a, b in zip(times, times[1:])]):
        row["seconds"] = seconds
    return rows


def run_minigpt(directory: Path, work: Path, steps: int, lr: float) -> list[dict]:
    run, reward = work / "imported", work / "reward.py"
    reward.write_text(REWARD)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in PROMPTS))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "minigpt.hub", "import", str(directory), "--out",
                    str(run)], check=True, env=env, cwd=work)
    subprocess.run([sys.executable, "-m", "minigpt.train", "--init-from", str(run),
                    "--objective", "grpo", "--data", str(work / "prompts.jsonl"), "--reward",
                    f"{reward}:count_a", "--steps", str(steps), "--batch-size", "16",
                    "--seq-len", "32", "--lr", str(lr), "--preset", "dp", "--devices", "1",
                    "--out", str(work / "grpo"), "--log-every", "1", "--no-sample",
                    "--eval-every", str(steps), "--set", "train.num_generations=4",
                    "--set", "train.max_completion_length=8", "--set", "train.weight_decay=0",
                    "--set", "train.beta2=0.999", "--set", "train.warmup_steps=0",
                    "--set", "train.min_lr_ratio=1", "--set", f"data_root={work / 'data'}"],
                   check=True, env=env, cwd=work)
    rows = [json.loads(line) for line in (work / "grpo" / "metrics.jsonl").read_text()
            .splitlines()]
    rows = [r for r in rows if "reward" in r]
    for row in rows:
        if "tokens_per_s" in row:
            row["seconds"] = 16 * 32 / row["tokens_per_s"]
    return rows


def summary(rows: list[dict]) -> dict:
    rewards = [r["reward"] for r in rows]
    seconds = [r["seconds"] for r in rows if "seconds" in r]
    return {"first5": sum(rewards[:5]) / 5, "last5": sum(rewards[-5:]) / 5,
            "rise": sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5,
            "steps_per_s": len(seconds) / sum(seconds), "rewards": rewards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_checkpoint(work / "hf")
        theirs = summary(run_trl(work / "hf", work, args.steps, args.lr))
        ours = summary(run_minigpt(work / "hf", work, args.steps, args.lr))
    for name, s in (("TRL GRPOTrainer", theirs), ("minigpt --objective grpo", ours)):
        print(f"{name}: reward {s['first5']:.3f} (first 5 steps) -> {s['last5']:.3f} (last 5), "
              f"rise {s['rise']:+.3f}; {s['steps_per_s']:.2f} steps/s")
        print("  rewards: " + " ".join(f"{r:.2f}" for r in s["rewards"]))
    print(f"minigpt / TRL: rise {ours['rise'] / theirs['rise']:.2f}x, steps per second "
          f"{ours['steps_per_s'] / theirs['steps_per_s']:.2f}x")


if __name__ == "__main__":
    main()
