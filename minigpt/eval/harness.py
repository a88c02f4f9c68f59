"""The harness's model `minigpt`: lm-evaluation-harness scores any run through this `LM`.

Registered with the harness as `minigpt` when this module is imported (`import minigpt.eval`
does it), so `lm_eval --model minigpt --model_args run=RUN,preset=fsdp` and
`lm_eval.simple_evaluate(model="minigpt", model_args={"run": RUN})` work in that process, and
an instance can be passed to `simple_evaluate` as it is. Its three request types are answered
as the harness's `hf` model answers them on the same files, quirks included, so the scores
compare with everyone's:

- `loglikelihood`: contexts and continuations split as the harness's `TemplateLM` splits them
  (a context's trailing spaces go to the continuation; an empty context is the prefix token),
  truncated from the left to the context + 1 tokens, scored in batches by length;
- `loglikelihood_rolling`: the document with the tokenizer's own added tokens, in the harness's
  disjoint windows of the whole context, each conditioned on the prefix token or the window
  before;
- `generate_until`: the prompt truncated from the left to leave room for `max_gen_toks`, decoded
  by the engine every door shares (`minigpt.decoding`), greedy (or sampled, where a task asks:
  request j of a task with `seed + j`) until a stop string or end token, decoded without special
  tokens and cut at the first stop string. Generations equal the `hf` model's at its batch size
  1 (in its larger batches a row that stopped goes on until the whole batch has, and text a
  stop token's removal leaves behind shows in its answer) and `minigpt.generate`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from minigpt import chat_template, runtime
from minigpt.decoding import Settings, TextStream, decode_all
from minigpt.eval.loading import EvalError, load
from minigpt.eval.scoring import Row, Scorer
from minigpt.eval.tokens import HarnessTokenizer
from minigpt.models.decoder import count_params

DEFAULT_BATCH = 16
MAX_GEN_TOKS = 256  # the harness's default for a task that names none, as the hf model's
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # how transformers finds a message to continue


@register_model("minigpt")
class MiniGPTLM(TemplateLM):
    """A run's latest weights as an lm-evaluation-harness model.

    `run` (or `pretrained`, which the harness uses to name its output folder): the run
    directory; `preset`: how to lay the model out (`devices`: simulate that many CPU devices,
    before JAX starts); `batch_size`: rows per batch ("auto" is 16); `max_length`: tokens the
    model sees (default: its context); `max_gen_toks`: the default limit of a generation;
    `seed`: for tasks that sample. The harness's `device` and `max_batch_size` are ignored:
    the preset places the model."""

    def __init__(self, run: str | None = None, pretrained: str | None = None, preset: str = "dp",
                 devices: int = 0, batch_size: int | str = DEFAULT_BATCH,
                 max_length: int | None = None, max_gen_toks: int = MAX_GEN_TOKS, seed: int = 0,
                 progress: bool = True, **ignored: Any):
        super().__init__()
        path = run if run is not None else pretrained
        if path is None:
            raise EvalError("the minigpt model needs a run: --model_args run=RUN")
        if devices:
            try:
                runtime.set_simulated_devices(int(devices))
            except RuntimeError as error:
                raise EvalError(f"devices={devices}: {error}") from None
        self.evaluated = load(str(path), str(preset))
        self.vocab = HarnessTokenizer(self.evaluated.tokenizer)
        self.batch = _batch_size(batch_size)
        self.scorer = Scorer(self.evaluated, self.batch)
        context = self.evaluated.context
        self._max_length = int(max_length or context)
        if not 1 <= self._max_length <= context:
            raise EvalError(f"max_length {max_length} must be 1 to the model's context, "
                            f"{context}")
        self.max_gen_toks, self.seed, self.progress = int(max_gen_toks), int(seed), progress

    # --- what the harness asks of a model ----------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.vocab.eos

    @property
    def prefix_token_id(self) -> int:
        return self.vocab.prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.vocab.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        ids = self.vocab.encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.vocab.decode(tokens, skip_special=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (strings, context ids, continuation ids)."""
        rows, keys = {}, []  # identical requests are run once
        for _, context, continuation in requests:
            if not 1 <= len(continuation) <= self.max_length:
                raise EvalError(f"a request's continuation has {len(continuation)} tokens: "
                                f"1 to the model's {self.max_length} can be scored")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            key = (tuple(whole), len(continuation))
            if key not in rows:  # the continuation's predictions count
                rows[key] = Row(whole[:-1], whole[1:],
                                scored=range(len(whole) - 1 - len(continuation), len(whole) - 1))
            keys.append(key)
        unique = list(rows)
        scored = dict(zip(unique, self.scorer.score(
            [rows[k] for k in unique], desc="minigpt: loglikelihood",
            progress=self.progress and not disable_tqdm)))
        answers = []
        for (strings, _, _), key in zip(requests, keys):
            scores, hits = scored[key]
            answer = (float(np.sum(scores)), bool(np.all(hits)))
            answers.append(answer)
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, every token scored once, in the harness's windows."""
        windows, owners = [], []
        for number, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(number)
        totals = [0.0] * len(requests)
        for number, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows,
                                                                         disable_tqdm)):
            totals[number] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, from the decoding engine: the requests of one group of
        settings decoded together, `batch_size` at a time, each stopping at its stop strings
        (the text stream's rule, with the end token's text among them) or end ids."""
        answers: list = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for number, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(number)
        end_text = self.vocab.decode([self.vocab.eos], skip_special=False)
        tokenizer = self.evaluated.tokenizer
        for numbers in groups.values():
            settings = normalize_gen_kwargs(requests[numbers[0]].args[1], self.max_gen_toks)
            until = [settings["until"]] if isinstance(settings["until"], str) \
                else list(settings["until"])
            if end_text not in until:
                until.append(end_text)
            max_new = int(settings["max_gen_toks"])
            room = self.max_length - max_new
            if room < 1:
                raise EvalError(f"a task asks for {max_new} new tokens, which leaves no room "
                                f"for its prompt in the model's {self.max_length}")
            prompts = [self.vocab.encode_for_generation(requests[n].args[0])[-room:]
                       for n in numbers]
            draws = [Settings.seeded(
                self.seed + j, temperature=float(settings.get("temperature", 1.0)),
                top_k=int(settings.get("top_k") or 0), top_p=float(settings.get("top_p") or 1.0))
                if settings.get("do_sample") else Settings() for j in range(len(numbers))]
            rows = self.evaluated.ways("batch")
            slots = -(-min(self.batch, len(prompts)) // rows) * rows
            with tqdm(total=len(prompts), desc="minigpt: generate_until", unit="request",
                      disable=not self.progress or disable_tqdm) as bar, \
                    self.evaluated.active():
                new = decode_all(self.evaluated.model, prompts, max_new=max_new, settings=draws,
                                 stop_ids=self.vocab.stop_ids, slots=slots,
                                 streams=[TextStream(tokenizer, stops=until) for _ in prompts],
                                 on_done=lambda i: bar.update(1))
            for n, tokens in zip(numbers, new):
                text = postprocess_generated_text(self.vocab.decode(tokens), until, None)
                answers[n] = text
                self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return answers

    # --- chat templates ------------------------------------------------------------------------

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return getattr(self.evaluated.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as the run's chat template renders it, as transformers'
        `apply_chat_template` does; without a generation prompt, the last message left open to
        be continued (`continue_final_message`). A template that refuses a system message is
        given the conversation without it, as the `hf` model does."""
        try:
            return self._render(chat_history, add_generation_prompt)
        except chat_template.RenderError:
            return self._render([m for m in chat_history if m["role"] != "system"],
                                add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tokenizer = self.evaluated.tokenizer
        limit = self.max_length * chat_template.CHARS_PER_TOKEN
        if add_generation_prompt:
            return tokenizer.render_chat(messages, add_generation_prompt=True, max_chars=limit)
        messages = [dict(m) for m in messages]
        messages[-1]["content"] += CONTINUE_TAG
        text = tokenizer.render_chat(messages, add_generation_prompt=False, max_chars=limit)
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0:
            raise EvalError("the chat template leaves out the message to continue")
        return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG \
            else text[:at].rstrip()

    # --- what the harness records about the model ------------------------------------------------

    def get_model_info(self) -> dict[str, Any]:
        run = self.evaluated.run
        return {"model_num_parameters": count_params(run.model, run.config),
                "model_dtype": run.config.dtype, "model_revision": f"step {run.step}",
                "model_sha": "", "minigpt_run": str(run.path.absolute()),
                "minigpt_preset": run.layout.name}


def _batch_size(value: int | str) -> int:
    """A batch size from the harness's flag: a number, or "auto" (which the hf model tunes to
    its GPU; here it is DEFAULT_BATCH)."""
    if isinstance(value, str) and value.startswith("auto"):
        return DEFAULT_BATCH
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise EvalError(f"batch_size must be a number or auto, got {value!r}") from None
    if size < 1:
        raise EvalError(f"batch_size must be 1 or more, got {size}")
    return size
