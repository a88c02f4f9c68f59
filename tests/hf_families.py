"""Tiny random checkpoints of the dense families people download, written by transformers itself
(test_families.py): each model by its own transformers class, each tokenizer by the class or
converter that made the real files, so that config.json, generation_config.json, tokenizer.json
and tokenizer_config.json have the structure the real ones have.

- Llama 3: tiktoken ranks (the shipped tinystories-4k vocabulary) through transformers'
  `TikTokenConverter` with Llama 3's split regex, its special tokens in its order and a
  post-processor adding <|begin_of_text|>; `rope_type: "llama3"` scaling; end tokens
  [<|end_of_text|>, <|eot_id|>]; untied with head_dim given, and tied with config.json in the
  older rope_theta / rope_scaling spelling (the instruct variant: Llama 3.2's template, in
  tokenizer_config.json as Meta's files carry it).
- Qwen2 / Qwen2.5 / Qwen3: `Qwen2Tokenizer` from a vocab.json and merges.txt (Qwen's NFC
  normalizer, split regex, <|endoftext|>, <|im_start|>, <|im_end|>); query/key/value biases
  (Qwen2, whose config.json names a sliding window that `use_sliding_window: false` leaves
  unused, as Qwen2.5's does) or query/key norms (Qwen3), tied, rope_theta 1e6, a vocabulary
  with unused rows.
- Llama 2 / TinyLlama / Mistral: a SentencePiece BPE model with byte fallback trained by
  `sentencepiece` on TinyStories text, converted by `LlamaTokenizer` (`add_bos_token`, as
  their tokenizer_config.json says).
- SmolLM2: `tokenizers` BPE with Digits (each digit alone) then ByteLevel, tied; the instruct
  variant with SmolLM2's ChatML template.
- Gemma 3 (text): `Gemma3ForCausalLM`, a local (sliding window of 8) and a global layer, its own
  query scale and rotary bases, tied; a SentencePiece BPE with byte fallback and Gemma's
  special tokens converted by `GemmaTokenizer`; a template in Gemma's turn format (the system
  message joins the first user turn, the assistant is "model").
- OLMo 2: `Olmo2ForCausalLM`, norms after each sublayer and query/key norms over the whole
  projection, untied, config.json without `bos_token_id` as allenai/OLMo-2-0425-1B's; a GPT-2
  class tokenizer of tiktoken ranks with cl100k's split (OLMo's dolma2 tokenizer is cl100k's),
  `<|endoftext|>` and `<|pad|>`, and OLMo's Tulu-style chat template.
- OLMo 3: `Olmo3ForCausalLM`, OLMo 2's block with a sliding (window of 8) and a full layer,
  rotary settings per kind of layer, OLMo 2's tokenizer.
- Phi-3: `Phi3ForCausalLM` with its fused projections, a sliding window on every layer,
  untied, as microsoft/Phi-3-mini-4k-instruct; the Llama 2 style SentencePiece tokenizer with
  Phi-3's chat tokens added (<|end|>, <|user|>, ...), several end ids, Phi-3's template.
  Phi-4-mini: a partial rotary embedding (0.75), tied, a GPT-2 class tokenizer.

tokenizer_config.json names the class the real files name (PreTrainedTokenizerFast,
Qwen2Tokenizer, LlamaTokenizer, GPT2Tokenizer). What the tests compare with is transformers'
reading of the folder as written (`AutoModelForCausalLM`, `AutoTokenizer`).

Needs torch, transformers and sentencepiece (the [hf] extra): import it after skipping without
them. Models are 2 layers of width 64; weights are drawn larger than transformers' default
initialisation so that mistakes show in the logits.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path

import sentencepiece
import torch
import transformers
from tokenizer_texts import training_stories
from tokenizers import Tokenizer, decoders, models, processors, trainers
from tokenizers import pre_tokenizers as pt
from transformers.convert_slow_tokenizer import TikTokenConverter

from minigpt.tokenizer import SHIPPED_DIR

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's special tokens in its order (ids 128000... there; here after the 4,095 ranks).
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                   "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                   *[f"<|reserved_special_token_{i}|>" for i in range(3, 9)]]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]
SMOLLM2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
                    "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>"]

# Llama 3.2 Instruct's template, without the tool-calling branches: bos_token, strftime_now,
# `|trim`, slicing the system message off.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 - the template's own lines
# Qwen2.5 Instruct's template, without the tool-calling branches.
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma's turn format, written here (Gemma 3's own template also takes images).
GEMMA_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set prefix = messages[0]['content'] + '\n\n' %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set prefix = '' %}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""

# OLMo 2 Instruct's format, written here: <|user|> / <|assistant|> turns in plain text, each
# reply ended by the end token.
OLMO_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + "
    "eos_token + ('' if loop.last else '\n') }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    "{% endfor %}")

# Phi-3's turns, written here: each message ended by <|end|>.
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
    "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% else %}{{ eos_token }}{% endif %}")

CHAT_SYSTEM = "You are a storyteller for small children."
CHAT_MESSAGE = "Tell me a story about a cat named Tom."
CHAT_TOKENS = 24  # new tokens a chat may take; the instruct models stop before (`make_it_stop`)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)


# --- tokenizers ------------------------------------------------------------------------------

def llama3_tokenizer(*, instruct: bool) -> transformers.PreTrainedTokenizerBase:
    """Llama 3's layout: tiktoken ranks through TikTokenConverter, its specials, a
    post-processor adding <|begin_of_text|> (ByteLevel's first, as in Meta's file)."""
    tok = TikTokenConverter(vocab_file=str(SHIPPED_DIR / "tinystories-4k.tiktoken"),
                            pattern=LLAMA3_SPLIT,
                            extra_special_tokens=LLAMA3_SPECIALS).converted()
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos,
        eos_token="<|eot_id|>" if instruct else "<|end_of_text|>", model_max_length=128)


def qwen_tokenizer(work: Path, *, instruct: bool) -> transformers.PreTrainedTokenizerBase:
    """Qwen's layout, made by transformers' Qwen2Tokenizer from a byte-level BPE vocab.json and
    merges.txt (trained here on TinyStories, as Qwen's were trained on its own text)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(training_stories(), trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False))
    data = json.loads(bpe.to_str())["model"]
    work.mkdir(parents=True, exist_ok=True)
    (work / "vocab.json").write_text(json.dumps(data["vocab"], ensure_ascii=False))
    (work / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in data["merges"]), encoding="utf-8")
    tok = transformers.Qwen2Tokenizer(
        vocab=str(work / "vocab.json"), merges=str(work / "merges.txt"), errors="replace",
        bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=QWEN_SPECIALS[1:], model_max_length=128)
    if instruct:
        tok.eos_token = "<|im_end|>"
    assert tok.convert_tokens_to_ids(QWEN_SPECIALS) == [1000, 1001, 1002], "Qwen's order"
    return tok


def sentencepiece_tokenizer(work: Path) -> transformers.PreTrainedTokenizerBase:
    """Llama 2's layout: SentencePiece BPE with byte fallback (trained with Llama 2's settings:
    digits split, whitespace kept as it is, a dummy prefix), converted by LlamaTokenizer."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for s in training_stories() for line in s.splitlines()
                                if line.strip()]),
        model_writer=model, model_type="bpe", vocab_size=500, byte_fallback=True,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=True, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, character_coverage=0.9995, minloglevel=2, num_threads=1)
    work.mkdir(parents=True, exist_ok=True)
    (work / "tokenizer.model").write_bytes(model.getvalue())
    return transformers.LlamaTokenizer.from_pretrained(
        work, add_bos_token=True, add_eos_token=False, legacy=False, model_max_length=128)


def gemma_tokenizer(work: Path) -> transformers.PreTrainedTokenizerBase:
    """Gemma's layout: SentencePiece BPE with byte fallback, no dummy prefix, its specials
    first (<pad> 0, <eos> 1, <bos> 2, <unk> 3) and its turn markers, converted by
    GemmaTokenizer, which adds <bos>."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for s in training_stories() for line in s.splitlines()
                                if line.strip()]),
        model_writer=model, model_type="bpe", vocab_size=500, byte_fallback=True,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=False, pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=GEMMA_TURNS, character_coverage=0.9995,
        minloglevel=2, num_threads=1)
    work.mkdir(parents=True, exist_ok=True)
    (work / "tokenizer.model").write_bytes(model.getvalue())
    return transformers.GemmaTokenizer.from_pretrained(
        work, model_max_length=128, add_bos_token=True, additional_special_tokens=GEMMA_TURNS)


def olmo_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """OLMo 2's layout: byte-level BPE ranks with cl100k's split (Llama 3's regex is the same),
    <|endoftext|> and <|pad|> after them, nothing added to a text."""
    tok = TikTokenConverter(vocab_file=str(SHIPPED_DIR / "tinystories-4k.tiktoken"),
                            pattern=LLAMA3_SPLIT,
                            extra_special_tokens=["<|endoftext|>", "<|pad|>"]).converted()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        pad_token="<|pad|>", unk_token=None, model_max_length=128)


def phi3_tokenizer(work: Path) -> transformers.PreTrainedTokenizerBase:
    """Phi-3's layout: Llama 2's SentencePiece tokenizer (adding <s>) with its chat tokens
    after the pieces, special."""
    tok = sentencepiece_tokenizer(work)
    tok.add_special_tokens({"eos_token": "<|endoftext|>",
                            "additional_special_tokens": PHI3_SPECIALS[1:]})
    return tok


def phi4_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """Phi-4-mini's layout: byte-level BPE ranks (o200k's split is cl100k's but for CJK and
    contractions: TinyStories has neither), Phi's chat tokens after them, nothing added."""
    tok = TikTokenConverter(vocab_file=str(SHIPPED_DIR / "tinystories-4k.tiktoken"),
                            pattern=LLAMA3_SPLIT, extra_special_tokens=PHI3_SPECIALS).converted()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None, model_max_length=128)


def smollm2_tokenizer(*, instruct: bool) -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's layout: `tokenizers` BPE, digits one by one, then ByteLevel; its specials
    first (ids 0...)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pt.Sequence([pt.Digits(individual_digits=True),
                                     pt.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(training_stories(), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SMOLLM2_SPECIALS,
        initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False))
    end = "<|im_end|>" if instruct else "<|endoftext|>"
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>" if instruct else "<|endoftext|>",
        eos_token=end, pad_token=end, unk_token="<|endoftext|>", model_max_length=128,
        additional_special_tokens=SMOLLM2_SPECIALS[1:])


# --- models ----------------------------------------------------------------------------------

def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights larger than the default initialisation, so that mistakes show in the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                torch.nn.init.normal_(p, std=0.2)
            else:  # norm scales
                torch.nn.init.normal_(p, 1.0, 0.1)
    return model.eval()


@dataclasses.dataclass(frozen=True)
class Family:
    """How one family's tiny checkpoint is made: its tokenizer (from a scratch folder), its
    model class and config fields, its end tokens, its chat template, where it keeps it."""

    tokenizer: Callable[[Path], transformers.PreTrainedTokenizerBase]
    model: type
    config: type
    fields: dict
    eos: tuple[str, ...]  # generation_config.json's eos_token_id, by name
    bos: str | None
    vocab_multiple: int = 1  # rows past the tokenizer's, as Qwen's models have
    template: str | None = None
    template_in_config: bool = False  # in tokenizer_config.json (older files) or its own file
    stop: str | None = None  # the end token an instruct model is made to reply with
    old_rope_spelling: bool = False  # config.json with rope_theta and rope_scaling
    config_json: dict = dataclasses.field(default_factory=dict)  # as the real config.json has
    tokenizer_class: str | None = None  # as the real tokenizer_config.json names it
    # special tokens listed after the model's rows, as Gemma 3's <image_soft_token> is
    past_rows: tuple[str, ...] = ()


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
LLAMA, MISTRAL = transformers.LlamaForCausalLM, transformers.MistralForCausalLM
QWEN2, QWEN3 = transformers.Qwen2ForCausalLM, transformers.Qwen3ForCausalLM
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}
FAMILIES = {
    "llama3": Family(lambda w: llama3_tokenizer(instruct=False), LLAMA, transformers.LlamaConfig,
                     dict(rope_parameters=LLAMA3_ROPE, head_dim=16, tie_word_embeddings=False),
                     eos=("<|end_of_text|>", "<|eot_id|>"), bos="<|begin_of_text|>",
                     tokenizer_class="PreTrainedTokenizerFast"),
    "llama3-tied": Family(lambda w: llama3_tokenizer(instruct=False), LLAMA,
                          transformers.LlamaConfig,
                          dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
                          eos=("<|end_of_text|>", "<|eot_id|>"), bos="<|begin_of_text|>",
                          old_rope_spelling=True, tokenizer_class="PreTrainedTokenizerFast"),
    "llama3-instruct": Family(lambda w: llama3_tokenizer(instruct=True), LLAMA,
                              transformers.LlamaConfig,
                              dict(rope_parameters=LLAMA3_ROPE, head_dim=16,
                                   tie_word_embeddings=False),
                              eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                              bos="<|begin_of_text|>", template=LLAMA3_TEMPLATE,
                              template_in_config=True, stop="<|eot_id|>",
                              tokenizer_class="PreTrainedTokenizerFast"),
    "qwen2": Family(lambda w: qwen_tokenizer(w, instruct=False), QWEN2, transformers.Qwen2Config,
                    dict(rope_parameters=QWEN_ROPE, tie_word_embeddings=True,
                         use_sliding_window=False), eos=("<|endoftext|>",),
                    bos="<|endoftext|>", vocab_multiple=64,
                    # Qwen2.5's files name a window that use_sliding_window leaves unused
                    config_json={"sliding_window": 64, "max_window_layers": 1}),
    "qwen2-instruct": Family(lambda w: qwen_tokenizer(w, instruct=True), QWEN2,
                             transformers.Qwen2Config,
                             dict(rope_parameters=QWEN_ROPE, tie_word_embeddings=True,
                                  use_sliding_window=False),
                             eos=("<|im_end|>", "<|endoftext|>"), bos="<|endoftext|>",
                             vocab_multiple=64, template=QWEN_TEMPLATE, stop="<|endoftext|>"),
    "qwen3": Family(lambda w: qwen_tokenizer(w, instruct=False), QWEN3, transformers.Qwen3Config,
                    dict(rope_parameters=QWEN_ROPE, head_dim=16, tie_word_embeddings=True),
                    eos=("<|endoftext|>",), bos="<|endoftext|>", vocab_multiple=64),
    "llama2": Family(sentencepiece_tokenizer, LLAMA, transformers.LlamaConfig,  # TinyLlama's
                     dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          tie_word_embeddings=False), eos=("</s>",), bos="<s>"),
    "mistral": Family(sentencepiece_tokenizer, MISTRAL, transformers.MistralConfig,
                      dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           sliding_window=8, tie_word_embeddings=False),
                      eos=("</s>",), bos="<s>"),
    "smollm2": Family(lambda w: smollm2_tokenizer(instruct=False), LLAMA,
                      transformers.LlamaConfig,
                      dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=True), eos=("<|endoftext|>",),
                      bos="<|endoftext|>", tokenizer_class="GPT2Tokenizer"),
    "smollm2-instruct": Family(lambda w: smollm2_tokenizer(instruct=True), LLAMA,
                               transformers.LlamaConfig,
                               dict(rope_parameters={"rope_type": "default",
                                                     "rope_theta": 10000.0},
                                    tie_word_embeddings=True), eos=("<|im_end|>",),
                               bos="<|im_start|>", template=SMOLLM2_TEMPLATE,
                               stop="<|im_end|>", tokenizer_class="GPT2Tokenizer"),
    "gemma3": Family(gemma_tokenizer, transformers.Gemma3ForCausalLM,
                     transformers.Gemma3TextConfig,
                     dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                 "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "default",
                                                              "rope_theta": 1e6}},
                          hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                          rms_norm_eps=1e-6),
                     eos=("<eos>", "<end_of_turn>"), bos="<bos>", template=GEMMA_TEMPLATE,
                     stop="<end_of_turn>", tokenizer_class="GemmaTokenizer",
                     past_rows=("<image_soft_token>",)),
    "olmo2": Family(lambda w: olmo_tokenizer(), transformers.Olmo2ForCausalLM,
                    transformers.Olmo2Config,
                    dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=False, pad_token_id=4096),
                    eos=("<|endoftext|>",), bos=None, vocab_multiple=64,
                    template=OLMO_TEMPLATE, stop="<|endoftext|>",
                    tokenizer_class="GPT2Tokenizer"),
    "olmo3": Family(lambda w: olmo_tokenizer(), transformers.Olmo3ForCausalLM,
                    transformers.Olmo3Config,
                    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                         rope_parameters={kind: {"rope_type": "default", "rope_theta": 5e5}
                                          for kind in ("sliding_attention", "full_attention")},
                         tie_word_embeddings=False, pad_token_id=4096),
                    eos=("<|endoftext|>",), bos=None, vocab_multiple=64,
                    tokenizer_class="GPT2Tokenizer"),
    "phi3": Family(phi3_tokenizer, transformers.Phi3ForCausalLM, transformers.Phi3Config,
                   dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 1.0},
                        sliding_window=8, tie_word_embeddings=False, pad_token_id=500),
                   eos=("<|endoftext|>", "<|assistant|>", "<|end|>"), bos="<s>",
                   vocab_multiple=64, template=PHI3_TEMPLATE, stop="<|end|>",
                   tokenizer_class="LlamaTokenizer"),
    "phi4-mini": Family(lambda w: phi4_tokenizer(), transformers.Phi3ForCausalLM,
                        transformers.Phi3Config,
                        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75},
                             tie_word_embeddings=True, pad_token_id=4095),
                        eos=("<|endoftext|>", "<|end|>"), bos="<|endoftext|>",
                        tokenizer_class="GPT2Tokenizer"),
}


@dataclasses.dataclass
class Checkpoint:
    """A written checkpoint: its folder, and transformers' model and tokenizer read from it."""

    directory: Path
    model: torch.nn.Module
    tokenizer: transformers.PreTrainedTokenizerBase
    family: Family

    @property
    def specials(self) -> list[str]:
        """The special tokens a text may spell for the model (those past its rows excepted)."""
        return [t.content for t in self.tokenizer.added_tokens_decoder.values()
                if t.special and t.content not in self.family.past_rows]

    @property
    def stop_ids(self) -> list[int]:
        return [self.tokenizer.convert_tokens_to_ids(t) for t in self.family.eos]

    def chat_messages(self, system: bool = True) -> list[dict[str, str]]:
        head = [{"role": "system", "content": CHAT_SYSTEM}] if system else []
        return [*head, {"role": "user", "content": CHAT_MESSAGE}]


def write_family(name: str, directory: Path) -> Checkpoint:
    """Write family `name`'s tiny checkpoint into `directory` with `save_pretrained`."""
    family = FAMILIES[name]
    tokenizer = family.tokenizer(directory.parent / f"{directory.name}-source")
    if family.template:
        tokenizer.chat_template = family.template
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*family.eos, family.bos) if t}
    eos = [ids[t] for t in family.eos]
    vocab = -(-len(tokenizer) // family.vocab_multiple) * family.vocab_multiple
    if family.past_rows:  # listed after the rows, so the model has none for them
        assert len(tokenizer) == vocab
        tokenizer.add_tokens([transformers.AddedToken(t, special=True) for t in family.past_rows],
                             special_tokens=True)
    config = family.config(vocab_size=vocab, **{**SMALL, **family.fields},
                           bos_token_id=ids.get(family.bos),
                           eos_token_id=eos if len(eos) > 1 else eos[0])
    model = randomize(family.model(config))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids.get(family.bos), eos_token_id=eos if len(eos) > 1 else eos[0])
    checkpoint = Checkpoint(directory, model, tokenizer, family)
    if family.stop:
        make_it_stop(checkpoint)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if family.template_in_config:  # as files saved by earlier transformers versions hold it
        (directory / "chat_template.jinja").unlink()
        _edit_json(directory / "tokenizer_config.json", chat_template=family.template)
    if family.tokenizer_class:
        _edit_json(directory / "tokenizer_config.json", tokenizer_class=family.tokenizer_class)
    _edit_json(directory / "config.json", **family.config_json)
    if family.old_rope_spelling:
        config = json.loads((directory / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    # What the tests compare with is transformers' reading of the files as they now are.
    return Checkpoint(directory,
                      transformers.AutoModelForCausalLM.from_pretrained(directory).eval(),
                      transformers.AutoTokenizer.from_pretrained(directory), family)


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


def chat_prompt(checkpoint: Checkpoint, system: bool = True) -> list[int]:
    """The chat's prompt as transformers makes it: apply_chat_template's ids."""
    return checkpoint.tokenizer.apply_chat_template(
        checkpoint.chat_messages(system), add_generation_prompt=True)["input_ids"]


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
           stop: list[int] | None = None) -> list[int]:
    """transformers' greedy continuation of `prompt` (stopping at `stop`, or its
    generation_config's end tokens), the stop token included."""
    kwargs = {} if stop is None else {"eos_token_id": stop}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def make_it_stop(checkpoint: Checkpoint, at: int = 6) -> None:
    """Make the instruct model's greedy reply to its chat end with its `stop` token well within
    CHAT_TOKENS: the stop token's output row becomes the direction of the final hidden state
    at reply position `at`, long enough that its logit there beats the likeliest by 4.

    A random model would otherwise run to the token limit and never show where a reply ends.
    Other positions may pick the stop token first (the reply then ends sooner); a tied model
    also reads the row as the token's embedding, which moves the hidden states when the prompt
    holds the token, so this repeats until transformers' own greedy reply ends with it."""
    model, prompt = checkpoint.model, chat_prompt(checkpoint)
    stop = checkpoint.tokenizer.convert_tokens_to_ids(checkpoint.family.stop)
    head = model.get_output_embeddings().weight
    for _ in range(10):
        reply = greedy(model, prompt, CHAT_TOKENS, stop=checkpoint.stop_ids)
        if reply[-1] in checkpoint.stop_ids and 2 <= len(reply) < CHAT_TOKENS - 4:
            return
        sequence = prompt + reply[:at]
        with torch.no_grad():
            hidden = model.model(torch.tensor([sequence])).last_hidden_state[0, -1]
            logits = model.lm_head(hidden)
            direction = hidden / hidden.norm()
            head[stop] = direction * (float(logits.max()) + 4.0) / float(hidden.norm())
    raise AssertionError(f"cannot make the {checkpoint.family.stop} reply stop")
