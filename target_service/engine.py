"""The target's one operation: extend sequences by token trees, keep the accepted paths."""

from __future__ import annotations

import random
import time

import torch

from kernels.tree_attention import StepLayout
from tandem.tree import ancestor_mask, children, depths, validate_tree
from target_service.acceptance import accept_greedy, accept_sampling, target_probs
from target_service.model import LlamaModel
from target_service.types import (
    InvalidStep,
    KvLoad,
    OutOfCapacity,
    SequenceResult,
    SequenceStep,
)

MAX_TOP_LOGPROBS = 20


class TargetEngine:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 max_model_len: int | None = None):
        self.model = model
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.max_model_len = min(max_model_len or model.cfg.max_position, model.cfg.max_position)
        self.last_step_seconds = 0.0
        self._seed_source = random.Random()

    # --- queries ----------------------------------------------------------
    def load(self) -> KvLoad:
        return KvLoad(len(self.kv.seqs), self.kv.block_size, self.kv.num_blocks, self.kv.free_blocks)

    def length(self, request_id: str) -> int:
        return self.kv.seqs[request_id].length

    def resolve_feature_layers(self, layers: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        layers = tuple(layers) or self.model.cfg.default_feature_layers
        bad = [i for i in layers if not 0 <= i <= self.model.cfg.num_layers]
        if bad:
            raise InvalidStep(f"feature layer(s) {bad} out of range 0..{self.model.cfg.num_layers}")
        return layers

    def with_seeds(self, items: list[SequenceStep]) -> list[SequenceStep]:
        """Give every sampled item without a seed one (done once, on rank 0, before a step is broadcast)."""
        out = []
        for it in items:
            if not it.sampling.greedy and it.sampling.seed is None:
                sp = it.sampling
                it = SequenceStep(it.request_id, it.tokens, it.parents, it.num_fixed, it.create,
                                  type(sp)(sp.temperature, sp.top_k, sp.top_p,
                                           self._seed_source.getrandbits(63)),
                                  it.top_logprobs, it.return_features)
            out.append(it)
        return out

    # --- validation -------------------------------------------------------
    def _validate(self, items: list[SequenceStep]) -> None:
        if not items:
            raise InvalidStep("a step needs at least one item")
        vocab = self.model.cfg.vocab_size
        seen: set[str] = set()
        for it in items:
            rid = it.request_id
            if not rid:
                raise InvalidStep("request_id must not be empty")
            if rid in seen:
                raise InvalidStep(f"request {rid!r} appears twice in one step")
            seen.add(rid)
            if it.create and rid in self.kv.seqs:
                raise InvalidStep(f"request {rid!r} already exists; release it before creating it again")
            if not it.create and rid not in self.kv.seqs:
                raise InvalidStep(f"unknown request {rid!r} (set create=true for a new sequence)")
            if len(it.tokens) != len(it.parents):
                raise InvalidStep(f"request {rid!r}: {len(it.tokens)} tokens but {len(it.parents)} parents")
            problem = validate_tree(it.parents, it.num_fixed)
            if problem:
                raise InvalidStep(f"request {rid!r}: {problem}")
            bad = [t for t in it.tokens if not 0 <= t < vocab]
            if bad:
                raise InvalidStep(f"request {rid!r}: token id {bad[0]} out of range [0, {vocab})")
            problem = it.sampling.problem()
            if problem:
                raise InvalidStep(f"request {rid!r}: {problem}")
            if not 0 <= it.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidStep(f"request {rid!r}: top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
            end = self._current_length(rid) + max(depths(it.parents)) + 1
            if end > self.max_model_len:
                raise InvalidStep(f"request {rid!r}: sequence would reach {end} tokens, over the "
                                  f"model's maximum length {self.max_model_len}")

    def _current_length(self, rid: str) -> int:
        return self.kv.seqs[rid].length if rid in self.kv.seqs else 0

    # --- the step ---------------------------------------------------------
    def step(self, items: list[SequenceStep], feature_layers: tuple[int, ...] = ()) -> list[SequenceResult]:
        t0 = time.perf_counter()
        self._validate(items)
        layers = self.resolve_feature_layers(feature_layers) if any(i.return_features for i in items) else ()
        node_depths = [depths(it.parents) for it in items]
        ends = [self._current_length(it.request_id) + max(d) + 1 for it, d in zip(items, node_depths)]
        need = sum(self.kv.extra_blocks_needed(it.request_id, e) for it, e in zip(items, ends))
        if need > self.kv.free_blocks:
            raise OutOfCapacity(f"step needs {need} more KV blocks, {self.kv.free_blocks} free")
        created = [it.request_id for it in items if it.create]
        try:
            for it, end in zip(items, ends):
                if it.create:
                    self.kv.create(it.request_id)
                self.kv.reserve(it.request_id, end)
            results = self._run(items, node_depths, layers)
        except Exception:
            for rid in created:
                self.kv.release(rid)
            for it in items:
                if it.request_id in self.kv.seqs:
                    self.kv.trim(it.request_id)
            raise
        self.last_step_seconds = time.perf_counter() - t0
        return results

    def _run(self, items: list[SequenceStep], node_depths: list[list[int]],
             layers: tuple[int, ...]) -> list[SequenceResult]:
        device = self.model.device
        starts, counts, prefix_slots, masks, positions, logit_rows = [], [], [], [], [], []
        row = 0
        for it, d in zip(items, node_depths):
            length = self.kv.seqs[it.request_id].length
            starts.append(row)
            counts.append(len(it.tokens))
            prefix_slots.append(self.kv.slots(it.request_id, 0, length))
            masks.append(ancestor_mask(it.parents).to(device))
            positions.extend(length + x for x in d)
            # Logits are needed from the last fixed node on (it decides the first new token).
            logit_rows.extend(range(row + it.num_fixed - 1, row + len(it.tokens)))
            row += len(it.tokens)
        tokens = torch.tensor([t for it in items for t in it.tokens], dtype=torch.long, device=device)
        layout = StepLayout(tuple(starts), tuple(counts), tuple(prefix_slots), tuple(masks))
        out = self.model.forward(tokens, torch.tensor(positions, device=device), layout, self.kv,
                                 torch.tensor(logit_rows, device=device), layers)
        logits = out.logits.cpu()
        results = []
        logit_base = 0
        for it, d, start in zip(items, node_depths, starts):
            first = it.num_fixed - 1
            logits_of = {first + j: logits[logit_base + j] for j in range(len(it.tokens) - first)}
            logit_base += len(it.tokens) - first
            results.append(self._accept_and_commit(it, d, start, logits_of, out, layers))
        return results

    def _accept_and_commit(self, it: SequenceStep, d: list[int], start: int,
                           logits_of: dict[int, torch.Tensor], out, layers) -> SequenceResult:
        kids = children(it.parents)
        root = it.num_fixed - 1
        seq = self.kv.seqs[it.request_id]
        tokens = list(it.tokens)
        sp = it.sampling
        if sp.greedy:
            acc = accept_greedy(tokens, kids, root, logits_of)
        else:
            probs_of = {n: target_probs(logits_of[n], sp.temperature, sp.top_k, sp.top_p)
                        for n in logits_of}
            acc = accept_sampling(tokens, kids, root, probs_of, sp.seed, seq.length + d[root], d)
        committed = list(range(it.num_fixed)) + acc.accepted
        new_tokens = [tokens[n] for n in acc.accepted] + [acc.bonus]
        parents_of_new = [root] + acc.accepted  # the node each new token was predicted from
        logprobs, tops = [], []
        for tok, parent in zip(new_tokens, parents_of_new):
            lp = torch.log_softmax(logits_of[parent], -1)
            logprobs.append(float(lp[tok]))
            if it.top_logprobs:
                v, ix = lp.topk(it.top_logprobs)
                tops.append((ix.tolist(), v.tolist()))
        rows = torch.tensor([start + n for n in committed], device=self.model.device)
        slots = self.kv.slots(it.request_id, seq.length, seq.length + len(committed))
        for layer in range(len(out.new_k)):
            self.kv.write(layer, slots, out.new_k[layer][rows], out.new_v[layer][rows])
        seq.length += len(committed)
        self.kv.trim(it.request_id)
        features = out.features[rows].float().cpu() if (it.return_features and layers) else None
        return SequenceResult(it.request_id, acc.accepted, new_tokens, logprobs, tops, features, seq.length)

    def release(self, request_ids: list[str]) -> int:
        return sum(self.kv.release(r) for r in request_ids)
