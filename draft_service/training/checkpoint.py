"""Periodic training checkpoints in OUT/checkpoints/, and resuming from the latest.

A checkpoint holds the draft's state_dict, the optimizer, the step, the RNG
states, the run's log and its config. Batches are a function of (seed, step),
so a resumed run sees exactly the batches the uninterrupted run would have.
Only the newest `keep` checkpoints stay on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch

PATTERN = "step_*.pt"


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def latest(out: Path) -> Path | None:
    found = sorted(checkpoint_dir(out).glob(PATTERN))
    return found[-1] if found else None


def save(out: Path, step: int, state: dict, keep: int = 2) -> Path:
    d = checkpoint_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({**state, "step": step, "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp)
    tmp.replace(path)  # never leave a half-written checkpoint under the real name
    for old in sorted(d.glob(PATTERN))[:-keep]:
        old.unlink()
    return path


def load(path: Path, device: torch.device) -> dict:
    state = torch.load(path, map_location=device, weights_only=False)
    torch.set_rng_state(state["rng_cpu"].cpu())
    if state.get("rng_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])
    return state
