"""Mixture-of-experts checkpoints in and out, against transformers itself: random
`MixtralForCausalLM` and `Qwen3MoeForCausalLM` saved with `save_pretrained` import under `dp` and
`ep` with transformers' logits (1e-4) and 20 greedy tokens, each device reading only its own
experts' bytes; the export loads back with `from_pretrained` with the same logits.

Needs the [hf] extra (torch, transformers); skipped, saying why, without it.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from minigpt import hub  # noqa: E402
from minigpt.generate import generate_tokens  # noqa: E402
from minigpt.hub import convert  # noqa: E402
from minigpt.hub.tokenizer_export import tokenizer_json_from_encoding  # noqa: E402
from minigpt.runs import load_run  # noqa: E402
from minigpt.tokenizer import load_tokenizer  # noqa: E402

# Logits are compared with transformers' float32 ones: float32 on an accelerator too.
pytestmark = pytest.mark.usefixtures("float32_compute")

IDS = np.random.default_rng(0).integers(0, 4096, size=(2, 20))
SHAPE = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
             num_experts_per_tok=2, tie_word_embeddings=False)


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SHAPE, intermediate_size=48, num_local_experts=8, rope_theta=5000.0,
        sliding_window=None))


def _qwen3_moe(norm: bool):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=48, num_experts=8, head_dim=16,
        norm_topk_prob=norm, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))


def _save(model, directory):
    torch.manual_seed(0)
    for p in model.parameters():  # larger than the default init, so mistakes show
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer.json").write_text(json.dumps(
        tokenizer_json_from_encoding(load_tokenizer("tinystories-4k"))))
    return model


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("kind, preset", [
    ("mixtral", "ep"), pytest.param("mixtral", "dp", marks=pytest.mark.slow),
    ("qwen3-moe-renormalised", "dp"),
    pytest.param("qwen3-moe", "ep", marks=pytest.mark.slow)])
def test_expert_checkpoints_import_exactly_and_export_back(tmp_path, kind, preset, monkeypatch):
    model = _save(_mixtral() if kind == "mixtral" else
                  _qwen3_moe(norm=kind.endswith("renormalised")), tmp_path / "hf")
    reads = []
    real = convert.Source._one
    monkeypatch.setattr(convert.Source, "_one", lambda self, tensor, ids, *a: (
        reads.append((tensor.name, ids)), real(self, tensor, ids, *a))[1])
    assert hub.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "run"),
                     "--preset", preset]) == 0
    expert_reads = [r for r in reads if "{e}" in r[0]]
    assert expert_reads and len(expert_reads) == len(set(expert_reads))  # each once: its device
    run = load_run(tmp_path / "run", preset)
    cfg = run.config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_dim) == (8, 2, 48)
    assert cfg.norm_topk_prob == (kind != "qwen3-moe")
    assert cfg.options.qk_norm == (kind != "mixtral")
    with run.layout.active():
        ours = np.asarray(nnx.jit(lambda m, t: m(t))(run.model, jnp.asarray(IDS)))[..., :4096]
        prompt = [int(t) for t in IDS[0, :5]]
        got = generate_tokens(run.model, [prompt], max_new_tokens=20, temperature=0.0,
                              rng=jax.random.key(0))[0]
    theirs = _theirs(model, IDS)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  min_new_tokens=20, pad_token_id=0)[0, 5:].tolist()
    assert got == expected
    assert hub.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(again).__name__ == type(model).__name__
    np.testing.assert_allclose(_theirs(again, IDS), theirs, rtol=1e-5, atol=1e-5)
