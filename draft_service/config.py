"""The EAGLE-3 draft's config.json, read against the target it drafts for.

The draft is a one-layer Llama decoder, so the Llama fields are read with the
same loader as the target's (`load_llama_config`); this module adds the EAGLE-3
fields and checks that the pair fits together.

Feature layers (SGLang's convention, which we follow): the target hands the
draft the residual stream at the *input* of some of its layers. When the draft
config lists `eagle_config.eagle_aux_hidden_state_layer_ids = [i, ...]`, the
features are the outputs of layers i, i.e. the inputs of layers i + 1 (vLLM
would use the inputs of layers i; we do not). When absent, SGLang's default:
the inputs of layers [2, L//2, L-3] of an L-layer target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.model_config import LlamaConfig, ModelLoadError, load_llama_config

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class DraftConfig:
    """The draft head's shape and how it maps onto its target."""

    layer: LlamaConfig  # the draft's own decoder shape (one layer)
    draft_vocab_size: int  # rows of lm_head; ids are mapped to target ids by d2t
    target_vocab_size: int
    target_hidden_size: int  # width of one feature layer
    target_num_layers: int
    # Target layers whose input residual stream forms the features, in order.
    feature_layers: tuple[int, ...]
    # The ids as written in the checkpoint's eagle_config, or None when it had none.
    aux_layer_ids: tuple[int, ...] | None = None
    fc_bias: bool = False

    def __post_init__(self) -> None:
        if self.layer.num_layers != 1:
            raise ModelLoadError(
                f"EAGLE-3 drafts have one decoder layer (midlayer); config says num_hidden_layers="
                f"{self.layer.num_layers}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ModelLoadError(f"draft_vocab_size must be in 1..{self.target_vocab_size} (the target's "
                                 f"vocabulary), got {self.draft_vocab_size}")
        if self.layer.vocab_size != self.target_vocab_size:
            raise ModelLoadError(f"the draft config's vocab_size ({self.layer.vocab_size}) differs from the "
                                 f"target's ({self.target_vocab_size}): is this the draft for another model?")
        if not self.feature_layers:
            raise ModelLoadError("the draft needs at least one target feature layer")
        bad = [i for i in self.feature_layers if not 0 <= i <= self.target_num_layers]
        if bad:
            raise ModelLoadError(
                f"feature layer(s) {bad} (input-of-layer convention) are outside the target's "
                f"0..{self.target_num_layers}; check eagle_config.eagle_aux_hidden_state_layer_ids")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_width(self) -> int:
        """Columns of one token's features: one target hidden state per feature layer."""
        return len(self.feature_layers) * self.target_hidden_size

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.target_vocab_size


def feature_layers_from_aux_ids(aux_ids: tuple[int, ...] | None, target: LlamaConfig) -> tuple[int, ...]:
    """Map eagle_aux_hidden_state_layer_ids to input-of-layer indices (SGLang adds 1)."""
    if aux_ids is None:
        return target.default_feature_layers
    return tuple(i + 1 for i in aux_ids)


def _aux_ids(raw: dict, path: Path) -> tuple[int, ...] | None:
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ModelLoadError(f"{path}: eagle_config must be an object")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ModelLoadError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of "
                             f"integers, got {ids!r}")
    return tuple(ids)


def load_draft_config(draft_dir: str | Path, target: LlamaConfig) -> DraftConfig:
    draft_dir = Path(draft_dir)
    layer = load_llama_config(draft_dir)  # raises ModelLoadError when config.json is absent or bad
    path = draft_dir / "config.json"
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    # Accept any Eagle3 spelling (SGLang/SpecForge write LlamaForCausalLMEagle3, vLLM
    # Eagle3LlamaForCausalLM), refuse EAGLE-1/2 heads whose tensors differ.
    if archs and not any("eagle3" in str(a).lower() for a in archs):
        raise ModelLoadError(f"{path}: architectures {archs} is not an EAGLE-3 draft "
                             f"(expected {EAGLE3_ARCHITECTURE})")
    draft_vocab = raw.get("draft_vocab_size")
    target_hidden = raw.get("target_hidden_size")
    aux = _aux_ids(raw, path)
    try:
        cfg = DraftConfig(
            layer=layer,
            draft_vocab_size=int(draft_vocab) if draft_vocab is not None else target.vocab_size,
            target_vocab_size=target.vocab_size,
            target_hidden_size=int(target_hidden) if target_hidden is not None else target.hidden_size,
            target_num_layers=target.num_layers,
            feature_layers=feature_layers_from_aux_ids(aux, target),
            aux_layer_ids=aux,
            fc_bias=bool(raw.get("bias", False)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path} has a malformed field: {e}") from e
    if cfg.target_hidden_size != target.hidden_size:
        raise ModelLoadError(f"{path}: target_hidden_size is {cfg.target_hidden_size} but the target's "
                             f"hidden_size is {target.hidden_size}")
    return cfg
