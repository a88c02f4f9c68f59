"""Hostile and mistaken LoRA adapters, fed to `python -m minigpt.hub import ADAPTER --base RUN`
as a user would: a PEFT folder downloaded from someone else, its adapter_config.json checked
field by field, its safetensors header read before anything is allocated. Each hostile case sits
beside one that must work.

The rule: a refusal is exit status 2 with one `error:` line naming adapter_config.json and the
field, no traceback, and nothing written (every file in the test's folder and in the base run as
it was). A run's own recorded adapters (its config.json) are tests/test_hostile_run_folders.py's.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import refused, snapshot
from hf_checkpoints import llama_checkpoint
from tiny_llama import D, L, V

from minigpt import hub
from minigpt.hub import adapter_config, peft
from minigpt.hub.configs import model_config
from minigpt.hub.safetensors import encode


def adapter(directory: Path, **config) -> Path:
    """A PEFT adapter folder for `wordpiece_run`: rank-4 adapters on q_proj and v_proj,
    described by an adapter_config.json with `config`'s changes ("INF" becomes the JSON number
    1e999)."""
    r = 4
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(L):
        for name, out in (("q_proj", 64), ("v_proj", 16)):
            module = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{module}.lora_A.weight"] = rng.standard_normal((r, D), np.float32)
            tensors[f"{module}.lora_B.weight"] = rng.standard_normal((out, r), np.float32)
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(b"".join(encode(tensors)))
    values = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "use_dora": False,
              "base_model_name_or_path": None, **config}
    text = json.dumps({k: v for k, v in values.items() if v is not ...})
    (directory / "adapter_config.json").write_text(text.replace('"INF"', "1e999"))
    return directory


@pytest.mark.parametrize("config, message", [
    ({"lora_alpha": "INF"}, "lora_alpha must be a finite number, got inf"),
    ({"lora_alpha": "16"}, "lora_alpha must be a finite number, got '16'"),
    ({"lora_alpha": 1e308}, "scales each adapter's output by 2.5e+307, over the 10000"),
    ({"r": 0}, "needs r > 0 (got 0)"),
    ({"r": "4"}, "r must be an integer, got '4'"),
    ({"lora_dropout": 1.5}, "lora_dropout in [0, 1)"),
    ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
    ({"layer_replication": [[0, 1]]}, "layer_replication"),
    ({"trainable_token_indices": [5]}, "trained token embeddings"),
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "a bias on lora_B"),
    ({"rank_pattern": {"q_proj": 8}}, "a rank per module"),
    ({"peft_type": "IA3"}, 'peft_type "IA3"'),
    ({"task_type": "SEQ_CLS"}, 'task_type "SEQ_CLS"'),
    ({"init_lora_weights": "pissa"}, "changes the base weights"),
    ({"use_future_trick": True}, "use_future_trick = true, a field minigpt does not know"),
    ({"target_modules": ".*q_proj"}, "not a regular expression"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "adapts embed_tokens, which"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}, "made for 'meta-llama/Llama-3"),
    ({"base_model_name_or_path": 7}, "base_model_name_or_path must be str, got 7"),
])
def test_an_adapter_config_is_checked_field_by_field(wordpiece_run, tmp_path, capsys, config,
                                                     message):
    folder = adapter(tmp_path / "adapter", **config)
    before = snapshot(tmp_path, wordpiece_run)
    refused(capsys, hub.main(["import", str(folder), "--base", str(wordpiece_run), "--out",
                              str(tmp_path / "new")]),
            message, "adapter_config.json", unchanged=before)
    assert not (tmp_path / "new").exists()


def test_a_rank_of_a_billion_is_refused_from_the_header_before_anything_is_allocated(
        wordpiece_run, tmp_path, capsys):
    folder = adapter(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 10**9}))
    before = snapshot(tmp_path, wordpiece_run)
    refused(capsys, hub.main(["import", str(folder), "--base", str(wordpiece_run), "--out",
                              str(tmp_path / "new")]),
            "needs float [1000000000, 64]", "its r is wrong", unchanged=before)


def test_a_plain_adapter_imports_and_says_how_its_base_was_matched(wordpiece_run, tmp_path,
                                                                   capsys):
    """Valid: unknown fields left unset, rsLoRA, and a base named by the checkpoint's folder
    name from elsewhere (matched by name and shapes, and said so)."""
    folder = adapter(tmp_path / "adapter", use_rslora=True, use_future_trick=None,
                     base_model_name_or_path="someone/hf")
    assert hub.main(["import", str(folder), "--base", str(wordpiece_run), "--out",
                     str(tmp_path / "new")]) == 0
    assert "matched by folder name and tensor shapes only" in capsys.readouterr().err
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert saved["adapters"]["rank"] == 4 and saved["adapters"]["alpha"] == pytest.approx(16.0)
    assert saved["imported"]["base_matched_by"] == "folder name and shapes"


@pytest.mark.parametrize("targets, ours", [
    ("all-linear", ("down", "gate", "key", "out", "query", "up", "value")),  # not the head
    (["q_proj", "lm_head"], ("output", "query")),
    (["self_attn.q_proj", "model.layers.0.mlp.up_proj"], ("query", "up")),  # 1 layer: all
])
def test_target_modules_name_projections_as_peft_matches_them(tmp_path, targets, ours):
    cfg = model_config(llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)[0])
    adapters, config = peft.read_config(adapter(tmp_path / "a", target_modules=targets), cfg)
    assert adapters.targets == ours and isinstance(config, adapter_config.AdapterConfig)
