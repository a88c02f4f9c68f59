"""The model zoo: shapes, logical axes, causality, vocabulary padding, dropout."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import ConfigError
from minigpt.models import CONFIGS, build_model, count_params, get_config
from minigpt.sharding import LOGICAL_AXES

MODELS_DIR = Path(__file__).resolve().parent.parent / "minigpt" / "models"


@pytest.fixture(scope="module")
def tiny():
    return build_model(get_config("minigpt-tiny"), rngs=nnx.Rngs(0))


def test_minigpt_has_the_tutorial_shape():
    cfg = get_config("minigpt")
    assert (cfg.vocab_size, cfg.context_len, cfg.embed_dim, cfg.num_heads, cfg.mlp_dim,
            cfg.num_layers, cfg.dropout) == (50257, 256, 256, 8, 256, 8, 0.1)
    assert cfg.padded_vocab == 50304
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    V, T, D, F = 50257, 256, 256, 256
    attention = 4 * (D * D + D)  # query, key, value and output projections with biases
    block = attention + (D * F + F) + (F * D + D) + 2 * (2 * D)
    assert count_params(model, cfg) == V * D + T * D + 8 * block + D * V + V


def test_every_parameter_names_a_logical_axis_per_dimension(tiny):
    for path, var in nnx.to_flat_state(nnx.state(tiny, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.get_value().ndim, path
        assert all(a is None or a in LOGICAL_AXES for a in axes), path


def test_model_code_knows_no_mesh():
    for path in MODELS_DIR.glob("*.py"):
        source = path.read_text()
        for word in ("PartitionSpec", "NamedSharding", "Mesh", "jax.P(", "set_mesh", '"fsdp"',
                     '"data"'):
            assert word not in source, f"{path.name} mentions {word}"


def test_tiny_config_divides_by_eight_everywhere_a_preset_may_split():
    cfg = get_config("minigpt-tiny")
    assert cfg.context_len >= 128
    for size in (cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.mlp_dim, cfg.padded_vocab):
        assert size % 8 == 0


def test_causality_later_tokens_do_not_change_earlier_logits(tiny):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, (2, 64)).astype(np.int32)
    changed = tokens.copy()
    t = 40
    changed[:, t + 1:] = rng.integers(0, 50257, (2, 64 - t - 1))
    a, b = tiny(jnp.asarray(tokens)), tiny(jnp.asarray(changed))
    np.testing.assert_array_equal(np.asarray(a[:, :t + 1]), np.asarray(b[:, :t + 1]))
    assert not np.allclose(np.asarray(a[:, t + 1:]), np.asarray(b[:, t + 1:]))


def test_padded_vocabulary_gets_no_probability(tiny):
    logits = tiny(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 50304)
    assert np.all(np.isneginf(np.asarray(logits[..., 50257:])))
    assert np.all(np.isfinite(np.asarray(logits[..., :50257])))
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(probs[..., 50257:].sum()) == 0.0
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, rtol=1e-5)


def test_dropout_is_on_only_with_a_key(tiny):
    tokens = jnp.arange(16, dtype=jnp.int32)[None]
    plain = np.asarray(tiny(tokens))
    np.testing.assert_array_equal(plain, np.asarray(tiny(tokens)))
    a = np.asarray(tiny(tokens, dropout_key=jax.random.key(1)))
    b = np.asarray(tiny(tokens, dropout_key=jax.random.key(1)))
    c = np.asarray(tiny(tokens, dropout_key=jax.random.key(2)))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, plain) and not np.allclose(a, c)


def test_unknown_model_lists_the_zoo():
    with pytest.raises(ConfigError) as e:
        get_config("gpt5")
    for name in CONFIGS:
        assert name in str(e.value)
