"""The newcomer's first command: train on a synthetic dataset behind an emulated slow remote.

    python3 -m bench.demo

Generates a small ImageNet-like dataset (once, into bench/work/), starts the emulated EFS-like
remote, reads it directly and through cachefs keeping 20 % of the files with the client's
prefetch hints, and prints one line per epoch: samples/s, the share of the epoch the loop
waited for data, the cache hit ratio and the bytes read from the remote against the floor no
cache can beat. About a minute; every mount is gone when it ends. Takes the flags of
``python3 -m bench.run`` (``--help``).
"""

from __future__ import annotations

import signal
import sys

from bench import report, targets
from bench.run import _sigterm_as_interrupt, run
from bench.settings import build_parser, settings_from_args


def summary(results: dict) -> str:
    """The verdicts on the measured variants, one line each."""
    lines = []
    for verdict in results["verdicts"]:
        if verdict["met"] is None:
            continue
        mark = "met" if verdict["met"] else "MISSED"
        lines.append(f"  {verdict['variant']:<20} {verdict['target']}: {verdict['measured']} "
                     f"[{mark}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("python3 -m bench.demo", __doc__.strip().splitlines()[0],
                          quick_flag=False)
    settings = settings_from_args(parser, argv, "demo")
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        results = run(settings)
    except KeyboardInterrupt:
        print("demo: interrupted; every mount was unmounted", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"demo: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    report.write(results, settings.out_dir)
    print()
    print(report.console_table(results))
    print(f"\nSteady state (epochs 2+), pace {settings.pace:.0f} samples/s "
          f"({settings.step_ms:.0f} ms per batch of {settings.batch}):")
    print(summary(results))
    if targets.machine_reaches_pace(results, settings.step_ms) is False:
        print("  (this machine cannot keep the pace even from local disk)")
    print(f"\nFull results: {settings.out_dir / 'latest.md'}; the whole comparison "
          "(rclone, other fractions, local disk): python3 -m bench.run")
    return 1 if any(v["error"] for v in results["variants"]) else 0


if __name__ == "__main__":
    sys.exit(main())
