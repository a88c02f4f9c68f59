"""The safetensors and index readers (minigpt.hub.safetensors) against files made to break them.

A checkpoint folder is something people download from strangers. Every malformed header,
hostile index and outside-pointing link must be refused when it is opened, as one-line
`WeightsError` naming the file and the tensor or index entry, never as another exception; and
nothing outside the model folder (or, in a Hugging Face cache, the repository's blobs) may be
opened to find out. Fuzzed headers check the same against the `safetensors` package's reader.
"""

import contextlib
import itertools
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzzed headers need hypothesis (the dev extra)")
from conftest import refused  # noqa: E402
from hf_checkpoints import llama_checkpoint, write_hf  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minigpt import hub  # noqa: E402
from minigpt.hub import safetensors as weights  # noqa: E402
from minigpt.hub.safetensors import Checkpoint, SafetensorsFile, WeightsError  # noqa: E402


def _write(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file with this header (JSON, or raw bytes as they are), length and data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _refused(path: Path, *fragments: str) -> str:
    with pytest.raises(WeightsError) as caught:
        SafetensorsFile(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


# --- hand-made hostile headers ---------------------------------------------------------------

HOSTILE = [  # header (JSON, or raw bytes), data, announced length, what the refusal says
    ([W], b"", None, ["the header is a JSON list"]),
    ("w", b"", None, ["the header is a JSON string"]),
    (7, b"", None, ["the header is a JSON number"]),
    (b'{"w": ', b"", None, ["the header is not JSON"]),
    (b"\xff\xfe{}", b"", None, ["not UTF-8"]),
    (b"[" * 100_000, b"", None, ["too deeply nested"]),
    (b'{"w": %s, "w": %s}' % (json.dumps(W).encode(), json.dumps(W).encode()), bytes(8), None,
     ["'w' appears twice"]),
    ({"w": [1, 2]}, b"", None, ["tensor 'w' is a JSON list"]),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, ["tensor 'w' has no data_offsets"]),
    ({"w": {"data_offsets": [0, 8]}}, bytes(8), None, ["tensor 'w' has no dtype and no shape"]),
    ({"w": {**W, "dtype": "F7"}}, bytes(8), None, ["tensor 'w' has dtype 'F7'", "BF16"]),
    ({"w": {**W, "dtype": ["F32"]}}, bytes(8), None, ["tensor 'w' has dtype ['F32']"]),
    ({"w": {**W, "shape": [-2]}}, bytes(8), None, ["tensor 'w' has shape [-2]"]),
    ({"w": {**W, "shape": "2"}}, bytes(8), None, ["tensor 'w' has shape '2'"]),
    ({"w": {**W, "shape": [True, 2]}}, bytes(8), None, ["tensor 'w' has shape [True, 2]"]),
    ({"w": {**W, "shape": [1] * 40}}, bytes(4), None, ["at most 32"]),
    ({"w": {**W, "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}, b"", None,
     ["larger than any array"]),
    ({"w": {**W, "data_offsets": [-8, 0]}}, bytes(8), None, ["data_offsets [-8, 0]"]),
    ({"w": {**W, "data_offsets": [8, 0]}}, bytes(8), None, ["data_offsets [8, 0]"]),
    ({"w": {**W, "data_offsets": [0, 8, 16]}}, bytes(8), None, ["not two integers"]),
    ({"w": {**W, "data_offsets": [0.0, 8.0]}}, bytes(8), None, ["not two integers"]),
    ({"w": {**W, "data_offsets": [2**70, 2**70 + 8]}}, bytes(8), None, ["past the 8-byte"]),
    ({"w": W}, bytes(4), None, ["tensor 'w' ends at byte 8, past the 4-byte data section",
                                "is truncated"]),
    ({"w": {**W, "shape": [3]}}, bytes(12), None,
     ["tensor 'w' holds 8 bytes but its shape [3] of F32 needs 12"]),
    ({"a": W, "b": {**W, "data_offsets": [4, 12]}}, bytes(12), None,
     ["tensors 'a' and 'b' share bytes 4 to 8"]),
    # listed out of order, and the second inside the first: sorting finds them all the same
    ({"b": {**W, "data_offsets": [16, 24]}, "c": {**W, "shape": [1], "data_offsets": [4, 8]},
      "a": {**W, "shape": [4], "data_offsets": [0, 16]}}, bytes(24), None,
     ["tensors 'a' and 'c' share bytes 4 to 16"]),
    ({"w": W, "__metadata__": ["pt"]}, bytes(8), None, ["__metadata__ is not an object"]),
    ({"w": W, "__metadata__": {"format": 1}}, bytes(8), None, ["__metadata__ is not an object"]),
    ({"w": W}, bytes(8), 2**63, ["announce a header of 9,223,372,036,854,775,808 bytes"]),
    ({"w": W}, bytes(8), 100_000_001, ["beyond the 100,000,000"]),
    ({"w": W}, bytes(8), 1_000, ["is truncated: its header needs 1,000 bytes"]),
]


@pytest.mark.parametrize("header,data,length,fragments", HOSTILE,
                         ids=[fragments[0] for *_, fragments in HOSTILE])
def test_hostile_headers_are_refused_when_opened(tmp_path, header, data, length, fragments):
    _refused(_write(tmp_path / "model.safetensors", header, data, length), *fragments)


def test_a_file_too_short_for_a_header_length_is_truncated(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    _refused(tmp_path / "model.safetensors", "is truncated: 2 bytes")


def test_names_from_the_file_are_shown_on_one_line_and_cut_short(tmp_path):
    name = "evil\n\x1b[2J" + "x" * 10_000
    message = _refused(_write(tmp_path / "m.safetensors", {name: {**W, "dtype": "F7"}}, bytes(8)))
    assert "\x1b" not in message and len(message) < 400


def test_what_a_file_may_hold_is_still_read(tmp_path):
    """Empty tensors (anywhere), gaps between tensors, a null __metadata__, padding."""
    data = np.arange(6, dtype=np.float32).tobytes()
    header = {"__metadata__": None, "empty": {"dtype": "I8", "shape": [0, 3], "data_offsets":
                                              [4, 4]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
              "a": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}}
    file = SafetensorsFile(_write(tmp_path / "m.safetensors", json.dumps(header).encode() + b"  ",
                                  data))
    assert file.metadata == {} and sorted(file.keys()) == ["a", "b", "empty"]
    np.testing.assert_array_equal(file["a"], [[0, 1]])
    np.testing.assert_array_equal(file["b"], [4, 5])
    assert file["empty"].shape == (0, 3) and file["empty"].dtype == np.int8


def test_overlapping_tensors_are_refused_by_the_import_cli(tmp_path, capsys):
    """Before the check, two tensors sharing bytes imported silently: one layer norm received
    the other's weights."""
    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w)
    path = hf / weights.SINGLE
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    first, second = (f"model.layers.{i}.input_layernorm.weight" for i in (0, 1))
    header[second]["data_offsets"] = header[first]["data_offsets"]
    _write(path, header, raw[8 + length:])
    refused(capsys, hub.main(["import", str(hf), "--out", str(tmp_path / "run")]),
            f"tensors '{first}' and '{second}' share bytes")
    assert not (tmp_path / "run").exists()


# --- fuzzed headers --------------------------------------------------------------------------

UNKNOWN = ["F7", "bf16", "", "F32 "]  # names neither minigpt nor the safetensors package reads


@st.composite
def _files(draw):
    """(header, header bytes, announced length, data): mostly well-formed files with a few
    things wrong, in any order, so both the accepting and the refusing paths are exercised."""
    names = draw(st.lists(st.text(max_size=4), max_size=4, unique=True))
    header, offset = {}, 0
    for name in names:
        dtype = draw(st.sampled_from([*weights.DTYPES] * 6 + UNKNOWN))
        shape = draw(st.lists(st.sampled_from([0, 1, 2, 3] * 4 + [-1]), max_size=3))
        itemsize = weights.DTYPES[dtype].itemsize if dtype in weights.DTYPES else 4
        nbytes = math.prod(max(n, 0) for n in shape) * itemsize
        where = draw(st.sampled_from(["next"] * 6 + ["after a gap", "overlapping", "anywhere"]))
        begin = {"next": offset, "after a gap": offset + draw(st.integers(0, 8)),
                 "overlapping": max(0, offset - draw(st.integers(1, 8))),
                 "anywhere": draw(st.integers(-4, 64))}[where]
        end = begin + nbytes + draw(st.sampled_from([0] * 24 + [-1, 1, -begin - 1]))
        offset = max(offset, end)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        broken = draw(st.sampled_from([None] * 40 + list(entry)))
        if broken is not None:
            entry[broken] = draw(st.sampled_from([None, "x", 1.5, [], {}, [1, 2, 3]]))
        header[name] = entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.sampled_from([{"format": "pt"}, {}, None, {"a": "b"}] * 2
                                                      + [["pt"], {"format": 1}]))
    order = draw(st.permutations(list(header)))
    header = {name: header[name] for name in order}
    data_size = max(0, offset + draw(st.sampled_from([0] * 12 + [-1, -4, 3])))
    data = draw(st.binary(min_size=data_size, max_size=data_size))
    text = json.dumps(header).encode() + b" " * draw(st.integers(0, 7))
    length = len(text) + draw(st.sampled_from([0] * 12 + [-1, 1, 2**40]))
    return header, text, max(length, 0), data


_numbered = itertools.count()


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(made=_files())
def test_fuzzed_headers_read_back_their_bytes_or_are_refused(tmp_path, made):
    safetensors = pytest.importorskip("safetensors.numpy")
    header, text, length, data = made
    path = _write(tmp_path / f"{next(_numbered)}.safetensors", text, data, length)
    try:
        ours = SafetensorsFile(path)
    except WeightsError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        ours = None
    try:
        theirs = safetensors.load_file(path)
    except Exception:  # the package refuses more than we do: gaps, empty tensors inside others
        theirs = None
    assert ours is not None or theirs is None, f"the safetensors package reads {header}"
    if ours is None:
        return
    section = (text + data)[length:]  # where the announced length says the data begins
    spans = sorted(tuple(header[name]["data_offsets"]) for name in ours.keys())
    spans = [(begin, end) for begin, end in spans if end > begin]
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:])), "shared bytes"
    assert sorted(ours.keys()) == sorted(set(header) - {"__metadata__"})
    for name in ours.keys():
        entry = header[name]
        begin, end = entry["data_offsets"]
        array = ours[name]
        assert array.shape == tuple(entry["shape"])
        assert array.dtype == weights.DTYPES[entry["dtype"]]
        assert array.tobytes() == section[begin:end]
        if theirs is not None:
            assert theirs[name].shape == array.shape
            assert theirs[name].tobytes() == section[begin:end]


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_random_bytes_are_refused_as_a_weights_error(tmp_path, raw):
    path = tmp_path / f"{next(_numbered)}.safetensors"
    path.write_bytes(raw)
    try:
        SafetensorsFile(path)
    except WeightsError as error:
        assert "\n" not in str(error) and str(path) in str(error)


# --- indexes and the paths they name ---------------------------------------------------------

_recorders: list[list[str]] = []


def _audit(event, args):
    if event == "open" and _recorders and isinstance(args[0], (str, bytes, os.PathLike)):
        _recorders[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed: it records only while a test listens


@contextlib.contextmanager
def watching_opens():
    """Every path opened (by open, Path.open, os.open, np.memmap...) inside the block."""
    paths: list[str] = []
    _recorders.append(paths)
    try:
        yield paths
    finally:
        _recorders.remove(paths)


def _opened_inside(paths: list[str], *folders: Path) -> bool:
    real = [Path(os.path.realpath(folder)) for folder in folders]
    return all(any(Path(os.path.realpath(p)).is_relative_to(f) for f in real) for p in paths)


SECRET = np.arange(12_345, dtype=np.uint8)  # an outside file whose size we can look for


@pytest.fixture
def outside(tmp_path):
    """A folder beside the model holding a file that must never be opened."""
    folder = tmp_path / "outside"
    folder.mkdir()
    weights.save({"secret": SECRET}, folder)
    return folder / weights.SINGLE


def _says_nothing_of_the_secret(message: str, folder: Path) -> None:
    """Neither the outside file's size nor its name nor its content, wherever the temporary
    folder's own name (which may hold any digits) is left out."""
    told = message.replace(str(folder), "")
    for secret in (str(SECRET.nbytes), f"{SECRET.nbytes:,}", "secret", SECRET[:16].tobytes().hex()):
        assert secret not in told, message


def _model(folder: Path, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A model folder of one shard, `shard.safetensors`, and an index naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors or {"w": np.arange(6, dtype=np.float32)}
    weights.save(tensors, folder)
    (folder / weights.SINGLE).rename(folder / "shard.safetensors")
    _index(folder, dict.fromkeys(tensors, "shard.safetensors"))
    return folder


def _index(folder: Path, weight_map) -> None:
    (folder / weights.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _refused_checkpoint(folder: Path, *fragments: str, opens_only: Path | None = None) -> str:
    """The refusal's message, checked for `fragments`; with `opens_only`, checked too that no
    file outside that folder was opened on the way to it."""
    with watching_opens() as opened, pytest.raises(WeightsError) as caught:
        Checkpoint(folder)
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    if opens_only is not None:
        assert _opened_inside(opened, opens_only), opened
    return message


def test_an_index_is_read_with_its_shards(tmp_path):
    folder = _model(tmp_path / "m", {"a": np.ones(3, np.float32), "b": np.zeros(2, np.int8)})
    with watching_opens() as opened:
        checkpoint = Checkpoint(folder)
    assert sorted(checkpoint.keys()) == ["a", "b"]
    np.testing.assert_array_equal(checkpoint["a"], np.ones(3))
    assert len(opened) == 2 and _opened_inside(opened, folder), opened  # the index, the shard


@pytest.mark.parametrize("file", ["../outside/model.safetensors", "sub/../../x.safetensors",
                                  "ABSOLUTE", "", "C:shard.safetensors",
                                  "..\\outside\\model.safetensors", "shard.safetensors\0"])
def test_index_entries_that_are_not_relative_names_are_refused(tmp_path, outside, file):
    folder = _model(tmp_path / "m")
    file = str(outside) if file == "ABSOLUTE" else file
    _index(folder, {"w": file})
    message = _refused_checkpoint(folder, f"{folder / weights.INDEX} entry 'w' names",
                                  "not a path relative to the model folder",
                                  opens_only=folder)
    _says_nothing_of_the_secret(message, folder)


@pytest.mark.parametrize("layout", ["index entry", "shard in a linked folder", "single file",
                                    "index itself"])
def test_links_out_of_the_folder_are_refused_before_anything_is_opened(tmp_path, outside, layout):
    folder = _model(tmp_path / "m")
    if layout == "index entry":
        (folder / "linked.safetensors").symlink_to(outside)
        _index(folder, {"w": "linked.safetensors"})
        fragment = "entry 'w' names 'linked.safetensors', which leads outside"
    elif layout == "shard in a linked folder":
        (folder / "sub").symlink_to(outside.parent, target_is_directory=True)
        _index(folder, {"w": "sub/model.safetensors"})
        fragment = "entry 'w' names 'sub/model.safetensors', which leads outside"
    elif layout == "single file":
        (folder / weights.INDEX).unlink()
        (folder / weights.SINGLE).symlink_to(outside)
        fragment = f"{folder / weights.SINGLE} names 'model.safetensors', which leads outside"
    else:
        (folder / weights.INDEX).unlink()
        (folder / weights.INDEX).symlink_to(outside)
        fragment = f"names '{weights.INDEX}', which leads outside"
    message = _refused_checkpoint(folder, fragment, opens_only=folder)
    _says_nothing_of_the_secret(message, folder)
    assert str(outside.parent) not in message


def test_a_refusal_says_nothing_of_whether_the_outside_file_exists(tmp_path, outside):
    messages = []
    for target in (outside, outside.parent / "missing.safetensors"):
        folder = _model(tmp_path / "m")
        (folder / "linked.safetensors").unlink(missing_ok=True)
        (folder / "linked.safetensors").symlink_to(target)
        _index(folder, {"w": "linked.safetensors"})
        messages.append(_refused_checkpoint(folder, "leads outside"))
    assert messages[0] == messages[1]


def _hub_cache(cache: Path, repo: str, tensors: dict[str, np.ndarray]) -> Path:
    """A Hugging Face cache repository as the Hub client lays it out: the bytes in blobs/, and a
    snapshot folder of relative links to them. Returns the snapshot folder."""
    blobs = cache / f"models--{repo}" / "blobs"
    blobs.mkdir(parents=True)
    weights.save(tensors, blobs)
    (blobs / weights.SINGLE).rename(blobs / "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd1")
    snapshot = cache / f"models--{repo}" / "snapshots" / ("0123456789abcdef" * 3)[:40]
    snapshot.mkdir(parents=True)
    return snapshot


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs(tmp_path):
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    snapshot = _hub_cache(tmp_path / "hub", "a--b", tensors)
    blob = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd1"
    (snapshot / weights.SINGLE).symlink_to(Path("../../blobs") / blob)
    with watching_opens() as opened:
        np.testing.assert_array_equal(Checkpoint(snapshot)["w"], tensors["w"])
    # and the sharded layout, whose index is a blob too
    (snapshot / weights.SINGLE).rename(snapshot / "model-00001-of-00001.safetensors")
    blobs = snapshot.parent.parent / "blobs"
    (blobs / "index-blob").write_text(json.dumps(
        {"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (snapshot / weights.INDEX).symlink_to(Path("../../blobs/index-blob"))
    with watching_opens() as opened_too:
        np.testing.assert_array_equal(Checkpoint(snapshot)["w"], tensors["w"])
    assert _opened_inside(opened + opened_too, blobs) and len(opened + opened_too) == 3


def test_a_hub_cache_snapshot_may_not_link_into_another_repositorys_blobs(tmp_path):
    _hub_cache(tmp_path / "hub", "other--secret", {"secret": SECRET})
    snapshot = _hub_cache(tmp_path / "hub", "a--b", {"w": np.ones(2, np.float32)})
    blob = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd1"
    (snapshot / weights.SINGLE).symlink_to(Path("../../../models--other--secret/blobs") / blob)
    message = _refused_checkpoint(snapshot, "names 'model.safetensors', which leads outside",
                                  opens_only=snapshot.parent.parent)
    _says_nothing_of_the_secret(message, snapshot)
    # nor may a folder that merely looks like a cache link anywhere above it
    (snapshot / weights.SINGLE).unlink()
    (snapshot / weights.SINGLE).symlink_to(Path("../../../../outside.safetensors"))
    _refused_checkpoint(snapshot, "leads outside")


@pytest.mark.parametrize("index,fragments", [
    ([], ["is not a safetensors index: it is a JSON list"]),
    ({"weight_map": [["w", "shard.safetensors"]]}, ["its weight_map is a JSON list"]),
    ({"metadata": {}}, ["its weight_map is a JSON null"]),
    ({"weight_map": {"w": 3}}, ["gives tensor 'w' a JSON number, not a file name"]),
    ({"weight_map": {"w": "missing.safetensors"}},
     ["names 'missing.safetensors', which is not in"]),
    ({"weight_map": {"v": "shard.safetensors"}},
     ["puts 'v' in 'shard.safetensors', which does not hold it"]),
    ({"weight_map": {"w": "config.json"}}, ["config.json: its first 8 bytes announce"]),
])
def test_malformed_indexes_are_refused_in_one_line(tmp_path, index, fragments):
    folder = _model(tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / weights.INDEX).write_text(json.dumps(index))
    _refused_checkpoint(folder, *fragments)


def test_an_index_that_is_not_json_is_refused(tmp_path):
    folder = _model(tmp_path / "m")
    (folder / weights.INDEX).write_text("{ nope")
    _refused_checkpoint(folder, f"{folder / weights.INDEX} is not a safetensors index: it is "
                                f"not JSON")
