"""The server (`minigpt.serve`) through the official `openai` client: greedy completions and
chats, streamed and not, give `minigpt.generate`'s tokens; 16 concurrent requests of different
lengths each give their tokens alone; echo + logprobs give the model's own log-probabilities;
stop strings, n, seeds; every bad request gets its 4xx and the server stays up; a client that
goes away frees its slot; an API key is asked for where one is set, and required off loopback.

One tiny untrained Llama with the TinyStories vocabulary, served once for the whole module on
127.0.0.1 (a free port) from one device; a run directory served under a preset through the
command line is tests/test_serve_load.py's. The text streams are checked without a server.
"""

import asyncio
import json
import time
import types

import numpy as np
import pytest
from conftest import small_vocab

pytest.importorskip("fastapi", reason="the web stack is the [serve] extra")
pytest.importorskip("sse_starlette", reason="the web stack is the [serve] extra")
openai = pytest.importorskip("openai", reason="the openai client is the server's test client")
httpx = pytest.importorskip("httpx", reason="comes with the openai client")

from minigpt import chat_template  # noqa: E402
from minigpt.decoding import TextStream  # noqa: E402
from minigpt.generate import chat, generate_tokens  # noqa: E402
from minigpt.serve import Engine, ServeError, Server, Service  # noqa: E402
from minigpt.tokenizer import load_tokenizer  # noqa: E402

MODEL = small_vocab("llama-tiny")  # context 128
SLOTS = 16


@pytest.fixture(scope="module")
def server():
    """The tiny model served on one device: what is checked is the server and its engine,
    which no layout changes (tests/test_serve_load.py serves a run directory under a preset
    through the command line)."""
    from flax import nnx

    from minigpt.models import build_model

    engine = Engine(build_model(MODEL, rngs=nnx.Rngs(0)), slots=SLOTS, log=lambda line: None,
                    call_seconds=0.1, background=True)
    service = Service(engine=engine, tokenizer=load_tokenizer(MODEL.tokenizer), name="tiny",
                      context=MODEL.context_len, vocab_size=MODEL.vocab_size, max_batch=SLOTS)
    with service, Server(service, "127.0.0.1", 0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def solo(server, prompt, max_new):
    """What minigpt.generate gives for this prompt alone, greedily."""
    engine = server.service.engine
    with engine.context():
        return generate_tokens(engine.model, [prompt], max_new_tokens=max_new,
                               temperature=0.0, stop_ids=server.service.tokenizer.stop_tokens)[0]


def ids_of(logprobs_tokens):
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def test_greedy_completions_streamed_or_not_give_generates_tokens(server, client):
    tokenizer = server.service.tokenizer
    prompt = "Once upon a time"
    expected = solo(server, tokenizer.encode_prompt(prompt), 20)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                      temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True})
    assert ids_of(whole.choices[0].logprobs.tokens) == expected
    assert whole.choices[0].text == tokenizer.decode(expected)
    assert whole.choices[0].finish_reason == ("length" if len(expected) == 20 else "stop")
    assert whole.usage.prompt_tokens == len(tokenizer.encode_prompt(prompt))
    assert whole.usage.completion_tokens == len(expected)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_chats_streamed_or_not_give_generates_reply(server, client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about a cat."}]
    engine = server.service.engine
    templated = chat_template.with_template(server.service.tokenizer)[0]
    with engine.context():
        expected = chat(engine.model, templated, messages, max_new_tokens=12, temperature=0.0)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                           temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    rendered = templated.encode_ordinary(templated.render_chat(messages))
    assert whole.usage.prompt_tokens == len(rendered)
    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                            max_completion_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sixteen_concurrent_requests_of_different_lengths_each_give_their_solo_tokens(
        server):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4000, n).tolist() for n in range(1, 17)]
    budgets = [6 + (i * 5) % 17 for i in range(16)]  # they end at different steps
    expected = [solo(server, p, 22)[:m] for p, m in zip(prompts, budgets)]

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x") as aclient:
            return await asyncio.gather(*(aclient.completions.create(
                model="tiny", prompt=p, max_tokens=m, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True})
                for p, m in zip(prompts, budgets)))

    steps = server.service.engine.steps
    answers = asyncio.run(ask_all())
    for answer, tokens in zip(answers, expected):
        assert ids_of(answer.choices[0].logprobs.tokens) == tokens
    # They ran side by side: far fewer steps than tokens.
    assert server.service.engine.steps - steps < sum(budgets) / 3
    assert server.service.engine.health()["slots_in_use"] == 0


def test_echo_with_logprobs_gives_the_models_own_logprobs(server, client):
    import jax
    import jax.numpy as jnp

    prompt = [7, 900, 31, 2048, 5, 77, 1234, 8]
    engine = server.service.engine
    with engine.context():
        logits = jax.jit(lambda m, x: m(x))(engine.model, jnp.asarray([prompt]))[0]
    own = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    scored = client.completions.create(model="tiny", prompt=[prompt], max_tokens=0, echo=True,
                                       logprobs=1, temperature=0)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
    np.testing.assert_allclose(lp.token_logprobs[1:], own[np.arange(7), prompt[1:]], atol=1e-4)
    assert scored.usage.completion_tokens == 0
    # As lm-evaluation-harness asks (max_tokens 1): the prompt's, then the new token's.
    harness = client.completions.create(model="tiny", prompt=[prompt], max_tokens=1, echo=True,
                                        logprobs=1, temperature=0)
    lp = harness.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1
    np.testing.assert_allclose(lp.token_logprobs[1:-1], own[np.arange(7), prompt[1:]],
                               atol=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(own[-1].max(), abs=1e-4)
    for given, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert max(top.values()) >= given - 1e-6


def test_lm_evaluation_harness_reads_the_scores_and_the_tokenizer(server, client):
    """What lm-evaluation-harness's local-completions model sends (its own payload) and how it
    reads the answer (its own parser), and the vLLM tokenizer routes its remote tokenizer uses."""
    harness = pytest.importorskip("lm_eval.models.openai_completions",
                                  reason="lm-evaluation-harness is not installed")
    import jax
    import jax.numpy as jnp

    context, continuation = [4095, 200, 17, 900], [31, 2048, 5]
    engine = server.service.engine
    with engine.context():
        logits = jax.jit(lambda m, x: m(x))(engine.model, jnp.asarray([context + continuation]))
    own = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    expected = sum(own[len(context) - 1 + i, t] for i, t in enumerate(continuation))
    as_configured = types.SimpleNamespace(model="tiny")  # what the method reads of its model
    payload = harness.LocalCompletionsAPI._create_payload(
        as_configured, [context + continuation], generate=False)
    answer = post(server, "/v1/completions", payload).json()
    [(score, _)] = harness.LocalCompletionsAPI.parse_logprobs(answer, ctxlens=[len(context)])
    assert score == pytest.approx(expected, abs=1e-4)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "<|im_start|>" in info["chat_template"]
    assert post(server, "/tokenize", {"prompt": info["eos_token"],
                                      "add_special_tokens": False}).json()["tokens"] == [4095]
    ids = post(server, "/tokenize", {"prompt": "a cat", "add_special_tokens": False}).json()
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == "a cat"


def test_stop_strings_n_and_seeds(server, client):
    tokenizer = server.service.tokenizer
    full = client.completions.create(model="tiny", prompt="The dog", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt="The dog", max_tokens=16,
                                    temperature=0, stop=[stop, "\x00never"])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="The dog", max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]
    many = client.completions.create(model="tiny", prompt=["The dog", "A cat"], max_tokens=5,
                                     n=2, temperature=0)
    texts = {c.index: c.text for c in many.choices}
    assert sorted(texts) == [0, 1, 2, 3] and texts[0] == texts[1] == full[:len(texts[0])]
    assert texts[2] == texts[3] and tokenizer is server.service.tokenizer

    def sample(seed):
        return client.completions.create(model="tiny", prompt="The dog", max_tokens=12,
                                         temperature=1.0, top_p=0.9, seed=seed).choices[0].text

    assert sample(5) == sample(5) != sample(6)
    # Seeds are taken modulo 2^32, as jax.random.key takes them: OpenAI's clients send 64-bit
    # integers, and -1 is 2^32 - 1.
    assert sample(-1) == sample(2**32 - 1) == sample(2**63 + 2**32 - 1)


def post(server, path, body, **headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=data, timeout=30,
                      headers={"content-type": "application/json", **headers})


BAD = [  # (path, body, status, words of the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": "x"', 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens must be an int"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature must be a nu"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt must be a string"),
    ("/v1/completions", {"prompt": [1, "x"]}, 400, "prompt must be a string"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt must be"),
    ("/v1/completions", {"prompt": [99999]}, 400, "not in the model's vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "at least 0"),
    ("/v1/completions", {"prompt": list(range(1, 130))}, 400, "past the model's context of 128"),
    ("/v1/completions", {"prompt": list(range(1, 101)), "max_tokens": 40}, 400,
     "ask for at most 28"),
    ("/v1/completions", {"prompt": "x", "n": SLOTS + 1}, 400, "--max-batch"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs must be in [0, 5]"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1.0}, 400, "not supported"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1.2}, 400, "not supported"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed must be an integer"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k must be at least -1"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p must be in [0, 1]"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist here"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "needs a role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "must be text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, 400,
     "past the model's context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, 400, "at least 1"),
    ("/v1/nowhere", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, said", BAD)
def test_a_bad_request_gets_its_4xx_as_an_openai_error(server, path, body, status, said):
    answer = post(server, path, body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert said in error["message"] and error["type"] == "invalid_request_error"


def test_the_server_stays_up_for_others_after_bad_requests(server, client):
    for path, body, _, _ in BAD[:6]:
        post(server, path, body)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["slots"] == SLOTS
    assert health["slots_in_use"] == 0 and health["queue_length"] == 0
    # Decode programs by row count (1, 4, 16), greedy or sampling, with log-probabilities or
    # not, and a few prefills (by prompt count and length), each compiled once.
    compiled = health["compiled"]
    assert {"decode 1 row, sampling", "decode 16 rows, sampling"} <= set(compiled[:4])
    assert {"prefill 1 x 32", "prefill 16 x 32"} <= set(compiled[:4])
    assert len(set(compiled)) == len(compiled) <= 24, compiled


def test_a_failed_step_ends_its_requests_with_an_error_and_the_server_goes_on(server, client,
                                                                          monkeypatch):
    engine = server.service.engine
    run, failures = engine.programs.run, []

    def fails_once(name, args):
        if name[0] == "decode" and not failures:
            failures.append(1)
            raise RuntimeError("the device went away")
        return run(name, args)

    monkeypatch.setattr(engine.programs, "run", fails_once)
    with pytest.raises(openai.InternalServerError, match="the device went away"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).usage
    assert engine.health()["slots_in_use"] == 0


def test_a_client_that_goes_away_frees_its_slot_at_once(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
            "prompt": "Once", "max_tokens": 120, "stream": True, "temperature": 0}) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.service.engine.health()["slots_in_use"] == 1
    began = time.monotonic()
    while server.service.engine.health()["slots_in_use"] and time.monotonic() - began < 5:
        time.sleep(0.01)
    assert server.service.engine.health()["slots_in_use"] == 0
    assert time.monotonic() - began < 1.0


def test_an_api_key_is_asked_for_where_set_and_required_off_loopback(server, monkeypatch):
    monkeypatch.setattr(server.service, "api_key", "sesame")
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    refused = post(server, "/v1/completions", {"prompt": "x"}, authorization="Bearer nope")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", headers={
        "authorization": "Bearer sesame"}).json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200  # for load balancers
    monkeypatch.setattr(server.service, "api_key", None)
    with pytest.raises(ServeError, match="--host 0.0.0.0 can be reached from other machines"):
        Server(server.service, "0.0.0.0", 0)


def test_the_command_line_refuses_an_exposed_host_a_bad_or_taken_port_before_loading(
        tmp_path, capsys):
    import socket

    from minigpt.serve.cli import main

    assert main(["--run", str(tmp_path / "nothing"), "--host", "0.0.0.0"]) == 2
    assert "give an --api-key" in capsys.readouterr().err
    for port in ("99999", "-1"):
        assert main(["--run", str(tmp_path / "nothing"), "--port", port]) == 2
        assert "--port must be from 0 to 65535" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["--run", str(tmp_path / "nothing"), "--port", port]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_chat_page_is_served_from_the_package(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and 'id="stop"' in page.text and 'id="system"' in page.text
    assert "http" not in page.text.split("<body>")[1]  # nothing fetched from elsewhere
    script = httpx.get(f"{server.url}/static/chat.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "/v1/chat/completions" in script.text and "AbortController" in script.text


@pytest.mark.parametrize("stops, pieces, text", [
    ((), ["Once", " upon"], "Once upon"),
    (("up",), ["Once", " u", "pon"], "Once "),
    (("upon a",), ["Once", " upon", " the"], "Once upon the"),
    (("\n\n",), ["Hi", "\n", "\n", "there"], "Hi"),
])
def test_the_text_stream_holds_back_what_may_become_a_stop_string(stops, pieces, text):
    enc = load_tokenizer("tinystories-4k")
    stream = TextStream(enc, stops=stops)
    out = ""
    for piece in pieces:
        for token in enc.encode_ordinary(piece):
            delta = stream.add([token])
            out += delta
            assert not any(s in out for s in stops)
    assert out + stream.finish() == text


@pytest.mark.parametrize("burst", [1, 3])  # tokens arrive one by one or a few a call
def test_the_text_stream_waits_for_whole_characters(burst):
    enc = load_tokenizer("tinystories-4k")
    tokens = enc.encode_ordinary("a café 🐈 here")
    stream = TextStream(enc)
    pieces = [stream.add(tokens[i:i + burst]) for i in range(0, len(tokens), burst)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == "a café 🐈 here"


@pytest.mark.parametrize("scale", [8.0, 0.5])  # a peaked distribution and a flat one
def test_the_nucleus_is_the_smallest_set_of_likeliest_tokens_reaching_top_p(scale):
    import jax

    from minigpt.decoding.sampler import nucleus_floor

    logits = np.asarray(jax.random.normal(jax.random.key(3), (3, 4096))) * scale
    top_p = np.asarray([0.3, 0.9, 0.99], np.float32)
    kept = logits >= np.asarray(nucleus_floor(logits, top_p))[:, None]
    for row, p in enumerate(top_p):
        order = np.argsort(-logits[row])
        probs = np.exp(logits[row][order] - logits[row].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        assert set(order[before < p]) == set(np.nonzero(kept[row])[0])


def test_the_inverse_cdf_draw_lands_in_proportion_to_the_probabilities():
    import jax
    import jax.numpy as jnp

    from minigpt.decoding.sampler import inverse_cdf

    probs = np.zeros(700, np.float32)
    probs[[3, 300, 699]] = [0.1, 0.3, 0.6]  # in different blocks, the last one at the end
    logits = jnp.log(jnp.asarray(probs))[None]
    u = jnp.linspace(0.0, 0.9999, 2000)
    drawn = np.asarray(jax.vmap(lambda x: inverse_cdf(logits, x[None])[0])(u))
    assert set(drawn) == {3, 300, 699}
    counts = np.bincount(drawn, minlength=700)[[3, 300, 699]] / len(u)
    np.testing.assert_allclose(counts, [0.1, 0.3, 0.6], atol=0.002)


def test_calls_are_sized_to_the_work_and_each_request_gets_its_solo_tokens():
    """Driven by hand, without its thread: a request admitted while slots stay free gets a call
    of one step (more may be on their way), then calls as long as the step's time allows, on
    the decode program of one row while it is alone. The three that arrive together are
    prefilled in one call (padded to 4 rows, in two length buckets' worth of prompts), run on
    the program of 4 rows, and a call is not cut short for the request nearest its limit:
    each stops on the device where it ends and gets the tokens it gets alone. A prompt whose
    prefill shape is new then runs on a larger compiled one while its own compiles in the
    background, with the same tokens. Its layers run scanned, as on an accelerator (the server
    above runs a CPU's default, each layer on weights of its own)."""
    from flax import nnx

    from minigpt.decoding import Request, Tokens
    from minigpt.models import build_model

    model = build_model(MODEL, rngs=nnx.Rngs(0))
    lines = []
    engine = Engine(model, slots=4, log=lines.append, how="scanned", call_seconds=0.1,
                    background=True)
    assert engine.programs.layers is None and Engine(model).programs.how == "per layer"
    engine._fresh_state()
    engine._warm_up()
    while engine.programs.compiling:  # the background compiles begun at warm-up
        time.sleep(0.05)
    assert {"decode 1 row, sampling", "decode 4 rows, sampling", "prefill 1 x 32",
            "prefill 4 x 32", "decode 4 rows, sampling, top logprobs"} == set(
        engine.programs.compiled)
    # A call's steps fill about 0.1 s at the fastest step of its program's last calls (a call
    # with a prefill beside it only looks slower), up to the program's most.
    assert engine._steps_per_call(4) == 1  # not known yet
    engine._step_times[4].extend([0.08, 0.02])
    assert engine._steps_per_call(4) == 5 and engine._steps_per_call(1) == 1
    engine._step_times[4].append(0.0013)
    assert engine._steps_per_call(4) == engine.programs.most == 64
    engine._step_times.clear()
    engine._steps_per_call = lambda rows: 16  # what a fast step gets (its timing is not the point)
    prompts = [[5, 6, 7], [9], list(range(3, 43)), [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    budgets = [60, 5, 20, 20]  # the second ends a few steps into its first call
    got = [[] for _ in prompts]

    def request(prompt, budget, out):
        return Request(prompt, budget, sink=lambda event: isinstance(event, Tokens)
                       and out.extend(event.ids))

    requests = [request(p, n, out) for p, n, out in zip(prompts, budgets, got)]

    def calls():
        engine._iteration()
        record = engine._records[-1]  # the call just dispatched
        return record.rows, record.asked

    engine.submit(requests[0])
    assert calls() == (1, 1)  # three slots free: the rest of a burst may be arriving
    assert calls() == (1, 16)  # (greedy: the sampling program serves while its own compiles)
    engine.submit(*requests[1:])
    assert calls() == (4, 16)  # every slot taken: nobody else can join
    assert any(name.startswith("prefill 4 x 64") for name in engine.programs.compiled)
    while not all(r.finished for r in requests):
        engine._iteration()
    # Alone, 40 tokens: one row of the 64 bucket, not compiled; 4 x 64 serves it meanwhile.
    prompts.append(list(range(50, 90)))
    budgets.append(8)
    got.append([])
    requests.append(request(prompts[-1], 8, got[-1]))
    engine.submit(requests[-1])
    while not requests[-1].finished:
        engine._iteration()
    engine.programs.close(wait=True)  # waits for the background compiles
    assert any(line.startswith("compiled prefill 1 x 64 in") and "in the background" in line
               for line in lines), lines
    # Alone, each prompt's first 60 tokens (greedy: a shorter budget takes their start).
    for prompt, n, tokens in zip(prompts, budgets, got):
        assert tokens == generate_tokens(model, [prompt], max_new_tokens=60, temperature=0)[0][:n]
