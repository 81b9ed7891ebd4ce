"""Exceptions shared by the library, the services and the CLIs.

* :class:`ConfigError` is a caller mistake (unknown name, bad value). The CLIs print its
  message as one sentence and exit with code 2; no traceback.
* :class:`ProtocolError` is a malformed or inconsistent message/update (wrong shape, NaN,
  ciphertext under another key). Services log it, reject the message and keep running.
* :class:`StorageError` is a file a service could not write (disk full, read-only,
  permission): the service stops with one sentence naming the path and the OS reason,
  exit code :data:`STORAGE_EXIT` (74); its job resumes when it is restarted.
* :class:`SecretKeyExportError` guards the secret key: it never serialises by accident.
"""

from __future__ import annotations


class SenseShieldError(Exception):
    """Base class of every error SenseShield raises on purpose."""


class ConfigError(SenseShieldError, ValueError):
    """A caller supplied a value that is not allowed; the message names it and what is."""


class ProtocolError(SenseShieldError, ValueError):
    """An update, ciphertext or message is malformed or inconsistent with the round."""


class KeyMismatchError(ProtocolError):
    """A ciphertext was produced under a different public key than the one in use."""


class SecretKeyExportError(SenseShieldError):
    """Someone tried to serialise a secret key without asking for it explicitly."""


STORAGE_EXIT = 74
"""Exit code of a service that stopped because it could not write a file (sysexits'
EX_IOERR): disk full, read-only file system, permission. The job is resumable."""


class StorageError(SenseShieldError, OSError):
    """A file could not be written (disk full, read-only, permission, a file where a
    directory should be). Not a caller mistake and not a bad message: a service that meets
    one stops (exit :data:`STORAGE_EXIT`) with this one sentence, and nothing half-written
    is left behind (:func:`senseshield.runtime.files.write_atomic`)."""

    def __init__(self, message: str, *, path: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.path, self.errno = path, code

    @classmethod
    def writing(cls, path: object, exc: OSError) -> "StorageError":
        """The sentence for ``exc`` met while writing ``path``."""
        import errno

        name = errno.errorcode.get(exc.errno or 0)
        reason = exc.strerror or str(exc)
        return cls(f"Cannot write {str(path)!r}: {reason}" + (f" ({name})" if name else ""), path=str(path),
                   code=exc.errno)

    def __str__(self) -> str:
        return str(self.args[0])
