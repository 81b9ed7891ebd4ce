"""Files that hold secrets (the key server's HE secret key, every role's identity key).

One place for the rules: a key directory is mode 0700, a secret file is 0600 from creation
on (written through a temporary file and renamed), and a secret file group or other can read
stops the service at start with the command that fixes it.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from senseshield.errors import ConfigError
from senseshield.runtime.files import write_atomic

log = logging.getLogger("senseshield.keyfiles")


def writable_dir(path: str | Path, flag: str, *, mode: int | None = None) -> Path:
    """``path`` as a directory this process can write in, created if missing (and set to
    ``mode`` if given); else :class:`ConfigError` naming ``flag``. Services call it at start,
    so a bad ``--out`` or ``--key-dir`` stops them before the first round, not after it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a file; give a directory (it is created if missing).")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if mode is not None and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {str(path)!r} is not a writable directory ({exc.strerror or exc}); give one this user can write."
        ) from None
    return path


def secure_dir(path: Path, flag: str = "--key-dir") -> Path:
    """Create ``path`` (mode 0700) or tighten an existing one to 0700; :class:`ConfigError`
    if it is a file, cannot be written, or holds a key file others may read."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(f"{flag} {str(path)!r} is a symbolic link; give the directory itself (a link could be "
                          "pointed elsewhere by whoever owns it).")
    if path.is_dir() and path.stat().st_uid != os.geteuid():
        raise ConfigError(f"{flag} {str(path)!r} belongs to user id {path.stat().st_uid}, not this process's "
                          f"({os.geteuid()}); a key directory must be the service user's own.")
    before = stat.S_IMODE(path.stat().st_mode) if path.is_dir() else None
    writable_dir(path, flag, mode=0o700)
    if before is not None and before & 0o077:
        log.warning("key directory %s was mode %o; tightened to 0700", path, before)
    # one entry at a time (a local fleet's directory holds thousands of identities); the
    # first bad file by name is the one named, whatever order the directory lists them in
    bad: list[tuple[str, ConfigError]] = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(".key"):
                try:
                    check_private(path / entry.name)
                except ConfigError as exc:
                    bad.append((entry.name, exc))
    if bad:
        raise min(bad, key=lambda b: b[0])[1]
    return path


def check_private(path: Path) -> None:
    """A secret key file must be a regular file of this user, readable by its owner only."""
    if path.is_symlink():
        raise ConfigError(f"Secret key file {path} is a symbolic link; give the file itself.")
    if path.stat().st_uid != os.geteuid():
        raise ConfigError(f"Secret key file {path} belongs to user id {path.stat().st_uid}, not this process's "
                          f"({os.geteuid()}).")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"Secret key file {path} has mode {mode:o}; it must be 0600 (chmod 600 {path}).")


def check_secret_dir(folder: Path) -> None:
    """The directory a secret is written in must be a real directory of this user that
    nobody else can write: otherwise another user could plant or swap files in it (a link
    where the temporary file goes) between the checks and the write."""
    try:
        st = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(f"Key directory {folder} cannot be checked ({exc.strerror or exc}).") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"Key directory {folder} is not a directory (a symbolic link or a file); give the directory itself.")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"Key directory {folder} belongs to user id {st.st_uid}, not this process's ({os.geteuid()}).")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ConfigError(f"Key directory {folder} has mode {stat.S_IMODE(st.st_mode):o}, which others can write; "
                          f"a secret is only written in a directory of mode 0700 (chmod 700 {folder}).")


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to a file only its owner can read (0600 from creation on), atomically
    (:func:`senseshield.runtime.files.write_atomic`: a fresh temporary name opened with
    ``O_EXCL | O_NOFOLLOW``, so a planted file or link is never written through), in a
    directory :func:`check_secret_dir` accepts."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_secret_dir(path.parent)
    write_atomic(path, data, mode=0o600)
