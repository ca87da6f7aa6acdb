"""Arithmetic the planner and the runtime share, with no torch import.

* The communication vocabulary: the op names the comm ledger records and the planner predicts, the
  ring algorithms' bytes on the wire, and the axis names collectives are credited to.
* The pipeline's stage split: per-layer forward costs, the cost-balanced split (or `--pp-split`),
  and which pp rank runs which chunk.
* Shard arithmetic: the model's parameter shapes, their tensor-parallel local shapes, and FSDP2's
  dim-0 chunking with padding.

Defined once here so that what `fivefold plan` predicts and what `fivefold.parallel` does cannot
drift apart by a rename or a second copy of a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.config import Layout, ModelSpec
from fivefold.config.layout import split_fields
from fivefold.errors import FivefoldError, suggest

# ---- the op vocabulary (what the ledger records, what the planner predicts)
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"  # bytes: the gathered output
REDUCE_SCATTER = "reduce_scatter"  # bytes: the unreduced input
ALL_TO_ALL = "all_to_all"  # bytes: the input
BROADCAST = "broadcast"
SCATTER = "scatter"
GATHER = "gather"
REDUCE = "reduce"
SEND = "send"
RECV = "recv"
BARRIER = "barrier"
OPS = (
    ALL_REDUCE,
    ALL_GATHER,
    REDUCE_SCATTER,
    ALL_TO_ALL,
    BROADCAST,
    SCATTER,
    GATHER,
    REDUCE,
    SEND,
    RECV,
    BARRIER,
)
P2P = (SEND, RECV)

# ---- the axis vocabulary: mesh axes, flattened dims, and the ledger's names for other groups
MESH_AXES = ("dp", "fsdp", "cp", "tp", "pp", "ep")
#: groups are credited to the first of these whose ranks match (see fivefold.measure.ledger)
# which dim a process group is credited to when several dims hold the same ranks: ep comes after
# fsdp_cp, since its own traffic (the token all-to-alls) runs on a copy of its group whenever another
# dim shares it (fivefold.parallel.expert)
AXIS_PRIORITY = ("tp", "cp", "fsdp", "dp", "pp", "expert_fsdp", "fsdp_cp", "ep", "batch", "dp_fsdp_cp")
WORLD, LOCAL, OTHER = "world", "local", "other"


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Per-rank bytes on the wire of the ring algorithm of `op` over `n` ranks (payload as recorded).

    all_reduce 2(n-1)/n·S; all_gather, reduce_scatter, all_to_all (and broadcast, scatter, gather,
    reduce as a pipelined chain) (n-1)/n·S; send and recv S.
    """
    if op in P2P:
        return float(payload)
    if n <= 1 or op == BARRIER:
        return 0.0
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n * payload
    return (n - 1) / n * payload


def one_world_group(layout: Layout, ranks: int) -> bool:
    """Whether mesh dims over the same `ranks` ranks share one process group: torch hands every dim
    that spans the whole world the default group, and makes each other dim a group of its own (the
    ledger then names a shared group after its first axis in AXIS_PRIORITY)."""
    return ranks == layout.world


def replica_wrapper(layout: Layout) -> str | None:
    """What keeps a layout's data-parallel replicas in step in fivefold's runtime: "fsdp" (FSDP2 or
    HSDP over fsdp×cp), "replicate" (torch's FSDP2-based `replicate`, for tensor-parallel weights),
    "ddp" (torch DDP, which a pipeline's stages replace with their own average), or None (one
    replica). One rule for the runtime (`parallel.precision`) and the planner."""
    if layout.fsdp > 1:
        return "fsdp"
    if layout.dp * layout.cp == 1:
        return None
    return "replicate" if layout.tp > 1 else "ddp"


def replica_axis(layout: Layout, dims: tuple[str, ...]) -> str | None:
    """The ledger's name for a flattened group over `dims`: the one split axis, or the flat name."""
    names = {("dp", "fsdp"): "batch", ("fsdp", "cp"): "fsdp_cp", ("dp", "fsdp", "cp"): "dp_fsdp_cp"}
    split = [a for a in dims if getattr(layout, a) > 1]
    if dims == ("dp", "fsdp", "cp") and split == ["fsdp", "cp"]:  # the fsdp×cp ranks, named first
        return names[("fsdp", "cp")]
    if not split:
        return None
    if len(split) == 1 and not (dims == ("fsdp", "cp") and split[0] == "cp"):
        return split[0]
    return names[dims]


# ---- pipeline: costs, the split, and chunk placement
SINGLE_STAGE = ("gpipe", "1f1b")  # one chunk per rank
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, folded into a V
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # input- and weight-gradient passes apart


@dataclass(frozen=True)
class StageCosts:
    """Forward FLOPs per token of each piece of the model."""

    embedding: float
    layers: tuple[float, ...]
    head: float  # final norm + output head + loss

    def chunk_cost(self, start: int, stop: int, first: bool, last: bool) -> float:
        ends = (self.embedding if first else 0.0) + (self.head if last else 0.0)
        return sum(self.layers[start:stop]) + ends


def stage_costs(spec: ModelSpec, seq_len: int) -> StageCosts:
    """Forward FLOPs per token: 2 per weight a token multiplies, attention scores and sums, the head."""
    h = spec.hidden
    attn_core = 2 * seq_len * spec.heads * 2 * spec.head_dim  # QK^T and PV
    layers = tuple(
        2.0 * spec.layer_params(i, active=True) + attn_core + 10.0 * h  # + norms, residuals, rope
        for i in range(spec.layers)
    )
    # the embedding is a gather (h reads per token forward, h adds backward); the head is a
    # vocab × hidden matmul plus softmax cross-entropy (~5 FLOPs per logit)
    head = 2.0 * spec.vocab * h + 5.0 * spec.vocab + 4.0 * h
    return StageCosts(embedding=2.0 * h, layers=layers, head=head)


def parse_split(text: str, layers: int, chunks: int) -> list[int]:
    """`--pp-split 3,5,5,3`: layers per chunk, in stage order."""
    try:
        counts = [int(x) for x in split_fields(text)]
    except ValueError:
        raise FivefoldError(f"--pp-split takes layer counts like 2,2; got {text!r}") from None
    if len(counts) != chunks:
        raise FivefoldError(
            f"--pp-split {text} names {len(counts)} chunks but pp × virtual_stages = {chunks}; "
            f"give {chunks} layer counts"
        )
    if sum(counts) != layers:
        raise FivefoldError(f"--pp-split {text} adds up to {sum(counts)} layers, the model has {layers}")
    for i, c in enumerate(counts):
        if c < 0 or (c == 0 and 0 < i < chunks - 1):
            raise FivefoldError(
                f"--pp-split {text}: chunk {i} has {c} layers; every middle chunk needs at least one "
                "(the first and last may hold only the embedding or the head)"
            )
    return counts


def balanced_split(costs: StageCosts, chunks: int) -> list[int]:
    """Layers per chunk (each >= 1) minimising the most expensive chunk; ties: the most even counts.

    Dynamic programming over (layers placed, chunks used): exact, and cheap for any real depth.
    """
    n = len(costs.layers)
    if chunks > n:
        raise FivefoldError(f"cannot split {n} layers into {chunks} chunks of at least one layer")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, k: int) -> float:  # layers i..j-1 as chunk k
        return (
            prefix[j]
            - prefix[i]
            + (costs.embedding if k == 0 else 0.0)
            + (costs.head if k == chunks - 1 else 0.0)
        )

    ideal = n / chunks
    # the even split is feasible, so no chunk of the optimum costs more than its worst chunk: chunks
    # above that bound are never tried (exact, and it makes the search about n instead of n² per cell)
    even = [n // chunks + (k < n % chunks) for k in range(chunks)]
    edges = [sum(even[:k]) for k in range(chunks + 1)]
    bound = max(cost(edges[k], edges[k + 1], k) for k in range(chunks))
    bound += 1e-9 * abs(bound) + 1e-6
    if chunks == 1:
        return [n]
    # no chunk of the optimum is longer than `longest` layers (each costs at least the cheapest), so
    # the first k chunks end within reach of both ends: a window about chunks wide, not n (10,000 layers
    # took seconds per split otherwise)
    cheapest = min(costs.layers)
    longest = n if cheapest <= 0 else min(n, int(bound / cheapest) + 1)
    inf = (math.inf, math.inf)
    # best[k][j]: (max cost, spread) of placing the first j layers into k chunks
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, chunks + 1):
        first, last = max(k, n - (chunks - k) * longest), min(n - (chunks - k), k * longest)
        for j in [n] if k == chunks else range(first, last + 1):
            for i in range(j - 1, k - 2, -1):  # longest chunk last: stop once it costs too much
                if cost(i, j, k - 1) > bound:
                    break
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                # round costs so float noise does not beat an even split
                cand = (round(max(prev[0], cost(i, j, k - 1)), 6), prev[1] + (j - i - ideal) ** 2)
                if cand <= best[k][j]:  # ties: the shortest last chunk, as an ascending scan
                    best[k][j], cut[k][j] = cand, i
    counts, j = [], n
    for k in range(chunks, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def cp_prefill_width(width: int, cp: int) -> int:
    """Columns a prompt batch left-padded to `width` is widened to (masked in front) so that it splits
    into 2·cp chunks, as `fivefold generate --cp` splits it (cp 1: as is)."""
    return width + -width % (2 * cp) if cp > 1 else width


def stage_split(spec: ModelSpec, layout: Layout, seq_len: int) -> list[int]:
    """Layers per chunk the run uses: `--pp-split` when given, else the cost-balanced split."""
    chunks = layout.pp * layout.virtual_stages
    if layout.pp_split:
        return parse_split(layout.pp_split, spec.layers, chunks)
    key = (spec_key(spec), chunks, seq_len)
    if key not in _SPLITS:  # the planner asks for the same split for many layouts
        _SPLITS[key] = balanced_split(stage_costs(spec, seq_len), chunks)
    return list(_SPLITS[key])


_SPLITS: dict[tuple, list[int]] = {}
_SHAPES: dict[tuple, dict[str, tuple[int, ...]]] = {}


def spec_key(spec: ModelSpec) -> tuple:
    """The fields that decide a model's shapes and costs (ModelSpec itself is not hashable)."""
    return tuple(
        getattr(spec, f)
        for f in (
            "name",
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "ffn_hidden",
            "vocab",
            "experts",
        )
    ) + (
        spec.experts_per_token,
        spec.expert_ffn_hidden,
        spec.shared_experts,
        spec.moe_layers,
        spec.tie_embeddings,
        spec.qk_norm,
        spec.attention_bias,
    )


def stage_to_rank(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that runs chunk `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def end_ranks(layout: Layout) -> tuple[int, int]:
    """The pp ranks that run the first chunk (the embedding) and the last (the head): one rank under
    the V-shaped schedules, two otherwise (the pair that sums a tied weight's gradient)."""
    last = layout.pp * layout.virtual_stages - 1
    return stage_to_rank(0, layout.pp, layout.pp_schedule), stage_to_rank(last, layout.pp, layout.pp_schedule)


def rank_stages(rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The chunks pp rank `rank` runs, in increasing stage order."""
    return [s for s in range(pp * virtual_stages) if stage_to_rank(s, pp, schedule) == rank]


# ---- shard arithmetic


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The single-process model's parameter shapes by name (fivefold.model.transformer's names).

    Cached per model shape: callers must not modify the returned dict.
    """
    key = spec_key(spec)
    if key not in _SHAPES:
        _SHAPES[key] = _param_shapes(spec)
    return _SHAPES[key]


_WITH_HEAD: dict[tuple, dict[str, tuple[int, ...]]] = {}


def chunk_param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """`param_shapes`, plus under tied embeddings the head that a pipeline's last chunk holds as its
    own copy of the shared weight (the runtime sums the two copies' gradients). Cached like it."""
    key = spec_key(spec)
    if key not in _WITH_HEAD:
        shapes = dict(param_shapes(spec))
        shapes.setdefault("lm_head.weight", (spec.vocab, spec.hidden))
        _WITH_HEAD[key] = shapes
    return _WITH_HEAD[key]


_BY_LAYER: dict[tuple, dict[int, list[str]]] = {}


def names_by_layer(spec: ModelSpec) -> dict[int, list[str]]:
    """Parameter names of each transformer layer, in the model's order (cached; do not modify)."""
    key = spec_key(spec)
    if key not in _BY_LAYER:
        out: dict[int, list[str]] = {i: [] for i in range(spec.layers)}
        for name in param_shapes(spec):
            if name.startswith("model.layers."):
                out[int(name.split(".")[2])].append(name)
        _BY_LAYER[key] = out
    return _BY_LAYER[key]


def _param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, d, f, v = spec.hidden, spec.head_dim, spec.ffn_hidden, spec.vocab
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (spec.kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (spec.kv_heads * d, h)
        if spec.attention_bias:  # Qwen2: q, k and v biases
            shapes[p + "self_attn.q_proj.bias"] = (spec.heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (spec.kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (spec.kv_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, spec.heads * d)
        if spec.qk_norm:  # Qwen3: one RMSNorm weight over the head dim for q, one for k
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe_layer(i):
            e, fe = spec.experts, spec.expert_ffn_hidden
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj"] = (e, fe, h)
            shapes[p + "mlp.experts.up_proj"] = (e, fe, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, fe)
            if spec.shared_experts:
                fs = fe * spec.shared_experts
                shapes[p + "mlp.shared_expert.gate_proj.weight"] = (fs, h)
                shapes[p + "mlp.shared_expert.up_proj.weight"] = (fs, h)
                shapes[p + "mlp.shared_expert.down_proj.weight"] = (h, fs)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


@dataclass(frozen=True)
class LocalCounts:
    """Elements a tp rank holds, layer by layer, as prefix sums (a stage's layers i..j hold
    dense[j] - dense[i] dense and experts[j] - experts[i] routed-expert elements), each layer's
    total (for the largest), and the embedding's, final norm's and head's."""

    dense: list[int]
    experts: list[int]
    totals: list[int]
    ends: dict[str, int]


_LOCAL_COUNTS: dict[tuple, LocalCounts] = {}


def local_param_counts(spec: ModelSpec, tp: int, ep: int) -> LocalCounts:
    """Elements a tp rank holds of each layer, dense and routed experts ÷ ep, and of the embedding,
    the final norm and the head (`tp_local_shape`'s cuts; cached: do not modify)."""
    key = (spec_key(spec), tp, ep)
    if key not in _LOCAL_COUNTS:
        shapes = chunk_param_shapes(spec)

        def local(name: str) -> int:
            return numel(rank_local_shape(name, shapes[name], spec, tp, ep))

        layers = [
            (sum(local(n) for n in names if not is_expert(n)), sum(local(n) for n in names if is_expert(n)))
            for names in names_by_layer(spec).values()
        ]
        ends = {n: local(n) for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
        dense, experts = [0], [0]
        for d, e in layers:
            dense.append(dense[-1] + d)
            experts.append(experts[-1] + e)
        _LOCAL_COUNTS[key] = LocalCounts(dense, experts, [d + e for d, e in layers], ends)
    return _LOCAL_COUNTS[key]


def is_expert(name: str) -> bool:
    return ".experts." in name


def tp_local_shape(name: str, shape: tuple[int, ...], spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """Megatron splits: column-parallel on dim 0, row-parallel on dim 1; MoE and norms whole."""
    if tp == 1 or ".mlp.gate." in name or is_expert(name) or "shared_expert" in name:
        return shape
    if len(shape) == 1 and not name.endswith("_proj.bias"):  # norms
        return shape
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and tp > spec.kv_heads:
        return shape  # KV heads replicated: every rank keeps the whole projection
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (shape[0], shape[1] // tp)
    return (shape[0] // tp, *shape[1:])  # q/k/v, gate/up, vocabulary rows of embedding and head


def rank_local_shape(name: str, shape: tuple[int, ...], spec: ModelSpec, tp: int, ep: int) -> tuple[int, ...]:
    """What a tp rank of an ep group stores of a parameter before any data sharding: `tp_local_shape`'s
    cut, and a routed expert tensor's experts (dim 0) split over ep."""
    local = tp_local_shape(name, shape, spec, tp)
    return (local[0] // ep, *local[1:]) if ep > 1 and is_expert(name) else local


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of the full tensor once dim 0 is padded to a multiple of n (FSDP2)."""
    return math.ceil(shape[0] / n) * n * numel(shape[1:])


def chunk_rows(rows: int, n: int, index: int) -> int:
    """Rows rank `index` of n holds when dim 0 is chunked (torch.chunk, the DTensor rule)."""
    per = math.ceil(rows / n)
    return max(0, min(per, rows - index * per))


def interleaved_needs_chunks(layers: int, pp: int) -> FivefoldError:
    """The refusal of interleaved 1F1B with one chunk a rank, naming the chunk counts that would do."""
    ok = list(range(2, layers // pp + 1))
    valid = (
        f"valid --virtual-stages for pp {pp} over {layers} layers: {suggest(ok)}"
        if ok
        else f"pp {pp} leaves fewer than 2 of the {layers} layers a rank: use --pp-schedule 1f1b"
    )
    return FivefoldError(
        f"--pp-schedule interleaved-1f1b needs --virtual-stages >= 2 (model chunks per rank); {valid}"
    )
