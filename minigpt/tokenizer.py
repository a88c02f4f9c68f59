"""Tokenizers: tiktoken encodings by name (GPT-2 by default) and the messages when they fail.

The zoo's own vocabularies are tiktoken encodings: tiktoken's `gpt2`, and byte-level BPE
vocabularies trained on TinyStories that ship with minigpt as ranks files (`tinystories-4k`, in
`minigpt/vocabularies/`, each beside a JSON file saying how it was made); a path to such a
`.tiktoken` file works too. They load as an `Encoding`: a `tiktoken.Encoding` that keeps what it
was made of at hand (`ranks`, `pattern`, `special_tokens`), which exporting it needs and tiktoken
keeps private. The shipped vocabularies are their mergeable ranks, GPT-2's split pattern and
`<|endoftext|>` as the last id; a ranks file converted from a Hugging Face tokenizer by earlier
versions has its own split regex and special tokens, recorded as `pat_str` and `special_tokens`
in its JSON. An imported checkpoint's tokenizer is an `HFTokenizer`: its own `tokenizer.json`,
read by the `tokenizers` library that defines the format. Both speak one interface (see
`Encoding`), which training, generation, the notebooks and export use. Training a new vocabulary
is `minigpt.data.vocabulary`.

tiktoken fetches an encoding's BPE files from OpenAI's blob store on first use and keeps them in
a cache directory. Without a network and without that cache it fails deep inside `requests`
with a connection traceback; `load_tokenizer` turns that into one message that says how to
point `TIKTOKEN_CACHE_DIR` at a copy of the files. The document separator of the GPT-2
encoding is `<|endoftext|>`, id 50256 (`enc.eot_token`).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import tiktoken
from tiktoken_ext import openai_public

from minigpt import chat_template
from minigpt.config.values import ConfigError, check_value
from minigpt.errors import TokenizerError
from minigpt.files import first_line, read_json_object
from minigpt.ranks import read_provenance, read_ranks, write_ranks  # noqa: F401 (exported)

DEFAULT_TOKENIZER = "gpt2"
# End-of-text tokens by their usual names, for a tokenizer whose configs name none.
END_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
SHIPPED_DIR = Path(__file__).resolve().parent / "vocabularies"
EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation, whitespace. A BPE
# merge never crosses these pieces.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Encoding(tiktoken.Encoding):
    """A tiktoken encoding with what it is made of at hand: `ranks` (token bytes -> id, the id
    also the merge priority), the split regex `pattern` and `special_tokens` (name -> id).

    It speaks the interface every minigpt tokenizer speaks (`HFTokenizer` is the other):
    `encode_ordinary[_batch]` (text as text: special tokens' names are not special),
    `encode_prompt`, `decode(ids, skip_special_tokens=False)`, `n_vocab`, `n_rows` (the
    embedding rows a model needs for every id it gives), `eot_token` (the id
    after each document, `<|endoftext|>`), `bos_token` (before each document: None here),
    `stop_tokens` (where generation stops) and `chat_template` (None here)."""

    bos_token = None
    chat_template = None

    def __init__(self, name: str, *, pattern: str, ranks: dict[bytes, int],
                 special_tokens: dict[str, int], explicit_n_vocab: int | None = None):
        super().__init__(name, pat_str=pattern, mergeable_ranks=ranks,
                         special_tokens=special_tokens, explicit_n_vocab=explicit_n_vocab)
        self.ranks, self.pattern, self.special_tokens = ranks, pattern, dict(special_tokens)

    @property
    def n_rows(self) -> int:
        return self.n_vocab

    @property
    def eot_token(self) -> int:
        """`<|endoftext|>`, or the first special token where it is absent."""
        specials = self.special_tokens
        if not specials:
            raise TokenizerError(f"{self.name} has no special token to end a document with")
        return specials.get(EOT, min(specials.values()))

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return (self.eot_token,)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as a document starts in the training stream: after the end token that
        closes the one before (which starts a document where documents are kept apart)."""
        return [self.eot_token, *self.encode_ordinary(text)]

    def render_chat(self, messages: list[dict], **options) -> str:
        raise TokenizerError(f"the {self.name} tokenizer has no chat template (runs imported "
                             f"from an instruct checkpoint have one): use --prompt instead")

    render_chat_with_spans = render_chat

    def decode(self, tokens, errors: str = "replace", skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            special = set(self.special_tokens.values())
            tokens = [t for t in tokens if t not in special]
        return super().decode(tokens, errors=errors)


class HFTokenizer:
    """A Hugging Face tokenizer, as its own library (`tokenizers`) reads it: a folder holding
    the checkpoint's `tokenizer.json` and, where it had them, `tokenizer_config.json`,
    `generation_config.json` and `chat_template.jinja` (`minigpt.hub` copies them into a run).

    Normalizers, pre-tokenizers, byte fallback, `▁` spaces and added tokens behave as they do
    for the people who trained the model, because the same library runs them. Its begin token
    (added before each document where the tokenizer's post-processor adds it, as Llama's does),
    its end tokens (a list is kept whole: generation stops at any of them; the first separates
    documents) and its chat template come from the configs, generation_config.json first; where
    they name no end token, a special token of a usual end name (`END_NAMES`) is one.

    A model may have fewer embedding rows (`n_rows`: its config.json's `vocab_size`, which
    `minigpt.hub` writes into a run) than the tokenizer has ids: Gemma 3's list
    `<image_soft_token>` one past them. Text spelling a special token past the rows is refused
    where it is encoded; ordinary ids past them, when loaded. Same interface as `Encoding`."""

    def __init__(self, folder: str | Path):
        import tokenizers  # only imported checkpoints need it

        self.folder = Path(folder)
        self.name = self.folder.name
        path = self.folder / "tokenizer.json"
        try:
            self.inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises plain Exceptions for a file it refuses
            raise TokenizerError(f"{path} cannot be read by the tokenizers library: "
                                 f"{first_line(error)}") from None
        self.special_tokens = {t.content: i for i, t in
                               self.inner.get_added_tokens_decoder().items() if t.special}
        self.n_vocab = self.inner.get_vocab_size(with_added_tokens=True)
        self._files = [self.folder / name for name in (
            "generation_config.json", "config.json", "tokenizer_config.json")]
        configs = [read_json_object(path, TokenizerError) for path in self._files]
        self.stop_tokens = self._ids(configs, "eos") or tuple(
            self.special_tokens[name] for name in END_NAMES if name in self.special_tokens)[:1]
        bos = self._ids(configs, "bos")
        try:
            added = self.inner.encode("a", add_special_tokens=True).ids
        except Exception as error:  # e.g. a model that cannot encode without an unknown token
            raise TokenizerError(f"{path} cannot encode text: {first_line(error)}") from None
        self.bos_token = bos[0] if bos and added[:1] == [bos[0]] else None
        # None: nothing to end a document with (data preparation then refuses the tokenizer).
        self.eot_token = self.stop_tokens[0] if self.stop_tokens else None
        self._config = configs[2]
        self.chat_template = _chat_template(self.folder, configs[2])
        self.n_rows = self._rows(configs[1])

    def _rows(self, config: dict) -> int:
        """The ids a model reads: the config's `vocab_size` where it holds fewer than the
        tokenizer's, once every id past them is checked to be a special token that is not a
        begin or end token."""
        rows, where = config.get("vocab_size"), f"{self._files[1]}: vocab_size"
        if rows is None or (type(rows) is int and rows >= self.n_vocab):
            return self.n_vocab
        if type(rows) is not int or rows < 1:
            raise TokenizerError(f"{where} must be a positive number of rows, got "
                                 f"{json.dumps(rows)[:60]}")
        special = set(self.special_tokens.values())
        ordinary = next((i for i in range(rows, self.n_vocab) if i not in special), None)
        if ordinary is not None:
            raise TokenizerError(
                f"{self.folder / 'tokenizer.json'} has {self.n_vocab:,} tokens but the model's "
                f"vocabulary is {rows:,}: {self.token_name(ordinary)!r} (id {ordinary}) is "
                f"ordinary text past the embedding rows; the checkpoint and its tokenizer "
                f"disagree")
        ends = [i for i in (*self.stop_tokens, self.bos_token) if i is not None and i >= rows]
        if ends:
            raise TokenizerError(f"{where} is {rows:,}, but the begin or end token "
                                 f"{self.token_name(ends[0])!r} is id {ends[0]}, past the "
                                 f"model's embedding rows")
        return rows

    def _readable(self, ids: list[int]) -> list[int]:
        """`ids`, refused (TokenizerError) where the text spelled a special token past the
        model's embedding rows."""
        if self.n_rows < self.n_vocab and ids and max(ids) >= self.n_rows:
            token = next(i for i in ids if i >= self.n_rows)
            raise TokenizerError(
                f"the text holds {self.token_name(token)}, token {token}, a special token past "
                f"the model's {self.n_rows:,} embedding rows (the tokenizer lists it for inputs "
                f"this model does not read): remove it from the text")
        return ids

    def _ids(self, configs: list[dict], role: str) -> tuple[int, ...]:
        """The ids of the begin ("bos") or end ("eos") tokens: generation_config.json's and
        config.json's ids (one, or a list), else tokenizer_config.json's token names. Each is
        checked where it is read: ids of the vocabulary, names as text."""
        for config, path in zip(configs[:2], self._files):
            where = f"{path}: {role}_token_id"
            ids = token_ids(config.get(f"{role}_token_id"), where)
            outside = [i for i in ids if not 0 <= i < self.n_vocab]
            if outside:
                raise TokenizerError(f"{where} names {outside[0]}, which is not a token of "
                                     f"this tokenizer (ids 0 to {self.n_vocab - 1})")
            if ids:
                return tuple(dict.fromkeys(ids))
        name = configs[2].get(f"{role}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if name is not None and not isinstance(name, str):
            raise TokenizerError(f"{self._files[2]}: {role}_token must be a token's text (or "
                                 f"an object with its content), got {json.dumps(name)[:60]}")
        token = None if name is None else self.inner.token_to_id(name)
        return () if token is None else (token,)

    def encode_ordinary(self, text: str) -> list[int]:
        """The text's ids without what the post-processor adds (its begin token). Unlike a
        tiktoken `Encoding`'s, special tokens written in the text are those tokens, as
        transformers reads them with `add_special_tokens=False`: a rendered chat template
        spells its turns that way."""
        return self._readable(self.inner.encode(text, add_special_tokens=False).ids)

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        return [self._readable(e.ids)
                for e in self.inner.encode_batch(texts, add_special_tokens=False)]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model's own tokenizer gives it to the model (its begin token too)."""
        return self._readable(self.inner.encode(text, add_special_tokens=True).ids)

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        return self.inner.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def token_name(self, token: int) -> str | None:
        return self.inner.id_to_token(token)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    max_chars: int = chat_template.DEFAULT_MAX_CHARS) -> str:
        """The conversation as the model reads it: the chat template rendered the way
        transformers' `apply_chat_template` renders it (`minigpt.chat_template`: the sandbox,
        its time, memory and `max_chars` limits). A template that fails or exceeds a limit
        says why, in one line."""
        return self.render_chat_with_spans(messages, add_generation_prompt=add_generation_prompt,
                                           max_chars=max_chars).text

    def render_chat_with_spans(self, messages: list[dict], *, add_generation_prompt: bool = False,
                               max_chars: int = chat_template.DEFAULT_MAX_CHARS
                               ) -> chat_template.Rendered:
        """The rendered conversation and the [start, end) character spans its template marks
        with `{% generation %}` (the assistant's replies, as transformers'
        `return_assistant_tokens_mask` finds them; none where the template has no such tag)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.folder} has no chat template (tokenizer_config.json's "
                                 f"chat_template, or chat_template.jinja): use --prompt instead")
        roles = {}
        for role in ("bos", "eos", "unk", "pad"):
            ids = self._ids([{}, {}, self._config], role)
            if ids:
                roles[f"{role}_token"] = self.inner.id_to_token(ids[0])
        try:
            return chat_template.render(self.chat_template, list(messages), variables=roles,
                                        add_generation_prompt=add_generation_prompt,
                                        max_chars=max_chars)
        except chat_template.TooLong as error:
            raise TokenizerError(str(error)) from None
        except chat_template.RenderError as error:
            raise TokenizerError(f"the chat template of {self.folder} {error}") from None


def token_ids(value, where: str) -> tuple[int, ...]:
    """A config's `bos_token_id` or `eos_token_id`: one id, a list of them, or none (null),
    type-checked as every config field is (`minigpt.config.values.check_value`)."""
    if value is None:
        return ()
    try:
        if isinstance(value, list):
            check_value(where, tuple[int, ...], tuple(value))
            return tuple(value)
        check_value(where, int, value)
    except ConfigError as error:
        raise TokenizerError(f"{error}: a token id, or a list of them") from None
    return (value,)


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The chat template: chat_template.jinja (how transformers 5 saves it), else
    tokenizer_config.json's `chat_template` (a string, or named templates: "default"); a file
    that is not UTF-8 text, or a value of another shape, is refused in one line."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise TokenizerError(f"{jinja} is not UTF-8 text (byte {error.start}), so it is not "
                                 f"a chat template: replace it with the checkpoint's own") from None
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in template):
        return {t["name"]: t["template"] for t in template}.get("default")
    if template is None or isinstance(template, str):
        return template
    raise TokenizerError(f"{folder / 'tokenizer_config.json'}: chat_template must be a template "
                         f"(text) or a list of named ones, got {json.dumps(template)[:60]}")


def _cache_dir() -> str:
    """Where tiktoken looks for its files, resolved the way tiktoken.load resolves it."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def shipped_tokenizers() -> list[str]:
    """Names of the vocabularies that ship with minigpt (`tinystories-4k`, ...)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.tiktoken"))


def ranks_file(name: str) -> Path | None:
    """The ranks file a tokenizer name means, or None for tiktoken's own encodings and
    tokenizer folders."""
    if (Path(name) / "tokenizer.json").is_file():
        return None
    if name in shipped_tokenizers():
        return SHIPPED_DIR / f"{name}.tiktoken"
    if name.endswith(".tiktoken") or os.sep in name:
        return Path(name)
    return None


def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Encoding | HFTokenizer:
    """The tokenizer called `name`, loaded once per process: a folder holding a tokenizer.json
    (an imported checkpoint's: `HFTokenizer`), or an `Encoding` (tiktoken's own, a shipped
    vocabulary, or a `.tiktoken` ranks file).

    Raises TokenizerError for an unknown name (listing the known ones), an unreadable file,
    and when tiktoken's files can be neither read from the cache nor downloaded.
    """
    return _load(name)


@functools.cache
def _load(name: str) -> Encoding | HFTokenizer:
    if (Path(name) / "tokenizer.json").is_file():
        return HFTokenizer(name)
    path = ranks_file(name)
    if path is not None:
        return _from_ranks(name, path)
    known = openai_public.ENCODING_CONSTRUCTORS
    if name not in known:
        raise TokenizerError(
            f"unknown tokenizer {name!r}: minigpt ships {', '.join(shipped_tokenizers())}; "
            f"tiktoken {tiktoken.__version__} knows {', '.join(sorted(known))}; or give the "
            f"path of a .tiktoken ranks file")
    try:
        # tiktoken's plugin table says what each encoding is made of; reading it ourselves
        # keeps the ranks at hand.
        made_of = known[name]()
    except (OSError, ValueError) as error:
        # requests' connection errors are OSErrors; a download that fails tiktoken's sha256
        # check is a ValueError. Both mean the files are not usable from here.
        detail = (str(error).splitlines() or ["no details"])[0][:160]
        raise TokenizerError(
            f"cannot load the {name!r} tokenizer: its BPE files are not in the tiktoken cache "
            f"({_cache_dir()}) and downloading them failed ({type(error).__name__}: {detail}). "
            f"Offline, set TIKTOKEN_CACHE_DIR to a directory holding the files under tiktoken's "
            f"cache names: copy the cache directory of a machine where "
            f"`tiktoken.get_encoding({name!r})` ran, then `export TIKTOKEN_CACHE_DIR=<that "
            f"directory>`."
        ) from error
    return Encoding(made_of["name"], pattern=made_of["pat_str"],
                    ranks=made_of["mergeable_ranks"], special_tokens=made_of["special_tokens"],
                    explicit_n_vocab=made_of.get("explicit_n_vocab"))


def _from_ranks(name: str, path: Path) -> Encoding:
    """A ranks file as an encoding: the split regex (`pat_str`) and special tokens come from its
    provenance JSON (converted vocabularies have both); else GPT-2's pattern and
    `<|endoftext|>` after the last rank."""
    provenance = read_provenance(path)
    specials = provenance.get("special_tokens")
    ranks = read_ranks(path, specials.values() if specials else ())
    pat_str = provenance.get("pat_str", PATTERN)
    try:
        return Encoding(path.stem, pattern=pat_str, ranks=ranks,
                        special_tokens=specials or {EOT: len(ranks)})
    except ValueError as error:  # a pat_str that tiktoken's regex engine does not compile
        raise TokenizerError(f"{path.with_suffix('.json')}: tiktoken refuses its pat_str: "
                             f"{error}") from error


load_tokenizer.cache_clear = _load.cache_clear  # forget what was loaded (tests)
