"""`python -m minigpt.plan`: the planner's table (`minigpt.plan.cli`)."""

import sys

from minigpt.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
