"""When `tandem serve` restarts a child that died: a limit within a window, and a growing back-off.

A child that dies is started again, with the same command line at the same address, after
a pause that doubles with each restart in the window (1, 2, 4, ... seconds, at most
`max_backoff_s`). Once it has been restarted `max_restarts` times within `window_s`
seconds, the next death is final: the supervisor reports it and stops everything, as it
always did with `max_restarts` 0. Crash loops thus end in a clear error rather than
running forever, while a rare crash costs only a brief outage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_RESTARTS = 3
DEFAULT_WINDOW_S = 600.0


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS  # 0: a dead child stops everything
    window_s: float = DEFAULT_WINDOW_S
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"the restart window must be > 0 seconds, got {self.window_s}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= first back-off <= max back-off, got {self.first_backoff_s}, "
                             f"{self.max_backoff_s}")

    def recent(self, restarts: Sequence[float], now: float) -> int:
        """How many of the restarts (monotonic times) fall within the window before `now`."""
        return sum(1 for t in restarts if now - t < self.window_s)

    def delay(self, restarts: Sequence[float], now: float) -> float | None:
        """Seconds to wait before restarting a child that died at `now`, having been restarted
        at the times `restarts`; None when the limit is reached (give up)."""
        n = self.recent(restarts, now)
        if n >= self.max_restarts:
            return None
        return min(self.first_backoff_s * 2 ** n, self.max_backoff_s)
