"""Model building blocks shared by the target and the draft: norms, RoPE, weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.model_config import ModelLoadError, RopeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like Hugging Face Llama, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between the two thresholds is interpolated smoothly.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """cos/sin tables indexed by absolute position (rotate-half convention)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int, device: torch.device):
        inv_freq = rope_inv_freq(head_dim, rope).to(device)
        t = torch.arange(max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SafetensorsDir:
    """Reads tensors (or slices of them) from a directory of safetensors shards."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self.where: dict[str, Path] = {}
        if index.exists():
            for name, shard in json.loads(index.read_text())["weight_map"].items():
                self.where[name] = self.dir / shard
        else:
            for shard in sorted(self.dir.glob("*.safetensors")):
                with safe_open(shard, framework="pt") as f:
                    for name in f.keys():
                        self.where[name] = shard
        if not self.where:
            pickles = [p.name for p in self.dir.glob("*.bin")] + [p.name for p in self.dir.glob("*.pt")]
            hint = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
            raise ModelLoadError(f"{self.dir} has no safetensors weights{hint}")
        missing = sorted({str(p) for p in self.where.values() if not p.exists()})
        if missing:
            raise ModelLoadError(f"safetensors index names missing shard(s): {', '.join(missing)}")
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _file(self, name: str):
        path = self.where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None, dim: int | None = None,
            start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Load `name`, optionally rows/cols [start, stop) along `dim`, checking the full shape."""
        if name not in self.where:
            raise ModelLoadError(f"tensor {name!r} is missing from {self.dir}")
        full = self.shape(name)
        if shape is not None and full != tuple(shape):
            raise ModelLoadError(f"tensor {name!r} has shape {list(full)}, expected {list(shape)}")
        if dim is None:
            return self._file(name).get_tensor(name)
        sl = self._file(name).get_slice(name)
        index = [slice(None)] * len(full)
        index[dim] = slice(start, stop)
        return sl[tuple(index)]
