"""The README's quickstart, timed as written: every command of it and its Python example, in a
fresh directory, in order, each one's wall time, and for each run whose stories it prints the
held-out bits per byte (the first 200 held-out stories, scored as bench/bench_stories.py scores
them) and the stories themselves.

Nothing is shrunk, with one exception: the mission's own `python -m minigpt.train --preset fsdp`
(5,000 steps of the 29M `minigpt` at batch 64 x 256) is timed over its first few steps and its
whole length estimated from them, because it is meant for an accelerator.

TinyStories cannot be downloaded here, so a local server hands out a stand-in at the pinned
revision: the shared TinyStories text (MINIGPT_ASSETS) as the training file, the held-out stories
of bench_stories as the validation file. It is prepared before the commands run, so the times
leave out the first download and tokenization (the real files: 1.9 GB, about one and a half
minutes to tokenize on 2 cores, plus the download).

    python bench/bench_quickstart.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_stories import score, scored_text, split_stories  # noqa: E402
from bench.report import append_section, table  # noqa: E402

MISSION = "python -m minigpt.train --preset fsdp"
MISSION_STEPS = 3
CURVE_STORIES = 200


def quickstart() -> tuple[list[str], str]:
    """The quickstart's command lines and its Python example, from the README."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    bash = section.split("```bash", 1)[1].split("```", 1)[0]
    python = section.split("```python", 1)[1].split("```", 1)[0]
    lines = [line.split("  #")[0].strip() for line in bash.splitlines()]
    return [line for line in lines if line.startswith("python -m ")], python


def serve(folder: Path) -> tuple[ThreadingHTTPServer, str]:
    """The files of `folder` at any path ending in their names (the pinned revision's URLs)."""
    class Handler(SimpleHTTPRequestHandler):
        def translate_path(self, path):
            return str(folder / path.rsplit("/", 1)[-1])

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stand_in(work: Path) -> tuple[Path, list[str]]:
    """TinyStories' two files made of the shared text, and the held-out stories."""
    assets = Path(os.environ.get("MINIGPT_ASSETS", REPO.parent / "shared" / "assets"))
    files, held_file, held, _ = split_stories(assets / "tinystories", work / "split")
    served = work / "served"
    served.mkdir()
    (served / "TinyStories-train.txt").write_bytes(b"".join(f.read_bytes() for f in files))
    (served / "TinyStories-valid.txt").write_bytes(held_file.read_bytes())
    return served, held


def held_out_score(run: Path, held: list[str]) -> dict:
    """Bits per byte of a run's latest weights on the first held-out stories."""
    import minigpt

    loaded = minigpt.load_run(run)
    with loaded.layout.active():
        return score(loaded.model, loaded.tokenizer, scored_text(held[:CURVE_STORIES]))


def main() -> None:
    from minigpt.data import download, prepare_tinystories

    work = Path(tempfile.mkdtemp(prefix="quickstart-"))
    served, held = stand_in(work)
    httpd, url = serve(served)
    download.KNOWN_FILES = {}  # the stand-in has its own sizes and hashes
    for tokenizer in ("gpt2", "tinystories-4k"):
        prepare_tinystories(work / "data", "v1", base_url=url, tokenizer=tokenizer,
                            progress=False)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["MINIGPT_HF_BASE"] = url
    commands, python = quickstart()
    rows, stories, outputs = [], [], {}
    for command in commands:
        argv = command + (f" --steps {MISSION_STEPS}" if command == MISSION else "")
        start = time.perf_counter()
        done = subprocess.run(argv, shell=True, cwd=work, env=env, capture_output=True,
                              text=True)
        seconds = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"{command} failed:\n{done.stderr[-3000:]}")
        outputs[command] = done.stdout
        note = ""
        if command == MISSION:
            steps = [json.loads(line) for line in (work / "runs/default/metrics.jsonl").open()]
            rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
            per_step = 64 * 256 / max(rates)
            note = (f"{MISSION_STEPS} steps run: {per_step:.1f} s a step after compiling, so "
                    f"its 5,000 steps take about {5000 * per_step / 3600:.0f} hours here")
        run = re.search(r"--run (\S+)", command)
        if run and "generate" in command:
            result = held_out_score(work / run.group(1), held)
            note = f"{result['bits_per_byte']:.3f} held-out bits per byte"
            stories.append((command, done.stdout.strip()))
        rows.append((f"`{command}`", f"{seconds:.0f}", note))
    script = python + "\nprint('STORY:', stories[0])\n"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], cwd=work, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the Python example failed:\n{done.stderr[-3000:]}")
    py_run = re.search(r'out="([^"]+)"', python)
    py_note = ""
    if py_run:
        py_note = (f"{held_out_score(work / py_run.group(1), held)['bits_per_byte']:.3f} "
                   f"held-out bits per byte")
    rows.append(("the Python example", f"{time.perf_counter() - start:.0f}", py_note))
    stories.append(("the Python example", done.stdout.split("STORY:", 1)[-1].strip()))
    httpd.shutdown()
    body = table(["quickstart line, as written", "wall time (s)", "what it shows"], rows)
    for command, text in stories:
        body += ["", f"Stories from `{command}`:", "", "> " + text.replace("\n", "\n> ")]
    append_section(
        "the README's quickstart, timed as written",
        ["TinyStories stood in for by the shared text from a local server, prepared before "
         "the first command (download and tokenization not timed)",
         f"held-out bits per byte: the first {CURVE_STORIES} of bench_stories' held-out "
         f"stories, each scored from its first token",
         f"`{MISSION}`: the first {MISSION_STEPS} steps timed, the rest estimated"],
        body)


if __name__ == "__main__":
    main()
