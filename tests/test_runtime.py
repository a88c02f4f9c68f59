"""Process set-up: simulated devices only before JAX starts, and the one restart with huge pages,
which says it happened and can be turned off."""

import sys

import jax
import pytest

from minigpt import runtime


def test_simulated_devices_are_refused_once_jax_has_started():
    jax.devices()
    with pytest.raises(RuntimeError, match="simulated devices must be set before JAX starts"):
        runtime.set_simulated_devices(4)


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime.os, "execve", lambda *args: calls.append(args))
    monkeypatch.setattr(runtime.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime.sys, "argv", ["minigpt", "--steps", "3"])
    monkeypatch.setattr(runtime, "_huge_pages_available", lambda: True)
    monkeypatch.setattr(runtime, "has_accelerator", lambda: False)
    for name in ("GLIBC_TUNABLES", "MINIGPT_HUGE_PAGES", runtime._RELAUNCHED):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_entry_points_restart_once_with_huge_pages_and_say_so(execs, monkeypatch, capsys):
    runtime.relaunch_with_huge_pages()
    (executable, argv, env), = execs
    assert executable == sys.executable and argv[0] == sys.executable
    assert env["GLIBC_TUNABLES"] == runtime.HUGE_PAGES and env[runtime._RELAUNCHED] == "1"
    assert capsys.readouterr().err == ""  # the restarted process speaks, not this one
    # The restarted process does not restart again (nor do its children), prints nothing
    # itself (an error or --help would follow), and gives its note once, to the trainer.
    monkeypatch.setenv("GLIBC_TUNABLES", runtime.HUGE_PAGES)
    monkeypatch.setenv(runtime._RELAUNCHED, "1")
    runtime.relaunch_with_huge_pages()
    runtime.relaunch_with_huge_pages()
    assert capsys.readouterr().err == ""
    note = runtime.huge_pages_note()
    assert "restarted with huge pages" in note and "MINIGPT_HUGE_PAGES=0" in note
    assert runtime.huge_pages_note() is None
    assert len(execs) == 1 and runtime._RELAUNCHED not in runtime.os.environ


@pytest.mark.parametrize("env", [{"MINIGPT_HUGE_PAGES": "0"}, {"GLIBC_TUNABLES": "mine"}])
def test_huge_pages_can_be_turned_off_or_left_to_the_user(execs, monkeypatch, capsys, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runtime.relaunch_with_huge_pages()
    assert execs == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("change", ["help", "no transparent huge pages", "accelerator"])
def test_no_restart_where_huge_pages_change_nothing(execs, monkeypatch, capsys, change):
    if change == "help":
        monkeypatch.setattr(runtime.sys, "argv", ["minigpt", "--help"])
    elif change == "accelerator":
        monkeypatch.setattr(runtime, "has_accelerator", lambda: True)
    else:
        monkeypatch.setattr(runtime, "_huge_pages_available", lambda: False)
    runtime.relaunch_with_huge_pages()
    assert execs == [] and capsys.readouterr().err == ""


def test_transparent_huge_pages_are_read_from_the_kernel_setting(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(runtime, "TRANSPARENT_HUGE_PAGES", setting)
    assert not runtime._huge_pages_available()  # no such file: not Linux's THP
    for text, available in (("always [madvise] never", True), ("[always] madvise never", True),
                            ("always madvise [never]", False)):
        setting.write_text(text + "\n")
        assert runtime._huge_pages_available() is available
