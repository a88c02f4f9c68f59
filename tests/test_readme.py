"""The README's quickstart, run as written: every `python -m` line of its first code block, in a
fresh directory, in order, then its Python example, so the README cannot drift from the code.

Only sizes change (`SIZES`: a shorter budget, fewer steps and tokens); each substitution must
still match the README, so a quickstart edited without this test failing is impossible. The
TinyStories download is stood in for by small files a local server hands out at the pinned
revision, prepared once before the commands run, as a first run would prepare them.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

from minigpt.data import download, prepare_tinystories

REPO = Path(__file__).resolve().parent.parent

# README text -> what the test runs instead: sizes only.
SIZES = {
    "--time-budget 3m": "--time-budget 25s",
    "python -m minigpt.train --preset fsdp": "python -m minigpt.train --preset fsdp --steps 2 "
                                             "--batch-size 8 --seq-len 32 --set eval_batches=1",
    "--steps 300 --out runs/demo": "--steps 4 --batch-size 8 --seq-len 32 "
                                   "--set eval_batches=1 --out runs/demo",
    "--resume --steps 400": "--resume --steps 8",
    "--max-new-tokens 200": "--max-new-tokens 20",
    "steps=300": "steps=3",
    "batch_size=16, seq_len=128": "batch_size=8, seq_len=32, eval_batches=1",
    "max_new_tokens=100": "max_new_tokens=10",
}


def quickstart() -> tuple[list[str], str]:
    """The quickstart's command lines and its Python example, from the README."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    bash = section.split("```bash", 1)[1].split("```", 1)[0]
    python = section.split("```python", 1)[1].split("```", 1)[0]
    return [line for line in bash.splitlines() if line.startswith("python -m ")], python


def sized(text: str, used: set[str]) -> str:
    for written, run in SIZES.items():
        if written in text:
            text = text.replace(written, run)
            used.add(written)
    return text


@pytest.mark.slow  # seven fresh processes, each compiling its model: a few minutes
@pytest.mark.usefixtures("optimised")  # the commands as users run them
def test_the_quickstart_runs_as_written(tmp_path, server, monkeypatch, stories_file):
    # TinyStories at the pinned revision, from a local server, prepared for both tokenizers
    # the quickstart's models use, where `data/` puts it.
    text = stories_file.read_bytes()
    server.files = {"TinyStories-train.txt": text,
                    "TinyStories-valid.txt": text[:len(text) // 5].rsplit(b"<|endoftext|>", 1)[0]
                    + b"<|endoftext|>\n"}
    monkeypatch.setattr(download, "KNOWN_FILES", {})
    for tokenizer in ("gpt2", "tinystories-4k"):
        prepare_tinystories(tmp_path / "data", "v1", base_url=server.url, tokenizer=tokenizer,
                            progress=False)
    env = {**child_env(), "MINIGPT_HF_BASE": server.url}  # devices as the README says
    commands, python = quickstart()
    assert len(commands) >= 6, commands
    used: set[str] = set()
    outputs = []
    for command in commands:
        argv = sized(command, used)
        done = subprocess.run(argv, shell=True, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
    # The resume line goes on with the 8 simulated devices the run was trained on, to step 8.
    resumed = outputs[[i for i, c in enumerate(commands) if "--resume" in c][0]]
    assert "on 8 simulated CPU devices, as it was trained" in resumed
    assert "resumed from" in resumed
    records = [json.loads(line) for line in
               (tmp_path / "runs" / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert "Once upon a time" in outputs[1]  # the stories of the recipe run
    script = sized(python, used) + "\nprint('STORY:', stories[0])\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STORY: Once upon a time" in done.stdout
    assert used == set(SIZES), f"the README no longer says {sorted(set(SIZES) - used)}"
