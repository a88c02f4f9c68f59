"""Chat fine-tuning (`minigpt.data.chats`): conversations read and refused by file and line,
rendered by the run's own template (ChatML for a zoo vocabulary), the loss on the assistant's
tokens alone exactly where transformers' templates put them, packed whole into windows; and,
in the slow set, an imported instruct model that after 30 steps answers as it was taught, and
a zoo model's chat run with LoRA adapters that resumes exactly."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import losses

from minigpt import chat_template
from minigpt.data import chats
from minigpt.data.cli import main as data_main
from minigpt.data.token_files import DataError
from minigpt.models import get_config
from minigpt.runs import RunDir
from minigpt.tokenizer import load_tokenizer

CHATS = [
    [{"role": "user", "content": "What colour is the sky?"},
     {"role": "assistant", "content": "Blue, said the owl."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
     {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Pear."}],
    [{"role": "user", "content": "Who is Tom?"}, {"role": "assistant", "content": "Tom is a cat."}],
]


def write_chats(path: Path, conversations=CHATS) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


@pytest.fixture
def zoo_run(tmp_path) -> Path:
    """A run directory of a zoo model (its config.json: enough to render and tokenize)."""
    RunDir(tmp_path / "zoo").path.mkdir()
    RunDir(tmp_path / "zoo").write(get_config("llama-cpu"), None)
    return tmp_path / "zoo"


BAD = [
    ("not json", "line 2: not JSON"),
    ('{"chat": []}', 'line 2: expected {"messages"'),
    ('{"messages": [{"role": "user"}]}', "line 2: message 0 needs a role and a content"),
    ('{"messages": [{"role": "narrator", "content": "x"}]}',
     "line 2: message 0 has role 'narrator'; roles are system, user, assistant"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant turn"),
]


@pytest.mark.parametrize("line, said", BAD)
def test_a_conversation_that_cannot_train_is_refused_by_file_and_line(tmp_path, zoo_run, capsys,
                                                                      line, said):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + line + "\n")
    assert data_main(["sft", "--run", str(zoo_run), "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}, {said}") and "\n" not in err


def test_a_template_that_fails_is_refused_by_line(tmp_path):
    tokenizer = chat_template.Templated(load_tokenizer("tinystories-4k"),
                                        "{{ raise_exception('no system role here') }}")
    with pytest.raises(DataError, match=r"chats.jsonl, line 1: .*no system role here"):
        chats.encode(tokenizer, CHATS[0], "chats.jsonl, line 1", max_chars=10_000)


def test_a_zoo_vocabulary_renders_chatml_and_trains_each_reply_with_its_end_token(
        tmp_path, zoo_run, capsys):
    path = write_chats(tmp_path / "chats.jsonl")
    assert data_main(["sft", "--run", str(zoo_run), "--data", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert "rendered as ChatML" in out.err
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert len(rows) == 3
    enc = load_tokenizer("tinystories-4k")
    for conversation, row in zip(CHATS, rows):
        ids, mask = np.array(row["ids"]), np.array(row["loss_mask"], bool)
        trained = enc.decode(ids[mask].tolist())
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert trained == "".join(f"{r}<|endoftext|>\n" for r in replies)
        assert enc.decode(ids[~mask].tolist()).count("<|im_start|>") == len(conversation)
        assert (ids == enc.eot_token).sum() == len(conversation)  # each turn closed by it
    shown = data_main(["sft", "--run", str(zoo_run), "--data", str(path), "--show", "1"])
    assert shown == 0 and "[[Blue, said the owl.<|endoftext|>\n]]" in capsys.readouterr().out


def test_conversations_pack_whole_into_windows_and_a_long_one_is_refused_or_cut():
    made = [chats.Conversation(list(range(n)), [0] * (n // 2) + [1] * (n - n // 2), f"f, line {i}")
            for i, n in enumerate((5, 4, 7), 1)]
    rows = chats.pack(made, 8, truncate=False)
    # 4 + 3 pairs fit the first window of 8, the third's 6 pairs start a second.
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1] * 6 + [0, 0]]
    assert rows["inputs"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows["targets"][0].tolist() == [1, 2, 3, 4, 1, 2, 3, 0]
    assert rows["loss_mask"][0].tolist() == [0, 1, 1, 1, 0, 1, 1, 0]  # padding never trained
    with pytest.raises(DataError, match=r"f, line 3: 7 tokens, longer than a window of 6"):
        chats.pack(made, 5, truncate=False)
    cut = chats.pack(made, 5, truncate=True)
    assert cut["segment_ids"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1] * 5]


@pytest.mark.parametrize("family", ["llama3-instruct", "qwen2-instruct", "smollm2-instruct"])
def test_trained_tokens_are_where_transformers_templates_put_the_replies(tmp_path, family,
                                                                        capsys):
    pytest.importorskip("transformers", reason="needs the [hf] test extra")
    import hf_families

    import minigpt

    checkpoint = hf_families.write_family(family, tmp_path / family)
    minigpt.import_checkpoint(str(tmp_path / family), str(tmp_path / "run"))
    path = write_chats(tmp_path / "chats.jsonl")
    assert data_main(["sft", "--run", str(tmp_path / "run"), "--data", str(path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok = checkpoint.tokenizer

    def ids(messages, **kw):
        return list(tok.apply_chat_template(messages, tokenize=True, **kw)["input_ids"])

    for conversation, row in zip(CHATS, rows):
        mask = [0] * len(ids(conversation))
        for i, message in enumerate(conversation):  # each reply as TRL finds one
            if message["role"] == "assistant":
                start = len(ids(conversation[:i], add_generation_prompt=True))
                mask[start:len(ids(conversation[:i + 1]))] = [1] * (
                    len(ids(conversation[:i + 1])) - start)
        assert row == {"ids": ids(conversation), "loss_mask": mask}


@pytest.mark.slow
def test_an_imported_instruct_model_learns_its_replies(tmp_path, capsys):
    pytest.importorskip("transformers", reason="needs the [hf] test extra")
    import hf_families

    import minigpt
    from minigpt.generate import main as generate_main
    from minigpt.train import main as train_main

    hf_families.write_family("smollm2-instruct", tmp_path / "smol")
    minigpt.import_checkpoint(str(tmp_path / "smol"), str(tmp_path / "run"))
    path = write_chats(tmp_path / "chats.jsonl")
    assert train_main(["--init-from", str(tmp_path / "run"), "--data", str(path), "--preset",
                       "fsdp", "--steps", "30", "--batch-size", "8", "--seq-len", "128", "--lr",
                       "1e-2", "--set", "eval_every=30", "--set", "eval_batches=1",
                       "--out", str(tmp_path / "sft"), "--no-sample"]) == 0
    capsys.readouterr()
    for conversation in (CHATS[0], CHATS[2]):
        assert generate_main(["--run", str(tmp_path / "sft"), "--chat",
                              conversation[0]["content"], "--max-new-tokens", "20"]) == 0
        assert capsys.readouterr().out.strip() == conversation[1]["content"]


@pytest.mark.slow
def test_a_zoo_models_chat_run_resumes_exactly_and_chats_as_it_trained(tmp_path, capsys,
                                                                       small_stories):
    import minigpt
    from minigpt.generate import main as generate_main
    from minigpt.train import main as train_main

    base = ["--model", "llama-cpu", "--preset", "dp", "--batch-size", "8", "--seq-len", "64",
            "--no-sample", "--set", "eval_batches=1"]
    assert train_main([*base, "--data", str(small_stories), "--steps", "2",
                       "--out", str(tmp_path / "stories")]) == 0
    path = write_chats(tmp_path / "chats.jsonl")
    sft = ["--init-from", str(tmp_path / "stories"), "--data", str(path), "--preset", "dp",
           "--batch-size", "8", "--seq-len", "128", "--lr", "1e-2", "--no-sample",
           "--set", "eval_every=100", "--set", "eval_batches=1", "--set", "save_every=10",
           "--set", "train.lora_rank=8", "--set", "decay_steps=20", "--set", "warmup_steps=2"]
    assert train_main([*sft, "--steps", "20", "--out", str(tmp_path / "straight")]) == 0
    assert train_main([*sft, "--steps", "10", "--out", str(tmp_path / "cut")]) == 0
    assert train_main(["--out", str(tmp_path / "cut"), "--resume", "--steps", "20",
                       "--no-sample"]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "straight")
    record = RunDir(tmp_path / "cut").read().record
    assert record["chat_template"] == chat_template.CHATML
    # --chat renders the conversation with the template the run recorded, as training did:
    # its reply is the one the Python API gives from that rendering.
    capsys.readouterr()
    assert generate_main(["--run", str(tmp_path / "cut"), "--chat", "Who is Tom?",
                          "--max-new-tokens", "12", "--temperature", "0"]) == 0
    said = capsys.readouterr().out.strip()
    run = minigpt.load_run(tmp_path / "cut")
    messages = [{"role": "user", "content": "Who is Tom?"}]
    assert run.tokenizer.render_chat(messages) == (
        "<|im_start|>user\nWho is Tom?<|endoftext|>\n<|im_start|>assistant\n")
    with run.layout.active():
        assert said == minigpt.chat(run.model, run.tokenizer, messages, max_new_tokens=12).strip()
