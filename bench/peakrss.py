"""The peak RSS of a command, its own.

A process started by a large one (a benchmark that imported torch, a test run) reports in
its ru_maxrss the RSS of its parent at the fork, not only its own: the kernel carries the
high-water mark over the exec.  So the command is started by a small Python process of its
own, whose children's peak is then the command's (or that small process's, some 10 MiB,
whichever is larger).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

_LAUNCHER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(code)
"""


def run_with_peak_rss(command: list[str], **popen_kwargs) -> tuple[int, int]:
    """Run ``command`` to its end (Popen's keyword arguments: stdout, env, cwd...): its exit
    status and its peak RSS in bytes."""
    with tempfile.NamedTemporaryFile(prefix="peakrss-", delete=False) as f:
        report = Path(f.name)
    try:
        child = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(report), *command],
                                 **popen_kwargs)
        try:
            code = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        text = report.read_text()
        if not text:
            raise RuntimeError(f"{command[:3]} ended without its peak RSS (status {code})")
        return code, int(text)
    finally:
        report.unlink(missing_ok=True)


if __name__ == "__main__":  # python3 -m bench.peakrss COMMAND...: the peak in MiB on stderr
    status, peak = run_with_peak_rss(sys.argv[1:])
    print(f"peak RSS {peak / 2**20:.1f} MiB", file=sys.stderr)
    sys.exit(status)
