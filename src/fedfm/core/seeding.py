"""Seeds derived from names, never from global RNG state (a leaf module: hashlib only).

Randomness in fedfm is derived from ``(run seed, round, client, purpose)`` with
:func:`derive_seed`, so a resumed run and a run on another runtime draw the same numbers.
Every layer (data, core, models, tasks) may import it.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (run seed, round, client id, purpose).

    Randomness in fedfm is derived from such seeds rather than from global RNG state, so a
    resumed run and a run on another runtime draw the same numbers.
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
