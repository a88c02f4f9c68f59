"""Scores through the server: lm-evaluation-harness's `local-completions` model against
`python -m minigpt.serve` gives the scores `minigpt.eval` gives directly (with -m slow).

A tiny Llama 3 written by transformers is imported and served on a free loopback port; the
harness scores the small tasks of `test_eval.py` through OpenAI's completions API (prompts as
token ids, `echo` with `logprobs`: the log-likelihood requests of multiple choice, of a
continuation, one past the context, and of rolling windows) and directly through `minigpt`:
every request's log-likelihood agrees to 1e-4, every greedy flag and every metric is the same.
The server is the process this test starts, and it stops it.

Needs lm-evaluation-harness with its API models (the [eval] extra), the server's web stack (the
[serve] extra) and torch, transformers and sentencepiece (the [hf] extra); skipped, saying why,
without them.
"""

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, child_env

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the [eval] extra")
pytest.importorskip("fastapi", reason="the server's web stack is the [serve] extra")
pytest.importorskip("tenacity", reason="the harness's API models need lm-eval[api], which the "
                                       "[eval] extra installs")
pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
pytest.importorskip("transformers", reason="transformers is the [hf] extra")
pytest.importorskip("sentencepiece", reason="sentencepiece (the [hf] extra) is needed to write "
                                            "the test checkpoints")

import hf_families as hf  # noqa: E402
from test_eval import assert_same_scores, evaluate, reference_tasks  # noqa: E402

from minigpt import hub  # noqa: E402
from minigpt.eval import MiniGPTLM  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The checkpoint, its run, its tasks, and the run served on a loopback port."""
    root = tmp_path_factory.mktemp("served")
    ck = hf.write_family("llama3", root / "hf")
    assert hub.main(["import", str(ck.directory), "--out", str(root / "run")]) == 0
    names = reference_tasks(root / "tasks", "llama", ck.model, ck.tokenizer)
    port, log = _free_port(), root / "server.log"
    with open(log, "w") as out:  # a file, not a pipe: nothing has to read it while it runs
        server = subprocess.Popen(
            [sys.executable, "-m", "minigpt.serve", "--run", str(root / "run"), "--port",
             str(port), "--name", "tiny"], cwd=REPO, env=child_env(), stdout=out,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not start: "
                                         f"{log.read_text()[-2000:]}") from None
                time.sleep(1)
        yield {"checkpoint": ck, "run": root / "run", "tasks": root / "tasks", "port": port,
               "names": [n for n in names if not n.endswith("_gen")]}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_scores_through_the_server_equal_the_direct_ones(served):
    names, tasks = served["names"], served["tasks"]
    # The harness's API models keep a position for the token the server generates and crop one
    # more: with max_length 128 they score what its hf model (and minigpt) scores with 126.
    direct = evaluate(MiniGPTLM(run=str(served["run"]), batch_size=4, max_length=126,
                                progress=False), names, tasks)
    through = evaluate("local-completions", names, tasks, model_args={
        "model": "tiny", "base_url": f"http://127.0.0.1:{served['port']}/v1/completions",
        "tokenizer_backend": "huggingface", "tokenizer": str(served["checkpoint"].directory),
        # The harness's API models encode without a begin token unless told; its hf model
        # (and minigpt) with the tokenizer's own, which for a Llama adds one.
        "tokenized_requests": True, "add_bos_token": True, "max_length": 128,
        "num_concurrent": 1, "max_retries": 1})
    assert_same_scores(through, direct, names)
