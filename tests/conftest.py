"""Test set-up shared by every test module.

Every test runs on 8 simulated CPU devices, whatever accelerator the machine has, so the same
presets apply everywhere. The flags must be in the environment before JAX is first imported,
which is why this happens at import time of the conftest, not in a fixture. MINIGPT_TEST_DEVICES=
native leaves the devices as they are (the accelerator check runs the tests that need no
simulated devices on a GPU so). Measured peaks (minigpt.models.flops) are kept in a temporary
folder, never in the user's cache.

Offline assets (TinyStories text, the GPT-2 tokenizer files) are found through MINIGPT_ASSETS,
which defaults to ../shared/assets beside the repository. Where they are absent, tests that
need TinyStories text use a small synthetic fixture, and tiktoken downloads its files itself.
"""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The tests' shapes are tiny, so XLA's CPU compiler, not the programs, takes most of their time.
# They compile with JAX's "disable most optimizations" (LLVM without its optimisations) and XLA's
# classic elemental emitters instead of its fusion emitters: test_steps.py 54 s -> 38 s with the
# first; one Muon step of llama-tiny under fsdp compiles in 4.1-4.7 s instead of 7.7-9.2 s with
# the second (2026-11-26). XLA aborts the process on a flag it does not know, so that one is
# tried once in a child process first (a later jaxlib may drop it). The processes tests start
# (CLI runs, multi-process jobs, notebooks) inherit all of it.
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def _add_xla_flag(flag: str) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


if os.environ.get("MINIGPT_TEST_DEVICES") != "native":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        _add_xla_flag("--xla_force_host_platform_device_count=8")
    if "MINIGPT_TEST_XLA_PROBED" not in os.environ:  # once: workers and children inherit it
        os.environ["MINIGPT_TEST_XLA_PROBED"] = "1"
        flags = (os.environ["XLA_FLAGS"] + " " + FAST_COMPILE_FLAG).strip()
        if FAST_COMPILE_FLAG.split("=")[0] not in os.environ["XLA_FLAGS"] and _xla_accepts(flags):
            os.environ["XLA_FLAGS"] = flags
else:
    # An accelerator's float32 matmuls default to TF32 (a 10-bit mantissa): on an H200 that
    # put imports 1e-3 from transformers' logits (2026-11-27). The tests compare float32 results
    # to 1e-4 and finer, so they ask for full float32 there, as a CPU computes it.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ["MINIGPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="minigpt-test-cache-")
# A CPU training run's `model.dtype` auto takes bfloat16 operands where this machine's bfloat16
# products measure 1.5x float32's (minigpt.runs.resolved.training_dtype): the suite's runs keep
# float32, which their comparisons with references and each other assume, by giving the
# measurement as 1.0; tests of the rule set it themselves.
os.environ["MINIGPT_BFLOAT16_SPEEDUP"] = "1.0"


def child_env(*drop: str) -> dict[str, str]:
    """The environment of a process a test starts that chooses its own devices (a README
    command, a multi-process job): the test's own, less the 8 simulated devices and the names in
    `drop`, keeping the compile flags."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env

# A persistent compilation cache for the session, shared with the processes tests start (CLI
# runs, multi-process jobs, notebooks), is opt-in: MINIGPT_TEST_JAX_CACHE=1. It lives in a fresh
# temporary folder with one subfolder per pytest-xdist worker (JAX writes entries without
# locking). It is off by default: XLA:CPU (jaxlib 0.10.2, an AVX-512 Xeon) crashed in three
# full slow runs with it (a segfault or an abort in compilation_cache.put_executable_and_time),
# before the workers dropped each file's compiled programs (_release_compiled_programs below,
# which tells of a crash without the cache too). Tried again on 2026-11-26 with one folder per
# worker: test_train.py and test_steps.py 9% faster, no crash in those files. Most of the
# suite's compiles are of programs no other test compiles, so that little is all it buys,
# and a crash fails CI: it stays opt-in.
if os.environ.get("MINIGPT_TEST_JAX_CACHE") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    root = os.environ["MINIGPT_TEST_JAX_CACHE"]
    if root == "1":
        root = os.environ["MINIGPT_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="minigpt-jax-cache-")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(root, worker)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

REPO = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("MINIGPT_ASSETS", REPO.parent / "shared" / "assets")).resolve()
if (ASSETS / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ASSETS / "tiktoken_cache"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

EOT = "<|endoftext|>"


def expected_stories(raw: bytes, *, keep_unterminated: bool) -> list[str]:
    """The documented reading rules, written independently of minigpt.pretokenize."""
    *closed, tail = raw.split(EOT.encode())
    stories = [p.decode("utf-8").strip() for p in closed]
    if tail.strip() and (keep_unterminated or tail.endswith(b"\n")):
        stories.append(tail.decode("utf-8").strip())
    return [s for s in stories if s]


def tokens_of(folder: Path, split: str) -> np.ndarray:
    """A prepared folder's split (either layout) as one array of token ids."""
    from minigpt.data import open_corpus

    stream = open_corpus(folder).stream(split)
    return np.asarray(stream.read(0, len(stream)))


def write_one_file_layout(out: Path, files: list[tuple[Path, str]], *, val_fraction=0.1,
                          dataset: dict | None = None, complete: bool = False) -> Path:
    """A folder as minigpt wrote it before shards (format 1: `train.bin`, `val.bin`, meta.json;
    GPT-2's tokenizer), from text `files` with their split ("train", "val" or "train+val": story
    i of those held out when floor((i+1)f) > floor(i f)), written here from the documented rules
    so that tests have the data of runs of the previous format."""
    from fractions import Fraction

    import tiktoken

    gpt2, seen = tiktoken.get_encoding("gpt2"), 0
    f = Fraction(val_fraction).limit_denominator(10_000)
    ids = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    sources = []
    for path, split in files:
        raw = path.read_bytes()
        for story in expected_stories(raw, keep_unterminated=complete):
            chosen = split
            if split == "train+val":
                chosen = "val" if (seen + 1) * f // 1 > seen * f // 1 else "train"
                seen += 1
            ids[chosen] += gpt2.encode_ordinary(story) + [gpt2.eot_token]
            counts[chosen] += 1
        sources.append({"file": path.name, "path": str(path.resolve()), "split": split,
                        "bytes": len(raw), "mtime_ns": path.stat().st_mtime_ns,
                        "sha256": hashlib.sha256(raw).hexdigest()})
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        np.asarray(ids[split], np.uint16).tofile(out / f"{split}.bin")
    meta = {"format": 1, "tokenizer": "gpt2",
            "val_fraction": None if any(s == "val" for _, s in files) else val_fraction,
            "vocab_size": gpt2.n_vocab, "eot_token": gpt2.eot_token, "bos_token": None,
            "dtype": "uint16", "separator": EOT, "sources": sources, "dataset": dataset,
            **{f"{s}_tokens": len(ids[s]) for s in ids},
            **{f"{s}_stories": counts[s] for s in counts}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


SYNTHETIC_STORIES = [
    "Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball.",
    "One day, Lily went to the park with her mom. She saw a big dog and said hello.",
    "Ben had a toy car. He drove it around the house. Then he gave it to his sister.",
    "The sun was hot. A small bird sat in a tree and sang a happy song for its friends.",
    "Mia found a shiny stone by the river. She kept it in her pocket and smiled all day.",
]


def write_synthetic_stories(path: Path, copies: int = 200) -> Path:
    """Write TinyStories-layout text: stories separated by `<|endoftext|>` lines."""
    stories = [f"{s} It was story number {i}." for i in range(copies) for s in SYNTHETIC_STORIES]
    path.write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Each test file compiles its own programs once; when the file is done they are dropped.

    JAX keeps every compiled executable (and the traced functions behind it) for the life of the
    process, and a pytest-xdist worker runs many files. Over test_lora's and test_pipeline's
    quick cases in one process a worker grew from 0.7 to 3.5 GB without this, to 2.8 GB with
    it. A full slow run without it crashed (a segfault in XLA's compilation, a thread
    that could not start beside it); the next, with it, passed, its workers under 4.9 GB each and
    the machine under 10.3 GB in use. Memory is the likely cause of that crash, not a proven one.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    if "minigpt.decoding.compiled" in sys.modules:  # the decoding engine's own table
        sys.modules["minigpt.decoding.compiled"].forget()
    gc.collect()
    try:  # and glibc hands the freed pages back to the system rather than keeping them
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    return ASSETS


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory) -> Path:
    """TinyStories text: the real head of the dataset if the assets are here, else synthetic."""
    real = ASSETS / "tinystories" / "TinyStories-train-head.txt"
    if real.is_file():
        return real
    return write_synthetic_stories(tmp_path_factory.mktemp("stories") / "stories.txt")


@pytest.fixture(scope="session")
def data_dir(stories_file, tmp_path_factory, gpt2) -> Path:
    """The stories prepared with GPT-2's tokenizer, once per test process."""
    from minigpt.data import resolve_data

    return resolve_data([str(stories_file)], tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def data_4k(small_stories, tmp_path_factory) -> Path:
    """About 400 KB of the stories prepared with the TinyStories vocabulary (4,096 tokens, which
    ships with the package): what a test that trains a small model for a few steps needs. Its
    output layer is a twelfth of GPT-2's, so each step runs several times faster."""
    from minigpt.data import resolve_data

    return resolve_data([str(small_stories)], tmp_path_factory.mktemp("data-4k"),
                        tokenizer="tinystories-4k")


def untrained_run(path: Path, cfg) -> Path:
    """A run directory holding an untrained model's weights (seed 0) as its checkpoint."""
    import jax
    from flax import nnx

    from minigpt.checkpoint import Checkpointer
    from minigpt.models import build_model
    from minigpt.runs import RunDir

    run = RunDir(path)
    run.path.mkdir(parents=True)
    run.write(cfg, None)
    checkpointer = Checkpointer(run.checkpoints, async_save=False)
    checkpointer.save(0, build_model(cfg, rngs=nnx.Rngs(0)), None, data_state={},
                      rng=jax.random.key(0))
    checkpointer.wait()
    checkpointer.close()
    return run.path


def small_vocab(name: str, **changes):
    """A zoo model's config with the TinyStories vocabulary (for `data_4k`), and any changes."""
    return dataclasses.replace(zoo_config(name), tokenizer="tinystories-4k", vocab_size=4096,
                               **changes)


class Snapshot(dict):
    """Every path under some folders (`roots`), each file with the sha256 of its bytes, each
    folder as "dir": equal to a later snapshot of the same folders where nothing under them was
    written, changed or removed."""

    def __init__(self, *roots):
        self.roots = tuple(Path(root) for root in roots)
        super().__init__((str(p), hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                          else "dir") for root in self.roots for p in sorted(root.rglob("*")))


def snapshot(*roots) -> Snapshot:
    """What is under `roots` now (`Snapshot`), for `refused(..., unchanged=...)`."""
    return Snapshot(*roots)


def refused(output, code: int, *messages: str, unchanged: Snapshot | None = None,
            quiet: bool = False) -> str:
    """Assert that a command refused its input as every user error is refused: exit status 2,
    stderr exactly one line that starts "error: " and holds each of `messages`, no traceback on
    stdout or stderr; with `unchanged` (a `snapshot` taken before the command), every file and
    folder under its roots as they were; with `quiet`, nothing on stdout. `output` is the capsys
    fixture (read, so consumed) or a finished `subprocess.CompletedProcess` (text). Returns the
    line."""
    if isinstance(output, subprocess.CompletedProcess):
        out, err = output.stdout or "", output.stderr or ""
    else:
        out, err = output.readouterr()
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err, out + err
    for message in messages:
        assert message in err, err
    if quiet:
        assert out == "", out
    if unchanged is not None:
        assert snapshot(*unchanged.roots) == unchanged
    return err


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory, as TensorBoard's own reader sees it:
    tag -> [(step, value)] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def losses(run_dir) -> list[float]:
    """The training losses a run directory's metrics.jsonl records, step by step."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="session")
def small_stories(stories_file, tmp_path_factory) -> Path:
    """About 400 KB of the stories: enough for short training runs."""
    path = tmp_path_factory.mktemp("text") / "stories.txt"
    path.write_bytes(stories_file.read_bytes()[:400_000].rsplit(b"<|endoftext|>", 1)[0])
    return path


def zoo_config(name: str):
    """A zoo model's config; "NAME+qk_norm" is that Llama with query and key norms (Qwen3's),
    which the stories-cpu recipe trains."""
    from minigpt.models import get_config, replaced
    base, _, option = name.partition("+")
    cfg = get_config(base)
    return replaced(cfg, qk_norm=True) if option == "qk_norm" else cfg


def random_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token ids as a training batch: inputs and targets [batch, seq], int32."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture
def float32_compute(monkeypatch):
    """`model.dtype=auto` computes in float32 on every backend, as on a CPU: for the tests that
    compare logits with transformers' float32 ones to 1e-4, which an accelerator's bfloat16
    (auto's choice there) cannot meet. Layers read the dtype when they are built."""
    from minigpt.models import execution

    as_on_a_cpu = execution.compute_dtype
    monkeypatch.setattr(execution, "compute_dtype",
                        lambda choice, platform=None: as_on_a_cpu(choice, platform or "cpu"))


@pytest.fixture
def optimised(monkeypatch):
    """XLA's optimisations back on, here and in the processes the test starts: for a test whose
    time goes into running many steps rather than compiling (the 40-step run with the training
    defaults: 94 s with "disable most optimizations", 48 s without, 2026-11-27)."""
    import jax

    before = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1"  # as JAX read it
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """`straight(model_cfg, train_cfg)`: the training losses of an uninterrupted run of those
    configs (whatever `out` says), trained once per session: what every resumed, interrupted
    or recovered run of them must reproduce."""
    from minigpt import train

    done: dict = {}

    def losses_of(model_cfg, train_cfg) -> list[float]:
        key = (model_cfg, dataclasses.replace(train_cfg, out=""))
        if key not in done:
            out = tmp_path_factory.mktemp("straight") / "run"
            train.train(model_cfg, dataclasses.replace(train_cfg, out=str(out)), sample=False)
            done[key] = losses(out)
        return done[key]

    return losses_of


@pytest.fixture(scope="session")
def wordpiece_run(tmp_path_factory) -> Path:
    """A tiny Llama in the Hugging Face layout with a WordPiece tokenizer, a chat template and
    two end tokens (tests/tiny_llama.py), imported once per test process: a run at step 0."""
    from tiny_llama import hf_folder

    from minigpt import hub

    root = tmp_path_factory.mktemp("wordpiece")
    hf = hf_folder(root / "hf", files={"generation_config.json": {"eos_token_id": [2, 3]}})
    assert hub.main(["import", str(hf), "--out", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture(scope="session")
def gpt2():
    """The GPT-2 encoding; tests that need it are skipped, saying why, where it cannot load."""
    from minigpt.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer()
    except TokenizerError as error:
        pytest.skip(f"GPT-2 tokenizer unavailable here: {error}")


# A local HTTP server with Range support and scripted failures, standing in for the Hub.

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        server = self.server
        name = self.path.rsplit("/", 1)[-1]
        server.log.append({"path": self.path, "range": self.headers.get("Range"), "sent": 0})
        data = server.files.get(name)
        if data is None:
            self.send_error(404)
            return
        start = 0
        if self.headers.get("Range") and not server.ignore_range:
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if server.cuts:  # promise the whole body, send part of it, hang up
            body = body[:server.cuts.pop(0)]
            self.close_connection = True
        # Logged before writing: the client may finish reading before this thread runs again.
        server.log[-1]["sent"] = len(body)
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """Serves `server.files` (name -> bytes) on 127.0.0.1; `cuts` drops connections after that
    many bytes, `ignore_range` answers Range requests with the whole file; `log` records every
    request."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files, httpd.log, httpd.cuts, httpd.ignore_range = {}, [], [], False
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


