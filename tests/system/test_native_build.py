"""native_build's cache folder: the temporary fallback is used only when it is private to this user; the
compiler is a command line as CXX allows; processes that want one library at once wait for one build."""

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from minisarathi.backends import native_build


@pytest.fixture
def home_unwritable(tmp_path, monkeypatch):
    """MINISARATHI_CACHE_DIR under a file, so the per-user cache cannot be made; the temporary folder in
    tmp_path."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"minisarathi-kind-{os.getuid()}"


def test_the_temporary_folder_is_made_private(home_unwritable):
    assert native_build.cache_dir("kind") == home_unwritable
    assert stat.S_IMODE(os.lstat(home_unwritable).st_mode) & 0o077 == 0


def test_a_folder_others_can_write_is_refused(home_unwritable):
    home_unwritable.mkdir()
    home_unwritable.chmod(0o777)  # as another user could have left it, with a library planted in it
    with pytest.raises(RuntimeError, match="writable only by it"):
        native_build.cache_dir("kind")


def test_a_symlink_is_refused(home_unwritable, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    home_unwritable.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="not a directory of this user"):
        native_build.cache_dir("kind")


def test_a_folder_of_another_user_is_refused(home_unwritable, monkeypatch):
    home_unwritable.mkdir(mode=0o700)
    real_lstat = os.lstat

    def lstat_as_another_owner(path):
        st = real_lstat(path)
        return os.stat_result(
            (st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *tuple(st)[5:10])
        )

    monkeypatch.setattr(os, "lstat", lstat_as_another_owner)
    with pytest.raises(RuntimeError, match="owner uid"):
        native_build.cache_dir("kind")


def test_the_compiler_is_a_command_line(tmp_path, monkeypatch):
    """CXX="ccache g++" is a program and its first argument, not one program's name."""
    monkeypatch.setenv("MINISARATHI_CACHE_DIR", str(tmp_path))
    path = native_build.build_shared_library(
        "kind",
        "answer",
        'extern "C" int answer() { return 42; }\n',
        [],
        "env g++",
        ["-shared", "-fPIC"],
        "a test",
    )
    assert path.is_file() and path.parent == tmp_path / "kind"


def test_processes_that_want_one_library_at_once_wait_for_one_build(tmp_path):
    """Four processes ask for the same library together (as replicas or test workers starting at once):
    the compiler runs once, and every process gets the library. The compiler is a script that logs each
    run and takes a second, so that the requests overlap."""
    log = tmp_path / "runs"
    compiler = tmp_path / "slow-g++"
    compiler.write_text(f'#!/bin/sh\necho run >> "{log}"\nsleep 1\nexec g++ "$@"\n')
    compiler.chmod(0o755)
    ask = (
        "from minisarathi.backends import native_build; print(native_build.build_shared_library("
        f"'kind', 'answer', 'extern \"C\" int answer() {{ return 42; }}\\n', [], {str(compiler)!r}, "
        "['-shared', '-fPIC'], 'a test'))"
    )
    env = {**os.environ, "MINISARATHI_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", ask], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    paths = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    assert len(paths) == 1 and os.path.isfile(paths.pop())
    assert log.read_text().splitlines() == ["run"]
