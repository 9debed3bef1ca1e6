"""The subset of a Hugging Face Llama-family config.json that tandem needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message says why."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # None for plain RoPE, "llama3" for Llama 3.1 frequency scaling.
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.scaling_type not in (None, "default", "llama3"):
            raise ModelLoadError(f"unsupported rope scaling type {self.scaling_type!r} (supported: llama3)")
        if self.theta <= 0:
            raise ModelLoadError(f"rope theta must be positive, got {self.theta}")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def default_feature_layers(self) -> tuple[int, ...]:
        """SGLang's default EAGLE-3 capture points: inputs of layers 2, L//2 and L-3."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))


def _rope_from_hf(cfg: dict) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older versions rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type"))
    if kind in (None, "default"):
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        scaling_type=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings",
                                             cfg.get("max_position_embeddings", 8192))),
    )


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg, _read_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            value = [value]
        for v in value or []:
            if v not in ids:
                ids.append(int(v))
    return tuple(ids)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def load_llama_config(model_dir: str | Path) -> LlamaConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    cfg = _read_json(path)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return LlamaConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_from_hf(cfg),
            eos_token_ids=_eos_ids(model_dir, cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path} has a malformed field: {e}") from e
