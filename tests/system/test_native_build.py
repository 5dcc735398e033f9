"""native_build's cache folder: the temporary fallback is used only when it is private to this user, and the
compiler is a command line as CXX allows."""

import os
import stat
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
