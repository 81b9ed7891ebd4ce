"""Key directories and secret files (senseshield.runtime.keyfiles, issue 14): created 0700 /
0600, and a symbolic link, a directory or file of another user, or a file others may read
stops the service at start with one sentence."""

from __future__ import annotations

import os
import stat

import pytest

from keyserver.service import load_or_generate
from senseshield.errors import ConfigError
from senseshield.runtime.keyfiles import check_private, secure_dir, write_secret

OTHER_UID = 4242


def test_a_new_key_directory_and_secret_are_private(tmp_path):
    path = secure_dir(tmp_path / "keys")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    write_secret(path / "x.key", b"secret")
    assert stat.S_IMODE((path / "x.key").stat().st_mode) == 0o600
    check_private(path / "x.key")
    (tmp_path / "open").mkdir(mode=0o755)
    secure_dir(tmp_path / "open")  # tightened, with a warning
    assert stat.S_IMODE((tmp_path / "open").stat().st_mode) == 0o700


def test_symbolic_links_are_refused(tmp_path):
    real = secure_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="--key-dir .*link' is a symbolic link"):
        secure_dir(tmp_path / "link")
    write_secret(real / "a.key", b"k")
    (real / "b.key").symlink_to(real / "a.key")
    with pytest.raises(ConfigError, match="b.key is a symbolic link"):
        check_private(real / "b.key")
    # the key server's key file path: a link planted where the key would be is refused too
    keys = secure_dir(tmp_path / "ks")
    (keys / "paillier-1024.key").symlink_to(tmp_path / "elsewhere.key")  # dangling
    with pytest.raises(ConfigError, match="is a symbolic link"):
        load_or_generate(keys, "paillier", 1024)


def test_group_readable_secret_is_refused(tmp_path):
    keys = secure_dir(tmp_path / "keys")
    write_secret(keys / "a.key", b"k")
    os.chmod(keys / "a.key", 0o640)
    with pytest.raises(ConfigError, match="has mode 640; it must be 0600"):
        secure_dir(keys)
    # among several, the first by name is the one named, whatever order the directory lists
    for name, mode in (("m.key", 0o604), ("c.key", 0o660), ("z.key", 0o600)):
        write_secret(keys / name, b"k")
        os.chmod(keys / name, mode)
    with pytest.raises(ConfigError, match=r"a\.key has mode 640"):
        secure_dir(keys)
    os.chmod(keys / "a.key", 0o600)
    with pytest.raises(ConfigError, match=r"c\.key has mode 660"):
        secure_dir(keys)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_directory_or_key_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to user id {OTHER_UID}, not this process's"):
        secure_dir(theirs)
    mine = secure_dir(tmp_path / "mine")
    write_secret(mine / "a.key", b"k")
    os.chown(mine / "a.key", OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"a.key belongs to user id {OTHER_UID}"):
        check_private(mine / "a.key")


def test_each_key_structure_has_its_own_key_file_and_is_reloaded_as_made(tmp_path):
    keys = secure_dir(tmp_path / "keys")
    with pytest.warns(Warning):  # a 1024-bit test key
        fast = load_or_generate(keys, "packed-paillier", 1024)
        classic = load_or_generate(keys, "packed-paillier", 1024, "standard")
    assert (fast.structure, classic.structure) == ("subgroup", "standard")
    assert sorted(p.name for p in keys.glob("*.key")) == ["packed-paillier-1024-standard.key", "packed-paillier-1024.key"]
    with pytest.warns(Warning):
        again = load_or_generate(keys, "packed-paillier", 1024, "standard")
    assert again.public_key.key_id == classic.public_key.key_id and again.structure == "standard"
