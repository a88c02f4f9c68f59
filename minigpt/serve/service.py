"""What the server serves: a run's model on an engine, its tokenizers, its name and its limits.

A checked request (`protocol`) becomes engine requests here: a completion's prompts are
encoded as `minigpt.generate` encodes a prompt (its begin token too) or taken as token ids, a
chat's messages are rendered by the run's chat template as `minigpt.generate.chat` renders them
(ChatML closed by the end token for a vocabulary without a template, as chat fine-tuning
renders it), and each prompt is checked against the slots' length: a prompt of more positions
than a slot holds, or a prompt plus `max_tokens` past it, is refused (`RequestError`) before
anything runs. Temperatures below `minigpt.decoding.GREEDY_BELOW` decode greedily, as everywhere.
"""

from __future__ import annotations

import dataclasses
import secrets

from minigpt import chat_template
from minigpt.decoding import GREEDY_BELOW, Engine, Request, TextStream
from minigpt.decoding.text import decode
from minigpt.errors import UserError
from minigpt.serve.choices import Choice
from minigpt.serve.protocol import Chat, Completion, RequestError

COMPLETION_DEFAULT_TOKENS = 16  # what OpenAI's completions give without max_tokens


@dataclasses.dataclass
class Service:
    """The engine and what requests are checked against. `name` is the model's id in the API
    (the run directory's name); `aliases` are other names a request may give it."""

    engine: Engine
    tokenizer: object
    name: str
    context: int
    vocab_size: int
    max_batch: int
    api_key: str | None = None
    aliases: frozenset[str] = frozenset()
    created: int = 0
    dtype: str = "float32"  # what the model computes in (/health says)

    def __post_init__(self):
        self.chat_tokenizer = chat_template.with_template(self.tokenizer)[0]

    def __enter__(self) -> Service:
        """Start the engine's thread (its first programs compiled when this returns)."""
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()

    @property
    def length(self) -> int:
        return self.engine.length

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name and name not in self.aliases:
            raise RequestError(f"the model {name!r} does not exist here: this server serves "
                               f"{self.name!r} (GET /v1/models)", status=404, param="model",
                               code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "minigpt", "max_model_len": self.length}

    def tokenizer_info(self) -> dict:
        """What lm-evaluation-harness's remote tokenizer asks first (vLLM's /tokenizer_info)."""
        tokenizer, stops = self.chat_tokenizer, self.tokenizer.stop_tokens
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(tokenizer, chat_template.Templated):  # its end token, spelled out
            template = template.replace("{{ end }}", tokenizer.end_text)
        bos = getattr(self.tokenizer, "bos_token", None)
        return {"eos_token": tokenizer.decode([stops[0]]) if stops else None,
                "bos_token": None if bos is None else tokenizer.decode([bos]),
                "pad_token": None, "chat_template": template, "model": self.name,
                "max_model_len": self.length}

    def tokenize(self, body: dict) -> dict:
        """/tokenize: {"prompt": text, "add_special_tokens": bool} -> its ids (special
        tokens written in the text read as those tokens, as a chat template spells them)."""
        text, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(text, str) or not isinstance(special, bool):
            raise RequestError("send {\"prompt\": text, \"add_special_tokens\": true or false}",
                               param="prompt")
        ids = (self.tokenizer.encode_prompt(text) if special
               else self.chat_tokenizer.encode_ordinary(text))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.length}

    def detokenize(self, body: dict) -> dict:
        """/detokenize: {"tokens": ids} -> {"prompt": text}."""
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(type(t) is int for t in ids)):
            raise RequestError("send {\"tokens\": [token ids]}", param="tokens")
        self._check_ids(ids)
        return {"prompt": self.tokenizer.decode([t for t in ids if t < self.tokenizer.n_vocab])}

    def completion_choices(self, req: Completion) -> tuple[list[Choice], int]:
        """The choices of a completions request (n per prompt, in that order), and the number
        of prompt tokens."""
        choices, prompt_tokens, s = [], 0, req
        for p, prompt in enumerate(req.prompts):
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode_prompt(prompt), prompt
            else:
                ids = list(prompt)
                self._check_ids(ids)
                text = decode(self.tokenizer, ids)
            default = min(COMPLETION_DEFAULT_TOKENS, max(self.length - len(ids), 0))
            max_new = default if s.max_tokens is None else s.max_tokens
            self._check_length(len(ids), max_new, "max_tokens", "prompt")
            prompt_tokens += len(ids)
            for j in range(s.n):
                request = self._request(ids, max_new, s, p * s.n + j,
                                        logprobs=req.logprobs is not None,
                                        top=req.logprobs or 0,
                                        prompt_logprobs=req.echo and req.logprobs is not None)
                stream = TextStream(self.tokenizer, context=ids, stops=s.stop)
                choices.append(Choice(p * s.n + j, request, stream, self.tokenizer,
                                      prefix=text if req.echo else "",
                                      logprobs=req.logprobs is not None))
        return choices, prompt_tokens

    def chat_choices(self, req: Chat) -> tuple[list[Choice], int]:
        """The choices of a chat request, and the number of prompt tokens."""
        tokenizer = self.chat_tokenizer
        try:
            text = tokenizer.render_chat(list(req.conversation()), max_chars=self.length *
                                         chat_template.CHARS_PER_TOKEN)
        except UserError as error:
            raise RequestError(f"the chat cannot be rendered: {error}",
                               param="messages") from None
        ids = tokenizer.encode_ordinary(text)
        s = req
        field = "max_tokens"
        max_new = self.length - len(ids) if s.max_new is None else s.max_new
        self._check_length(len(ids), max(max_new, 1), field, "messages")
        choices = []
        for j in range(s.n):
            request = self._request(ids, max_new, s, j, logprobs=req.logprobs,
                                    top=req.top_logprobs)
            choices.append(Choice(j, request, TextStream(tokenizer, stops=s.stop), tokenizer,
                                  logprobs=req.logprobs))
        return choices, len(ids)

    def _request(self, ids: list[int], max_new: int, s: Completion | Chat, index: int, *,
                 logprobs: bool, top: int, prompt_logprobs: bool = False) -> Request:
        """Choice `index` of a request draws with the seed + index (a random seed without
        one), as `minigpt.generate --seed S --num-samples N` draws its samples."""
        greedy = s.temperature < GREEDY_BELOW
        seed = secrets.randbits(32) if s.seed is None else s.seed + index
        return Request(ids, max_new, temperature=0.0 if greedy else s.temperature,
                       top_k=s.every_token, top_p=s.top_p, min_p=s.min_p, seed=seed,
                       stop_ids=frozenset(() if s.ignore_eos else self.tokenizer.stop_tokens),
                       logprobs=logprobs, top=top, prompt_logprobs=prompt_logprobs)

    def _check_ids(self, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is not in the model's vocabulary of "
                               f"{self.vocab_size}", param="prompt")

    def _check_length(self, count: int, max_new: int, field: str, param: str) -> None:
        C = self.length
        limit = (f"the model's context of {C} tokens" if C == self.context else
                 f"this server's --max-len of {C} tokens (the model's context is "
                 f"{self.context})")
        if count == 0:
            raise RequestError("the prompt has no tokens: give at least one", param=param)
        if count > C or (count == C and max_new > 0):
            raise RequestError(f"the prompt has {count} tokens, past {limit}: shorten it to at "
                               f"most {C - 1} tokens to leave room for a new one", param=param)
        if count + max_new > C:
            raise RequestError(f"the prompt's {count} tokens and {field} {max_new} come to "
                               f"{count + max_new}, past {limit}: ask for at most "
                               f"{C - count} new tokens", param=field)
