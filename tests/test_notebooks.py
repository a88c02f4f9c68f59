"""The notebooks run top to bottom (with MINIGPT_SMALL=1) and say what their prose promises."""

import json
import re
import tomllib
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))

# Text each notebook's outputs must contain: the checks its prose relies on.
EXPECTED = {
    "01_train_minigpt.ipynb": ["1 device:", "'tokenizer': 'tinystories-4k', 'vocab_size': 4096",
                               "recipe='stories-cpu'", "checkpoint:", "sample:",
                               "restored step "],
    "02_parallelism_presets.ipynb": ["largest relative difference fsdp vs dp",
                                     "'all-gather'", "parameters:",
                                     "dual chunk: busiest device does 1.00x the mean"],
    "03_generation.ipynb": ["same tokens: True", "same seed, same story: True",
                            "another seed, another story: True", "refused:"],
    "04_pretrained_weights.ipynb": ["imported", "tokenizer.json", "stops at:", "reply:",
                                    "starts from:", "LoRA rank 8", "held-out loss after",
                                    "imported weights unchanged: True",
                                    "conversations in 04_chats.jsonl", " trained\n", "[[",
                                    "reply before:", "loss on the replies: first step",
                                    "held-out conversations after", "reply after:",
                                    "MiB of float32 weights", "model.safetensors",
                                    "adapter_model.safetensors"],
    "05_post_training.ipynb": ["held out: [", "accuracy after imitation:", "reward by step",
                               "held-out reward by step (greedy):", "sample completion:",
                               "accuracy after GRPO:", "points on numbers never trained on",
                               "held-out pairs preferred by the starting model:",
                               "held-out rewards/accuracies by step:",
                               "held-out pairs preferred after DPO:"],
}


# And in a run with MINIGPT_SMALL=1 (the test below), what its small settings make exact.
SMALL_EXPECTED = {"01_train_minigpt.ipynb": ["restored step 10"]}


def test_the_walkthroughs_are_there():
    assert NOTEBOOKS == sorted(EXPECTED)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_opens_in_colab_and_installs_itself(name):
    cells = json.loads((NOTEBOOK_DIR / name).read_text())["cells"]
    assert "colab.research.google.com/github/" in "".join(cells[0]["source"])
    assert f"notebooks/{name}" in "".join(cells[0]["source"])
    install = "".join(cells[2]["source"])
    assert "git" in install and "pip" in install and cells[2]["cell_type"] == "code"
    prose = [c for c in cells if c["cell_type"] == "markdown"]
    assert len(prose) >= 5  # a walkthrough explains between its cells
    assert all(c.get("outputs") for c in cells if c["cell_type"] == "code"
               and "print(" in "".join(c["source"])), "saved outputs from a real run"


def test_the_repository_address_is_the_one_in_pyproject():
    """pyproject.toml's [project.urls] Repository is the one address: every notebook's Colab
    badge opens the notebook from it, every install cell clones it, and any GitHub or Colab
    link in the README and the guides points at it."""
    root = NOTEBOOK_DIR.parent
    url = tomllib.loads((root / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    repo = url.removeprefix("https://github.com/")
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", repo), url
    for name in NOTEBOOKS:
        cells = json.loads((NOTEBOOK_DIR / name).read_text())["cells"]
        badge, install = "".join(cells[0]["source"]), "".join(cells[2]["source"])
        assert f"colab.research.google.com/github/{repo}/blob/main/notebooks/{name}" in badge
        assert f'"{url}"' in install, name
        for cell in (badge, install):
            assert set(re.findall(r"(?:github\.com|google\.com/github)/([\w.-]+/[\w.-]+)",
                                  cell)) == {repo}, name
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        # Colab links and links to a minigpt repository are ours; other projects' pages are
        # cited as sources (the evaluation guide's lm-evaluation-harness issues)
        text = page.read_text()
        ours = set(re.findall(r"google\.com/github/([\w.-]+/[\w.-]+)", text)) | {
            link for link in re.findall(r"github\.com/([\w.-]+/[\w.-]+)", text)
            if link.split("/")[1].lower() == "minigpt"}
        assert ours <= {repo}, (page.name, ours)


def saved_text(cells) -> str:
    return "\n".join(
        "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
        for cell in cells if cell["cell_type"] == "code" for out in cell["outputs"])


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_saved_outputs_come_from_one_run_of_every_cell(name):
    """The outputs saved in the repository are those of one run, top to bottom, of the cells as
    they are (every code cell executed, in order, in one kernel), and they show what a fresh run
    must show."""
    cells = json.loads((NOTEBOOK_DIR / name).read_text())["cells"]
    counts = [c["execution_count"] for c in cells if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), name
    text = saved_text(cells)
    for expected in EXPECTED[name]:
        assert expected in text, f"{name}: {expected!r} not in the saved outputs"


# Executing the notebooks is part of the slower set (`python -m pytest -m slow`); the checks
# of their saved outputs above run in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, tmp_path, stories_file, monkeypatch, request):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MINIGPT_SMALL", "1")
    monkeypatch.setenv("MINIGPT_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("MINIGPT_NOTEBOOK_TEXT", str(stories_file))
    if name == "03_generation.ipynb":  # generates many tokens: XLA's optimisations pay there
        request.getfixturevalue("optimised")
    if name == "04_pretrained_weights.ipynb":
        # A tiny random instruct-style checkpoint instead of the Hub's SmolLM2-135M-Instruct:
        # SmolLM2's tokenizer layout and chat template, written by transformers.
        pytest.importorskip("transformers", reason="notebook 04's stand-in checkpoint is "
                            "written by transformers (the [hf] extra)")
        from hf_families import write_family

        checkpoint = write_family("smollm2-instruct", tmp_path / "checkpoint")
        monkeypatch.setenv("MINIGPT_NOTEBOOK_CHECKPOINT", str(checkpoint.directory))
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # a cell that raises fails the test with its traceback
    text = "\n".join(
        out.get("text", "") + "".join(out.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)
    for expected in EXPECTED[name] + SMALL_EXPECTED.get(name, []):
        assert expected in text, f"{name}: {expected!r} not in the outputs"
    assert not list(NOTEBOOK_DIR.glob("runs")), "notebooks write under MINIGPT_RUNS"


def test_the_notebooks_use_the_public_api_for_what_it_covers():
    """What the package top offers (`minigpt.__all__`: configs, the zoo, presets, train, load a
    run, generate, chat, data, checkpoints in and out) the notebooks reach through `minigpt.`;
    they import modules only to look inside (the explainer, the loader, the schedules)."""
    import re

    import minigpt

    public = set(minigpt.__all__) | {"load_for_generation", "resolve_data", "prepare_text"}
    for name in NOTEBOOKS:
        code = "\n".join("".join(c["source"]) for c in json.loads(
            (NOTEBOOK_DIR / name).read_text())["cells"] if c["cell_type"] == "code")
        assert "import minigpt\n" in code, name
        imported = {n.strip() for group in re.findall(r"from minigpt[\w.]* import \(?([\w, \n]+)",
                                                      code) for n in group.split(",")}
        assert not imported & public, (name, sorted(imported & public))
