"""The data pipeline: downloads, pre-tokenized files, and the Grain batch iterator.

Downloads run against a local HTTP server on 127.0.0.1 that serves TinyStories text (the offline
assets where present, else synthetic stories) and can drop connections or ignore Range requests.
"""

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS, REPO, SYNTHETIC_STORIES, write_synthetic_stories

import minigpt.data
from minigpt import download, pretokenize
from minigpt.data import (
    DataError,
    batch_iterator,
    load_meta,
    main,
    prepare_text,
    prepare_tinystories,
    resolve_data,
)
from minigpt.tokenizer import TokenizerError, load_tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def gpt2():
    try:
        return load_tokenizer()
    except TokenizerError as error:
        pytest.skip(f"GPT-2 tokenizer unavailable here: {error}")


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    """A second story file, standing in for the official validation file."""
    real = ASSETS / "tinystories" / "TinyStories-subset-3k.txt"
    if real.is_file():
        return real
    return write_synthetic_stories(tmp_path_factory.mktemp("valid") / "valid.txt", copies=20)


def expected_stories(raw: bytes, *, keep_unterminated: bool) -> list[str]:
    """The documented reading rules, written independently of minigpt.pretokenize."""
    *closed, tail = raw.split(EOT.encode())
    stories = [p.decode("utf-8").strip() for p in closed]
    if tail.strip() and (keep_unterminated or tail.endswith(b"\n")):
        stories.append(tail.decode("utf-8").strip())
    return [s for s in stories if s]


def tokens_of(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


# ---------------------------------------------------------------------------------------------
# A local HTTP server with Range support and scripted failures.

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
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files, httpd.log, httpd.cuts, httpd.ignore_range = {}, [], [], False
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _fetch(server, tmp_path, data: bytes, **kwargs) -> tuple[Path, str]:
    server.files["f.txt"] = data
    dest = tmp_path / "f.txt"
    kwargs.setdefault("size", len(data))
    kwargs.setdefault("sha256", hashlib.sha256(data).hexdigest())
    digest = download.download_file(f"{server.url}/x/f.txt", dest, retry_wait=0,
                                    progress=False, **kwargs)
    return dest, digest


def test_download_success(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    dest, digest = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert digest == hashlib.sha256(data).hexdigest()
    assert [r["range"] for r in server.log] == [None]
    assert not (tmp_path / "f.txt.part").exists()
    # A second call checks the file on disk instead of fetching it again.
    assert _fetch(server, tmp_path, data)[1] == digest and len(server.log) == 1


def test_download_resumes_after_dropped_connection(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.cuts = [len(data) // 3]
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert [r["range"] for r in server.log] == [None, f"bytes={len(data) // 3}-"]
    assert server.log[1]["sent"] == len(data) - len(data) // 3


def test_download_resumes_part_left_by_an_earlier_run(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    (tmp_path / "f.txt.part").write_bytes(data[:1000])
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert server.log[0]["range"] == "bytes=1000-" and server.log[0]["sent"] == len(data) - 1000


def test_download_restarts_when_server_ignores_range(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.ignore_range = True
    (tmp_path / "f.txt.part").write_bytes(b"x" * 1000)  # would corrupt the file if appended to
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data


def test_download_that_keeps_failing_leaves_only_the_part(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.cuts = [1000, 1000]
    with pytest.raises(DataError, match=r"failed after 2 attempts.*2,000 bytes are kept.*again"):
        _fetch(server, tmp_path, data, attempts=2)
    assert not (tmp_path / "f.txt").exists()
    assert (tmp_path / "f.txt.part").read_bytes() == data[:2000]
    dest, _ = _fetch(server, tmp_path, data)  # the next run picks up from there
    assert dest.read_bytes() == data and server.log[-1]["range"] == "bytes=2000-"


def test_download_size_mismatch_is_refused(server, tmp_path):
    data = b"a story\n<|endoftext|>\n" * 100
    with pytest.raises(DataError, match=r"is 2,200 bytes, but f.txt at this revision has 2,201"):
        _fetch(server, tmp_path, data, size=len(data) + 1)
    assert not (tmp_path / "f.txt").exists() and not (tmp_path / "f.txt.part").exists()


def test_download_hash_mismatch_is_refused_and_part_deleted(server, tmp_path):
    data = b"a story\n<|endoftext|>\n" * 100
    with pytest.raises(DataError, match=r"f.txt from .* has sha256 [0-9a-f]{64}, expected 0{64}"):
        _fetch(server, tmp_path, data, sha256="0" * 64)
    assert not (tmp_path / "f.txt").exists() and not (tmp_path / "f.txt.part").exists()


def test_download_missing_file_and_wrong_existing_file(server, tmp_path):
    with pytest.raises(DataError, match="HTTP 404"):
        download.download_file(f"{server.url}/nothing.txt", tmp_path / "n.txt", progress=False)
    (tmp_path / "f.txt").write_bytes(b"short")
    with pytest.raises(DataError, match="has 5 bytes, but the pinned file has 10.*delete it"):
        _fetch(server, tmp_path, b"0123456789")


def test_hf_url_pins_the_revision_and_honours_the_override(monkeypatch):
    assert download.hf_url("TinyStories-valid.txt") == (
        "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/"
        f"{download.TINYSTORIES_REVISION}/TinyStories-valid.txt")
    assert len(download.TINYSTORIES_REVISION) == 40
    monkeypatch.setenv("MINIGPT_HF_BASE", "http://127.0.0.1:9/")
    assert download.hf_url("a.txt", revision="r").startswith(
        "http://127.0.0.1:9/datasets/roneneldan/TinyStories/resolve/r/")
    assert download.expected_file("TinyStories-valid.txt", "r") == (None, None)
    assert download.expected_file("TinyStories-valid.txt", download.TINYSTORIES_REVISION)[0] \
        == 19_447_282


def test_prepare_tinystories_end_to_end(server, tmp_path, monkeypatch, gpt2, stories_file,
                                        valid_file):
    server.files = {"TinyStories-train.txt": stories_file.read_bytes(),
                    "TinyStories-valid.txt": valid_file.read_bytes()}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    out = prepare_tinystories(tmp_path, "v1", revision="test-rev", progress=False)
    assert out == tmp_path / "tinystories"
    assert all("/datasets/roneneldan/TinyStories/resolve/test-rev/" in r["path"]
               for r in server.log)
    meta = load_meta(out)
    train = expected_stories(stories_file.read_bytes(), keep_unterminated=True)
    val = expected_stories(valid_file.read_bytes(), keep_unterminated=True)
    assert (meta["train_stories"], meta["val_stories"]) == (len(train), len(val))
    assert gpt2.decode(tokens_of(out / "val.bin").tolist()) == "".join(s + EOT for s in val)
    assert meta["dataset"]["revision"] == "test-rev"
    assert [s["sha256"] for s in meta["sources"]] == [
        hashlib.sha256(f.read_bytes()).hexdigest() for f in (stories_file, valid_file)]
    # A verified download is whole: its unterminated last story is kept, not dropped.
    assert not any(s["dropped_partial_story"] for s in meta["sources"])
    mtime = (out / "train.bin").stat().st_mtime_ns
    requests = len(server.log)
    assert prepare_tinystories(tmp_path, "v1", revision="test-rev", progress=False) == out
    assert len(server.log) == requests and (out / "train.bin").stat().st_mtime_ns == mtime


def test_pinned_revision_refuses_a_file_of_another_size(server, tmp_path, monkeypatch):
    server.files = {"TinyStories-train.txt": b"not the real file\n<|endoftext|>\n"}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    with pytest.raises(DataError, match="at this revision has 1,924,281,556"):
        prepare_tinystories(tmp_path, "v1", progress=False)
    assert not list((tmp_path / "tinystories").glob("TinyStories-train.txt*"))


def test_resolve_data_by_name_downloads_v2(server, tmp_path, monkeypatch, gpt2, stories_file,
                                           valid_file):
    server.files = {"TinyStoriesV2-GPT4-train.txt": stories_file.read_bytes(),
                    "TinyStoriesV2-GPT4-valid.txt": valid_file.read_bytes()}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    monkeypatch.setattr(download, "TINYSTORIES_REVISION", "test-rev")
    monkeypatch.setattr(download, "KNOWN_FILES", {})
    out = resolve_data("tinystories-v2", root=tmp_path)
    assert out == tmp_path / "tinystories-v2"
    assert {p.name for p in out.iterdir()} >= {"train.bin", "val.bin", "meta.json"}
    assert resolve_data([str(out)], root=tmp_path / "elsewhere") == out  # a prepared directory


# ---------------------------------------------------------------------------------------------
# Pre-tokenized files.

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, gpt2, stories_file) -> Path:
    return prepare_text([stories_file], tmp_path_factory.mktemp("data"), progress=False)


def test_token_files_decode_to_the_source_stories(prepared, gpt2, stories_file):
    stories = expected_stories(stories_file.read_bytes(), keep_unterminated=False)
    train = [s for i, s in enumerate(stories) if i % 10 != 9]
    val = [s for i, s in enumerate(stories) if i % 10 == 9]
    assert gpt2.decode(tokens_of(prepared / "train.bin").tolist()) == "".join(
        s + EOT for s in train)
    assert gpt2.decode(tokens_of(prepared / "val.bin").tolist()) == "".join(s + EOT for s in val)
    meta = load_meta(prepared)
    assert meta["train_tokens"] == sum(len(gpt2.encode_ordinary(s)) + 1 for s in train)
    assert meta["val_tokens"] == sum(len(gpt2.encode_ordinary(s)) + 1 for s in val)
    assert (meta["train_stories"], meta["val_stories"]) == (len(train), len(val))
    assert meta["tokenizer"] == "gpt2" and meta["eot_token"] == 50256
    assert meta["sources"][0]["sha256"] == hashlib.sha256(stories_file.read_bytes()).hexdigest()
    assert prepared.name == "text-" + hashlib.sha256(
        hashlib.sha256(stories_file.read_bytes()).digest()).hexdigest()[:12]


def test_small_chunks_give_identical_tokens(prepared, tmp_path, monkeypatch, stories_file):
    monkeypatch.setattr(pretokenize, "CHUNK_BYTES", 20_011)  # ~100 chunk edges mid-story
    out = prepare_text([stories_file], tmp_path, progress=False)
    for split in ("train", "val"):
        assert np.array_equal(tokens_of(out / f"{split}.bin"), tokens_of(prepared / f"{split}.bin"))


def test_blank_line_layout(tmp_path, gpt2, monkeypatch):
    text = "First story.\nStill first.\n\nSecond story.\n \n\n\nThird story.\n\nFourth.\n"
    path = tmp_path / "blank.txt"
    path.write_text(text)
    for chunk in (None, 5):  # whole file, then 5-byte chunks
        monkeypatch.setattr(pretokenize, "CHUNK_BYTES", chunk or 8 << 20)
        out = pretokenize.prepare(tmp_path / f"out{chunk}", [path], val_fraction=0.5,
                                  progress=False)
        assert out["sources"][0]["layout"] == "blank-line"
        train = gpt2.decode(tokens_of(tmp_path / f"out{chunk}" / "train.bin").tolist())
        val = gpt2.decode(tokens_of(tmp_path / f"out{chunk}" / "val.bin").tolist())
        assert train == f"First story.\nStill first.{EOT}Third story.{EOT}"
        assert val == f"Second story.{EOT}Fourth.{EOT}"


@pytest.mark.parametrize("ending, kept", [("", False), ("\n", True)])
def test_cut_off_last_story_rule(tmp_path, gpt2, ending, kept):
    path = tmp_path / "cut.txt"
    path.write_text(f"Story A.\n{EOT}\nStory B.\n{EOT}\nStory C is cut off mid{ending}")
    meta = pretokenize.prepare(tmp_path / "out", [path], val_fraction=0.5, progress=False)
    assert meta["sources"][0]["dropped_partial_story"] is not kept
    assert meta["train_stories"] + meta["val_stories"] == (3 if kept else 2)
    assert gpt2.decode(tokens_of(tmp_path / "out" / "train.bin").tolist()) == (
        f"Story A.{EOT}Story C is cut off mid{EOT}" if kept else f"Story A.{EOT}")


def test_reuse_and_rebuild(tmp_path, gpt2):
    path = write_synthetic_stories(tmp_path / "s.txt", copies=4)
    out = tmp_path / "out"
    first = pretokenize.prepare(out, [path], progress=False)
    mtime = (out / "train.bin").stat().st_mtime_ns
    assert pretokenize.prepare(out, [path], progress=False) == first
    assert (out / "train.bin").stat().st_mtime_ns == mtime
    with open(path, "a") as f:
        f.write("A brand new story about a dog.\n<|endoftext|>\n")
    second = pretokenize.prepare(out, [path], progress=False)
    assert second["train_stories"] + second["val_stories"] == 5 * 4 + 1
    assert second["sources"][0]["sha256"] != first["sources"][0]["sha256"]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("content, message", [
    (b"", r"input\.txt is empty"),
    (b"One long text with no breaks at all.\nAnother line.\n", r"has no story separators"),
    (b"\n<|endoftext|>\n  \n<|endoftext|>\n", r"contains no stories"),
    (b"Good story.\n<|endoftext|>\nBad \xff byte.\n<|endoftext|>\n",
     r"input\.txt: invalid UTF-8 at byte offset 30 \(bytes b'\\xff by'\)"),
    (b"Only one story.\n<|endoftext|>\n", r"the val split would be empty"),
])
def test_bad_text_is_refused_clearly(tmp_path, gpt2, content, message):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        pretokenize.prepare(tmp_path / "out", [path], progress=False)
    assert not (tmp_path / "out" / "train.bin").exists()
    assert not list(tmp_path.glob("out/*.tmp"))


def test_invalid_utf8_offset_in_a_later_chunk(tmp_path, gpt2, monkeypatch):
    good = b"A fine story.\n<|endoftext|>\n" * 50
    path = tmp_path / "late.txt"
    path.write_bytes(good + "Caf\u00e9 \u201cok\u201d\n".encode() + b"\xc3(\n<|endoftext|>\n")
    monkeypatch.setattr(pretokenize, "CHUNK_BYTES", 64)
    offset = path.read_bytes().index(b"\xc3(")
    with pytest.raises(DataError, match=f"late.txt: invalid UTF-8 at byte offset {offset:,}"):
        pretokenize.prepare(tmp_path / "out", [path], progress=False)


def test_resolve_data_for_text_files(tmp_path, gpt2):
    a = write_synthetic_stories(tmp_path / "a.txt", copies=3)
    b = tmp_path / "b.txt"
    b.write_text("\n\n".join(SYNTHETIC_STORIES) + "\n")
    out = resolve_data([str(a), str(b)], root=tmp_path / "data")
    assert out.parent == tmp_path / "data" and out.name.startswith("text-")
    meta = load_meta(out)
    assert [s["layout"] for s in meta["sources"]] == ["separator", "blank-line"]
    assert meta["train_stories"] + meta["val_stories"] == 15 + 5
    assert resolve_data([str(b), str(a)], root=tmp_path / "data") != out  # order matters
    with pytest.raises(DataError, match="no such file: missing.txt"):
        resolve_data(["missing.txt"], root=tmp_path)
    with pytest.raises(DataError, match="not a prepared data directory"):
        load_meta(tmp_path)


def test_cli(tmp_path, capsys, gpt2, stories_file):
    assert main(["prepare", "--text", str(stories_file), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    meta = load_meta(next(tmp_path.glob("text-*")))
    assert f"train {meta['train_tokens']:,} tokens" in out
    # The real entry point, in a fresh process: a user error is one line and exit status 1.
    result = subprocess.run(
        [sys.executable, "-m", "minigpt.data", "prepare", "--text", str(tmp_path / "nope.txt"),
         "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: no such file: {tmp_path / 'nope.txt'} (data is 'tinystories', "
        f"'tinystories-v2', a prepared directory, or text files)"]


# ---------------------------------------------------------------------------------------------
# The batch iterator, over a token file whose token at position i is i (so every row names its
# window).

@pytest.fixture(scope="module")
def counting(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("counting")
    n = {"train": 64 * 16 + 1, "val": 100}  # train: exactly 64 windows of 16 + 1 tokens
    for split, count in n.items():
        np.arange(count, dtype=np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.json").write_text(json.dumps(
        {"dtype": "uint16", "tokenizer": "gpt2", "train_tokens": n["train"],
         "val_tokens": n["val"]}))
    return out


def take(it, n):
    return [next(it) for _ in range(n)]


def window_starts(batches) -> list[int]:
    return [int(row[0]) for b in batches for row in b["inputs"]]


def test_windows_cover_the_stream_with_one_token_overlap(counting):
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0, shuffle=False,
                        num_epochs=1)
    batches = list(it)
    assert len(batches) == 8
    inputs = np.concatenate([b["inputs"] for b in batches])    # [64, 16]
    targets = np.concatenate([b["targets"] for b in batches])  # [64, 16]
    assert inputs.dtype == targets.dtype == np.int32
    stream = np.arange(64 * 16 + 1)
    for i in range(64):
        assert np.array_equal(inputs[i], stream[i * 16:i * 16 + 16])
        assert np.array_equal(targets[i], stream[i * 16 + 1:i * 16 + 17])
    assert np.array_equal(inputs[1:, 0], targets[:-1, -1])  # next window starts at last target


def test_shuffle_is_seeded_per_epoch_permutation(counting):
    def epochs(seed, n=2):
        it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=seed, num_epochs=n)
        starts = window_starts(list(it))
        return [starts[64 * e:64 * (e + 1)] for e in range(n)]

    first, second = epochs(seed=1)
    assert sorted(first) == sorted(second) == list(range(0, 64 * 16, 16))
    assert first != second  # a new order each epoch
    assert epochs(seed=1) == [first, second]
    other = epochs(seed=2)[0]
    assert sorted(other) == sorted(first) and other != first


def test_processes_read_their_rows_of_the_same_global_batches(counting):
    whole = take(batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3), 12)
    for count in (2, 4):
        for p in range(count):
            part = take(batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3,
                                       process_index=p, process_count=count), 12)
            rows = slice(p * 8 // count, (p + 1) * 8 // count)
            for mine, full in zip(part, whole):
                assert mine["inputs"].shape == (8 // count, 16)
                assert np.array_equal(mine["inputs"], full["inputs"][rows])
                assert np.array_equal(mine["targets"], full["targets"][rows])
    with pytest.raises(DataError, match="must split evenly over 3 processes"):
        batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3, process_count=3)


def test_a_process_gathers_only_its_own_rows(counting, monkeypatch):
    reads = []

    class Spy:  # stands in for the memory-mapped token file and records every gather
        def __init__(self, tokens):
            self.tokens = tokens

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, index):
            reads.append(np.shape(index))
            return self.tokens[index]

    real_open = minigpt.data._open_split
    monkeypatch.setattr(minigpt.data, "_open_split", lambda *a: Spy(real_open(*a)))
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0, process_index=3,
                        process_count=4)
    take(it, 3)
    assert reads and set(reads) == {(2, 17)}  # 2 of the 8 rows, 16 + 1 tokens each


def test_restored_iterator_continues_with_identical_batches(counting):
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=5)
    take(it, 6)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = take(it, 5)  # crosses into the second epoch
    resumed = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=5)
    resumed.set_state(state)
    for a, b in zip(take(resumed, 5), expected):
        assert np.array_equal(a["inputs"], b["inputs"])
        assert np.array_equal(a["targets"], b["targets"])


def test_iterator_refuses_unusable_requests(counting, tmp_path):
    with pytest.raises(DataError, match=r"has 100 tokens, fewer than one batch of 8 windows"):
        batch_iterator(counting, "val", seq_len=16, batch_size=8, seed=0)
    with pytest.raises(DataError, match="unknown split 'test'"):
        batch_iterator(counting, "test", seq_len=16, batch_size=8, seed=0)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text((counting / "meta.json").read_text())
    (broken / "train.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="prepare the data again"):
        batch_iterator(broken, "train", seq_len=16, batch_size=8, seed=0)


def test_batches_from_prepared_stories(prepared):
    batch = next(batch_iterator(prepared, "train", seq_len=64, batch_size=4, seed=0))
    assert batch["inputs"].shape == batch["targets"].shape == (4, 64)
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].max() < 50257
