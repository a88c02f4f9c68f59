"""A checkpoint's own tokenizer files, into a run and back out.

An imported run keeps the tokenizer files of the checkpoint it came from, byte for byte, in
`<run>/tokenizer/` (those of `TOKENIZER_FILES` the checkpoint has): `minigpt.tokenizer.
HFTokenizer` reads them with the `tokenizers` library, the reference implementation of
`tokenizer.json`, so every normalizer, pre-tokenizer, byte fallback and added token behaves as
it does for the people who trained the model. Export copies them back, so `transformers` gets
the tokenizer, the special tokens and the chat template the checkpoint had.

The begin and end ids a checkpoint's config.json gives, where its generation_config.json does
not, are written into the run's copy of generation_config.json, so the folder says on its own
where documents begin and end and where generation stops.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from minigpt.files import read_json_object, write_text_atomic
from minigpt.hub.architectures import HubError
from minigpt.tokenizer import HFTokenizer, TokenizerError, token_ids

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
FOLDER = "tokenizer"  # inside a run directory


def import_tokenizer_files(directory: Path, hf_config: dict[str, Any], run: Path,
                           vocab_size: int, inside) -> HFTokenizer:
    """Copy a checkpoint folder's tokenizer files into `run/tokenizer/` and load them; refuses
    (HubError, one line) a tokenizer the library cannot read, one with ordinary tokens past the
    model's vocabulary (special ones past it, as Gemma 3's `<image_soft_token>`, are kept:
    `HFTokenizer.n_rows`), and files outside the folder (`inside(path)` resolves a path the
    folder names, as the weights' index is resolved)."""
    folder = run / FOLDER
    folder.mkdir()
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file() or path.is_symlink():
            shutil.copyfile(inside(path, name), folder / name)
    try:  # the copies are read; a refusal names the checkpoint's own files
        generation = read_json_object(folder / "generation_config.json", TokenizerError)
        added = {f"{role}_token_id": hf_config[f"{role}_token_id"] for role in ("bos", "eos")
                 if f"{role}_token_id" not in generation
                 and hf_config.get(f"{role}_token_id") is not None}
        for field, value in added.items():  # checked where they came from, before writing
            token_ids(value, f"{directory / 'config.json'}: {field}")
        if added:
            write_text_atomic(folder / "generation_config.json",
                              json.dumps({**generation, **added}, indent=2) + "\n")
        # The model's rows, as a checkpoint's config.json gives them: the tokenizer refuses
        # ordinary ids past them and text spelling a special token past them.
        write_text_atomic(folder / "config.json", json.dumps({"vocab_size": vocab_size}) + "\n")
        tokenizer = HFTokenizer(folder)
    except TokenizerError as error:
        raise HubError(str(error).replace(str(folder), str(directory))) from None
    return tokenizer


def export_tokenizer_files(tokenizer: HFTokenizer, out: Path, model_max_length: int) -> None:
    """Write an imported tokenizer's files into `out` as they came in; where the checkpoint had
    no tokenizer_config.json or generation_config.json, ones naming its begin and end tokens
    (which transformers reads to find the tokenizer's class and where to stop)."""
    for name in TOKENIZER_FILES:
        if (tokenizer.folder / name).is_file():
            shutil.copyfile(tokenizer.folder / name, out / name)
    ids = special_ids(tokenizer)
    if not (out / "generation_config.json").is_file():
        write_text_atomic(out / "generation_config.json", json.dumps(ids, indent=2) + "\n")
    if not (out / "tokenizer_config.json").is_file():
        eos = ids["eos_token_id"][0] if isinstance(ids["eos_token_id"], list) and \
            ids["eos_token_id"] else ids["eos_token_id"]
        names = {role: tokenizer.token_name(i) for role, i in (
            ("bos_token", ids["bos_token_id"]), ("eos_token", eos)) if isinstance(i, int)}
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
                  **names}
        write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def special_ids(tokenizer) -> dict[str, Any]:
    """The begin and end ids config.json carries for a tokenizer: `bos_token_id` (or None) and
    `eos_token_id` (one id, or the list of them an imported checkpoint had)."""
    if isinstance(tokenizer, HFTokenizer):
        generation = read_json_object(tokenizer.folder / "generation_config.json", HubError)
        stops = list(tokenizer.stop_tokens)
        eos = generation.get("eos_token_id", stops[0] if len(stops) == 1 else stops or None)
        bos = generation.get("bos_token_id", tokenizer.bos_token)
        return {"bos_token_id": bos, "eos_token_id": eos}
    return {"bos_token_id": None, "eos_token_id": tokenizer.eot_token}
