"""`python -m minigpt.hub import SOURCE --out RUN` and `python -m minigpt.hub export --run RUN
--out DIR` (`minigpt.hub.cli`)."""

import sys

from minigpt.hub.cli import main

if __name__ == "__main__":
    sys.exit(main())
