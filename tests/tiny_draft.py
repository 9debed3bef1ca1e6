"""Tiny random EAGLE-3 draft checkpoints, written with SGLang/SpecForge's tensor names and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def eagle3_tensors(target_cfg: dict, draft_vocab_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, intermediate_size: int, num_feature_layers: int = 3, seed: int = 0,
                   std: float = 0.15) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    H, V = target_cfg["hidden_size"], target_cfg["vocab_size"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        # Not all ones, so that mixing up two norms shows.
        return 1.0 + 0.2 * torch.randn(H, generator=gen)

    hot = torch.randperm(V, generator=gen)[:draft_vocab_size].sort().values  # draft vocab -> target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    return {
        "fc.weight": randn(H, num_feature_layers * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": randn(num_heads * head_dim, 2 * H),
        "midlayer.self_attn.k_proj.weight": randn(num_kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": randn(num_kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": randn(H, num_heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(intermediate_size, H),
        "midlayer.mlp.up_proj.weight": randn(intermediate_size, H),
        "midlayer.mlp.down_proj.weight": randn(H, intermediate_size),
        "norm.weight": norm(),
        # A larger scale spreads the draft's log-probs so ties are rare.
        "lm_head.weight": randn(draft_vocab_size, H) * 3,
        "d2t": hot - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }


def make_tiny_eagle3(path: Path, target_dir: Path, draft_vocab_size: int = 24, seed: int = 0,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                     intermediate_size: int = 96, aux_layer_ids: list[int] | None = None,
                     rope_theta: float | None = None, prefix: str = "",
                     tensors: dict[str, torch.Tensor | None] | None = None,
                     config: dict | None = None) -> Path:
    """Write a draft for the target in `target_dir`.

    `tensors` replaces (or, with None, removes) tensors by name before saving;
    `config` overrides config.json fields (None removes one); `prefix` is put
    before every tensor name (e.g. "model.").
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    H = target_cfg["hidden_size"]
    head_dim = head_dim or H // num_heads
    weights = eagle3_tensors(target_cfg, draft_vocab_size, num_heads, num_kv_heads, head_dim,
                             intermediate_size, 3 if aux_layer_ids is None else len(aux_layer_ids), seed)
    for name, value in (tensors or {}).items():
        if value is None:
            weights.pop(name, None)
        else:
            weights[name] = value
    save_file({prefix + k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": H,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class ReferenceEagle3:
    """The EAGLE-3 forward written out from DESIGN section 3, one position at a time.

    Independent of draft_service: it reads the safetensors files itself, uses
    plain RoPE and explicit softmax attention, and keeps K/V in Python lists.
    float64 throughout, so it serves as an oracle for float32 code.
    """

    def __init__(self, draft_dir: Path, target_dir: Path):
        from safetensors.torch import load_file

        self.cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        w = {k.removeprefix("model."): v.double() for k, v in
             load_file(str(Path(draft_dir) / "model.safetensors")).items()}
        self.w = w
        target = load_file(str(Path(target_dir) / "model.safetensors"))
        self.embed = target["model.embed_tokens.weight"].double()
        self.hot = (torch.arange(w["d2t"].shape[0]) + w["d2t"].long()).tolist()  # draft id -> target id
        self.heads, self.kv_heads = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        self.head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.heads
        self.eps = self.cfg["rms_norm_eps"]
        self.theta = self.cfg.get("rope_theta", 10000.0)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean() + self.eps) * self.w[name]

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:  # x: [heads, D]
        d = self.head_dim
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
        x1, x2 = x[:, : d // 2], x[:, d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def g_from_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.w["fc.weight"] @ features.double()

    def step(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: int, next_token: int,
             g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One position that sees `keys`/`values` (its visible past) and itself.
        Returns (k, v, pre-norm h, log-probs over the draft vocabulary)."""
        w, p = self.w, "midlayer."
        x = torch.cat((self._norm(self.embed[next_token], p + "input_layernorm.weight"),
                       self._norm(g, p + "hidden_norm.weight")))
        q = self._rope((w[p + "self_attn.q_proj.weight"] @ x).view(self.heads, -1), pos)
        k = self._rope((w[p + "self_attn.k_proj.weight"] @ x).view(self.kv_heads, -1), pos)
        v = (w[p + "self_attn.v_proj.weight"] @ x).view(self.kv_heads, -1)
        K, V = torch.stack([*keys, k]), torch.stack([*values, v])  # [n, kv_heads, D]
        group = self.heads // self.kv_heads
        out = []
        for head in range(self.heads):
            kh, vh = K[:, head // group], V[:, head // group]
            att = torch.softmax(kh @ q[head] / self.head_dim ** 0.5, 0)
            out.append(att @ vh)
        h = g + w[p + "self_attn.o_proj.weight"] @ torch.cat(out)
        m = self._norm(h, p + "post_attention_layernorm.weight")
        gate, up = w[p + "mlp.gate_proj.weight"] @ m, w[p + "mlp.up_proj.weight"] @ m
        h = h + w[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        logits = w["lm_head.weight"] @ self._norm(h, "norm.weight")
        return k, v, h, torch.log_softmax(logits, -1)

    def prefill(self, tokens: list[int], features: list[torch.Tensor | None]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Positions 0..len(tokens)-2: position t pairs features[t] (or the previous h,
        zeros at t = 0, when None) with tokens[t+1]. Returns per-position k, v, h, log-probs."""
        ks, vs, hs, lps = [], [], [], []
        h_prev = torch.zeros(self.cfg["hidden_size"], dtype=torch.float64)
        for t in range(len(tokens) - 1):
            g = self.g_from_features(features[t]) if features[t] is not None else h_prev
            k, v, h_prev, lp = self.step(ks, vs, t, tokens[t + 1], g)
            ks.append(k)
            vs.append(v)
            hs.append(h_prev)
            lps.append(lp)
        return ks, vs, hs, lps

    def path_scores(self, ks: list[torch.Tensor], vs: list[torch.Tensor], h_root: torch.Tensor,
                    lp_root: torch.Tensor, max_depth: int) -> dict[tuple[int, ...], float]:
        """Cumulative log-prob of every path of draft ids below the root, up to max_depth
        (brute force: every node runs with its ancestors as its only tree context)."""
        n = len(ks)
        scores: dict[tuple[int, ...], float] = {}

        def visit(path: tuple[int, ...], score: float, lp: torch.Tensor, h: torch.Tensor,
                  tk: list[torch.Tensor], tv: list[torch.Tensor]) -> None:
            for d in range(lp.shape[0]):
                child = (*path, d)
                scores[child] = score + float(lp[d])
                if len(child) < max_depth:
                    k, v, h2, lp2 = self.step(ks + tk, vs + tv, n + len(path), self.hot[d], h)
                    visit(child, scores[child], lp2, h2, tk + [k], tv + [v])

        visit((), 0.0, lp_root, h_root, [], [])
        return scores
