"""The training-time-test loss: K unrolled draft steps against the target's distribution.

Alignment (row t, step k): the draft reads token t+1+k and predicts token
t+2+k, whose distribution under the target is softmax(target_logits[t+1+k]).
The label is that distribution restricted to the draft vocabulary and
renormalised; rows whose target argmax lies outside the draft vocabulary are
masked (the draft cannot propose that token, as SpecForge does), and so are
rows that run past the sequence. Step k's loss is weighted decay**k.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draft_service.training.module import Eagle3TrainModel


@dataclass(frozen=True)
class TTTResult:
    # Weighted sum over steps; differentiable. The rest are detached [steps] tensors, left on
    # the device so a training step does not wait for the GPU (read them every few steps).
    loss: torch.Tensor
    step_losses: torch.Tensor  # masked mean cross-entropy per step
    step_accuracy: torch.Tensor  # top-1 agreement with the target's argmax per step
    step_rows: torch.Tensor  # rows that counted per step


def _shift(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, by:] padded at the end back to length T (dim 1)."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], 1)


def ttt_hidden_states(model: Eagle3TrainModel, tokens: torch.Tensor, features: torch.Tensor,
                      steps: int) -> Iterator[torch.Tensor]:
    """Yield the pre-norm h [B, T, H] of steps 0..steps-1: step k, row t read token t+1+k
    (zero past the end, where the loss is masked) at position t+k."""
    g = model.project(features)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k in range(steps):
        h = model.step(_shift(tokens, k + 1, 0), g, k, cache)
        yield h
        g = h  # the next step reads this step's pre-norm hidden state


def ttt_targets(model: Eagle3TrainModel, target_logits: torch.Tensor,
                steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (label probs [B, T, Vd], label argmax [B, T], mask [B, T]) of each step: row t of
    step k is scored against the target's distribution of token t+2+k (target row t+1+k)."""
    with torch.no_grad():
        tl = target_logits.float()
        in_vocab = model.t2d[tl.argmax(-1)]
        label = torch.softmax(tl[..., model.target_ids], -1)  # renormalised over the draft vocabulary
        label_argmax = label.argmax(-1)
    for k in range(steps):
        yield _shift(label, k + 1, 0.0), _shift(label_argmax, k + 1, -1), _shift(in_vocab, k + 1, False)


def ttt_loss(model: Eagle3TrainModel, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
             steps: int, decay: float = 0.8) -> TTTResult:
    """tokens [B, T] target ids; features [B, T, F*H]; target_logits [B, T, V] (row i predicts token i+1)."""
    T = tokens.shape[1]
    if steps < 1 or steps > T - 1:
        raise ValueError(f"TTT steps must be in 1..{T - 1} for sequences of {T} tokens, got {steps}")
    total = torch.zeros((), dtype=torch.float32, device=tokens.device)
    losses, accs, rows = [], [], []
    for k, (h, (p, p_argmax, valid)) in enumerate(zip(ttt_hidden_states(model, tokens, features, steps),
                                                       ttt_targets(model, target_logits, steps))):
        logp = torch.log_softmax(model.logits(h).float(), -1)
        mask = valid.float()
        n = mask.sum().clamp_min(1.0)
        step_loss = (-(p * logp).sum(-1) * mask).sum() / n
        total = total + decay ** k * step_loss
        with torch.no_grad():
            accs.append(((logp.argmax(-1) == p_argmax).float() * mask).sum() / n)
            losses.append(step_loss.detach())
            rows.append(mask.sum())
    return TTTResult(total, torch.stack(losses), torch.stack(accs), torch.stack(rows))


def acceptance_proxy(step_accuracy) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the mean accepted length of a greedy chain if step
    accuracies were independent (a rough, optimistic-or-not proxy; the real number
    comes from serving)."""
    total, run = 1.0, 1.0
    for a in step_accuracy:
        run *= float(a)
        total += run
    return total
