"""Homomorphic-encryption schemes behind one interface (see :mod:`senseshield.he.base`).

Importing this package registers the built-in schemes in :data:`SCHEMES`.
"""

from senseshield.he.base import (
    SCHEMES,
    CipherPart,
    EncryptedVector,
    PlainPart,
    PublicKey,
    Scheme,
    SecretKey,
)
from senseshield.he import paillier as _paillier  # noqa: F401  (registers "paillier")
from senseshield.he import ckks as _ckks  # noqa: F401  (registers "ckks")
from senseshield.he import packed as _packed  # noqa: F401  (registers "packed-paillier")
from senseshield.he import masked as _masked  # noqa: F401  (registers "masked")

__all__ = [
    "SCHEMES",
    "CipherPart",
    "EncryptedVector",
    "PlainPart",
    "PublicKey",
    "Scheme",
    "SecretKey",
    "generate_keys",
]


def generate_keys(scheme: str, **params: object) -> SecretKey:
    """Generate a key pair of the registered ``scheme``; the public half is ``.public_key``."""
    return SCHEMES.get(scheme).generate(**params)
