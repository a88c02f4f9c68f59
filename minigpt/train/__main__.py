"""`python -m minigpt.train`: train a model of the zoo under a parallelism preset.

A command line that names no preset, recipe or run that exists is refused before JAX starts
(`minigpt.train.flags.early_refusal`), and before the process restarts itself with huge pages.
"""

import contextlib
import sys

from minigpt.runtime import relaunch_with_huge_pages, set_gpu_flags
from minigpt.train.flags import early_refusal

if __name__ == "__main__":
    refusal = early_refusal(sys.argv[1:])
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        sys.exit(2)
    relaunch_with_huge_pages()
    set_gpu_flags()  # before JAX starts its backends
    from minigpt.train import main

    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
