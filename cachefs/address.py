"""Where the metrics endpoint listens: a value of the settings, kept apart from the metrics
themselves so that a command reading the settings does not import the metrics library."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MetricsAddress:
    """Where /metrics is served (--metrics-addr)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
