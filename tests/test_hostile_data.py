"""Hostile and mistaken training data: text files that are not there, chat files nested without
end, folders of `.json` conversations, a reader that closes the pipe early, conversations that
leave nothing to train on, chats mixed with stories, and document ids (`segment_ids`) of the
wrong shape or type, fed to `python -m minigpt.data`, `python -m minigpt.train` and the model as
a user would. Each hostile case sits beside one that must work.

The rule: a refusal is exit status 2 with one `error:` line naming the file and line (or the
argument), no traceback, and nothing written (every file in the test's folder as it was); a
model given arrays it cannot read raises `InputError` (a `UserError`) naming them.
"""

import dataclasses
import json
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, refused, snapshot, write_synthetic_stories
from flax import nnx

from minigpt import data, sharding, train
from minigpt.errors import UserError
from minigpt.models import build_model, get_config
from minigpt.models.inputs import InputError
from minigpt.runs import RunDir

CHAT = [{"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Blue, said the owl."}]
OTHER = [{"role": "user", "content": "Who is Tom?"},
         {"role": "assistant", "content": "Tom is a cat."}]


def test_data_of_a_file_that_is_not_there_is_refused(tmp_path, capsys):
    before = snapshot(tmp_path)
    refused(capsys, data.main(["prepare", "--text", str(tmp_path / "missing.txt"), "--out",
                               str(tmp_path / "data")]), "no such file", unchanged=before)


# --- conversations ---------------------------------------------------------------------------

@pytest.fixture
def zoo_run(tmp_path):
    """A run directory of a zoo model (its config.json: enough to render and tokenize)."""
    RunDir(tmp_path / "zoo").path.mkdir()
    RunDir(tmp_path / "zoo").write(get_config("llama-cpu"), None)
    return tmp_path / "zoo"


def chats_file(path, conversations=(CHAT,) * 20):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def chat_run(tmp_path, *data_and_flags: str) -> list[str]:
    """The command line of a tiny Llama's chat run (TinyStories' vocabulary, ChatML) in
    tmp_path."""
    return ["--model", "llama-tiny", "--tokenizer", "tinystories-4k", "--data", *data_and_flags,
            "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "8", "--no-sample",
            "--set", f"train.data_root={tmp_path / 'data'}"]


@pytest.mark.parametrize("command", ["sft", "train"])
def test_a_chat_line_nested_without_end_is_one_line_naming_file_and_line(zoo_run, tmp_path,
                                                                         capsys, command):
    path = chats_file(tmp_path / "chats.jsonl", [CHAT])
    with path.open("a") as f:
        f.write("[" * 100_000 + "\n")  # was a RecursionError traceback
    before = snapshot(tmp_path)
    code = (data.main(["sft", "--run", str(zoo_run), "--data", str(path)]) if command == "sft"
            else train.main(chat_run(tmp_path, str(path), "--seq-len", "64")))
    refused(capsys, code, f"{path}, line 2: JSON nested too deeply", unchanged=before)


def test_a_folder_of_json_conversations_is_read(zoo_run, tmp_path, capsys):
    """`sft --data DIR` where DIR holds only .json files (one conversation, or a list of them):
    once exit 0 with nothing printed."""
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "one.json").write_text(json.dumps({"messages": CHAT}))
    (folder / "two.json").write_text(json.dumps([{"messages": CHAT}, {"messages": OTHER}]))
    assert data.main(["sft", "--run", str(zoo_run), "--data", str(folder), "--show", "3"]) == 0
    out = capsys.readouterr().out
    for where in ("one.json", "two.json, item 0", "two.json, item 1"):
        assert f"--- {folder / where}: " in out, out
    assert "[[Blue, said the owl." in out and "[[Tom is a cat." in out
    assert data.main(["sft", "--run", str(zoo_run), "--data", str(folder), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(sum(row["loss_mask"]) > 0 for row in rows)


def test_sft_json_into_a_reader_that_closes_early_ends_quietly(zoo_run, tmp_path):
    """`sft --json | head -1` once ended in a BrokenPipeError traceback. Four hundred
    conversations (130 KB) are more than a pipe holds, so the reader closes it mid-stream."""
    path = chats_file(tmp_path / "chats.jsonl", [CHAT] * 400)
    sft = shlex.join([sys.executable, "-m", "minigpt.data", "sft", "--run", str(zoo_run),
                      "--data", str(path), "--json"])
    command = f"{sft} | head -1; exit ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr  # the python process's exit status
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert len(done.stdout.splitlines()) == 1 and json.loads(done.stdout)["loss_mask"]


def test_chats_cut_to_no_reply_are_refused_before_training(tmp_path, capsys):
    """`data.truncate` with a window shorter than every question leaves no reply token: the
    run once trained on, at a loss (and eval loss) of 0.0. (A template that renders no reply:
    tests/test_hostile_templates.py.)"""
    path = chats_file(tmp_path / "chats.jsonl")
    before = snapshot(tmp_path)
    refused(capsys, train.main(chat_run(tmp_path, str(path), "--seq-len", "8",
                                        "--set", "data.truncate=true")),
            f"the conversations of {path} leave no reply token to train on", unchanged=before)


def test_conversations_and_text_in_one_run_are_refused(tmp_path, capsys):
    """The chats' raw JSON was once trained as if it were stories."""
    chats = chats_file(tmp_path / "chats.jsonl")
    stories = write_synthetic_stories(tmp_path / "stories.txt", copies=2)
    before = snapshot(tmp_path)
    refused(capsys, train.main(chat_run(tmp_path, str(chats), str(stories))),
            f"--data mixes conversations ({chats}) with text ({stories})", unchanged=before)


# --- document ids ----------------------------------------------------------------------------

CONFIG = dataclasses.replace(get_config("minigpt-tiny"), vocab_size=256, context_len=64,
                             embed_dim=32, num_layers=1, mlp_dim=32, dropout=0.0)


@pytest.mark.parametrize("shape, dtype", [((2, 63), np.int32), ((64,), np.int32),
                                          ((2, 64, 1), np.int32), ((2, 64), np.float32)])
def test_segment_ids_of_another_shape_or_type_are_refused_naming_them(shape, dtype):
    """They once failed inside as "mul got incompatible shapes" or "tuple index out of
    range". (The model's weights are shapes alone: the arrays are refused at its door.)"""
    model = nnx.eval_shape(lambda: build_model(CONFIG, rngs=nnx.Rngs(0)))
    with pytest.raises(InputError, match=r"segment_ids must be integers of the tokens' shape "
                                         r"\(2, 64\)") as refusal:
        model(jnp.zeros((2, 64), jnp.int32), segment_ids=jnp.ones(shape, dtype))
    assert isinstance(refusal.value, UserError) and "\n" not in str(refusal.value)
    assert f"{jnp.dtype(dtype)} {shape}" in str(refusal.value)


def test_a_batch_the_data_axis_does_not_divide_runs_under_dp():
    """Three rows on eight devices under dp (once JAX's IndivisibleError): the logits of the
    same weights on one device."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (3, 64)), jnp.int32)
    ids = jnp.asarray(np.where(np.arange(64) < 20, 1, 2)[None].repeat(3, 0), jnp.int32)
    layout = sharding.Layout.make("dp")
    sharded = sharding.create_sharded(lambda: build_model(CONFIG, rngs=nnx.Rngs(0)), layout)
    with layout.active():
        logits = sharding.jit(lambda m, x, s: m(x, segment_ids=s))(sharded, tokens, ids)
    graph, state = nnx.split(sharded)
    alone = nnx.merge(graph, jax.device_put(state, jax.devices()[0]))
    assert not any(len(leaf.devices()) > 1 for leaf in jax.tree.leaves(nnx.state(alone)))
    expected = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(alone, tokens, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)
