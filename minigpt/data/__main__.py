"""`python -m minigpt.data`: prepare a dataset, or train a vocabulary (`minigpt.data.main`)."""

import sys

from minigpt.data import main

if __name__ == "__main__":
    sys.exit(main())
