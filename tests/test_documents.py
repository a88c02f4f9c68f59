"""Documents kept apart in packed windows (`minigpt.data.documents`, `minigpt.models.masks`):
the ids, positions and loss mask a window's tokens give, and a model that, told where the
documents are, gives each document the logits (and, in the slow set under the presets that
split attention in every way, the loss and gradients) it would give alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import zoo_config
from flax import nnx

from minigpt import sharding
from minigpt.data.documents import text_targets, window_documents
from minigpt.models import build_model
from minigpt.models.inputs import loss_batch

EOT, BOS = 9, 8


def test_a_window_of_gpt2_style_stories_starts_each_at_its_end_token():
    # ... a b | EOT c d EOT | e: the end token closes one story and begins the next.
    window = np.array([[1, 2, EOT, 3, 4, EOT, 5]])
    got = window_documents(window, begin=EOT, end=EOT)
    assert got["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 3]]
    assert got["positions"].tolist() == [[0, 1, 0, 1, 2, 0]]
    # Every target is trained: the end token is predictable from the story it closes.
    assert got["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 1]]


def test_a_window_with_begin_tokens_does_not_train_on_the_next_documents_start():
    window = np.array([[1, EOT, BOS, 3, EOT, BOS, 5, 6]])
    got = window_documents(window, begin=BOS, end=EOT)
    assert got["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 3, 3]]
    assert got["positions"].tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    # The begin token after an end token cannot be predicted from the story before it.
    assert got["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1, 1]]


def test_bits_per_byte_count_the_trained_text_and_not_the_special_tokens():
    batch = {"targets": np.array([[1, 2, EOT, 3], [4, 5, 6, 7]]),
             "loss_mask": np.array([[1, 1, 1, 1], [1, 1, 0, 1]])}
    got = text_targets(batch, lambda ids: "x" * len(ids) + "é", special=(EOT,))
    assert got["text_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 0, 1]]
    assert got["text_bytes"].tolist() == [[5, 0, 0, 0], [5, 0, 0, 0]]  # 3 ids + é (2 bytes)


def test_weights_make_the_loss_the_mean_over_trained_targets():
    batch = loss_batch({"inputs": jnp.zeros((2, 4), jnp.int32),
                        "loss_mask": jnp.array([[1, 1, 0, 0], [1, 0, 0, 0]])})
    np.testing.assert_allclose(batch["weights"], [[8 / 3, 8 / 3, 0, 0], [8 / 3, 0, 0, 0]])
    ids = loss_batch({"inputs": jnp.zeros((1, 4), jnp.int32),
                      "segment_ids": jnp.array([[1, 1, 2, 0]])})  # padding is not trained
    np.testing.assert_allclose(ids["weights"], [[4 / 3, 4 / 3, 4 / 3, 0]])
    assert ids["positions"].tolist() == [[0, 1, 0, 0]]


def small(name: str, **changes):
    """A zoo architecture at a size that compiles in seconds; T = 128 runs the CPU kernels'
    blocked attention (64-query blocks)."""
    cfg = dataclasses.replace(zoo_config(name), vocab_size=256, context_len=128, embed_dim=64,
                              num_layers=2, mlp_dim=64, dropout=0.0)
    if cfg.num_experts:
        cfg = dataclasses.replace(cfg, expert_mlp_dim=32, shared_expert_mlp_dim=32)
    return dataclasses.replace(cfg, **changes)


ARCHITECTURES = ["minigpt-tiny", "gpt2-tiny", "llama-tiny+qk_norm", "moe-tiny"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_document_of_a_window_gets_the_logits_it_gets_alone(name):
    rng = np.random.default_rng(0)
    split, T = 50, 128
    tokens = rng.integers(0, 256, (2, T)).astype(np.int32)
    ids = np.where(np.arange(T) < split, 1, 2)[None].repeat(2, 0).astype(np.int32)
    logits = {}
    for kernels in ("reference", "cpu"):
        model = build_model(small(name, kernels=kernels), rngs=nnx.Rngs(0))
        forward = nnx.jit(lambda m, x, s: m(x, segment_ids=s)[..., :256])
        logits[kernels] = forward(model, jnp.asarray(tokens), jnp.asarray(ids))
    packed = logits["cpu"]
    np.testing.assert_allclose(packed, logits["reference"], atol=1e-5)
    alone = nnx.jit(lambda m, x: m(x)[..., :256])
    np.testing.assert_allclose(packed[:, :split], alone(model, jnp.asarray(tokens[:, :split])),
                               atol=1e-5)
    np.testing.assert_allclose(packed[:, split:], alone(model, jnp.asarray(tokens[:, split:])),
                               atol=1e-5)


def packed_and_alone(preset_name: str, name: str, strategy: str = "ring"):
    """The loss and gradients of a batch whose rows hold documents A then B, and of A and B
    each alone (at the start of a row of padding), under a preset."""
    cfg = small(name, router_aux_loss_coef=0.0) if "moe" in name else small(name)
    rng = np.random.default_rng(1)
    B, T, split = 8, 128, 50
    inputs, targets = (rng.integers(0, 256, (B, T)).astype(np.int32) for _ in range(2))
    ids = np.where(np.arange(T) < split, 1, 2)[None].repeat(B, 0).astype(np.int32)
    layout = sharding.Layout.make(preset_name)
    model = sharding.create_sharded(lambda: build_model(cfg, rngs=nnx.Rngs(0)), layout)
    pipe = sharding.Pipeline(microbatches=2) if "pp" in preset_name else sharding.Pipeline()
    how = sharding.ContextParallel(strategy=strategy)

    with layout.replace(pipeline=pipe, context_parallel=how).active():
        step = sharding.jit(lambda m, b: nnx.value_and_grad(lambda m, b: m.loss(b))(m, b))

        def run(batch):
            return step(model, {k: jnp.asarray(v) for k, v in batch.items()})

        def alone(lo, hi):
            x, y, s = (np.zeros((B, T), np.int32) for _ in range(3))
            x[:, :hi - lo], y[:, :hi - lo], s[:, :hi - lo] = inputs[:, lo:hi], targets[:, lo:hi], 1
            return run({"inputs": x, "targets": y, "segment_ids": s})

        packed = run({"inputs": inputs, "targets": targets, "segment_ids": ids})
        return packed, alone(0, split), alone(split, T), split / T


CASES = [("dp", "llama-tiny+qk_norm", "ring"), ("dp", "moe-tiny", "ring"),
         ("fsdp_tp", "gpt2-tiny", "ring"), ("fsdp_tp", "llama-tiny", "ring"),
         ("cp", "llama-tiny", "ring"), ("cp", "minigpt-tiny", "all_gather"),
         ("fsdp_cp_tp", "gpt2-tiny", "ring"), ("dp_pp", "minigpt-tiny", "ring"),
         ("dp_pp", "llama-tiny+qk_norm", "ring")]


@pytest.mark.slow
@pytest.mark.parametrize("preset, name, strategy", CASES)
def test_packed_documents_train_as_each_alone_under_a_preset(preset, name, strategy):
    (loss, grads), (loss_a, grads_a), (loss_b, grads_b), share = packed_and_alone(
        preset, name, strategy)
    np.testing.assert_allclose(loss, share * loss_a + (1 - share) * loss_b, rtol=1e-5)
    worst = jax.tree.map(lambda g, a, b: float(jnp.max(jnp.abs(g - (share * a + (1 - share) * b)))),
                         grads, grads_a, grads_b)
    assert max(jax.tree.leaves(worst)) < 1e-5
