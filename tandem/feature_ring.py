"""A shared-memory ring for pushed feature rows, where the target and a draft share a host.

Pushed through the subscription stream, a step's features are serialised, copied by gRPC and
copied again on arrival: at 64 requests on the 8B shapes, 6.3 MB a step, which cost 11-13 ms
as one message and 26-31 ms as a message per sequence on the dev machine (BENCHMARKS.md, "Pushed
features"). Through the ring the target copies the rows once into memory the draft maps, and
the stream carries only where they are.

The subscriber (the draft) makes the ring: a file under /dev/shm of a name it draws, space
reserved up front (posix_fallocate: a full /dev/shm is an error here, not a SIGBUS later),
mode 0600. It names the ring when it subscribes; a target on the same host that can open it
writes there, and the subscriber unlinks the file once the target has answered, so that
nothing is left behind when either process dies. A target elsewhere cannot open the name and
sends the rows in its messages, as before.

Layout: 64 bytes of header, then the data. The writer keeps every batch contiguous (one that
would run past the end starts again at the front) and, before it writes, stores in the header
how many bytes it will have written in all once the batch is in (`claimed`, counting from the
ring's start, never wrapping). A reader that has copied a batch out checks `claimed`: if the
writer has since claimed bytes more than a ring's length past the batch's start, the batch
may have been written over while it was read, and is dropped (its positions are caught up
without target features: approximate, and no output depends on them).
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

import numpy as np
import torch

RING_DIR = Path("/dev/shm")
HEADER_BYTES = 64
_NAME = re.compile(r"^tandem-features-[0-9a-f]{32}$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


class RingUnavailable(OSError):
    """The ring cannot be made or opened here (no /dev/shm, no room, another host's name)."""


class FeatureRing:
    """One mapping of a ring file. Made by the reader (create), opened by the writer (attach)."""

    def __init__(self, name: str, data_bytes: int, fd: int, owner: bool):
        self.name = name
        self.data_bytes = data_bytes
        self._owner = owner
        try:
            # Populated now: the first touch of each page would otherwise fault inside the steps'
            # copies (20 steps of 6.3 MB cost 8.4 ms each to write until the ring had wrapped once).
            self._map = mmap.mmap(fd, HEADER_BYTES + data_bytes, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)  # the mapping keeps the memory
        # numpy views: a copy is a plain memcpy (torch's copy_ cost 18-25 us a 98 KB batch, numpy's 3).
        self._claimed = np.frombuffer(self._map, dtype=np.uint64, count=1)
        self._data = np.frombuffer(self._map, dtype=np.uint8, offset=HEADER_BYTES, count=data_bytes)
        self._written = 0  # writer: bytes written in all, as `claimed` counts them

    @classmethod
    def create(cls, data_bytes: int) -> FeatureRing:
        if data_bytes <= 0:
            raise ValueError(f"a feature ring needs a positive size, got {data_bytes} bytes")
        name = f"tandem-features-{uuid.uuid4().hex}"
        try:
            fd = os.open(RING_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise RingUnavailable(f"cannot make a feature ring under {RING_DIR}: {exc.strerror}") from None
        try:
            os.posix_fallocate(fd, 0, HEADER_BYTES + data_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(RING_DIR / name)
            raise RingUnavailable(f"no room for a {data_bytes >> 20} MB feature ring under {RING_DIR}: "
                                  f"{exc.strerror}") from None
        return cls(name, data_bytes, fd, owner=True)

    @classmethod
    def attach(cls, name: str, data_bytes: int) -> FeatureRing:
        """The writer's mapping of a ring the reader named (RingUnavailable if it is not here)."""
        if not _NAME.match(name):
            raise RingUnavailable(f"{name!r} is not a feature ring's name")
        try:
            fd = os.open(RING_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise RingUnavailable(f"cannot open the feature ring {name}: {exc.strerror}") from None
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + data_bytes or data_bytes <= 0:
            os.close(fd)
            raise RingUnavailable(f"the feature ring {name} holds {size} bytes, not {HEADER_BYTES + data_bytes}")
        return cls(name, data_bytes, fd, owner=False)

    def unlink(self) -> None:
        """Remove the file (the reader's, once the writer has opened it or will not): both
        mappings stay valid, and the memory goes with the last of them."""
        if self._owner:
            try:
                os.unlink(RING_DIR / self.name)
            except FileNotFoundError:
                pass
            self._owner = False

    def close(self) -> None:
        self.unlink()
        self._claimed = self._data = None  # the views go first: a mapping with views cannot close
        self._map.close()

    # --- the writer ------------------------------------------------------------------
    def write(self, parts: list[torch.Tensor]) -> int | None:
        """Copy host tensors into the ring, one after the other; the byte count written before
        them in all (where the reader finds them), or None when they do not fit in the ring."""
        sizes = [part.numel() * part.element_size() for part in parts]
        n = sum(sizes)
        if n > self.data_bytes:
            return None
        if self._written % self.data_bytes + n > self.data_bytes:  # keep the batch contiguous
            self._written += self.data_bytes - self._written % self.data_bytes
        start = self._written
        self._claimed[0] = start + n  # claimed before the bytes land: see the module's docstring
        at = start % self.data_bytes
        for part, size in zip(parts, sizes):
            self._data[at: at + size] = part.contiguous().view(-1).view(torch.uint8).numpy()
            at += size
        self._written = start + n
        return start

    # --- the reader ------------------------------------------------------------------
    def read(self, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A copy of the rows written at `start`, or None if the writer may have overwritten them."""
        n = int(np.prod(shape)) * dtype.itemsize
        at = start % self.data_bytes
        if at + n > self.data_bytes:
            return None
        out = self._data[at: at + n].copy()
        if int(self._claimed[0]) > start + self.data_bytes:
            return None
        return torch.from_numpy(out).view(dtype).view(shape)
