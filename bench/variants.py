"""The ways of reaching the dataset that a run compares, and how they are named on the command line.

* ``local``: the dataset's own directory on the local disk, the limit nothing can beat;
* ``direct``: the emulated remote read directly, what training does without a cache;
* ``cachefs-f<F>`` and ``cachefs-f<F>-hints``: cachefs over the remote keeping a fraction F,
  without and with the client's prefetch hints;
* ``rclone``: rclone's VFS cache (``--vfs-cache-mode full``) over the remote, given the byte
  budget that cachefs has at the peer fraction (0.2 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL = "local"
DIRECT = "direct"
CACHEFS = "cachefs"
RCLONE = "rclone"
DEFAULT_FRACTIONS = (0.0, 0.2, 0.5, 1.0)
# The fraction whose byte budget rclone gets, and the one the speed-up targets are about.
PEER_FRACTION = 0.2


@dataclass(frozen=True)
class Variant:
    kind: str
    fraction: float | None = None  # cachefs: the --fraction; rclone: the budget's fraction
    hints: bool = False

    @property
    def name(self) -> str:
        if self.kind == CACHEFS:
            return f"cachefs-f{self.fraction:g}" + ("-hints" if self.hints else "")
        return self.kind


def all_variants(fractions: tuple[float, ...] = DEFAULT_FRACTIONS) -> list[Variant]:
    """Every variant, in the order a run measures them."""
    cached = [Variant(CACHEFS, f, hints) for f in fractions for hints in (False, True)]
    return [Variant(LOCAL), Variant(DIRECT), *cached, Variant(RCLONE, PEER_FRACTION)]


def select(names: str | None, fractions: tuple[float, ...] = DEFAULT_FRACTIONS) -> list[Variant]:
    """The variants named in a comma-separated list (None: all); ValueError naming the choices."""
    every = all_variants(fractions)
    if not names:
        return every
    by_name = {v.name: v for v in every}
    chosen = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        if name not in by_name:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(by_name)}")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    if not chosen:
        raise ValueError("no variant named")
    # Measured in the canonical order whatever order they were named in.
    return [v for v in every if v in chosen]


def parse_fractions(text: str) -> tuple[float, ...]:
    """``"0,0.2,1"`` -> (0.0, 0.2, 1.0); ValueError when a value is not in [0, 1]."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"fraction {part!r} is not a number") from None
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"fraction {value:g} is not between 0 and 1")
        values.append(value)
    if not values:
        raise ValueError("no fraction given")
    return tuple(sorted(set(values)))
