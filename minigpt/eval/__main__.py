"""`python -m minigpt.eval`: see `minigpt.eval.cli`."""

import sys

from minigpt.eval.cli import main

sys.exit(main())
