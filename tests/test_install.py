"""A regular install, as `pip install git+URL`, a wheel from an index or a Colab cell without
`-e` gives: the wheel built from the checkout, installed into a fresh virtual environment and
run from a folder outside the checkout, carries every preset and recipe and trains and tells
stories. Offline, the fresh environment borrows the test environment's installed packages
(through a .pth line, which does not run the test environment's own .pth files, so the
editable install of the checkout stays out of sight)."""

import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import child_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gpt2")]


def build_wheel(out: Path) -> Path:
    """The wheel of the checkout's package, built from a copy of what the package is made of
    (an in-tree build would leave build/ behind in the checkout)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("minigpt", "presets", "recipes"):
        shutil.copytree(REPO / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(out / "wheels"), str(source)], check=True)
    return next((out / "wheels").glob("minigpt-*.whl"))


def fresh_environment(path: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel installed and the test environment's other
    packages within reach; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    borrowed = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "_borrowed.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True)
    return python


def test_a_wheel_installed_outside_the_checkout_trains_and_tells_stories(tmp_path,
                                                                          small_stories):
    python = fresh_environment(tmp_path / "venv", build_wheel(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = child_env("PYTHONPATH")

    def run(*args: str) -> str:
        done = subprocess.run([str(python), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    where = run("-c", "import minigpt.files as f; print(f.__file__); "
                      "print(f.shipped_folder('presets')); print(f.shipped_folder('recipes'))")
    package, presets, recipes = map(Path, where.split())
    assert tmp_path / "venv" in package.parents and REPO not in package.parents
    assert sorted(p.name for p in presets.glob("*.toml")) == sorted(
        p.name for p in (REPO / "presets").glob("*.toml"))
    assert sorted(p.name for p in recipes.glob("*.toml")) == sorted(
        p.name for p in (REPO / "recipes").glob("*.toml"))
    assert presets.parent == recipes.parent == package.parent

    assert "minigpt-tiny" in run("-m", "minigpt.models")
    explained = run("-m", "minigpt.sharding", "--model", "minigpt-tiny", "--preset", "fsdp",
                    "--devices", "8")
    assert "('fsdp', None)" in explained and "per device" in explained
    run("-m", "minigpt.train", "--recipe", "stories-cpu", "--steps", "2", "--data",
        str(small_stories), "--out", "runs/stories", "--no-sample")
    assert (elsewhere / "runs/stories/checkpoints/2").is_dir()
    run("-m", "minigpt.train", "--preset", "dp_tp", "--model", "minigpt-tiny", "--steps", "2",
        "--devices", "8", "--batch-size", "8", "--seq-len", "32", "--set", "eval_batches=1",
        "--data", str(small_stories), "--out", "runs/demo", "--no-sample")
    story = run("-m", "minigpt.generate", "--run", "runs/demo", "--prompt", "Once upon a time",
                "--max-new-tokens", "8")
    assert story.startswith("Once upon a time") and len(story) > len("Once upon a time")
