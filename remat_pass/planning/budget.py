"""Budget parsing: what the user may pass and what it means in bytes.

A float in (0, 1] is a fraction of the bytes the un-rematerialized step saves for backward
(known only once the graph is captured); an int or a size string ("512MB", "2GiB") is an
absolute cap. Booleans are rejected even though ``True`` is an int: ``budget=True`` is a bug.

A string without a unit is read as the number it spells (``"0.3"`` from a config file is the
fraction 0.3, ``"4096"`` the int 4096). A bare int up to ``MAX_AMBIGUOUS_INT`` is refused: ``1``
next to ``1.0`` (keep everything) or ``30`` meaning 30% are typing slips far more often than
real caps, and a cap that small is spelled with its unit (``"64B"``) when it is meant.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InvalidBudgetError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")

MAX_AMBIGUOUS_INT = 100
"""The largest bare int refused as a byte budget. 1 to 100 are exactly the ints a fraction or a
percentage is mistyped as (``1`` for ``1.0``, ``30`` for 30%); no real training step fits in 100
bytes, so such a budget is a slip, not a cap. Above 100 an int has no other reading and is bytes
(tiny test models and computed budgets such as ``BudgetInfeasibleError.min_bytes`` live there)."""
_ACCEPTED = (
    "a budget is a float in (0, 1] (fraction of the activation bytes the un-rematerialized step keeps), "
    "a positive int (bytes), or a size string such as '512MB', '1.5GB' or '2GiB' "
    f"(units: {', '.join(u for u in _UNITS if u)})"
)


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``fraction`` and ``nbytes`` is set."""

    fraction: float | None = None
    nbytes: int | None = None

    def resolve(self, keep_all_bytes: int) -> int:
        """Bytes allowed, given what the un-rematerialized step keeps."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(math.floor(self.fraction * keep_all_bytes + 1e-9))

    def __str__(self) -> str:
        return f"{self.fraction:g} of keep-all" if self.fraction is not None else f"{self.nbytes} bytes"


def parse_budget(value: object) -> Budget:
    """Validate a user's budget; raise InvalidBudgetError saying what is accepted.

    >>> parse_budget(0.4), parse_budget("2GiB").nbytes, parse_budget(300_000_000).nbytes
    (Budget(fraction=0.4, nbytes=None), 2147483648, 300000000)
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or value is None:
        raise InvalidBudgetError(f"invalid budget {value!r}: {_ACCEPTED}")
    if isinstance(value, str) and _NUMBER.match(value):
        return parse_budget(_as_number(value))
    if isinstance(value, int):
        if value <= 0:
            raise InvalidBudgetError(f"invalid budget {value!r}: byte budgets must be positive; {_ACCEPTED}")
        if value <= MAX_AMBIGUOUS_INT:
            raise InvalidBudgetError(_tiny_int_message(value))
        return Budget(nbytes=value)
    if isinstance(value, float):
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise InvalidBudgetError(
                f"invalid budget {value!r}: a float is a fraction and must lie in (0, 1]; "
                f"for an absolute cap pass an int or a string like '512MB'"
            )
        return Budget(fraction=value)
    if isinstance(value, str):
        return Budget(nbytes=parse_size(value))
    raise InvalidBudgetError(f"invalid budget of type {type(value).__name__}: {_ACCEPTED}")


def _as_number(text: str) -> int | float:
    """``"4096"`` -> 4096, ``"0.3"`` -> 0.3, ``"1e9"`` -> 1e9: what the literal means in Python."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return float(text)


def _tiny_int_message(value: int) -> str:
    if value == 1:
        guess = "did you mean 1.0? (the fraction 1.0 keeps everything)"
    else:
        guess = f"did you mean {value / 100:g}? (the fraction: {value}% of keep-all)"
    unit = "byte" if value == 1 else "bytes"
    return (
        f"invalid budget {value!r}: an int is a byte count, and {value} {unit} (at most {MAX_AMBIGUOUS_INT}) reads "
        f"like a fraction or a percentage; {guess} If you do mean {value} {unit}, write budget='{value}B'."
    )


def parse_size(text: str) -> int:
    """Bytes in a size string ("512MB", "2GiB", "100"): the one unit table of remat_pass.

    B, KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024; case-insensitive.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidBudgetError(f"invalid budget {text!r}: {_ACCEPTED}")
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise InvalidBudgetError(f"invalid budget {text!r}: the size must be positive")
    return nbytes
