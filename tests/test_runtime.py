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
    for name in ("GLIBC_TUNABLES", "MINIGPT_HUGE_PAGES", runtime._RELAUNCHED):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_entry_points_restart_once_with_huge_pages_and_say_so(execs, monkeypatch, capsys):
    runtime.relaunch_with_huge_pages()
    (executable, argv, env), = execs
    assert executable == sys.executable and argv[0] == sys.executable
    assert env["GLIBC_TUNABLES"] == runtime.HUGE_PAGES and env[runtime._RELAUNCHED] == "1"
    assert capsys.readouterr().err == ""  # the restarted process speaks, not this one
    # The restarted process: it says so once, and does not restart again (nor do its children).
    monkeypatch.setenv("GLIBC_TUNABLES", runtime.HUGE_PAGES)
    monkeypatch.setenv(runtime._RELAUNCHED, "1")
    runtime.relaunch_with_huge_pages()
    runtime.relaunch_with_huge_pages()
    err = capsys.readouterr().err
    assert err.count("note: restarted with huge pages") == 1 and "MINIGPT_HUGE_PAGES=0" in err
    assert len(execs) == 1 and runtime._RELAUNCHED not in runtime.os.environ


@pytest.mark.parametrize("env", [{"MINIGPT_HUGE_PAGES": "0"}, {"GLIBC_TUNABLES": "mine"}])
def test_huge_pages_can_be_turned_off_or_left_to_the_user(execs, monkeypatch, capsys, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runtime.relaunch_with_huge_pages()
    assert execs == [] and capsys.readouterr().err == ""
