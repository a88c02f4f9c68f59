"""`python -m minigpt.train`: train a model of the zoo under a parallelism preset."""

import contextlib
import sys

from minigpt.runtime import relaunch_with_huge_pages
from minigpt.train import main

if __name__ == "__main__":
    relaunch_with_huge_pages()
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
