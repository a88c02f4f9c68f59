"""The one decoding engine: its sampler against transformers' own filters, and the same tokens
through every door (`minigpt.generate`'s function and command line, the server, evaluation),
greedy and sampled with a seed, alone and beside 15 other requests, on a run trained with FP8
products.

The run is the tiny Llama with the TinyStories vocabulary, untrained, its config asking for
FP8: every engine program decodes with plain products (`minigpt.decoding.programs`), so its
tokens are also those of the same weights without FP8."""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_vocab, untrained_run
from flax import nnx

from minigpt.decoding.sampler import Sampling, filtered, seed_key
from minigpt.generate import generate_tokens, main
from minigpt.models import build_model

MODEL = small_vocab("llama-tiny", fp8=True)  # context 128
PROMPT = "Once upon a time, a little dog"
SETTINGS = [  # (what the server is sent, what generate_tokens and the command line take)
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 7},
     {"temperature": 1.0, "top_k": 40, "top_p": 0.9}),
    ({"temperature": 0.8, "min_p": 0.05, "seed": 2**32 + 3},  # seeds are taken mod 2^32
     {"temperature": 0.8, "min_p": 0.05}),
]
NEW = 24


def test_the_filters_keep_what_transformers_warpers_keep():
    torch = pytest.importorskip("torch", reason="transformers' warpers are the reference")
    generation = pytest.importorskip("transformers.generation.logits_process",
                                     reason="transformers' warpers are the reference")
    logits = np.random.default_rng(0).normal(size=(6, 1000)).astype(np.float32) * 3
    cases = [dict(temperature=0.7, top_k=50), dict(temperature=1.3, top_p=0.8),
             dict(temperature=1.0, min_p=0.1), dict(temperature=0.9, top_k=300, top_p=0.95,
                                                    min_p=0.02)]
    for case in cases:
        warpers = [generation.TemperatureLogitsWarper(case["temperature"])]
        if case.get("top_k"):
            warpers.append(generation.TopKLogitsWarper(case["top_k"]))
        if case.get("top_p"):
            warpers.append(generation.TopPLogitsWarper(case["top_p"]))
        if case.get("min_p"):
            warpers.append(generation.MinPLogitsWarper(case["min_p"]))
        theirs = torch.from_numpy(logits)
        for warper in warpers:
            theirs = warper(None, theirs)
        rows = Sampling(temperature=np.full(6, case["temperature"], np.float32),
                        top_k=np.full(6, case.get("top_k", 0), np.int32),
                        top_p=np.full(6, case.get("top_p", 1.0), np.float32),
                        min_p=np.full(6, case.get("min_p", 0.0), np.float32),
                        key=np.zeros((6, 2), np.uint32))
        ours = np.asarray(filtered(jnp.asarray(logits), rows, jnp.ones(6, bool)))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs.numpy()),
                                      err_msg=str(case))
        np.testing.assert_allclose(ours[np.isfinite(ours)], theirs.numpy()[np.isfinite(ours)],
                                   rtol=1e-6, err_msg=str(case))


def test_rows_of_one_batch_draw_with_their_own_settings_and_keys():
    from minigpt.decoding.sampler import choose

    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 300)), jnp.float32)
    rows = Sampling(temperature=np.asarray([0.0, 1.0, 1.0, 1.0], np.float32),
                    top_k=np.asarray([0, 1, 0, 0], np.int32),
                    top_p=np.ones(4, np.float32), min_p=np.zeros(4, np.float32),
                    key=np.stack([seed_key(s) for s in (0, 0, 5, 5)]))
    choose = jax.jit(choose)
    drawn = [np.asarray(choose(logits, rows, np.full(4, i, np.int32), np.ones(4, bool),
                               np.int32(0))[0]) for i in range(30)]
    best = np.asarray(jnp.argmax(logits, axis=-1))
    assert all(d[0] == best[0] and d[1] == best[1] for d in drawn)  # greedy, and top-k 1
    # The same key and token number: the same uniform, so rows 2 and 3 (alike but for their
    # logits) draw by their own distributions, and the draws change with the token number.
    assert len({int(d[2]) for d in drawn}) > 5
    alone = np.asarray(choose(logits[2:3], jax.tree.map(lambda a: a[2:3], rows),
                              np.full(1, 4, np.int32), np.ones(1, bool), np.int32(0))[0])
    assert alone[0] == drawn[4][2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return untrained_run(tmp_path_factory.mktemp("decoding") / "run", MODEL)


@pytest.fixture(scope="module")
def loaded(run):
    from minigpt.runs import load_run

    return load_run(run)


@pytest.fixture(scope="module")
def expected(loaded):
    """generate_tokens' tokens for the prompt alone, per setting (seeds as the server's)."""
    prompt = loaded.tokenizer.encode_prompt(PROMPT)
    out = []
    with loaded.layout.active():
        for body, settings in SETTINGS:
            key = None if "seed" not in body else jax.random.key(body["seed"])
            out.append(generate_tokens(loaded.model, [prompt], max_new_tokens=NEW, rng=key,
                                       stop_ids=loaded.tokenizer.stop_tokens, **settings)[0])
    assert all(len(tokens) > 4 for tokens in out)
    assert out[1] != out[0] != out[2]  # the sampled settings do sample
    return out


def test_generate_tokens_gives_its_tokens_beside_15_other_prompts_and_without_fp8(loaded,
                                                                                  expected):
    prompt = loaded.tokenizer.encode_prompt(PROMPT)
    rng = np.random.default_rng(0)
    others = [rng.integers(0, 4000, int(n)).tolist() for n in rng.integers(1, 60, 15)]
    plain = build_model(dataclasses.replace(MODEL, fp8=False), rngs=nnx.Rngs(0))
    with loaded.layout.active():
        for (body, settings), tokens in zip(SETTINGS, expected):
            key = None if "seed" not in body else jax.random.key(body["seed"])
            keys = None if key is None else [key] + [jax.random.key(i) for i in range(15)]
            batch = generate_tokens(loaded.model, [prompt] + others, max_new_tokens=NEW,
                                    rng=keys, stop_ids=loaded.tokenizer.stop_tokens, **settings)
            assert batch[0] == tokens, body
            assert generate_tokens(plain, [prompt], max_new_tokens=NEW, rng=key,
                                   stop_ids=loaded.tokenizer.stop_tokens, **settings)[0] == tokens


def test_the_command_line_prints_the_same_story(run, loaded, expected, capsys):
    prompt = loaded.tokenizer.encode_prompt(PROMPT)
    for (body, settings), tokens in zip(SETTINGS, expected):
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]
        assert main(["--run", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                     "--seed", str(body.get("seed", 0) % 2**32), *flags]) == 0
        printed = capsys.readouterr().out
        assert printed == loaded.tokenizer.decode(prompt + tokens,
                                                  skip_special_tokens=True) + "\n", body


def test_the_server_gives_the_same_tokens_alone_and_beside_15_others(run, expected):
    openai = pytest.importorskip("openai", reason="the server's test client")
    pytest.importorskip("fastapi", reason="the web stack is the [serve] extra")
    from minigpt.serve import Server, open_service

    rng = np.random.default_rng(2)
    others = [rng.integers(0, 4000, int(n)).tolist() for n in rng.integers(1, 60, 15)]
    with open_service(run, log=lambda line: None) as service, \
            Server(service, "127.0.0.1", 0) as server:
        def ask(client, prompt, body):
            return client.completions.create(
                model=service.name, prompt=prompt, max_tokens=NEW, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True,
                            **{k: v for k, v in body.items() if k in ("top_k", "min_p")}},
                **{k: v for k, v in body.items() if k not in ("top_k", "min_p")})

        async def together(body):
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x") as client:
                return await asyncio.gather(ask(client, PROMPT, body), *(
                    ask(client, p, {"temperature": 1.0, "seed": i})
                    for i, p in enumerate(others)))

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        for (body, _), tokens in zip(SETTINGS, expected):
            alone = ask(client, PROMPT, body).choices[0].logprobs.tokens
            assert [int(t.removeprefix("token_id:")) for t in alone] == tokens, body
            beside = asyncio.run(together(body))[0].choices[0].logprobs.tokens
            assert [int(t.removeprefix("token_id:")) for t in beside] == tokens, body
        health = service.engine.health()
    assert {"decode 1 row, sampling", "decode 16 rows, sampling"} <= set(health["compiled"])


def test_evaluations_greedy_generations_are_generates(run, loaded):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the [eval] extra")
    from lm_eval.api.instance import Instance

    from minigpt.eval import MiniGPTLM

    lm = MiniGPTLM(run=str(run), batch_size=4, progress=False)
    rng = np.random.default_rng(3)
    texts = [PROMPT, *(loaded.tokenizer.decode(rng.integers(0, 4000, 12).tolist())
                       for _ in range(5))]
    requests = [Instance("generate_until", {}, (text, {"until": ["\x00"], "max_gen_toks": NEW,
                                                       "do_sample": False}), i)
                for i, text in enumerate(texts)]
    answers = lm.generate_until(requests)
    with loaded.layout.active():
        for text, answer in zip(texts[:2], answers):
            ids = lm.vocab.encode_for_generation(text)  # the harness's encoding of a prompt
            tokens = generate_tokens(loaded.model, [ids], max_new_tokens=NEW, temperature=0.0,
                                     stop_ids=lm.vocab.stop_ids)[0]
            assert answer == loaded.tokenizer.decode(tokens, skip_special_tokens=True)
    # Its scores too are those of the same weights without FP8.
    context, continuation = [5, 900, 31, 2048], [7, 77, 1234]
    [(score, _)] = lm._loglikelihood_tokens([(None, context, continuation)])
    plain = build_model(dataclasses.replace(MODEL, fp8=False), rngs=nnx.Rngs(0))
    logits = jax.jit(lambda m, x: m(x))(plain, jnp.asarray([context + continuation]))[0]
    own = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    assert score == pytest.approx(sum(own[len(context) - 1 + i, t]
                                      for i, t in enumerate(continuation)), abs=1e-5)


def test_bfloat16_decoding_scores_within_2e_2_of_float32_and_every_door_takes_dtype(run, loaded,
                                                                                   capsys):
    """`--dtype bfloat16` (vLLM's spelling): the engine scores a story's tokens within 2e-2 of
    float32's log-probabilities; the command lines take the flag, refuse other values, and a
    server says in /health what it computes in."""
    from minigpt.decoding.engine import Engine
    from minigpt.decoding.request import PromptScores, Request
    from minigpt.runs import load_run
    from minigpt.serve.server import open_service

    story = loaded.tokenizer.encode_prompt(PROMPT + " ran to the park and saw a big red ball.")

    def scores(model):
        got = []
        request = Request(story, 0, prompt_logprobs=True, top=1)
        request.sink = lambda e: got.append(e) if isinstance(e, PromptScores) else None
        Engine(model, slots=1, length=64, log=lambda line: None).run([request])
        return np.array(got[0].logprobs)

    half = load_run(run, dtype="bfloat16")
    assert half.model.config.dtype == "bfloat16" and loaded.model.config.dtype != "bfloat16"
    with loaded.layout.active():
        exact, rounded = scores(loaded.model), scores(half.model)
    assert len(exact) == len(story) - 1
    np.testing.assert_allclose(rounded, exact, atol=2e-2)
    assert not np.array_equal(rounded, exact)  # it did compute in bfloat16
    capsys.readouterr()
    assert main(["--run", str(run), "--dtype", "bfloat16", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    with pytest.raises(SystemExit) as refused_dtype:
        main(["--run", str(run), "--dtype", "float16"])
    assert refused_dtype.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err
    assert open_service(run, dtype="bfloat16", max_batch=1, log=lambda line: None).dtype == \
        "bfloat16"
