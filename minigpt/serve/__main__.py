"""`python -m minigpt.serve --run RUN` (`minigpt.serve.cli`)."""

import sys

from minigpt.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
