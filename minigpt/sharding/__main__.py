"""`python -m minigpt.sharding`: the preset explainer (`minigpt.explain`) under the name in the
README, restarted once with huge pages like the other entry points (see `minigpt.runtime`)."""

import sys

from minigpt.explain import main
from minigpt.runtime import relaunch_with_huge_pages

if __name__ == "__main__":
    relaunch_with_huge_pages()
    sys.exit(main())
