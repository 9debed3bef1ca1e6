"""Wall time spent inside chosen functions, timed by wrapping them for a while (the benches' --phases)."""

from __future__ import annotations

import time


class CallClock:
    """Seconds spent in each wrapped function, summed by label, until `restore` puts the functions back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str | None = None) -> None:
        """Times owner.name (a class's, a module's or an instance's) under `label` (default: name)."""
        inner = getattr(owner, name)
        label = label or name
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t0

        # The owner's own attribute is put back; one it only looked up (an instance's method, an inherited
        # one) is removed, so that the lookup finds it again.
        self._undo.append((owner, name, inner if name in vars(owner) else None))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()
