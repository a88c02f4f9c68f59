"""A tiny Llama in the Hugging Face layout with a tokenizer trained here (WordPiece, BERT's
layout, or Unigram, SentencePiece's), its tokenizer_config.json and a chat template that marks
the replies with `{% generation %}`: the checkpoint the hostile-input tests change one file of
at a time (`hf_folder`), and, imported, the `wordpiece_run` fixture of tests/conftest.py.
"""

import json
from pathlib import Path

from hf_checkpoints import llama_checkpoint, write_hf

V, D, L = 256, 64, 1  # the tiny Llama: vocabulary, width, layers
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}"
            "{% generation %}{{ m.content }}[SEP]{% endgeneration %}{% else %}{{ m.content }}"
            "[SEP]{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ["Once upon a time there was a little cat named Tom who liked to play.",
        "One day Lily went to the park with her mom and saw a big dog.",
        "Ben had a toy car and he drove it around the house all day long."] * 40


def tokenizer(kind: str):
    """A WordPiece (BERT's layout) or Unigram (SentencePiece's) tokenizer of at most V ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pt

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pt.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=V - 8, show_progress=False,
                                            special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pt.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=V - 8, show_progress=False, unk_token="<unk>",
                                          special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXT, trainer)
    return tok


def hf_folder(directory: Path, kind: str = "wordpiece", *, config=None, tensors=None,
              files=None) -> Path:
    """A tiny Llama in the Hugging Face layout with its tokenizer and configs; `config`
    changes config.json, `files` adds (or, with None, removes) files."""
    hf_config, weights = llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)
    write_hf(directory, {**hf_config, **(config or {})}, {**weights, **(tensors or {})})
    tokenizer(kind).save(str(directory / "tokenizer.json"))
    end = "[SEP]" if kind == "wordpiece" else "</s>"
    defaults = {"tokenizer_config.json": {"eos_token": end, "unk_token": "[UNK]"},
                "chat_template.jinja": TEMPLATE}
    for name, content in {**defaults, **(files or {})}.items():
        path = directory / name
        if content is None:
            path.unlink(missing_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
    return directory
