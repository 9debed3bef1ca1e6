"""Plain-data inputs and outputs of the draft engine (protobuf stays at the gRPC edge).

Positions. A request's known tokens x_0..x_n are the tokens the target has
committed (x_0..x_{n-1}) followed by the pending token x_n that the target
sampled last (its target KV is not written yet). EAGLE-3 pairs the target
feature of token t with the embedding of token t+1, so draft position t exists
once x_{t+1} is known: the draft computes positions 0..n-1, and its output at
n-1 predicts x_{n+1}. The pending token x_n is therefore the root of the tree;
drafted nodes hang below it.

Depths follow the target's convention: the root sits at depth 0 (target
position n), a drafted node at depth d >= 1 at target position n + d. So the
gateway verifies `tokens=[root] + tree.tokens`, `parents=[-1] + [p + 1 if p >= 0
else 0 ...]`, `num_fixed=1` (see DraftTree.verify_tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.tree import ancestor_mask

# Guards against budgets that would blow up a call; generous next to SGLang's defaults (5/4/8).
MAX_STEPS = 32
MAX_TOPK = 32
MAX_DRAFT_TOKENS = 1024


class InvalidDraftInput(InvalidArgument):
    """A draft or ingest item that cannot be served; maps to INVALID_ARGUMENT."""


class OutOfDraftCapacity(ResourceExhausted):
    """The draft KV cache has no room for a catch-up; maps to RESOURCE_EXHAUSTED."""


@dataclass(frozen=True)
class IngestItem:
    """Known tokens of a request from `start_position` on, with target features for some of them.

    Tokens at positions the draft already knows must be the same (committed
    tokens never change); the rest are appended. `features` rows belong to
    positions start_position, start_position+1, ...: fewer rows than tokens is
    normal (the last token is usually the pending one, with no feature yet), and
    None means the target sent none (speculation was off). Positions that never
    receive features are caught up from the draft's own hidden state.
    target_feature_rows instead says that the target holds that many rows for
    positions start_position.. (a step with hold_features): the draft service
    reads them from the target before the engine sees the item.
    An item with start_position 0 for an unknown request starts it.
    """

    request_id: str
    start_position: int
    tokens: tuple[int, ...]
    features: torch.Tensor | None = None  # [rows, feature_width], any float dtype
    target_feature_rows: int = 0

    @property
    def num_feature_rows(self) -> int:
        return 0 if self.features is None else int(self.features.shape[0])


@dataclass(frozen=True)
class PushedRows:
    """Feature rows the target pushed as a step committed them, with the next tokens it knew.

    `rows` belong to positions start, start+1, ...; next_tokens[i] is the token
    at start + i + 1, or -1 where the step did not decide it (the last row of a
    prompt chunk short of the prompt's end). The draft may catch up on them
    before the gateway's ingest of the same tokens arrives (--catch-up-on-push).
    """

    request_id: str
    start_position: int
    rows: torch.Tensor  # [n, feature_width]
    next_tokens: tuple[int, ...]  # n of them

    @property
    def num_known(self) -> int:
        """Leading rows whose next token is known: the positions the draft can compute."""
        return next((i for i, t in enumerate(self.next_tokens) if t < 0), len(self.next_tokens))


@dataclass(frozen=True)
class DraftBudget:
    """How much to draft for one request. Any zero (or num_draft_tokens <= 1) means no tree.

    num_draft_tokens counts the root, as SGLang's --speculative-num-draft-tokens
    does: at most num_draft_tokens - 1 nodes come back.
    """

    steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0

    @property
    def empty(self) -> bool:
        return self.steps <= 0 or self.topk <= 0 or self.num_draft_tokens <= 1

    @property
    def shape(self) -> tuple[int, int]:
        """(topk, num_draft_tokens): budgets of one shape differ only in depth, and the draft grows their
        trees as one group, to the deepest (DraftEngine._grow)."""
        return self.topk, self.num_draft_tokens

    @property
    def max_nodes(self) -> int:
        """Nodes the tree can hold: the final top-N, or fewer when the levels hold fewer candidates."""
        if self.empty:
            return 0
        candidates = self.topk + (self.steps - 1) * self.topk * self.topk
        return min(self.num_draft_tokens - 1, candidates)

    def cut(self, steps: int) -> DraftBudget:
        """This budget with `steps` levels, its top-k and size kept: the tree a request near its max_tokens drafts
        (GatewayCore._budgets)."""
        return replace(self, steps=steps)

    def problem(self, draft_vocab_size: int) -> str | None:
        if min(self.steps, self.topk, self.num_draft_tokens) < 0:
            return f"budget values must be >= 0, got {self}"
        if self.empty:
            return None
        if self.steps > MAX_STEPS:
            return f"steps must be <= {MAX_STEPS}, got {self.steps}"
        if self.topk > min(MAX_TOPK, draft_vocab_size):
            return f"topk must be <= {min(MAX_TOPK, draft_vocab_size)}, got {self.topk}"
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            return f"num_draft_tokens must be <= {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}"
        return None


@dataclass(frozen=True)
class DraftItem:
    request_id: str
    budget: DraftBudget
    # Tokens the caller knows for the request (committed + the pending root);
    # when set, the call fails if the draft knows a different number, so a
    # tree is never grown below a stale root. None skips the check.
    num_tokens: int | None = None


@dataclass
class DraftTree:
    request_id: str
    root_token: int  # the pending token the tree hangs below (not among the nodes)
    root_position: int  # its position: tokens the target has committed for the request
    tokens: list[int] = field(default_factory=list)  # target-vocabulary ids
    parents: list[int] = field(default_factory=list)  # index of the parent node, -1 = the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    logprobs: list[float] = field(default_factory=list)  # draft log-prob of the node given its parent
    scores: list[float] = field(default_factory=list)  # cumulative log-prob from the root

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: node i sees node j when j is i or one of its ancestors (the root is implied)."""
        return ancestor_mask(self.parents)

    def verify_tree(self) -> tuple[list[int], list[int], int]:
        """(tokens, parents, num_fixed) of the target step that verifies this tree."""
        return ([self.root_token, *self.tokens], [-1, *[p + 1 if p >= 0 else 0 for p in self.parents]], 1)


@dataclass(frozen=True)
class RequestStatus:
    request_id: str
    num_tokens: int  # known tokens: committed by the target, then the pending one
    num_computed: int  # draft positions whose KV is written
    # Positions still to compute that have no target features: they will be
    # caught up from the draft's own hidden states (approximate).
    num_missing_features: int

    @property
    def ready(self) -> bool:
        """Caught up: every position whose next token is known has its draft KV."""
        return self.num_tokens > 0 and self.num_computed == self.num_tokens - 1


@dataclass(frozen=True)
class DraftLoad:
    num_sequences: int  # requests whose state the draft holds
    block_size: int
    total_blocks: int
    free_blocks: int

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def free_token_slots(self) -> int:
        return self.free_blocks * self.block_size


@dataclass(frozen=True)
class DraftInfo:
    """Static facts the gateway needs to pair the draft with its target."""

    hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    # Target layers whose *input* residual stream the draft wants, in order:
    # pass them as the target's StepRequest.feature_layers.
    feature_layers: tuple[int, ...]
    feature_width: int  # len(feature_layers) * target_hidden_size
    max_tokens: int  # longest request (known tokens) the draft accepts
    dtype: str
    device: str
