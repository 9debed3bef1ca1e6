"""Logits processors on the device: target_service.controls applied to a step's tree rows.

A step's logits are [B * M, V], row b * M + m for tree node m of sequence b. The
processors for node m see the context plain decoding would have after that node:
the sequence's committed tokens, then the step's nodes that are m's ancestors (or
m itself). The committed part lives here, as per-sequence token counts on the
device (prompt part and output part, [slots, 2, V] int32), for the sequences
whose penalties need it; each step adds the tokens it commits, on the device, so
nothing is resent and nothing waits on the host. The in-step part is read from
the step's packed ancestor masks.

Only steps with controls come here; the others keep the captured greedy tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.tree_metadata import SEQ_INFO_FIELDS
from target_service.controls import ControlColumns


class PenaltyHistory:
    """Token counts of the committed tokens of each sequence that asked for penalties."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(0, 2, vocab, dtype=torch.int32, device=device)  # [slots, prompt|output, V]
        self.slots: dict[str, int] = {}
        self._free: list[int] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.slots

    def create(self, request_id: str) -> None:
        if request_id in self.slots:
            return
        if not self._free:
            old = self.counts.shape[0]
            grown = torch.zeros(max(4, 2 * old), 2, self.vocab, dtype=torch.int32, device=self.device)
            grown[:old] = self.counts
            self.counts = grown
            self._free = list(range(grown.shape[0] - 1, old - 1, -1))
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.slots[request_id] = slot

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_array(self, request_ids: tuple[str, ...], padded: int) -> np.ndarray:
        """int32 [padded]: each sequence's slot, -1 for none (and for padding)."""
        out = np.full(padded, -1, dtype=np.int32)
        for b, rid in enumerate(request_ids):
            out[b] = self.slots.get(rid, -1)
        return out


@dataclass(frozen=True, kw_only=True, eq=False)
class StepControls:
    """One step's controls on the device, padded to its [B, M] grid."""

    seqs: int  # B (padded)
    tree: int  # M
    repetition: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    min_tokens: torch.Tensor  # int64 [B]
    prompt_len: torch.Tensor  # int64 [B]
    slot: torch.Tensor  # int64 [B]: history slot, -1 none
    penalized: np.ndarray  # int64 [P]: sequences with a history slot (host)
    stop_seq: torch.Tensor  # int64 [S]
    stop_ids: torch.Tensor  # int64 [S]
    bias_seq: torch.Tensor  # int64 [K]
    bias_ids: torch.Tensor  # int64 [K]
    bias_values: torch.Tensor  # float32 [K]
    any_min_p: bool

    @classmethod
    def build(cls, cols: ControlColumns, slots: np.ndarray, seqs: int, tree: int,
              device: torch.device) -> StepControls:
        """Pack the columns into one int32 buffer, copy it once, view it back."""
        B = cols.size

        def pad(values: np.ndarray, fill) -> np.ndarray:
            out = np.full(seqs, fill, dtype=values.dtype)
            out[:B] = values
            return out

        floats = [pad(cols.repetition_penalty, 1.0), pad(cols.frequency_penalty, 0.0),
                  pad(cols.presence_penalty, 0.0), pad(cols.min_p, 0.0)]
        ints = [pad(cols.min_tokens, 0), pad(cols.prompt_len, 0), slots.astype(np.int32)]
        stop_seq = np.repeat(np.arange(B, dtype=np.int32), cols.stop_counts)
        bias_seq = np.repeat(np.arange(B, dtype=np.int32), cols.bias_counts)
        parts = [*(f.astype(np.float32).view(np.int32) for f in floats), *ints, stop_seq,
                 cols.stop_ids.astype(np.int32), bias_seq, cols.bias_ids.astype(np.int32),
                 cols.bias_values.astype(np.float32).view(np.int32)]
        host = torch.from_numpy(np.concatenate(parts))
        dev = host.to(device, non_blocking=False)
        views, at = [], 0
        for p in parts:
            views.append(dev[at: at + len(p)])
            at += len(p)
        rep, freq, pres, min_p, min_tokens, prompt_len, slot, s_seq, s_ids, b_seq, b_ids, b_val = views
        return cls(seqs=seqs, tree=tree, repetition=rep.view(torch.float32), frequency=freq.view(torch.float32),
                   presence=pres.view(torch.float32), min_p=min_p.view(torch.float32), min_tokens=min_tokens.long(),
                   prompt_len=prompt_len.long(), slot=slot.long(), penalized=np.flatnonzero(slots >= 0),
                   stop_seq=s_seq.long(), stop_ids=s_ids.long(), bias_seq=b_seq.long(), bias_ids=b_ids.long(),
                   bias_values=b_val.view(torch.float32), any_min_p=bool((cols.min_p > 0).any()))


def _node_context_counts(views: dict[str, torch.Tensor], ctl: StepControls, seqs: torch.Tensor,
                         vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tree rows of sequences `seqs` ([P], on the device): counts [P * M, V] of each
    token among the step's nodes on the row's path (ancestors and itself), all of them and
    output only."""
    M = ctl.tree
    device = views["tokens"].device
    b = seqs.repeat_interleave(M)  # [N]
    m = torch.arange(M, device=device).repeat(len(seqs))
    step_row = views["tree_row"].view(-1, M).long()[b, m]  # the node's row in the step
    info = views["seq_info"].view(-1, SEQ_INFO_FIELDS).long()
    first, count = info[b, 1], info[b, 2]
    words = views["mask"][step_row]  # [N, W] int64: bit j of the row = local node j is on its path
    shifts = torch.arange(64, device=device)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(len(b), -1).bool()  # [N, W * 64]
    local = torch.arange(bits.shape[1], device=device)
    on_path = bits & (local[None, :] < count[:, None])
    rows = (first[:, None] + local[None, :]).clamp(max=views["tokens"].numel() - 1)
    tokens = views["tokens"].long()[rows]
    is_output = views["positions"].long()[rows] >= ctl.prompt_len[b][:, None]
    all_counts = torch.zeros(len(b), vocab, dtype=torch.int32, device=device)
    all_counts.scatter_add_(1, tokens, on_path.int())
    out_counts = torch.zeros_like(all_counts)
    out_counts.scatter_add_(1, tokens, (on_path & is_output).int())
    return all_counts, out_counts


def apply_controls(logits: torch.Tensor, views: dict[str, torch.Tensor], ctl: StepControls,
                   history: PenaltyHistory) -> torch.Tensor:
    """The logits the step decides with ([B * M, V] float32, a new tensor): bias, min_tokens,
    repetition, frequency and presence penalties, per tree node from its own path. min_p
    comes later, with temperature (target_probs_rows)."""
    B, M = ctl.seqs, ctl.tree
    V = logits.shape[-1]
    out = logits.float().clone()
    device = out.device
    if ctl.bias_ids.numel():
        rows = (ctl.bias_seq[:, None] * M + torch.arange(M, device=device)).reshape(-1)
        out.index_put_((rows, ctl.bias_ids.repeat_interleave(M)), ctl.bias_values.repeat_interleave(M),
                       accumulate=True)
    if ctl.stop_ids.numel():
        # The token chosen after node m lands at position pos(m) + 1: output index pos(m) + 1 - prompt_len.
        positions = views["positions"].long()[views["tree_row"].view(-1).long()].view(B, M)
        short = (positions + 1 - ctl.prompt_len[:, None]) < ctl.min_tokens[:, None]  # [B, M]
        rows = (ctl.stop_seq[:, None] * M + torch.arange(M, device=device)).reshape(-1)
        ids = ctl.stop_ids.repeat_interleave(M)
        suppress = short.reshape(-1)[rows]
        out[rows, ids] = torch.where(suppress, float("-inf"), out[rows, ids])
    if len(ctl.penalized):
        seq_t = torch.from_numpy(ctl.penalized).to(device)
        all_counts, out_counts = _node_context_counts(views, ctl, seq_t, V)
        hist = history.counts[ctl.slot[seq_t]].repeat_interleave(M, 0)  # [N, 2, V]
        seen = (all_counts + hist[:, 0] + hist[:, 1]) > 0
        output = (out_counts + hist[:, 1]).float()
        rows = (seq_t[:, None] * M + torch.arange(M, device=device)).reshape(-1)
        sub = out[rows]
        rep = ctl.repetition[seq_t].repeat_interleave(M)[:, None]
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
        sub = sub - ctl.frequency[seq_t].repeat_interleave(M)[:, None] * output
        sub = sub - ctl.presence[seq_t].repeat_interleave(M)[:, None] * (output > 0).float()
        out[rows] = sub
    return out


def record_committed(history: PenaltyHistory, views: dict[str, torch.Tensor], ctl: StepControls,
                     committed: torch.Tensor | None) -> None:
    """Add the tokens this step committed (rows marked in `committed` [R]; None: every real
    row, a step with nothing drafted) to their sequences' counts, prompt or output by
    position; on the device, no host sync."""
    if not len(ctl.penalized):
        return
    seq = views["row_seq"].long()
    slot = torch.where(seq >= 0, ctl.slot[seq.clamp(min=0)], -1)
    keep = slot >= 0 if committed is None else committed & (slot >= 0)
    region = (views["positions"].long() >= ctl.prompt_len[seq.clamp(min=0)]).long()
    V = history.vocab
    index = (slot.clamp(min=0) * 2 + region) * V + views["tokens"].long()
    history.counts.view(-1).index_add_(0, index, keep.int())
