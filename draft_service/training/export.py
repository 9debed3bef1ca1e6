"""Write a trained draft as SGLang/SpecForge write EAGLE-3 checkpoints.

config.json: a one-layer Llama config plus architectures
["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size and
eagle_config.eagle_aux_hidden_state_layer_ids. Those ids follow SGLang: they
name layer *outputs*, so a feature taken at the input of layer i is written
as i - 1 (draft_service.config adds the 1 back).
model.safetensors: fc.weight, midlayer.*, norm.weight, lm_head.weight (in the
chosen float dtype), d2t (int64) and t2d (bool). No embedding: the draft reads
the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draft_service.config import EAGLE3_ARCHITECTURE
from draft_service.training.module import Eagle3TrainModel
from tandem.model_config import LlamaConfig


def draft_config(model: Eagle3TrainModel, target: LlamaConfig, feature_layers: tuple[int, ...],
                 dtype: torch.dtype) -> dict:
    s = model.shape
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": s.target_vocab_size,
        "draft_vocab_size": s.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "max_position_embeddings": s.max_position,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": list(target.eos_token_ids) or None,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in feature_layers],
            "use_aux_hidden_state": True,
        },
    }


def export_tensors(model: Eagle3TrainModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        out[name] = t.to(dtype) if t.is_floating_point() else t
    out["d2t"] = out["d2t"].to(torch.int64)
    out["t2d"] = out["t2d"].to(torch.bool)
    return {k: v.contiguous() for k, v in out.items()}


def export_draft(model: Eagle3TrainModel, target: LlamaConfig, feature_layers: tuple[int, ...], out_dir: Path,
                 dtype: torch.dtype = torch.float32, extra: dict | None = None) -> Path:
    """Write config.json and model.safetensors into out_dir (atomically: temp file, then rename)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(export_tensors(model, dtype), str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    cfg = draft_config(model, target, feature_layers, dtype)
    if extra:
        cfg["tandem_training"] = extra  # how it was made; readers ignore unknown fields
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir
