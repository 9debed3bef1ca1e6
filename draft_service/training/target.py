"""The target during draft training: continuations, features and logits, via transformers.

Features follow tandem's (and SGLang's) convention: feature layer i is the
residual stream at the *input* of target layer i; i == L means the final
residual stream before the last norm. They are captured with forward
pre-hooks rather than output_hidden_states, whose last entry is normed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from tandem.model_config import LlamaConfig, ModelLoadError, load_llama_config


class TargetModel:
    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                 feature_layers: tuple[int, ...] | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg: LlamaConfig = load_llama_config(model_dir)  # also rejects non-Llama-shaped configs
        self.feature_layers = tuple(feature_layers or self.cfg.default_feature_layers)
        bad = [i for i in self.feature_layers if not 0 <= i <= self.cfg.num_layers]
        if bad:
            raise ModelLoadError(f"feature layers {bad} are outside 0..{self.cfg.num_layers} (inputs of layers)")
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        params = inspect.signature(self.model.forward).parameters
        # transformers renamed past_key_values to cache (5.2x); accept either.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] | None = None
        decoder = self.model.model
        if len(decoder.layers) != self.cfg.num_layers:
            raise ModelLoadError(f"{model_dir}: transformers built {len(decoder.layers)} layers, config says "
                                 f"{self.cfg.num_layers}")
        for i in sorted(set(self.feature_layers)):
            module = decoder.layers[i] if i < self.cfg.num_layers else decoder.norm
            module.register_forward_pre_hook(self._capture(i), with_kwargs=True)

    def _capture(self, index: int):
        def hook(_module, args, kwargs):
            if self._captured is not None:
                self._captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    @property
    def embed_tokens(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def features_and_logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> features [B, T, len(feature_layers) * H], logits [B, T, V] (float32)."""
        self._captured = {}
        try:
            logits = self.model(input_ids=tokens, use_cache=False).logits
            feats = torch.cat([self._captured[i] for i in self.feature_layers], -1)
        finally:
            self._captured = None
        return feats, logits.float()

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, temperature: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
        """Continue each prompt [B, P] by exactly new_tokens tokens: greedy where temperature[b] == 0,
        else sampled at that temperature. EOS is an ordinary token here (the corpus separates
        documents with it), so every row has the same length and needs no padding."""
        temperature = temperature.to(self.device, torch.float32)
        out = self.model(input_ids=prompts, use_cache=True)
        cache = out.get("cache", None)
        if cache is None:
            cache = out.get("past_key_values")
        pieces = [prompts]
        logits = out.logits[:, -1].float()
        for i in range(new_tokens):
            greedy = logits.argmax(-1)
            probs = torch.softmax(logits / temperature.clamp_min(1e-4)[:, None], -1)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            nxt = torch.where(temperature > 0, sampled, greedy)
            pieces.append(nxt[:, None])
            if i + 1 < new_tokens:
                out = self.model(input_ids=nxt[:, None], use_cache=True, **{self._cache_kw: cache})
                logits = out.logits[:, -1].float()
        return torch.cat(pieces, 1)
