"""Hostile and mistaken chat templates: a checkpoint's chat_template.jinja that never finishes,
renders without end, asks for a terabyte, raises, is not UTF-8, or renders no reply at all, fed
to `python -m minigpt.generate --chat` and to chat fine-tuning as a user would.

The rule: a refusal is exit status 2 with one `error:` line naming the template's fault (a time,
memory or length limit, the template's own message), no traceback, and nothing written (every
file in the test's folder and in the imported run as it was); the renderer goes on serving the
next template. Where a template marks its replies, they are where transformers puts them.
"""

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import refused, snapshot
from tiny_llama import TEMPLATE

from minigpt import chat_template, generate, train
from minigpt.tokenizer import HFTokenizer, TokenizerError, load_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]


def test_generation_spans_are_where_transformers_puts_them(wordpiece_run):
    tok = HFTokenizer(wordpiece_run / "tokenizer")
    rendered = tok.render_chat_with_spans(MESSAGES)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["hello[SEP]", "yes[SEP]"]
    with contextlib.suppress(ImportError):
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template([MESSAGES], chat_template=TEMPLATE,
                                             return_assistant_tokens_mask=True, eos_token="[SEP]")
        assert (rendered.text, list(rendered.spans)) == (texts[0], spans[0])


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "did not finish rendering within 0.5 s"),
    ("{% for i in range(100000) %}{{ 'x' * 1200 }}{% endfor %}", "renders more than 4,096"),
    ("{{ 'x' * 10**12 }}", "needs more than the 1 GiB"),
])
def test_a_template_is_rendered_under_time_memory_and_length_limits(template, message):
    with pytest.raises(chat_template.RenderError, match=message) as refusal:
        chat_template.render(template, MESSAGES, add_generation_prompt=True, max_chars=4096,
                             seconds=0.5)
    assert "\n" not in str(refusal.value)
    # and the renderer goes on serving the next template
    assert chat_template.render("{{ messages[0].content }}", MESSAGES,
                                add_generation_prompt=False).text == "hi"


def test_chat_refusals_are_one_line_before_anything_compiles(wordpiece_run, tmp_path, capsys,
                                                             monkeypatch):
    chat = ["--run", str(wordpiece_run), "--chat"]
    before = snapshot(wordpiece_run)
    refused(capsys, generate.main([*chat, ""]), "--chat needs a message", unchanged=before)
    refused(capsys, generate.main([*chat, "  \n"]), "it is empty", unchanged=before)
    # a message too long for the context, whatever the template does with it
    err = refused(capsys, generate.main([*chat, "once " * 1000]),
                  "the chat's messages hold 5,000 characters, more than a context of 128 tokens",
                  unchanged=before)
    assert "template" not in err
    run = Path(shutil.copytree(wordpiece_run, tmp_path / "run"))
    monkeypatch.setattr(chat_template, "SECONDS", 0.5)
    for template, message in (
            (b"\xff\xfe{{ x }}", "not UTF-8"),
            (b"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "did not finish rendering within 0.5 s"),
            (b"{% for i in range(100000) %}{{ 'x' * 1200 }}{% endfor %}",
             f"renders more than {128 * chat_template.CHARS_PER_TOKEN:,} characters")):
        (run / "tokenizer" / "chat_template.jinja").write_bytes(template)
        load_tokenizer.cache_clear()  # read the template afresh
        before = snapshot(tmp_path)
        refused(capsys, generate.main(["--run", str(run), "--chat", "hi"]), message,
                unchanged=before)


def test_a_template_error_keeps_its_type_and_first_line(wordpiece_run):
    tok = HFTokenizer(wordpiece_run / "tokenizer")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TokenizerError, match="failed: TemplateError: roles must alternate"):
        tok.render_chat(MESSAGES)


def test_a_template_that_renders_no_reply_is_refused_before_training(wordpiece_run, tmp_path,
                                                                     capsys):
    """A chat run whose template leaves the assistant's turns out has nothing to train on: it
    once trained on, at a loss of 0.0."""
    tokenizer = Path(shutil.copytree(wordpiece_run / "tokenizer", tmp_path / "tokenizer"))
    (tokenizer / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role != 'assistant' %}<|{{ m.role }}|>{{ m.content }}"
        "[SEP]\n{% endif %}{% endfor %}")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(20)))
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--model", "llama-tiny", "--tokenizer", str(tokenizer),
                                "--data", str(chats), "--out", str(tmp_path / "run"),
                                "--steps", "1", "--batch-size", "8", "--seq-len", "32",
                                "--no-sample", "--set", f"train.data_root={tmp_path / 'data'}"]),
            f"the conversations of {chats} leave no reply token to train on", unchanged=before)
