"""minigpt: a Flax NNX model zoo for GPT-style pre-training with interchangeable parallelism
presets."""
