"""minigpt's GPT-2 and Qwen3 (Llama with query and key norms, tied embeddings) against
transformers' own, through import and export. Llama itself, tied and untied, is
test_families.py's (Llama 3 untied in the quick suite; tied Llama 3 and SmolLM2 with -m slow),
through transformers' own classes and tokenizers too.

Needs torch and transformers (`pip install -e ".[dev,hf]"`); skipped, saying why, without them.
Randomly initialised transformers models are saved with `save_pretrained`, imported, and must
give the same logits (1e-4 relative) and the same greedy continuation; an export loads back into
transformers with the same logits.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from minigpt import hub, sharding  # noqa: E402
from minigpt.generate import generate_tokens  # noqa: E402
from minigpt.hub import tokenizer_export  # noqa: E402
from minigpt.runs import load_run  # noqa: E402
from minigpt.tokenizer import load_tokenizer  # noqa: E402

# Logits are compared with transformers' float32 ones: float32 on an accelerator too.
pytestmark = pytest.mark.usefixtures("float32_compute")

IDS = np.random.default_rng(0).integers(0, 4096, size=(2, 20))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=8))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=True))


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _ours(run, ids):
    loaded = load_run(run)
    model, preset, mesh = loaded.model, loaded.preset, loaded.mesh
    with sharding.Layout(preset, mesh).active():
        logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ids))
    return np.asarray(logits)[..., :model.config.vocab_size], (model, preset, mesh)


def _save(model, directory, tokenizer=None):
    torch.manual_seed(0)
    for p in model.parameters():  # larger than the default init, so mistakes show
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        (directory / "tokenizer.json").write_text(json.dumps(
            tokenizer_export.tokenizer_json_from_encoding(load_tokenizer(tokenizer))))


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_imports_match_transformers_and_exports_load_back(tmp_path, kind, request):
    if kind == "gpt2":
        request.getfixturevalue("gpt2")  # the tiktoken GPT-2 files, or a skip saying why
        model, tokenizer = _gpt2(), None
    else:
        model, tokenizer = _qwen3(), "tinystories-4k"
    _save(model, tmp_path / "hf", tokenizer)
    assert hub.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    theirs = _theirs(model, IDS)
    ours, imported = _ours(tmp_path / "run", IDS)
    assert getattr(imported[0].config.options, "qk_norm", False) == (kind == "qwen3")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())

    # greedy decoding: the same 20 tokens
    prompt = [int(t) for t in IDS[0, :5]]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  min_new_tokens=20, pad_token_id=0)[0, 5:].tolist()
    model_here, preset, mesh = imported
    with sharding.Layout(preset, mesh).active():
        got = generate_tokens(model_here, [prompt], max_new_tokens=20, temperature=0.0,
                              rng=jax.random.key(0))[0]
    assert list(got) == expected

    # the export loads in transformers and computes what the original did
    assert hub.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    np.testing.assert_allclose(_theirs(again, IDS), theirs, rtol=1e-5, atol=1e-6)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    enc = load_tokenizer("gpt2" if kind == "gpt2" else "tinystories-4k")
    text = "Once upon a time, 3 cats sat  on a mat.\n\nThe end. Café 🙂"
    assert auto(text)["input_ids"] == enc.encode(text)
