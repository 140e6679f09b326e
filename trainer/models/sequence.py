"""Pyramid sequence encoder over jagged histories (no padding in the data path).

Shape letters: B batch, L_i history length of row i, T = sum L_i tokens, D model width, H heads,
Dh = D / H head dim, l layer index (0-based), r pyramid ratio in (0, 1].

Layer l sees only the newest ``ceil(L_i * r**l)`` tokens of row i, so deeper layers spend their
compute on recent behaviour while layer 0 keeps the whole history: GEM's "pyramid-parallel"
sequence structure (Meta engineering blog, Nov 2025; /work/shared/GEM.md). Histories are stored
oldest first (sequences/schema.py), so the newest tokens are each row's tail and the truncation
is offsets arithmetic::

    L = [4, 0, 3], r = 0.5, layer 1 keeps ceil(L/2) = [2, 0, 2]
    values  [a b c d | e f g]   ->   [c d | f g]      offsets [0,4,4,7] -> [0,2,2,4]

Each layer (InterFormer's Sequence Arch, Zeng et al. 2024, arXiv 2411.09852, §3.3): causal
self-attention within each row (kernels.causal_attention), then a personalized FFN whose input is
gated by the non-sequence summary of the same example, each with a pre-LayerNorm and a residual.
The per-layer summary (InterFormer's Cross Arch, §3.4) is the target attention of the candidate
over the row (kernels.target_attention, DIN, Zhou et al. 2018, §4.3) and the newest token.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kernels.causal_attention import causal_attention
from kernels.segments import token_rows
from kernels.target_attention import target_attention
from kernels.types import AttentionBackend, Backend, Jagged


def pyramid_lengths(lengths: torch.Tensor, ratio: float, layer: int) -> torch.Tensor:
    """(B,) int64 tokens layer ``layer`` keeps: ``ceil(L_i * ratio**layer)``, computed in float64.

    Raises:
        ValueError: ratio outside (0, 1] or layer < 0.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"pyramid ratio must be in (0, 1], got {ratio}")
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return torch.ceil(lengths.to(torch.float64) * ratio**layer).to(torch.int64)


def keep_newest(x: Jagged, keep: torch.Tensor, *, validate: bool = True) -> Jagged:
    """The newest ``keep[i]`` tokens of each row of ``x`` (its tail), as a new Jagged.

    Args:
        x: values (T, *F), offsets (B+1,) int64.
        keep: (B,) int64; values above a row's length keep the whole row.
        validate: check that ``keep`` is >= 0 (a host sync); the models pass False (their ``keep`` are counts).

    Returns:
        Jagged with values (T', *F), T' = sum min(keep_i, L_i); gradients flow to the kept tokens.

    Raises:
        ValueError: keep is not (B,) or has a negative entry.
    """
    if keep.shape != (x.batch_size,):
        raise ValueError(f"keep must be (B={x.batch_size},), got {tuple(keep.shape)}")
    if validate and keep.numel() and int(keep.min()) < 0:
        raise ValueError(f"keep must be >= 0, got {keep.tolist()[:10]}")
    kept = torch.minimum(keep.to(torch.int64), x.lengths)
    new_offsets = torch.zeros_like(x.offsets)
    torch.cumsum(kept, dim=0, out=new_offsets[1:])
    num_kept = int(new_offsets[-1])
    rows = token_rows(new_offsets, num_kept)
    # Token j of the new row i is old token (end_i - kept_i) + j.
    start = x.offsets[1:] - kept
    index = start[rows] + torch.arange(num_kept, device=x.offsets.device) - new_offsets[:-1][rows]
    return Jagged(values=x.values.index_select(0, index), offsets=new_offsets)


def newest_token(x: Jagged) -> torch.Tensor:
    """(B, *F) last token of each row of ``x``; zeros for an empty row."""
    # An empty row reads an appended zero row: no data-dependent shape (nonzero), so no host sync or graph break.
    padded = torch.cat([x.values, x.values.new_zeros((1, *x.values.shape[1:]))])
    last = torch.where(x.lengths > 0, x.offsets[1:] - 1, x.num_tokens)
    return padded.index_select(0, last)


class SequenceLayer(nn.Module):
    """Causal self-attention + personalized FFN over jagged tokens (InterFormer §3.3).

    The personalized FFN is, with ``pffn_rank`` r = 0, a sigmoid gate on the FFN's input from the non-sequence
    summary (gem_small); with r > 0 InterFormer's per-example projection (§3.3: the FFN's weights are a function
    of the non-sequence summary), kept low-rank: token h of example b gets ``FFN(n) + (n U_b) V_b`` with
    n = LayerNorm(h) and U_b (D, r), V_b (r, D) linear in the summary (V's map starts at zero, so the layer
    starts as a plain FFN).

    Args:
        dim: D.
        heads: H (must divide D).
        backend: jagged kernel backend ("reference" on CPU: causal attention then runs its "sdpa" twin).
        pffn_rank: r (0: the gate).
    """

    def __init__(self, *, dim: int, heads: int, backend: Backend = "reference", pffn_rank: int = 0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model width {dim} must be divisible by heads={heads}")
        self.dim, self.heads, self.backend, self.pffn_rank = dim, heads, backend, pffn_rank
        # The reference kernels' causal attention runs through its fused twin (tested equal in
        # tests/kernels/test_sdpa_twin.py): forward+backward about 2x cheaper on CPU (benchmarks.kernels).
        self.attention_backend: AttentionBackend = "sdpa" if backend == "reference" else backend
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.condition = nn.Linear(dim, dim) if pffn_rank == 0 else nn.Linear(dim, dim * pffn_rank)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        if pffn_rank > 0:
            self.condition_out = nn.Linear(dim, pffn_rank * dim)
            nn.init.zeros_(self.condition_out.weight)
            nn.init.zeros_(self.condition_out.bias)

    def forward(self, x: Jagged, condition: torch.Tensor) -> Jagged:
        """x.values (T, D), condition (B, D) float32 -> Jagged (T, D) with x's offsets.

        Raises:
            ValueError: condition is not (B, D).
        """
        if condition.shape != (x.batch_size, self.dim):
            raise ValueError(f"condition must be (B={x.batch_size}, D={self.dim}), got {tuple(condition.shape)}")
        num_tokens, head_dim = x.num_tokens, self.dim // self.heads
        q, k, v = self.qkv(self.attn_norm(x.values)).view(num_tokens, 3, self.heads, head_dim).unbind(1)
        # Under torch.compile the reference itself: the fused twin's padding to a data-dependent max length
        # guards on it (graph breaks, tests/trainer/test_device.py), and compiled code fuses the reference anyway.
        backend = "reference" if self.attention_backend == "sdpa" and torch.compiler.is_compiling() else \
            self.attention_backend
        attended = causal_attention(x.with_values(q), x.with_values(k), x.with_values(v), backend=backend,
                                    validate=False)
        h = x.values + self.attn_out(attended.values.reshape(num_tokens, self.dim))
        rows = token_rows(x.offsets, num_tokens)
        if self.pffn_rank == 0:
            # Personalized FFN: the non-sequence summary of each example scales the FFN's input features.
            gate = torch.sigmoid(self.condition(condition))[rows]
            return x.with_values(h + self.ffn(self.ffn_norm(h) * gate))
        n = self.ffn_norm(h)
        u = self.condition(condition).view(-1, self.dim, self.pffn_rank)  # (B, D, r)
        v = self.condition_out(condition).view(-1, self.pffn_rank, self.dim)  # (B, r, D)
        personal = torch.einsum("tr,trd->td", torch.einsum("td,tdr->tr", n, u[rows]), v[rows])
        return x.with_values(h + self.ffn(n) + personal)


class SequenceSummary(nn.Module):
    """Cross Arch summary of one layer's tokens (InterFormer §3.4): (B, 2, D) = [target attention, newest token].

    Args:
        dim: D.
        heads: H of the target attention.
        backend: jagged kernel backend.
    """

    num_tokens = 2

    def __init__(self, *, dim: int, heads: int, backend: Backend = "reference") -> None:
        super().__init__()
        self.dim, self.heads, self.backend = dim, heads, backend
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)

    def forward(self, x: Jagged, target: torch.Tensor) -> torch.Tensor:
        """x.values (T, D), target (B, D) candidate embedding -> (B, 2, D) float32; empty rows give zeros."""
        head_dim = self.dim // self.heads
        query = self.query(target).view(-1, self.heads, head_dim)
        keys = x.with_values(self.key(x.values).view(-1, self.heads, head_dim))
        # Under bf16 autocast the projections are bf16 and the tokens may be float32: attend in one dtype.
        values = x.with_values(x.values.view(-1, self.heads, head_dim).to(keys.values.dtype))
        pooled = target_attention(query, keys, values, backend=self.backend, validate=False).reshape(-1, self.dim)
        return torch.stack([pooled, newest_token(x)], dim=1)


class PyramidSequenceEncoder(nn.Module):
    """Stack of :class:`SequenceLayer` with pyramid truncation and a summary after every layer.

    Args:
        dim: D.
        heads: H.
        num_layers: number of layers.
        ratio: r; layer l keeps the newest ceil(L_i * r**l) tokens of row i.
        backend: jagged kernel backend.
        pffn_rank: the layers' personalized FFN rank (:class:`SequenceLayer`).
    """

    def __init__(self, *, dim: int, heads: int, num_layers: int, ratio: float, backend: Backend = "reference",
                 pffn_rank: int = 0) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        pyramid_lengths(torch.zeros(0, dtype=torch.int64), ratio, 0)  # validates ratio
        self.ratio = ratio
        self.layers = nn.ModuleList(SequenceLayer(dim=dim, heads=heads, backend=backend, pffn_rank=pffn_rank) for _ in range(num_layers))
        self.summaries = nn.ModuleList(SequenceSummary(dim=dim, heads=heads, backend=backend) for _ in range(num_layers))

    def step(self, layer: int, x: Jagged, full_lengths: torch.Tensor, condition: torch.Tensor, target: torch.Tensor) -> tuple[Jagged, torch.Tensor]:
        """Run layer ``layer`` on the pyramid's share of ``x``.

        Args:
            layer: l.
            x: tokens out of layer l-1 (or the embeddings for l = 0), values (T, D).
            full_lengths: (B,) int64 original history lengths L_i.
            condition: (B, D) non-sequence summary for the personalized FFN.
            target: (B, D) candidate embedding for the summary.

        Returns:
            (tokens out of layer l, values (T_l, D); summary (B, 2, D)).
        """
        x = keep_newest(x, pyramid_lengths(full_lengths, self.ratio, layer), validate=False)
        x = self.layers[layer](x, condition)
        return x, self.summaries[layer](x, target)

    def forward(self, x: Jagged, condition: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """All layers with one fixed condition: x.values (T, D) -> per-layer summaries, each (B, 2, D)."""
        full_lengths = x.lengths
        out = []
        for layer in range(len(self.layers)):
            x, summary = self.step(layer, x, full_lengths, condition, target)
            out.append(summary)
        return out


def newest_tokens(x: Jagged, count: int) -> torch.Tensor:
    """(B, count, *F): slot 0 the newest token of each row, slot j the (j+1)-th newest; zeros past a row's length."""
    kept = keep_newest(x, torch.full((x.batch_size,), count, dtype=torch.int64, device=x.offsets.device), validate=False)
    rows = token_rows(kept.offsets, kept.num_tokens)
    slot = kept.offsets[1:][rows] - 1 - torch.arange(kept.num_tokens, device=rows.device)
    out = x.values.new_zeros((x.batch_size, count, *x.values.shape[1:]))
    return out.index_put((rows, slot), kept.values)


def append_tokens(x: Jagged, tokens: torch.Tensor) -> Jagged:
    """Row i of ``x`` followed by the same ``tokens`` (c, *F): values (T + B c, *F) in ``x``'s dtype, lengths L_i + c."""
    count, batch = tokens.shape[0], x.batch_size
    tokens = tokens.to(x.values.dtype)  # under autocast the tokens are bf16 and the learned ones float32
    lengths = x.lengths + count
    offsets = torch.zeros_like(x.offsets)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    rows = token_rows(x.offsets, x.num_tokens)
    old_at = offsets[:-1][rows] + torch.arange(x.num_tokens, device=rows.device) - x.offsets[:-1][rows]
    new_at = (offsets[1:] - count).unsqueeze(1) + torch.arange(count, device=rows.device)  # (B, c)
    values = x.values.new_empty((x.num_tokens + batch * count, *x.values.shape[1:]))
    values = values.index_copy(0, old_at, x.values)
    values = values.index_copy(0, new_at.reshape(-1), tokens.unsqueeze(0).expand(batch, *tokens.shape).reshape(-1, *tokens.shape[1:]))
    return Jagged(values=values, offsets=offsets)


def split_tail(x: Jagged, count: int, *, validate: bool = True) -> tuple[Jagged, torch.Tensor]:
    """Undo :func:`append_tokens`: (rows without their last ``count`` tokens, those tokens (B, count, *F)).
    ``validate``: check the row lengths (a host sync); False where the rows come from :func:`append_tokens`.

    Raises:
        ValueError: a row shorter than ``count``.
    """
    if validate and x.batch_size and int(x.lengths.min()) < count:
        raise ValueError(f"every row needs >= {count} tokens to split them off, got lengths {x.lengths.tolist()[:10]}")
    tail_at = (x.offsets[1:] - count).unsqueeze(1) + torch.arange(count, device=x.offsets.device)
    tail = x.values.index_select(0, tail_at.reshape(-1)).view(x.batch_size, count, *x.values.shape[1:])
    lengths = x.lengths - count
    offsets = torch.zeros_like(x.offsets)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    kept = x.num_tokens - x.batch_size * count
    rows = token_rows(offsets, kept)
    index = x.offsets[:-1][rows] + torch.arange(kept, device=rows.device) - offsets[:-1][rows]
    return Jagged(values=x.values.index_select(0, index), offsets=offsets), tail


class CrossSummary(nn.Module):
    """InterFormer's Cross Arch (§3.4) over one branch: [target attention, PMA tokens, CLS tokens], gated.

    - target attention: the candidate's attention over the row (DIN, Zhou et al. 2018, §4.3), as gem_small;
    - PMA: ``pma`` learned seeds each attend over the row (pooling by multihead attention, Lee et al. 2019,
      "Set Transformer", §3.2);
    - CLS: the outputs of the ``cls`` learned tokens the branch appended to every row (none for a branch that
      does not self-attend);
    - gating: each summary token s becomes s * sigmoid(W s + b) (InterFormer's selective summarization).

    An empty row gives zeros for its attention tokens. Args: dim D, heads H, pma, cls, backend.
    """

    def __init__(self, *, dim: int, heads: int, pma: int, cls: int, backend: Backend = "reference") -> None:
        super().__init__()
        self.dim, self.heads, self.pma, self.cls, self.backend = dim, heads, pma, cls, backend
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.seeds = nn.Parameter(torch.randn(pma, dim) * 0.02)
        self.gate = nn.Linear(dim, dim)

    @property
    def num_tokens(self) -> int:
        """1 + pma + cls summary tokens."""
        return 1 + self.pma + self.cls

    def forward(self, x: Jagged, target: torch.Tensor, cls: torch.Tensor | None) -> torch.Tensor:
        """x.values (T, D), target (B, D), cls (B, cls, D) or None -> (B, 1 + pma + cls, D) float32."""
        head_dim = self.dim // self.heads
        keys = x.with_values(self.key(x.values).view(-1, self.heads, head_dim))
        # Under bf16 autocast the projections are bf16, the tokens and the learned seeds may be float32.
        values = x.with_values(x.values.view(-1, self.heads, head_dim).to(keys.values.dtype))
        queries = [self.query(target)] + [self.seeds[i].expand(x.batch_size, self.dim) for i in range(self.pma)]
        pooled = [target_attention(q.reshape(-1, self.heads, head_dim).to(keys.values.dtype), keys, values, backend=self.backend,
                                   validate=False).reshape(-1, self.dim)
                  for q in queries]
        tokens = torch.stack(pooled, dim=1)
        if self.cls:
            if cls is None or cls.shape[1] != self.cls:
                raise ValueError(f"CrossSummary expects {self.cls} CLS outputs per row, got {None if cls is None else tuple(cls.shape)}")
            tokens = torch.cat([tokens, cls], dim=1)
        return tokens * torch.sigmoid(self.gate(tokens))


class SequenceStream(nn.Module):
    """One history as parallel branches over recency windows, each summarized every layer (GEM's pyramid-parallel
    long-sequence structure; Meta engineering blog, Nov 2025).

    Branch b reads the newest ``windows[b]`` tokens of each row (0: all of the stream's tokens). A branch of at
    most ``attention_len`` tokens runs a :class:`SequenceLayer` per layer (causal self-attention and the
    personalized FFN), with ``cls`` learned CLS tokens appended to every row; a longer one keeps its input
    tokens and is pooled only (target attention and PMA cost O(L), self-attention O(L²)), so old history is
    summarized rather than dropped. Layer l's summary of the stream is the concatenation of every branch's
    summary and, with ``recent`` > 0, the K newest tokens of the shortest branch after layer l.

    Args:
        dim, heads, num_layers, backend: as :class:`SequenceLayer`; pffn_rank: its personalized FFN.
        windows: branch lengths (0: all, i.e. ``max_len``).
        max_len: the longest row the stream is given.
        attention_len: longest branch that self-attends.
        cross: InterFormer's Cross Arch (:class:`CrossSummary`) per branch; False: :class:`SequenceSummary`
            (target attention, newest token) and no CLS or recent tokens.
        cls, pma, recent: CLS tokens, PMA seeds, K newest tokens (used with ``cross``).

    Raises:
        ValueError: no window.
    """

    def __init__(self, *, dim: int, heads: int, num_layers: int, windows: tuple[int, ...], max_len: int, attention_len: int,
                 cross: bool, cls: int, pma: int, recent: int, pffn_rank: int, backend: Backend = "reference") -> None:
        super().__init__()
        if not windows:
            raise ValueError("SequenceStream needs at least one recency window")
        self.windows = tuple(min(w, max_len) if w > 0 else max_len for w in windows)
        self.attends = tuple(w <= attention_len for w in self.windows)
        self.cls_count = cls if cross else 0
        self.recent = recent if cross else 0
        self.layers = nn.ModuleList(
            nn.ModuleList(SequenceLayer(dim=dim, heads=heads, backend=backend, pffn_rank=pffn_rank) for _ in range(num_layers))
            if attends else nn.ModuleList() for attends in self.attends
        )
        self.cls = nn.Parameter(torch.randn(max(self.cls_count, 1), dim) * 0.02)
        summaries: list[nn.Module] = []
        for attends in self.attends:
            for _ in range(num_layers):
                summaries.append(CrossSummary(dim=dim, heads=heads, pma=pma, cls=self.cls_count if attends else 0, backend=backend)
                                 if cross else SequenceSummary(dim=dim, heads=heads, backend=backend))
        self.summaries = nn.ModuleList(summaries)
        self.num_layers = num_layers
        self.shortest = min(range(len(self.windows)), key=lambda b: self.windows[b])

    @property
    def num_tokens(self) -> int:
        """Summary tokens per layer."""
        total = self.recent
        for b in range(len(self.windows)):
            summary = self.summaries[b * self.num_layers]
            total += summary.num_tokens if isinstance(summary, CrossSummary) else SequenceSummary.num_tokens
        return total

    def start(self, x: Jagged) -> list[Jagged]:
        """The branches' input tokens: the newest ``windows[b]`` of each row, CLS tokens appended where attending."""
        branches = []
        for window, attends in zip(self.windows, self.attends, strict=True):
            tokens = keep_newest(x, torch.full((x.batch_size,), window, dtype=torch.int64, device=x.offsets.device),
                                 validate=False)
            branches.append(append_tokens(tokens, self.cls[: self.cls_count]) if attends and self.cls_count else tokens)
        return branches

    def step(self, layer: int, branches: list[Jagged], condition: torch.Tensor, target: torch.Tensor) -> tuple[list[Jagged], torch.Tensor]:
        """Layer ``layer`` on every branch: (the branches' tokens after it, the stream's summary (B, num_tokens, D))."""
        out, summaries, shortest_body = [], [], None
        for b, (x, attends) in enumerate(zip(branches, self.attends, strict=True)):
            if attends:
                x = cast(nn.ModuleList, self.layers[b])[layer](x, condition)
            body, cls = split_tail(x, self.cls_count, validate=False) if attends and self.cls_count else (x, None)
            summary = self.summaries[b * self.num_layers + layer]
            summaries.append(summary(body, target, cls) if isinstance(summary, CrossSummary) else summary(body, target))
            if b == self.shortest:
                shortest_body = body
            out.append(x)
        if self.recent:
            assert shortest_body is not None
            summaries.append(newest_tokens(shortest_body, self.recent))
        return out, torch.cat(summaries, dim=1)
