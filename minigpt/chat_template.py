"""Chat templates, rendered as transformers renders them, in a process of their own.

A chat template is a Jinja2 program that came with a checkpoint from the Hub: untrusted code. It
runs in jinja2's immutable sandbox set up as transformers 5 sets it up for
`apply_chat_template` (trim_blocks and lstrip_blocks, the loop controls, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, a `dict` and a `namespace` that store no
private names, `tools` and `documents` None, messages without their None values and with their
reasoning under the names templates read), so every template renders here the text it renders
there. transformers' `{% generation %}` ... `{% endgeneration %}` tag renders its body and
records where it lies in the output (`Rendered.spans`, in characters): the assistant's
replies, which chat fine-tuning trains on.

The sandbox stops a template from reaching files or Python's internals, but not from looping
for hours or building a gigabyte of text. So rendering happens in a small child process (this
file run as a script: the standard library and jinja2, nothing of minigpt), started once per
process and reused: each render gets `SECONDS` of wall time, `MEMORY` bytes of address space
and an output limit in characters (`max_chars`: a chat that must fit a context of C tokens is
given C * CHARS_PER_TOKEN). A template that exceeds one is refused in one line (`RenderError`),
and the child, if it had to be killed, is started afresh for the next render.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from minigpt.errors import UserError

SECONDS = 5.0  # wall time a render may take
MEMORY = 1 << 30  # address space the rendering process may use, in bytes
# Characters a chat may render per token of the context it must fit: far above what any
# tokenizer averages (English runs about 4 characters a token), so a chat that fits is never
# refused, while a template that renders megabytes is stopped before a tokenizer sees them.
CHARS_PER_TOKEN = 32
DEFAULT_MAX_CHARS = 1 << 22


class RenderError(UserError, RuntimeError):
    """A chat template that cannot render (fails, loops too long, renders too much); the
    message is one line saying which."""


class TooLong(RenderError):
    """Messages longer, on their own, than the rendered chat may be: the chat is at fault, not
    its template."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A rendered chat: its text and the [start, end) character spans its `{% generation %}`
    blocks produced (empty for a template without them)."""

    text: str
    spans: tuple[tuple[int, int], ...] = ()


def render(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           variables: dict[str, Any] | None = None, max_chars: int = DEFAULT_MAX_CHARS,
           seconds: float | None = None) -> Rendered:
    """Render a conversation through `template` as transformers' `apply_chat_template` does
    (`variables`: the special tokens by role, `bos_token` ...), within `seconds`, `MEMORY` and
    `max_chars`; raises RenderError (one line) for a template that fails or exceeds one."""
    if not messages:
        raise RenderError("cannot render an empty conversation: give at least one message")
    chars = sum(len(m["content"]) for m in messages
                if isinstance(m, dict) and isinstance(m.get("content"), str))
    if chars > max_chars:
        raise TooLong(f"the chat's messages hold {chars:,} characters, more than a context of "
                      f"{max_chars // CHARS_PER_TOKEN:,} tokens can hold: shorten them")
    seconds = SECONDS if seconds is None else seconds
    request = {"template": template, "messages": messages, "max_chars": int(max_chars),
               "add_generation_prompt": bool(add_generation_prompt), "seconds": seconds,
               "variables": variables or {}}
    try:
        payload = json.dumps(request, allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as error:
        raise RenderError(f"the messages are not plain text and numbers: {error}") from None
    reply = _RENDERER.ask(payload, seconds)
    if "error" in reply:
        raise RenderError(reply["error"])
    return Rendered(reply["text"], tuple((int(a), int(b)) for a, b in reply["spans"]))


# ChatML, for a vocabulary without a template of its own: the tokenizer's end token (`end`)
# closes each turn, so generation stops where a reply ends.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}{{ end }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Templated:
    """A tokenizer without a chat template of its own (a zoo vocabulary) given one: ChatML with
    its end token closing each turn. Rendered text is tokenized with that end token read as the
    token it names, as a Hugging Face tokenizer reads the special tokens a template spells."""

    def __init__(self, tokenizer, template: str = CHATML):
        self.tokenizer, self.chat_template = tokenizer, template
        self.end_text = tokenizer.decode([tokenizer.eot_token])

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def render_chat_with_spans(self, messages: list[dict], *, add_generation_prompt: bool = False,
                               max_chars: int = DEFAULT_MAX_CHARS
                               ) -> Rendered:
        return render(self.chat_template, list(messages),
                                    variables={"end": self.end_text},
                                    add_generation_prompt=add_generation_prompt,
                                    max_chars=max_chars)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    max_chars: int = DEFAULT_MAX_CHARS) -> str:
        return self.render_chat_with_spans(messages, add_generation_prompt=add_generation_prompt,
                                           max_chars=max_chars).text

    def encode_ordinary(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allowed_special={self.end_text})


def with_template(tokenizer, template: str | None = None):
    """The tokenizer to render chats with: its own template, or the one a run recorded, or
    (neither) ChatML; returns (tokenizer, whether the default was given)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return tokenizer, False
    return Templated(tokenizer, template or CHATML), template is None


# --- this side: the child process and its pipe -----------------------------------------------

def _frame(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


class _Renderer:
    """The child process that renders, started on first use and again after it was killed; one
    request at a time (a lock), and a fresh child in a forked process (which cannot share its
    parent's pipes)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.owner = 0

    def _start(self) -> subprocess.Popen:
        if self.process is None or self.owner != os.getpid() or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(MEMORY)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.owner = os.getpid()
        return self.process

    def _stop(self) -> None:
        if self.process is not None and self.owner == os.getpid():
            self.process.kill()
            self.process.wait()
        self.process = None

    def ask(self, payload: bytes, seconds: float) -> dict[str, Any]:
        with self.lock:
            try:
                process = self._start()
            except OSError as error:
                raise RenderError(f"cannot start the process chat templates render in: "
                                  f"{error}") from None
            try:
                process.stdin.write(_frame(payload))
                process.stdin.flush()
                # The child stops a render itself after `seconds`; this is for one it cannot
                # interrupt (a single huge operation inside jinja2 or Python).
                reply = _read_frame(process.stdout.fileno(), time.monotonic() + seconds + 2.0)
            except (OSError, _Stopped) as error:
                why = (f"did not finish rendering within {seconds:g} s"
                       if isinstance(error, _Timeout) else "stopped the process it rendered in "
                       "(it ran out of memory, or was killed)")
                self._stop()
                raise RenderError(why) from None
            return json.loads(reply.decode("utf-8"))

    def close(self) -> None:
        with self.lock:
            self._stop()


class _Stopped(Exception):
    """The child closed its pipe before replying."""


class _Timeout(_Stopped):
    """The child did not reply in time."""


def _read_frame(fd: int, deadline: float) -> bytes:
    """One length-prefixed message from `fd`, waiting until `deadline` (time.monotonic)."""
    data = b""
    need = 8
    length = None
    while len(data) < need:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise _Timeout()
        chunk = os.read(fd, max(need - len(data), 1 << 16))
        if not chunk:
            raise _Stopped()
        data += chunk
        if length is None and len(data) >= 8:
            length = struct.unpack("<Q", data[:8])[0]
            need = 8 + length
    return data[8:need]


_RENDERER = _Renderer()
atexit.register(_RENDERER.close)


# --- the other side: the sandbox, run as `python -P chat_template.py MEMORY` -------------------

class _OverTime(Exception):
    pass


def _environment():
    """jinja2's immutable sandbox as transformers 5 configures it for chat templates, with a
    `generation` tag that records the spans it renders in `env.minigpt_spans` (when set)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.minigpt_spans = None
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=_Dict(), namespace=_namespace(),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


def _generation_tag():
    """transformers' `{% generation %}BODY{% endgeneration %}`: BODY, where it lies in the
    output noted (its start is what the render loop has emitted so far)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

        def _mark(self, caller):
            text = caller()
            tracking = self.environment.minigpt_spans
            if tracking is not None:  # ([characters emitted so far], [spans])
                start = tracking[0][0]
                tracking[1].append((start, start + len(text)))
            return text

    return Generation


def _namespace():
    """jinja2's `namespace`, storing no names that begin with an underscore."""
    import jinja2.exceptions
    import jinja2.utils

    def public(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store {name!r} on a namespace (names beginning "
                f"with an underscore are refused)")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - jinja2's own signature, so self= works
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for name in values:
                public(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            public(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


REASONING = ("reasoning_content", "thinking", "reasoning")


def _as_transformers_passes(messages: list[Any]) -> list[Any]:
    """The messages as apply_chat_template hands them to a template: keys whose value is None
    dropped, and a message's reasoning under `thinking` and `reasoning_content` too."""
    out = []
    for message in messages:
        if isinstance(message, dict):
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in REASONING if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _render_one(env, compiled: dict, request: dict[str, Any]) -> dict[str, Any]:
    """Render one request within its output limit; the time limit is the caller's alarm."""
    source = request["template"]
    if source not in compiled:
        if len(compiled) > 16:  # a few templates at a time; forget the older ones
            compiled.clear()
        compiled[source] = env.from_string(source)
    limit = request["max_chars"]
    emitted, spans, pieces = [0], [], []
    env.minigpt_spans = (emitted, spans)
    try:
        for piece in compiled[source].generate(
                messages=_as_transformers_passes(request["messages"]), tools=None,
                documents=None, add_generation_prompt=request["add_generation_prompt"],
                **request["variables"]):
            emitted[0] += len(piece)
            if emitted[0] > limit:
                return {"error": f"renders more than {limit:,} characters, more than the "
                                 f"context can hold"}
            pieces.append(piece)
    finally:
        env.minigpt_spans = None
    return {"text": "".join(pieces), "spans": spans}


def _serve(memory: int) -> None:
    """The child's loop: one request in, one reply out, until its parent closes the pipe."""
    import signal

    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    def over_time(signum, frame):
        raise _OverTime()

    signal.signal(signal.SIGALRM, over_time)
    env, compiled = _environment(), {}
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while header := source.read(8):
        request = json.loads(source.read(struct.unpack("<Q", header)[0]).decode("utf-8"))
        seconds = request["seconds"]
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                reply = _render_one(env, compiled, request)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _OverTime:
            reply = {"error": f"did not finish rendering within {seconds:g} s"}
        except MemoryError:
            reply = {"error": f"needs more than the {memory / 2**30:g} GiB of memory a "
                              f"template may use"}
        except RecursionError:
            reply = {"error": "RecursionError: it recurses too deeply"}
        except Exception as error:  # jinja2 raises its own kinds; a template may raise any
            lines = str(error).strip().splitlines() or [""]
            reply = {"error": f"failed: {type(error).__name__}: {lines[0][:200]}".rstrip(": ")}
        # ASCII both ways: a lone surrogate in a message survives the trip as it would in
        # transformers' own process.
        sink.write(_frame(json.dumps(reply).encode("ascii")))
        sink.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else MEMORY)
