"""The texts tokenizers are checked on (test_hf_tokenizer, test_families): TinyStories stories,
and a torture text of what tokenizers disagree about."""

from __future__ import annotations

import functools
import os
from pathlib import Path

ASSETS = Path(os.environ.get("MINIGPT_ASSETS", Path(__file__).resolve().parents[2] / "shared" /
                             "assets"))
# Digits, runs of spaces, tabs and newlines, accents composed and decomposed, emoji with
# joiners and modifiers, CJK, code, contractions; `torture_text` adds the special tokens.
TORTURE = (
    "Digits: 0 7 42 123 2024 1234567890 3.14159 1,000,000 -17 +3e-5 ½ ²³ ٣٤٥ ۱۲\n"
    "Spaces:a  b   c    d     e\t\tf \t g\n\n\n\nh\r\n\r\ni   \n   j\u00a0k\u3000l  \n"
    "   leading and trailing   \n"
    "Accents composed: café naïve Zürich São Paulo Ελλάδα İstanbul Ångström\n"
    "Accents decomposed: cafe\u0301 nai\u0308ve Zu\u0308rich Sa\u0303o A\u030angstro\u0308m\n"
    "Emoji: 🙂 👍🏽 👩\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈 🇨🇭🇯🇵 ❤️ 🧑🏾\u200d💻\n"
    "CJK: 日本語のテキストです。东京是一个大城市。한국어 문장입니다.\n"
    "Code:\n    def f(x: int) -> int:\n\treturn x ** 2  # square\n"
    "if (a != b && c >= 10) { printf(\"%d\\n\", a); }\n"
    "Contractions: it's I'm we'll they've you'd she's can't won't IT'S WE'LL O'Neil's\n")


@functools.cache
def stories_text() -> str:
    """TinyStories text: the real head of the dataset if the assets are here, else synthetic."""
    real = ASSETS / "tinystories" / "TinyStories-train-head.txt"
    if real.is_file():
        return real.read_text(encoding="utf-8")
    from conftest import SYNTHETIC_STORIES
    return "\n<|endoftext|>\n".join(f"{s} It was story number {i}." for i in range(400)
                                    for s in SYNTHETIC_STORIES)


def training_stories() -> list[str]:
    """The stories the tests' tokenizers are trained on (the first 300 KB)."""
    return [s.strip() for s in stories_text()[:300_000].split("<|endoftext|>") if s.strip()]


def held_out_stories(count: int = 40) -> list[str]:
    """Stories the tests' tokenizers were not trained on."""
    rest = stories_text()[300_000:] or stories_text()
    return [s.strip() for s in rest.split("<|endoftext|>") if s.strip()][:count]


def torture_text(specials: list[str]) -> str:
    """TORTURE with each special token written in the text, alone and between words."""
    return TORTURE + "Specials: " + " ".join(f"{s}x{s}" for s in specials) + "".join(specials)


def texts(specials: list[str]) -> list[str]:
    """Held-out stories one by one and together, and the torture text."""
    stories = held_out_stories()
    return [*stories, "\n\n".join(stories), torture_text(specials)]
