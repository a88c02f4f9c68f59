"""The server under load and in a browser (the slow set): `python -m minigpt.serve` serving a
run directory laid out by `fsdp` on 2 simulated devices, as a user starts it.

The load test: 64 concurrent streaming clients, one in ten hanging up midway, eight rounds;
every request that completes gives its prompt's greedy tokens (the ones `minigpt.generate`
gives in this process), no slot is left held, the server's resident memory is flat from the
second round on in every round that compiled no new prefill program, and each round ends within
its time bound. The browser test drives the chat
page in headless Chromium (Debian's package, through Playwright): a message typed gets a
streamed reply, a second one is stopped midway and frees its slot, and a screenshot of the page
is kept in the test's output folder. Ctrl-C then stops the server with exit status 0.
"""

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env, small_vocab, untrained_run

pytestmark = pytest.mark.slow
pytest.importorskip("fastapi", reason="the web stack is the [serve] extra")
httpx = pytest.importorskip("httpx", reason="comes with the openai client")
psutil = pytest.importorskip("psutil", reason="reads the server's resident memory")

CHROMIUM = Path("/usr/bin/chromium")
# A model slow enough per step, and a context long enough, that a reply streams for seconds
# and can be stopped midway.
MODEL = small_vocab("llama-tiny", num_layers=4, context_len=384)
CLIENTS, ROUNDS, NEW_TOKENS, SLOTS = 64, 8, 24, 16
PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 1 + (i * 5) % 40)) for i in range(CLIENTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The command line serving a run; yields (process, url, run directory)."""
    run = untrained_run(tmp_path_factory.mktemp("serve-load") / "stories", MODEL)
    process = subprocess.Popen(
        [sys.executable, "-m", "minigpt.serve", "--run", str(run), "--port", "0", "--preset",
         "fsdp", "--devices", "2", "--max-batch", str(SLOTS)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=child_env("JAX_DISABLE_MOST_OPTIMIZATIONS"))
    began, url = time.monotonic(), None
    while url is None and time.monotonic() - began < 180:
        line = process.stdout.readline()
        if not line:
            break
        found = re.search(r"serving \S+ on (http://\S+) ", line)
        url = found and found.group(1)
    assert url, f"the server did not start (exit {process.poll()})"
    yield process, url, run
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def expected(served):
    """Each prompt's greedy tokens from minigpt.generate, in this process, under the same
    preset (on this process's 8 simulated devices)."""
    from minigpt.generate import generate_tokens
    from minigpt.runs import load_run

    run = load_run(served[2], "fsdp")
    with run.layout.active():
        return generate_tokens(run.model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0,
                               stop_ids=run.tokenizer.stop_tokens)


def health(url):
    return httpx.get(f"{url}/health", timeout=10).json()


def settled(url, seconds=15.0):
    """/health once no slot is held, nothing waits and no prefill compiles in the background
    (or after `seconds`)."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        state = health(url)
        if state["slots_in_use"] == 0 and state["queue_length"] == 0 and not state["compiling"]:
            break
        time.sleep(0.05)
    return state


async def one_client(client, url, index):
    """Stream one greedy completion; every tenth client hangs up after its first chunk (a
    call's tokens come as one chunk, and a call may run 64 steps). Returns the token ids
    received and whether it completed."""
    body = {"prompt": PROMPTS[index], "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    tokens, chunks = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return tokens, True
            chunk = json.loads(data)["choices"][0]
            tokens += [int(t.removeprefix("token_id:")) for t in chunk["logprobs"]["tokens"]]
            chunks += 1
            if index % 10 == 0 and chunks == 1:
                return tokens, False  # leaving the block hangs up
    return tokens, False


async def one_round(url):
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(
            *(one_client(client, url, i) for i in range(CLIENTS))), timeout=90)


def test_64_streaming_clients_eight_rounds_all_correct_no_slot_leaked_memory_flat(served,
                                                                                 expected):
    process, url, _ = served
    # Two rounds first, uncounted: the engine compiles a program per shape of work it meets
    # (prefills by prompt count and length, decode programs by rows in use), in the
    # background; which shapes a round meets depends on how its requests happen to arrive.
    for _ in range(2):
        asyncio.run(one_round(url))
        settled(url)
    rss, times, programs = [], [], []
    for _ in range(ROUNDS):
        began = time.monotonic()
        results = asyncio.run(one_round(url))
        times.append(time.monotonic() - began)
        for i, (tokens, completed) in enumerate(results):
            if completed:
                assert tokens == expected[i], i
            else:
                assert i % 10 == 0 and tokens == expected[i][:len(tokens)], i
        assert sum(completed for _, completed in results) == CLIENTS - len(range(0, CLIENTS, 10))
        # at least one hang-up left a stream with tokens still to come
        assert any(len(results[i][0]) < NEW_TOKENS for i in range(0, CLIENTS, 10))
        state = settled(url)
        assert state["slots_in_use"] == 0 and state["queue_length"] == 0
        assert state["compiling"] == []
        rss.append(psutil.Process(process.pid).memory_info().rss)
        programs.append(len(state["compiled"]))
    print(f"rounds: {', '.join(f'{t:.1f} s' for t in times)}; server RSS after each: "
          f"{', '.join(f'{r / 2**20:.0f} MiB' for r in rss)}; programs: {programs}")
    assert max(times) < 60, times
    # Decode programs: 3 row counts (1, 4, 16) x greedy or sampling x what they report, of
    # which this load (greedy, with log-probabilities) uses its own three beside the four
    # compiled ahead; and a few prefill buckets.
    assert programs[-1] <= 16, programs
    # Flat from round 2 on, but for compiles. A prefill shape first met (how many prompts
    # arrive together, how long) compiles in the background, about 13 MiB each here, and a
    # round waits for those (`settled`); an arrival pattern first met in a late round may add
    # one (2026-11-28: 6 programs after round 1 in one run, 5 until round 8 in another). In the
    # rounds that compile nothing the allocator still steps now and then (+7 to +8 MiB in one
    # such round of eight, before and after background compiles, 2026-11-28), while a leak
    # grows every round: 100 KB a request would add 6 MiB to each. So the median round that
    # compiled nothing adds under 2 MiB, and all of them under 16 MiB together.
    quiet = [rss[i] - rss[i - 1] for i in range(2, ROUNDS) if programs[i] == programs[i - 1]]
    assert len(quiet) >= 4, programs
    assert statistics.median(quiet) < 2 << 20 and sum(quiet) < 16 << 20, (
        [r >> 20 for r in rss], programs)


def test_the_chat_page_streams_a_reply_and_stops_one_midway_in_chromium(served, tmp_path):
    if not CHROMIUM.is_file():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="drives the browser (pip install playwright)")
    _, url, _ = served
    with sync_api.sync_playwright() as playwright:
        # A fresh profile folder (Playwright passes it as --user-data-dir).
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            viewport={"width": 900, "height": 700},
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("document.getElementById('model').textContent"
                                   ".includes('stories')")
            page.click("#settings summary")
            page.fill("#system", "You tell short stories.")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "40")
            page.fill("#input", "Tell me about a cat.")
            page.press("#input", "Enter")
            reply = page.locator(".message.assistant").nth(0)
            page.wait_for_function("document.querySelector('.message.assistant')"
                                   ".textContent.length > 0")
            page.wait_for_selector(".message.assistant[data-state=done]", timeout=60_000)
            assert reply.text_content().strip()
            page.fill("#max-tokens", "")  # the rest of the context: a long reply to stop
            page.fill("#input", "And about a dog?")
            page.press("#input", "Enter")
            second = page.locator(".message.assistant").nth(1)
            page.wait_for_function("(document.querySelectorAll('.message.assistant')[1]"
                                   " || {}).textContent?.length > 0")
            page.click("#stop")
            page.wait_for_selector(".message.assistant[data-state=stopped]", timeout=10_000)
            assert "stopped" in second.text_content()
            assert page.locator(".message.user").count() == 2
            page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        finally:
            browser.close()
    state = settled(url)
    assert state["slots_in_use"] == 0
    assert (tmp_path / "chat.png").stat().st_size > 10_000
    print(f"screenshot: {tmp_path / 'chat.png'}")


def test_ctrl_c_stops_the_server_cleanly_with_exit_status_0(served):
    process, url, _ = served
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
            "prompt": [5, 6, 7], "max_tokens": 300, "stream": True}) as answer:
        next(line for line in answer.iter_lines() if line.startswith("data:"))
        os.kill(process.pid, signal.SIGINT)
        assert process.wait(timeout=30) == 0
    rest = process.stdout.read()
    assert "Traceback" not in rest, rest

