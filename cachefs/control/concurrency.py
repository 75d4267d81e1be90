"""How many files a warm has fetched at once: as many as make it faster, and no more.

A fetch from a remote with latency mostly waits, so more at once go faster, up to what the
remote serves (16 at once warm an EFS-like remote twice as fast as 2).  From a fast remote,
more at once only make the daemon's threads take turns at its interpreter lock: a fill of a
small file from a local tree costs the daemon twice the CPU with 16 at once as with 2, and
goes slower.  Neither can be known before the warm starts, so it is measured as it goes:
the rate at the concurrency in use is compared with the rate at double (or half) of it, in
turns; a change is kept when it is faster, or, for fewer at once, no slower.  A probe that
is not kept is followed at once by one the other way: only when neither way pays does the
warm stay where it is for a while (and probe again later, so that it follows a remote whose
speed changes).  Staying after the first failed probe instead kept a warm from a fast remote
at the starting concurrency for its first seconds: at 50,000 files, 3,126 files/s at 356 us
of daemon CPU per file, where one at a time ran at 4,371 and 228 us.

Thread safety: used by one thread.
"""

from __future__ import annotations

# A rate is measured over at least this long and this many answers...
WINDOW_SECONDS = 0.5
WINDOW_ANSWERS = 32
# ... after this long at a new concurrency, for the requests sent at the old one to drain.
SETTLE_SECONDS = 0.25
# More at once is kept when this much faster; fewer, unless this much slower.
FASTER = 1.10
NOT_SLOWER = 0.95
# Windows at a concurrency found best before it is probed again.
STAY_WINDOWS = 10
START = 4


class ConcurrencyTuner:
    """Says how many fetches to keep going at once, from the answers counted so far."""

    def __init__(self, maximum: int, start: int = START) -> None:
        self.maximum = max(1, maximum)
        self.current = min(self.maximum, max(1, start))
        self._kept = self.current  # the concurrency a probe is compared with
        self._kept_rate = 0.0
        self._up = True  # which way the next probe goes
        self._failed_ways = 0  # probes from the kept concurrency not kept, since it was found
        self._windows_to_stay = 0
        self._window_started: float | None = None
        self._window_answers = 0
        self._settle_until = 0.0

    def answered(self, count: int, now: float) -> int:
        """``count`` more answers came by ``now``: the concurrency to use from now on."""
        if self._window_started is None or now < self._settle_until:
            if now >= self._settle_until:
                self._window_started, self._window_answers = now, 0
            return self.current
        self._window_answers += count
        elapsed = now - self._window_started
        if elapsed < WINDOW_SECONDS or self._window_answers < WINDOW_ANSWERS:
            return self.current
        rate = self._window_answers / elapsed
        self._window_started, self._window_answers = now, 0
        self._judge(rate, now)
        return self.current

    def _judge(self, rate: float, now: float) -> None:
        if self.current == self._kept:  # a window at the concurrency kept
            self._kept_rate = rate
            if self._windows_to_stay > 0:
                self._windows_to_stay -= 1
            else:
                self._probe(now)
            return
        wanted = FASTER if self.current > self._kept else NOT_SLOWER
        if rate >= self._kept_rate * wanted:
            self._kept, self._kept_rate = self.current, rate
            self._failed_ways = 0
            self._probe(now)  # on the same way, while it pays
        else:
            self._turn()
            self._change(self._kept, now)

    def _probe(self, now: float) -> None:
        target = min(self.maximum, self.current * 2) if self._up else max(1, self.current // 2)
        if target == self.current:  # at a bound: this way does not pay either
            self._turn()
            return
        self._change(target, now)

    def _turn(self) -> None:
        """This way did not pay: the next probe goes the other way.  The first time from the
        concurrency kept, after one window there (its rate measured again); once both ways
        failed from it, after STAY_WINDOWS, and so after every failed probe from then on."""
        self._up = not self._up
        self._failed_ways += 1
        if self._failed_ways >= 2:
            self._windows_to_stay = STAY_WINDOWS

    def _change(self, concurrency: int, now: float) -> None:
        self.current = concurrency
        self._window_started = None
        self._settle_until = now + SETTLE_SECONDS
