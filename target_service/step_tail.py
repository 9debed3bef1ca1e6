"""After the forward, on the device: which drafted nodes are kept, the bonus token,
the KV of every committed node written to the cache, and one buffer of results.

Acceptance works on each sequence's tree part as a [B, M] grid (m = 0 is the
root, the last fixed node; parents precede children). The rules are those of
target_service.acceptance, vectorised:

- greedy: a drafted node is *taken* when its token is the target's argmax at its
  parent and no earlier sibling is; the kept path is the chain of taken nodes
  from the root (found by pointer jumping, log2(M) gathers); the bonus token is
  the argmax at the deepest kept node.
- sampling: child x of a node is tried in order and accepted with probability
  p(x) / (1 - mass of the siblings rejected before it), which is exactly the
  sequential rule (reject, zero p(x), renormalise); the first accepted child is
  taken. The bonus token is drawn from the deepest kept node's distribution with
  its (all rejected) children zeroed. Every random number is a hash of
  (seed, position of the token it decides, counter), so a seeded sequence's
  draws depend on nothing else.

Greedy-only steps run this as a captured graph with no host sync; steps with
sampled sequences or top log-probs run it eagerly.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kernels.kv_write import kv_commit_reference, kv_commit_triton
from kernels.logsumexp import logsumexp_rows
from tandem.tree import children as child_lists
from target_service import acceptance
from target_service.step_inputs import FIXED_ROW

_MASK32 = 0xFFFFFFFF
_BONUS_COUNTER = 1 << 20  # counters of the bonus draw start here; children use their rank


def output_width(tree: int, top_k: int) -> int:
    """int32 words per sequence in the result buffer: kept count, bonus token, then per
    new token its id and log-prob, the kept nodes' tree indices, and top log-probs."""
    return 2 + 3 * tree + 2 * tree * top_k


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding uint32
    values. Multipliers stay below 2**31, so no product overflows int64."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _MASK32
    return h ^ (h >> 16)


def draw_key(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One key per (seed, position): the draws that decide the token at `position`."""
    lo = seed_lo.long() & _MASK32
    hi = seed_hi.long() & _MASK32
    return _mix32(_mix32(_mix32(lo ^ 0x6A09E667) ^ hi) ^ (position.long() & _MASK32))


def uniform(key: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    """float32 in (0, 1) from a key and a counter (24 random bits, never 0 or 1)."""
    h = _mix32(key ^ _mix32((torch.as_tensor(counter, device=key.device).long() + 0x3C6EF372) & _MASK32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def target_probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """acceptance.target_probs for many rows at once, each with its own settings. logits: [N, V]
    float32; temperature (> 0), top_k (0 = off), top_p (1 = off), min_p (0 = off): [N].
    min_p drops, after temperature and before top-k/top-p (vLLM's order), the tokens less
    likely than min_p times the most likely one."""
    V = logits.shape[-1]
    scaled = logits / temperature[:, None]
    if min_p is not None:
        probs = torch.softmax(scaled, -1)
        low = probs < min_p[:, None] * probs.amax(-1, keepdim=True)
        scaled = scaled.masked_fill(low, float("-inf"))
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1
    if bool(use_k.any()) or bool(use_p.any()):
        ordered, order = scaled.sort(-1, descending=True)
        kth = ordered.gather(1, (top_k.clamp(1, V) - 1).long()[:, None])
        scaled = torch.where(use_k[:, None] & (scaled < kth), float("-inf"), scaled)
        probs = torch.softmax(scaled, -1)
        if bool(use_p.any()):
            sorted_p = probs.gather(1, order)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
            sorted_p = torch.where(use_p[:, None] & (before >= top_p[:, None]), 0.0, sorted_p)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs
    return torch.softmax(scaled, -1)


@functools.lru_cache(maxsize=4096)
def _children(tree_parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each node's children in order, of a tree part given by its nodes' parents (the root's
    first, not read: packed as 0). Cached: a step's trees repeat few shapes, and building the
    map took a 16-node tree about 10 us."""
    return tuple(map(tuple, child_lists((-1, *tree_parents[1:]))))


def _kept_path(take: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """[B, M] bool: nodes on the kept path below the root. take[b, m]: node m may be kept
    (its own test passed); the first such child of each node wins; a node is kept when
    it and every node between it and the root are winners."""
    B, M = take.shape
    m_idx = torch.arange(M, device=take.device).expand(B, M)
    candidate = torch.where(take, m_idx, M)
    first = torch.full((B, M), M, dtype=candidate.dtype, device=take.device)
    first = first.scatter_reduce(1, parent, candidate, "amin")
    ok = (take & (first.gather(1, parent) == m_idx)) | (m_idx == 0)
    up = parent
    for _ in range(max(1, (M - 1).bit_length())):
        ok = ok & ok.gather(1, up)
        up = up.gather(1, up)
    return ok & (m_idx > 0)


class StepTail:
    """Acceptance, KV commit and result packing over one step's device views.

    `views` are the step's input regions (step_inputs.InputLayout.device_views);
    `logits` are [B * M, V] float32, row b * M + m for tree node m of sequence b.
    """

    def __init__(self, *, views: dict[str, torch.Tensor], seqs: int, tree: int, trash_slot: int,
                 block_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, use_triton: bool,
                 row_invariant: bool = False):
        """row_invariant: log-probs whose every row is computed alike whatever the step's shape
        (kernels.logsumexp), as the batch-invariant target needs; torch's own reduction follows
        the shape."""
        self.v = views
        self.B, self.M = seqs, tree
        self.trash_slot = trash_slot
        self.table = block_table
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, slots, Hkv, D] flat views
        self.use_triton = use_triton
        self.row_invariant = row_invariant

    def _logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, V] -> [rows, 1]."""
        if self.row_invariant:
            return logsumexp_rows(logits)[:, None]
        return torch.logsumexp(logits, -1, keepdim=True)

    # --- acceptance ---------------------------------------------------------
    def _grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        v, B, M = self.v, self.B, self.M
        parent = v["tree_parent"].view(B, M).long()
        tokens = v["tokens"].long()[v["tree_row"].long()].view(B, M)
        m_idx = torch.arange(M, device=parent.device).expand(B, M)
        drafted = (m_idx > 0) & (m_idx < v["tree_size"].view(B, 1))
        return parent, tokens, m_idx, drafted

    def greedy(self, logits: torch.Tensor, processed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """processed: the logits after the step's controls (target_service.processors), which
        decide; log-probs stay those of the raw logits."""
        B, M = self.B, self.M
        if M == 1:  # plain decode or prefill: nothing drafted, the bonus is the argmax
            best, argmax = logits.max(-1, keepdim=True)
            if processed is not None:
                argmax = processed.argmax(-1, keepdim=True)
                best = logits.gather(1, argmax)
            return dict(kept=torch.zeros(B, 1, dtype=torch.bool, device=logits.device), bonus=argmax,
                        deepest=torch.zeros_like(argmax), plain_logprob=best - self._logsumexp(logits))
        parent, tokens, m_idx, drafted = self._grid()
        best, argmax = logits.max(-1)
        if processed is not None:
            argmax = processed.argmax(-1)
            best = logits.gather(1, argmax[:, None])[:, 0]
        logprob = (best - self._logsumexp(logits)[:, 0]).view(B, M)
        argmax = argmax.view(B, M)
        take = drafted & (tokens == argmax.gather(1, parent))
        kept = _kept_path(take, parent)
        deepest = torch.where(kept, m_idx, 0).amax(1, keepdim=True)
        return dict(kept=kept, tokens=tokens, deepest=deepest, bonus=argmax.gather(1, deepest),
                    parent_logprob=logprob)

    def greedy_on_host(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """greedy() then pack() for logits already on the host (the CPU's eager steps): the same
        rule walked per sequence in Python, which on a CPU costs far less than ~30 tensor ops.
        Fills `out` (a host tensor) and returns the kept mask. Tested equal to the device path."""
        B, M = self.B, self.M
        # numpy's argmax over a row is several times faster than torch's max(-1) on a CPU (16 x 4k
        # logits: about 3 against 35 us), and takes the first of equal maxima as torch does.
        host_logits = logits.numpy()
        argmax = host_logits.argmax(-1)
        best = host_logits[np.arange(len(argmax)), argmax]
        o = out.numpy()
        kept = np.zeros((B, M), dtype=bool)
        if M == 1:
            # One float32 subtraction, in numpy as in torch: the same bits.
            logprob = (best - torch.logsumexp(logits, -1).numpy()).astype(np.float32, copy=False)
            o[:, 0] = 0
            o[:, 1] = o[:, 2] = argmax
            o[:, 3] = logprob.view(np.int32)
            o[:, 4] = 1
            return torch.from_numpy(kept)
        argmax = argmax.reshape(B, M)
        v = self.v
        parent = v["tree_parent"].numpy().reshape(B, M)
        tokens = v["tokens"].numpy()[v["tree_row"].numpy()].reshape(B, M)
        size = v["tree_size"].numpy()
        paths = []
        for b in range(B):
            kids = _children(tuple(parent[b, : size[b]].tolist()))
            best_next, drafted = argmax[b].tolist(), tokens[b].tolist()  # Python ints: cheaper to compare
            node, path = 0, []
            while True:
                want = best_next[node]
                nxt = next((c for c in kids[node] if drafted[c] == want), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            paths.append((path, node))
        # Log-probs only of the rows whose token is committed (the root and the kept path): the
        # log-sum-exp over the vocabulary is the costly part, and most of a tree is rejected.
        rows = np.array([b * M + m for b, (path, _) in enumerate(paths) for m in (0, *path)], dtype=np.int64)
        lse = torch.logsumexp(logits.index_select(0, torch.from_numpy(rows)), -1).numpy()
        lp = (best[rows] - lse).astype(np.float32, copy=False).view(np.int32)
        at = 0
        for b, (path, node) in enumerate(paths):
            n = len(path)
            kept[b, path] = True
            o[b, 0] = n
            o[b, 1] = argmax[b, node]
            o[b, 2: 2 + M] = argmax[b, node]
            o[b, 2: 2 + n] = tokens[b, path]
            o[b, 2 + M: 2 + M + n + 1] = lp[at: at + n + 1]
            o[b, 2 + 2 * M: 2 + 3 * M] = M
            o[b, 2 + 2 * M: 2 + 2 * M + n] = path
            at += n + 1
        return torch.from_numpy(kept)

    def sampled(self, logits: torch.Tensor, greedy_part: dict[str, torch.Tensor], processed: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Acceptance for every sequence, sampled ones by the sampling rule (eager only).
        processed / min_p [B]: the step's controls (see greedy); log-probs stay raw."""
        v, B, M = self.v, self.B, self.M
        V = logits.shape[-1]
        parent, tokens, m_idx, drafted = self._grid()
        is_greedy = v["greedy"].view(B, 1).bool()
        temperature = torch.where(is_greedy[:, 0], 1.0, v["temperature"].view(B))
        probs = target_probs_rows(logits if processed is None else processed, temperature.repeat_interleave(M),
                                  v["top_k"].repeat_interleave(M), v["top_p"].repeat_interleave(M),
                                  None if min_p is None else min_p.repeat_interleave(M)).view(B, M, V)
        # p(x) of each drafted node under its parent's distribution.
        parent_row = (parent + torch.arange(B, device=parent.device)[:, None] * M).reshape(-1)
        p_x = probs.view(B * M, V)[parent_row, tokens.reshape(-1)].view(B, M)
        earlier_sibling = ((parent[:, :, None] == parent[:, None, :]) & (m_idx[:, None, :] < m_idx[:, :, None])
                           & drafted[:, :, None] & drafted[:, None, :])  # [B, m, m']
        duplicate = (earlier_sibling & (tokens[:, None, :] == tokens[:, :, None])).any(2)
        rejected_mass = (earlier_sibling.float() * (p_x * ~duplicate)[:, None, :]).sum(2)
        p_accept = torch.where(duplicate, 0.0, p_x / (1 - rejected_mass).clamp_min(1e-20)).clamp(0, 1)
        positions = v["positions"].long()[v["tree_row"].long()].view(B, M)  # each node's own position
        seed_lo, seed_hi = v["seed_lo"].view(B, 1), v["seed_hi"].view(B, 1)
        # A child decides the token at its parent's position + 1; its counter is its rank.
        child_key = draw_key(seed_lo, seed_hi, positions.gather(1, parent) + 1)
        u = uniform(child_key, earlier_sibling.sum(2))
        take = drafted & acceptance.accept_child_rule(p_accept, u)
        kept = _kept_path(take, parent)
        deepest = torch.where(kept, m_idx, 0).amax(1, keepdim=True)
        # The bonus: the deepest kept node's distribution without its (rejected) children.
        rows = probs.view(B * M, V)[deepest[:, 0] + torch.arange(B, device=deepest.device) * M]  # [B, V]
        children = drafted & (parent == deepest)
        zeroed = torch.zeros(B, V + 1, device=rows.device).scatter_(1, torch.where(children, tokens, V), 1.0)
        residual = rows.masked_fill(zeroed[:, :V] > 0, 0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, rows)
        key = draw_key(seed_lo, seed_hi, positions.gather(1, deepest) + 1)
        vocab = torch.arange(V, device=rows.device) + _BONUS_COUNTER
        gumbel = -torch.log(-torch.log(uniform(key, vocab[None, :])))
        bonus = torch.where(residual > 0, residual.log() + gumbel, float("-inf")).argmax(-1, keepdim=True)
        return dict(
            kept=torch.where(is_greedy, greedy_part["kept"], kept), tokens=tokens,
            deepest=torch.where(is_greedy, greedy_part["deepest"], deepest),
            bonus=torch.where(is_greedy, greedy_part["bonus"], bonus),
            log_softmax=(logits - self._logsumexp(logits)) if self.row_invariant else torch.log_softmax(logits, -1))

    # --- results ------------------------------------------------------------
    def pack(self, decided: dict[str, torch.Tensor], out: torch.Tensor, top_k: int = 0,
             logits: torch.Tensor | None = None) -> torch.Tensor:
        """Results into `out` [B, output_width(M, top_k)] int32; returns the kept mask."""
        B, M = self.B, self.M
        kept = decided["kept"]
        if "plain_logprob" in decided:  # M == 1: count 0, the bonus, its log-prob, no kept node
            bonus = decided["bonus"].int()
            lp = decided["plain_logprob"].float().view(torch.int32)
            out[:, :5] = torch.cat([torch.zeros_like(bonus), bonus, bonus, lp, torch.ones_like(bonus)], 1)
            if top_k:
                values, ids = logits.topk(top_k, -1)
                out[:, 5: 5 + top_k] = ids.int()
                out[:, 5 + top_k: 5 + 2 * top_k] = (values - self._logsumexp(logits)).float().view(torch.int32)
            return kept
        tokens = decided["tokens"]
        m_idx = torch.arange(M, device=kept.device).expand(B, M)
        count = kept.sum(1, keepdim=True)
        accepted = torch.where(kept, m_idx, M).sort(1).values  # kept nodes first, in depth order
        safe = accepted.clamp(max=M - 1)
        # New token j comes from the node before it on the path (the root for j = 0).
        before = torch.cat([torch.zeros_like(safe[:, :1]), safe[:, :-1]], 1)
        new = torch.where(m_idx < count, tokens.gather(1, safe), decided["bonus"])
        before_row = (before + torch.arange(B, device=before.device)[:, None] * M).reshape(-1)
        if "parent_logprob" in decided:  # greedy: every new token is its parent's argmax
            lp = decided["parent_logprob"].gather(1, before)
        else:
            lp = decided["log_softmax"][before_row, new.reshape(-1)].view(B, M)
        out[:, 0:1] = count.int()
        out[:, 1:2] = decided["bonus"].int()
        out[:, 2: 2 + M] = new.int()
        out[:, 2 + M: 2 + 2 * M] = lp.float().view(torch.int32)
        out[:, 2 + 2 * M: 2 + 3 * M] = accepted.int()
        if top_k:
            values, ids = logits.topk(top_k, -1)
            values = values - self._logsumexp(logits)
            at = 2 + 3 * M
            out[:, at: at + M * top_k] = ids[before_row].int().view(B, M * top_k)
            out[:, at + M * top_k: at + 2 * M * top_k] = (values[before_row].float().contiguous()
                                                          .view(torch.int32).view(B, M * top_k))
        return kept

    # --- the KV of committed nodes --------------------------------------------
    def committed_rows(self, kept: torch.Tensor) -> torch.Tensor | None:
        """[R] bool: rows whose KV is kept (fixed nodes and the kept path); None when the step
        has no drafted node (M == 1), so every real row is kept."""
        if self.M == 1:
            return None
        if kept.is_cpu:  # the same in numpy: a few array ops instead of tensor ops
            row_tree = self.v["row_tree"].numpy()
            on_path = kept.numpy().reshape(-1)[np.maximum(row_tree, 0)]
            return torch.from_numpy((row_tree == FIXED_ROW) | ((row_tree >= 0) & on_path))
        row_tree = self.v["row_tree"].long()
        on_path = kept.reshape(-1)[row_tree.clamp(min=0)]
        return (row_tree == FIXED_ROW) | ((row_tree >= 0) & on_path)

    def commit(self, committed: torch.Tensor | None, k_scratch: torch.Tensor, v_scratch: torch.Tensor) -> None:
        """Write every committed row's K/V (all layers) to its cache slot; the rest to trash.
        committed None: every row is fixed (nothing drafted), padding already points at trash."""
        slots = self.v["row_slot"]
        if committed is not None and committed.is_cpu:  # one numpy op, not a tensor op
            slots = torch.from_numpy(np.where(committed.numpy(), slots.numpy(), self.trash_slot))
        elif committed is not None:
            slots = torch.where(committed, slots, self.trash_slot)
        rows = slots.shape[0]
        if k_scratch.shape[1] != rows:  # a graph's scratch, sized for its largest bucket
            k_scratch, v_scratch = k_scratch[:, :rows], v_scratch[:, :rows]
        if self.use_triton:
            kv_commit_triton(self.k_cache, self.v_cache, k_scratch, v_scratch, slots)
        else:
            kv_commit_reference(self.k_cache, self.v_cache, k_scratch, v_scratch, slots)

    def apply_table_updates(self) -> None:
        """Set this step's new block-table entries (before the forward reads the table)."""
        self.table.view(-1)[self.v["update_index"].long()] = self.v["update_block"]
