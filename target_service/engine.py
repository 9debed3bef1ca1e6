"""The target's one operation: extend sequences by token trees, keep the accepted paths."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.kv_write import kv_write_triton
from kernels.tree_attention import StepLayout
from tandem.tree import ancestor_mask, children, depths, validate_tree
from target_service.acceptance import accept_greedy, accept_sampling, target_probs
from target_service.cuda_graphs import GraphConfig, StepGraphs
from target_service.model import LlamaModel, StepOutput
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
                 max_model_len: int | None = None, graphs: GraphConfig | None = None):
        self.model = model
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.max_model_len = min(max_model_len or model.cfg.max_position, model.cfg.max_position)
        # Decode and verify steps replay captured CUDA graphs when configured (GPU, triton, TP=1).
        self.graphs = StepGraphs(model, self.kv, self.max_model_len, graphs) if graphs is not None else None
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
        # The layout is built on the host (block tables, masks, slots): the kernel's
        # metadata is packed from it without reading anything back from the device.
        starts, counts, prefix_slots, masks, tables, positions, logit_rows = [], [], [], [], [], [], []
        row = 0
        for it, d in zip(items, node_depths):
            seq = self.kv.seqs[it.request_id]
            starts.append(row)
            counts.append(len(it.tokens))
            prefix_slots.append(torch.from_numpy(self.kv.host_slots(it.request_id, 0, seq.length)))
            tables.append(list(seq.blocks))
            masks.append(ancestor_mask(it.parents))
            positions.extend(seq.length + x for x in d)
            # Logits are needed from the last fixed node on (it decides the first new token).
            logit_rows.extend(range(row + it.num_fixed - 1, row + len(it.tokens)))
            row += len(it.tokens)
        tokens = [t for it in items for t in it.tokens]
        layout = StepLayout(tuple(starts), tuple(counts), tuple(prefix_slots), tuple(masks), tuple(tables))
        out = self._forward(items, tokens, positions, layout, logit_rows, layers)
        scores = _score_rows(out.logits, items)
        results, commit_rows, commit_slots = [], [], []
        logit_base = 0
        for it, d, start in zip(items, node_depths, starts):
            first = it.num_fixed - 1
            row_of = {first + j: logit_base + j for j in range(len(it.tokens) - first)}
            logit_base += len(it.tokens) - first
            result, committed = self._accept(it, d, row_of, scores)
            seq = self.kv.seqs[it.request_id]
            commit_rows.extend(start + n for n in committed)
            commit_slots.append(self.kv.host_slots(it.request_id, seq.length, seq.length + len(committed)))
            seq.length += len(committed)
            self.kv.trim(it.request_id)
            results.append(result)
        self._commit_kv(out, commit_rows, np.concatenate(commit_slots))
        if layers and any(it.return_features for it in items):
            results = self._attach_features(items, results, out, starts)
        return results

    def _forward(self, items: list[SequenceStep], tokens: list[int], positions: list[int], layout: StepLayout,
                 logit_rows: list[int], layers: tuple[int, ...]) -> StepOutput:
        if self.graphs is not None:
            out = self.graphs.run(items, tokens, positions, layout, layers)
            if out is not None:
                return out
        device = self.model.device
        return self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                  layout, self.kv, torch.tensor(logit_rows, device=device), layers)

    def _accept(self, it: SequenceStep, d: list[int], row_of: dict[int, int],
                scores: _RowScores) -> tuple[SequenceResult, list[int]]:
        """Acceptance for one item; returns its result (features not yet attached) and the
        step nodes whose KV is committed."""
        kids = children(it.parents)
        root = it.num_fixed - 1
        tokens = list(it.tokens)
        sp = it.sampling
        if sp.greedy:
            acc = accept_greedy(tokens, kids, root, {n: scores.argmax[r] for n, r in row_of.items()})
        else:
            probs_of = {n: target_probs(scores.logits[r], sp.temperature, sp.top_k, sp.top_p)
                        for n, r in row_of.items()}
            length = self.kv.seqs[it.request_id].length
            acc = accept_sampling(tokens, kids, root, probs_of, sp.seed, length + d[root], d)
        committed = list(range(it.num_fixed)) + acc.accepted
        new_tokens = [tokens[n] for n in acc.accepted] + [acc.bonus]
        parents_of_new = [root] + acc.accepted  # the node each new token was predicted from
        logprobs, tops = [], []
        for tok, parent in zip(new_tokens, parents_of_new):
            r = row_of[parent]
            if sp.greedy:  # every new token is the argmax at its parent
                logprobs.append(scores.argmax_logprob[r])
            else:
                logprobs.append(float(torch.log_softmax(scores.logits[r], -1)[tok]))
            if it.top_logprobs:
                tops.append((scores.top_ids[r][: it.top_logprobs], scores.top_logprobs[r][: it.top_logprobs]))
        length = self.kv.seqs[it.request_id].length + len(committed)
        return SequenceResult(it.request_id, acc.accepted, new_tokens, logprobs, tops, None, length), committed

    def _commit_kv(self, out: StepOutput, rows: list[int], slots: np.ndarray) -> None:
        """Write the accepted nodes' K/V of every request, one call per layer."""
        if not rows:
            return
        device = self.model.device
        rows_t = torch.tensor(rows, device=device)
        slots_t = torch.from_numpy(slots).to(device)
        fast = device.type == "cuda" and self.model.attention.name == "triton"
        for layer in range(len(out.new_k)):
            if fast:
                kv_write_triton(self.kv.k[layer], self.kv.v[layer], out.new_k[layer], out.new_v[layer],
                                rows_t, slots_t)
            else:
                self.kv.write(layer, slots_t, out.new_k[layer][rows_t], out.new_v[layer][rows_t])

    def _attach_features(self, items: list[SequenceStep], results: list[SequenceResult], out: StepOutput,
                         starts: list[int]) -> list[SequenceResult]:
        """Features of each committed node, for the items that asked: one device-to-host copy."""
        wanted: list[int] = []
        spans = []
        for it, res, start in zip(items, results, starts):
            if not it.return_features:
                spans.append(None)
                continue
            committed = list(range(it.num_fixed)) + res.accepted_nodes
            spans.append((len(wanted), len(committed)))
            wanted.extend(start + n for n in committed)
        host = out.features[torch.tensor(wanted, device=out.features.device)].float().cpu()
        return [res if span is None else replace(res, features=host[span[0]: span[0] + span[1]])
                for res, span in zip(results, spans)]

    def release(self, request_ids: list[str]) -> int:
        return sum(self.kv.release(r) for r in request_ids)


@dataclass
class _RowScores:
    """What acceptance reads of a step's logits, moved to the host in a few small copies:
    per logit row its argmax and that token's log-prob, the top log-probs when asked,
    and full logits only for rows of sampled requests."""

    argmax: list[int]
    argmax_logprob: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    logits: dict[int, torch.Tensor]


def _score_rows(logits: torch.Tensor, items: list[SequenceStep]) -> _RowScores:
    lse = torch.logsumexp(logits, -1)
    best_v, best_i = logits.max(-1)
    k = max(it.top_logprobs for it in items)
    top_ids: list[list[int]] = []
    top_lp: list[list[float]] = []
    if k:
        v, ix = logits.topk(k, -1)
        top_ids, top_lp = ix.cpu().tolist(), (v - lse[:, None]).cpu().tolist()
    sampled_rows = []
    row = 0
    for it in items:
        n = len(it.tokens) - it.num_fixed + 1
        if not it.sampling.greedy:
            sampled_rows.extend(range(row, row + n))
        row += n
    host_logits: dict[int, torch.Tensor] = {}
    if sampled_rows:
        block = logits[torch.tensor(sampled_rows, device=logits.device)].cpu()
        host_logits = dict(zip(sampled_rows, block))
    return _RowScores(best_i.cpu().tolist(), (best_v - lse).cpu().tolist(), top_ids, top_lp, host_logits)
