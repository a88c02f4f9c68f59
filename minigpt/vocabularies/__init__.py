"""Tokenizer vocabularies that ship with minigpt: `<name>.tiktoken` (BPE mergeable ranks, read by
tiktoken) and `<name>.json` beside each (what it was trained on, with which command and trainer).
`minigpt.tokenizer.load_tokenizer(name)` loads them."""
