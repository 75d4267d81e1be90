"""The ways of reaching the dataset that a run compares, and how they are named on the command line.

* ``local``: the dataset's own directory on the local disk, the limit nothing can beat;
* ``direct``: the emulated remote read directly, what training does without a cache;
* ``cachefs-f<F>`` and ``cachefs-f<F>-hints``: cachefs over the remote keeping a fraction F,
  without and with the client's prefetch hints;
* ``cachefs-f1-due`` and ``cachefs-f1-hints-due``: f = 1, without and with hints, and every
  file's attributes due for revalidation when each epoch starts (``--revalidate
  REVALIDATE_DUE_S``, and a pause that long before each epoch), as in every real epoch longer
  than the interval; the other variants' epochs are shorter than the default interval, so
  their attributes stay fresh, as with ``never``;
* ``rclone``: rclone's VFS cache (``--vfs-cache-mode full``) over the remote, given the byte
  budget that cachefs has at the peer fraction (0.2 by default);
* ``cachefs-f<F>-symlink`` and ``cachefs-f<F>-symlink-hints``: the cachefs variants read
  through a symlink to the directory that holds the mount (``/data`` linked to a local disk),
  as training jobs often name their data: the client must find its daemon all the same.
  Measured only when named (``--variants``), beside their twins through the real path.
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
# Longer than the client's hints run ahead of the reads (about one second here), so a hint's
# refresh is still fresh when its file is opened.
REVALIDATE_DUE_S = 5.0


@dataclass(frozen=True)
class Variant:
    kind: str
    fraction: float | None = None  # cachefs: the --fraction; rclone: the budget's fraction
    hints: bool = False
    attributes_due: bool = False  # cachefs: revalidate every file as each epoch starts
    through_symlink: bool = False  # cachefs: the loop names files through a symlinked parent

    @property
    def name(self) -> str:
        if self.kind == CACHEFS:
            return (f"cachefs-f{self.fraction:g}" + ("-symlink" if self.through_symlink else "")
                    + ("-hints" if self.hints else "") + ("-due" if self.attributes_due else ""))
        return self.kind

    @property
    def cachefs_args(self) -> tuple[str, ...]:
        return ("--revalidate", f"{REVALIDATE_DUE_S:g}") if self.attributes_due else ()

    @property
    def pause_before_epoch_s(self) -> float:
        return REVALIDATE_DUE_S if self.attributes_due else 0.0


def all_variants(fractions: tuple[float, ...] = DEFAULT_FRACTIONS) -> list[Variant]:
    """Every variant, in the order a run measures them."""
    cached = [Variant(CACHEFS, f, hints) for f in fractions for hints in (False, True)]
    due = [Variant(CACHEFS, 1.0, hints, attributes_due=True) for hints in (False, True)
           if 1.0 in fractions]
    return [Variant(LOCAL), Variant(DIRECT), *cached, *due, Variant(RCLONE, PEER_FRACTION)]


def on_request_variants(fractions: tuple[float, ...] = DEFAULT_FRACTIONS) -> list[Variant]:
    """Variants measured only when named: the cachefs ones through a symlinked path."""
    return [Variant(CACHEFS, f, hints, through_symlink=True) for f in fractions
            for hints in (False, True)]


def select(names: str | None, fractions: tuple[float, ...] = DEFAULT_FRACTIONS) -> list[Variant]:
    """The variants named in a comma-separated list (None: all but those measured on request);
    ValueError naming the choices."""
    if not names:
        return all_variants(fractions)
    every = all_variants(fractions) + on_request_variants(fractions)
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
