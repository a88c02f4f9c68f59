"""Scores people compare, for any run: lm-evaluation-harness tasks and bits per byte of any text.

`python -m minigpt.eval --run RUN --tasks hellaswag,...` scores a run with lm-evaluation-harness
(the `[eval]` extra), whose model `minigpt` this package registers when imported, so that
`lm_eval.simple_evaluate(model="minigpt", model_args={"run": RUN})` and the harness's own
command line work in a process that imported it; `--text FILE...` gives the loss and bits per
byte of any text. The modules: `loading` (the run under a preset, `EvalError`), `tokens` (text to
ids as the harness's reference backend makes them), `scoring` (rows of tokens scored in batches
of a few padded lengths), `harness` (the harness's `LM`, its generations from
`minigpt.decoding`), `text` (bits per byte of files) and `cli`.
"""

from minigpt.eval.loading import EvalError, Evaluated, load
from minigpt.eval.text import TextScore, score_texts

try:
    from minigpt.eval.harness import MiniGPTLM  # registers the harness's model `minigpt`
except ModuleNotFoundError as error:  # lm-evaluation-harness is the [eval] extra
    if (error.name or "").partition(".")[0] != "lm_eval":
        raise

__all__ = ["EvalError", "Evaluated", "MiniGPTLM", "TextScore", "load", "score_texts"]


def __getattr__(name: str):
    if name == "MiniGPTLM":  # only reached where the harness is not installed
        raise EvalError("the harness's model needs lm-evaluation-harness, the [eval] extra: "
                        "pip install \"minigpt[eval]\"")
    raise AttributeError(f"module 'minigpt.eval' has no attribute {name!r}")
