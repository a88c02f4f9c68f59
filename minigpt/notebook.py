"""What every notebook does first: pick the devices, say where runs land, and get story text.

The notebooks in `notebooks/` call these instead of pasting the same set-up cells:

    from minigpt.notebook import setup, story_files
    nb = setup()                      # 8 simulated CPU devices unless an accelerator is attached
                                      # (setup(devices=1): the CPU as it is)
    files = story_files(nb.runs)      # TinyStories text: local files, or the pinned download

Environment variables let the test suite run the notebooks small and offline: `MINIGPT_SMALL=1`
shrinks models and step counts, `MINIGPT_RUNS` is where runs and data land (default `runs`),
`MINIGPT_NOTEBOOK_TEXT` names local text files (joined by os.pathsep) to use instead of the
download.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from minigpt.data.download import TINYSTORIES_REVISION, download_file, expected_file, hf_url
from minigpt.runtime import has_accelerator, set_simulated_devices

# The 19 MB validation file of TinyStories v1: enough stories for a first model in minutes.
NOTEBOOK_FILE = "TinyStories-valid.txt"


@dataclasses.dataclass(frozen=True)
class NotebookSetup:
    small: bool  # MINIGPT_SMALL=1: tiny models and few steps, for the test suite
    runs: Path  # where runs and prepared data land


def setup(devices: int = 8) -> NotebookSetup:
    """Simulate `devices` CPU devices when no accelerator is attached, then start JAX.

    Must run before anything else touches JAX's devices. The simulated devices share the same
    cores, so nothing gets faster, but every sharding decision is real.
    """
    if not has_accelerator():
        set_simulated_devices(devices)
    import jax

    count = jax.device_count()
    print(f"{count} device{'s' if count > 1 else ''}: {jax.devices()}")
    runs = Path(os.environ.get("MINIGPT_RUNS", "runs"))
    runs.mkdir(parents=True, exist_ok=True)
    return NotebookSetup(small=os.environ.get("MINIGPT_SMALL") == "1", runs=runs)


def story_files(runs: Path) -> list[str]:
    """Local text named by MINIGPT_NOTEBOOK_TEXT, else TinyStories' validation file, downloaded
    once at the pinned revision and checked."""
    local = os.environ.get("MINIGPT_NOTEBOOK_TEXT")
    if local:
        return local.split(os.pathsep)
    size, sha256 = expected_file(NOTEBOOK_FILE, TINYSTORIES_REVISION)
    download_file(hf_url(NOTEBOOK_FILE), runs / "data" / NOTEBOOK_FILE, size=size, sha256=sha256)
    return [str(runs / "data" / NOTEBOOK_FILE)]
