"""Serving a model: weights + KV cache per GPU, prefill time and decode time per token.

KV cache per GPU = 2 (K and V) · layers on the stage · kv heads on the rank · head_dim · bytes ·
context · batch / cp, with kv heads split by tp (replicated when tp > kv_heads); multi-head latent
attention caches the compressed latent (kv_lora_rank + rope dim) per token instead, on every tp rank.
Prefill is compute-bound: the layers' forward over batch × prompt tokens on the roofline. Decode is
memory-bound: each new token reads the rank's weights (only the experts some token of the batch is
routed to) and the whole KV cache, plus two tp all-reduces per layer that cost mostly latency (with
cp, an all-gather over cp of the partial attention outputs of the KV shards).
Pipeline stages run one after the other for one token, so their times add.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.plan.comm import collective_time, ep_link, ep_members_per_node, links, ring_nics
from fivefold.plan.compute import Rates, layer_time
from fivefold.plan.memory import chunk_layers, stage_counts, stage_names, stage_params
from fivefold.plan.result import capacity, size_words
from fivefold.plan.runshape import dtype_name
from fivefold.plan.spec import GPT_GUESS_NOTE, Arch, gpt_block_guessed, kv_heads_local, resolve_arch

BYTES = 2


@dataclass(frozen=True)
class InferenceShape:
    batch: int  # concurrent sequences per replica
    context: int  # tokens each sequence attends to at the last decode step (prompt + generated)
    prompt: int  # tokens prefilled at once
    weight_bytes: int = 2
    kv_bytes: int = 2

    def validate(self) -> InferenceShape:
        if self.batch <= 0 or self.context <= 0 or self.prompt <= 0:
            raise FivefoldError("--batch, --context and --prompt must be positive")
        if self.prompt > self.context:
            raise FivefoldError(
                f"--prompt {self.prompt} cannot exceed --context {self.context} (prompt + generated tokens)"
            )
        return self


@dataclass
class InferencePlan:
    model: ModelSpec
    hardware: HardwareSpec
    layout: Layout
    shape: InferenceShape
    replicas: int
    weights: float
    kv_cache: float
    activations: float
    fits: bool
    prefill_time_s: float
    decode_time_per_token_s: float
    decode_tokens_per_s: float
    comm: dict[str, float]
    notes: list[str] = field(default_factory=list)  # what the figures assume, as a training plan's notes

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations

    def traffic(self) -> dict[int, dict[tuple[str, str], tuple[int, int]]]:
        """Per decoded token, the collectives of one rank of each distinct pipeline stage (the first,
        one in the middle, the last), as `fivefold generate` issues them (`decode_traffic`)."""
        pp = self.layout.pp
        stages = sorted({0, pp // 2, pp - 1} if pp > 2 else set(range(pp)))
        b, act = self.shape.batch, self.shape.weight_bytes
        return {s: decode_traffic(self.model, self.layout, b, s, act) for s in stages}

    def to_json(self) -> dict[str, object]:
        lay = self.layout
        return {
            "mode": "inference",
            "model": self.model.name,
            "hardware": self.hardware.name,
            "layout": {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "replicas": self.replicas},
            "batch": self.shape.batch,
            "context": self.shape.context,
            "prompt": self.shape.prompt,
            # the width the weights and the KV cache are held in (generate's: the weights' own)
            "dtype": dtype_name(self.shape.weight_bytes),
            "memory": {
                "params": int(self.weights),
                "kv_cache": int(self.kv_cache),
                "activations": int(self.activations),
                "buffers": 0,
                "grads": 0,
                "optimizer": 0,
                "total": int(self.total),
            },
            "memory_capacity": int(capacity(self.hardware)),
            "fits": self.fits,
            "prefill_time_s": self.prefill_time_s,
            "time_to_first_token_s": self.prefill_time_s,
            "decode_time_per_token_s": self.decode_time_per_token_s,
            # a layout that does not fit serves nothing: no throughput is claimed for it
            "decode_tokens_per_s": self.decode_tokens_per_s if self.fits else None,
            "comm_time_s": self.comm,
            "notes": self.notes,
            "decode_traffic": [
                {"stage": stage, "axis": axis, "op": op, "count": count, "bytes": size}
                for stage, rows in self.traffic().items()
                for (axis, op), (count, size) in sorted(rows.items())
            ],
        }


def stage_layers(model: ModelSpec, layout: Layout, stage: int) -> list[int]:
    """The layers pipeline rank `stage` holds (the training split, `plan.memory.chunk_layers`)."""
    return [i for chunk in chunk_layers(model, layout, model.max_seq_len, stage) for i in chunk]


def decode_traffic(
    model: ModelSpec,
    layout: Layout,
    batch: int,
    stage: int,
    act_bytes: int = 2,
    picks: bool = True,
    prompt: int = 0,
    peer_tokens: float | None = None,
) -> dict[tuple[str, str], tuple[int, int]]:
    """The collectives one rank of `fivefold generate` issues per decoded token (or, given `prompt`,
    in the prefill of prompts left-padded to that many tokens), in the ledger's words: (axis, op) ->
    (count, bytes), bytes as the ledger counts them (an all-gather's gathered size).

    `layout` is the generate layout (tp, pp, cp, ep; dp the replicas), `batch` the prompts of the
    rank's replica, `stage` its pipeline stage (the training split, `layout_math.stage_split`),
    `picks` whether it picks the tokens (cp rank 0 of the last stage), `peer_tokens` the mean tokens
    of the step over the replicas sharing its experts (its own when None). The prefill runs the rank's
    columns (with cp, the prompt widened to 2·cp chunks, a cp-th of them) and gathers each layer's K
    and V over cp instead of the partial outputs; the replicas of ep agree twice. Per decoded token:
    tp: an all-reduce after attention and after a dense MLP (a MoE block is whole on every tp rank),
    one more for the vocabulary-parallel embedding on stage 0, and the head's logits gathered where
    the tokens are picked; pp: the hidden states sent on and received, and the tokens broadcast;
    cp: each layer's partial attention outputs with their log-sum-exp (fp32) gathered, the tokens
    broadcast from cp rank 0; ep: per MoE layer the per-expert counts (int64), the rows out (tokens ·
    top-k) and the results back (balanced routing: a rank's experts get the mean rows of the group;
    the measured rows follow the router), and the flag of the replicas' lockstep.
    """
    from fivefold.layout_math import cp_prefill_width

    layers = stage_layers(model, layout, stage)
    moe = sum(model.is_moe_layer(i) for i in layers)
    last = stage == layout.pp - 1
    h = model.hidden
    width = cp_prefill_width(prompt, layout.cp)
    tokens = batch * (width // layout.cp if prompt else 1)  # the rows this rank runs
    out: dict[tuple[str, str], tuple[int, int]] = {}
    if layout.tp > 1:
        reduces = 2 * len(layers) - moe + (stage == 0)
        out["tp", "all_reduce"] = (reduces, reduces * tokens * h * act_bytes)
        if last and picks:  # the last position's logits
            out["tp", "all_gather"] = (1, batch * model.vocab * act_bytes)
    if layout.pp > 1:
        if not last:
            out["pp", "send"] = (1, tokens * h * act_bytes)
        if stage > 0:
            out["pp", "recv"] = (1, tokens * h * act_bytes)
        out["pp", "broadcast"] = (1, batch * 8)
    if layout.cp > 1:
        if prompt:  # K and V of every column
            gathered = batch * kv_heads_local(model, layout.tp) * width * model.head_dim * act_bytes
            out["cp", "all_gather"] = (2 * len(layers), 2 * len(layers) * gathered)
        else:
            partial = layout.cp * batch * (model.heads // layout.tp) * (model.head_dim + 1) * 4
            out["cp", "all_gather"] = (len(layers), len(layers) * partial)
        if last:
            out["cp", "broadcast"] = (1, batch * 8)
    if layout.ep > 1 and moe:
        sent = tokens * model.experts_per_token * h * act_bytes
        got = (tokens if peer_tokens is None else peer_tokens) * model.experts_per_token * h * act_bytes
        out["ep", "all_to_all"] = (3 * moe, round(moe * (model.experts * 8 + sent + got)))
        flags = 2 if prompt else 1
        out["ep", "all_reduce"] = (flags, 8 * flags)
    return out


def rank_weights(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Weight elements one rank of `fivefold generate` holds on pipeline stage `stage`, from the
    runtime's per-parameter shapes (`layout_math`: tp's splits, K/V whole where tp > kv_heads,
    experts divided over ep; the stage's layers, the embedding on the first, the final norm and the
    head on the last, a tied head's own copy there). The serving plan's `weights` count K/V heads
    as engines replicate them (one per rank where tp > kv_heads); this is what the run holds."""
    from fivefold.layout_math import chunk_param_shapes, is_expert, names_by_layer, numel, tp_local_shape

    shapes = chunk_param_shapes(model)
    by_layer = names_by_layer(model)
    names = [n for i in stage_layers(model, layout, stage) for n in by_layer[i]]
    if stage == 0:
        names.append("model.embed_tokens.weight")
    if stage == layout.pp - 1:
        names.append("model.norm.weight")
        if not (model.tie_embeddings and stage == 0):  # tied in one chunk: the head is the embedding
            names.append("lm_head.weight")
    total = 0
    for name in names:
        local = tp_local_shape(name, shapes[name], model, layout.tp)
        total += numel(local) // (layout.ep if is_expert(name) else 1)
    return total


def cached_columns(prompt: int, steps: int, cp: int = 1, cp_rank: int = 0) -> int:
    """Columns of a prompt batch left-padded to `prompt` tokens one rank of `fivefold generate` caches
    after `steps` decoding steps (the prefill one of them; the last token is never fed back): with cp,
    its chunks of the prompt widened to 2·cp chunks and every cp-th later column, in turn."""
    from fivefold.layout_math import cp_prefill_width

    if steps <= 0:
        return 0
    if cp == 1:
        return prompt + steps - 1
    later = steps - 1
    return cp_prefill_width(prompt, cp) // cp + later // cp + (cp_rank < later % cp)


def kv_bytes_per_token(model: ModelSpec, layout: Layout, kv_bytes: int = 2) -> float:
    """KV-cache bytes per token per layer on one rank."""
    if model.is_mla:
        return kv_bytes * (model.kv_lora_rank + model.qk_rope_head_dim)
    return 2 * kv_bytes * kv_heads_local(model, layout.tp) * model.head_dim


def serving_layout(layout: Layout) -> Layout:
    """Replicas are dp×fsdp; expert parallelism folds onto them (and cp), as in training."""
    replicas = layout.dp * layout.fsdp
    if (replicas * layout.cp) % layout.ep:
        raise FivefoldError(f"--ep {layout.ep} must divide replicas×cp = {replicas * layout.cp} in inference")
    return dataclasses.replace(layout, dp=1, fsdp=replicas, zero=3 if replicas > 1 else 0)


def inference_plan(
    model: ModelSpec,
    hw: HardwareSpec,
    layout: Layout,
    shape: InferenceShape,
    gpus_per_node: int | None = None,
    block: str = "auto",
) -> InferencePlan:
    shape.validate()
    layout.check_model(model, shape.prompt)
    lay = serving_layout(layout)
    gpn = gpus_per_node or hw.gpus_per_node
    arch = resolve_arch(model, block)
    rates = Rates.of(hw)
    kinds = links(layout, gpn)
    worst_weights = worst_kv = 0.0
    # every distinct rank of the pipeline (its ends and middle ranks; MoE layers may sit in the middle),
    # its KV cache from the same split as its weights
    for stage in stage_names(lay, model):
        dense, experts, _ = stage_params(model, arch, lay, stage)
        n_dense, n_moe = stage_counts(model, lay.pp, stage, lay)
        weights = shape.weight_bytes * (dense + experts)
        kv = (
            kv_bytes_per_token(model, lay, shape.kv_bytes)
            * (n_dense + n_moe)
            * shape.batch
            * shape.context
            / lay.cp
        )
        if weights + kv > worst_weights + worst_kv:
            worst_weights, worst_kv = weights, kv
    # transient activations of one prefill layer (the largest live set) and the last-token logits
    tokens = shape.batch * shape.prompt / lay.cp
    f_local = (
        model.expert_ffn_hidden * model.experts_per_token if model.is_moe else model.ffn_hidden
    ) / lay.tp
    activations = BYTES * tokens * (4 * model.hidden + 3 * f_local) + 4 * shape.batch * model.vocab / lay.tp

    tp_link = kinds.get("tp", "intra")
    tp_nics = ring_nics(layout, ("tp",), tp_link, gpn)
    cp_link = kinds.get("cp", "intra")
    cp_nics = ring_nics(layout, ("cp",), cp_link, gpn)
    prefill = decode = 0.0
    comm = {"tp": 0.0, "pp": 0.0, "ep": 0.0, "cp": 0.0}
    hbm = rates.hbm
    kv_token_layer = kv_bytes_per_token(model, lay, shape.kv_bytes) * shape.context * shape.batch / lay.cp
    for moe, count in zip((False, True), stage_counts(model, 1, "only"), strict=True):
        if not count:
            continue
        pre = layer_time(model, arch, lay, shape.batch, shape.prompt, rates, moe)
        prefill += count * pre.fwd
        shard_dense, shard_exp, _ = _layer_weights(model, arch, lay, moe)
        touched = shard_exp
        routed_flops = 0.0
        if moe:  # decode reads only the local experts some routed token hits: with ep a rank's experts
            # serve the tokens of all ep replicas, as many (balanced) as its own batch routes
            routed = lay.ep * shape.batch * model.experts_per_token
            touched = shard_exp * (1 - (1 - 1 / model.experts) ** routed)
            routed_flops = model.experts_per_token * model.expert_params() / lay.tp
        read = shape.weight_bytes * (shard_dense + touched) + kv_token_layer
        flops = 2 * shape.batch * (shard_dense + routed_flops)
        decode += count * max(read / hbm, flops / rates.flops)
        if lay.tp > 1:
            ar_tokens = BYTES * tokens * model.hidden
            # the serving model's tp goes through DTensor too: its host dispatch included
            t_pre = 2 * collective_time(hw, "all-reduce", ar_tokens, lay.tp, tp_link, tp_nics, "tp")[1]
            ar_batch = BYTES * shape.batch * model.hidden
            t_dec = 2 * collective_time(hw, "all-reduce", ar_batch, lay.tp, tp_link, tp_nics, "tp")[1]
            prefill += count * t_pre
            decode += count * t_dec
            comm["tp"] += count * t_dec
        if lay.cp > 1:
            # as `fivefold generate --cp` runs it (`parallel.context_decode`): prefill gathers each
            # layer's K and V over cp before its attention; decode: each rank attends over its KV
            # shard and the partial outputs with their log-sum-exp (fp32) are all-gathered over cp
            k_shard = BYTES * tokens * kv_heads_local(model, lay.tp) * model.head_dim
            t_pre = 2 * collective_time(hw, "all-gather", k_shard * lay.cp, lay.cp, cp_link, cp_nics, "cp")[1]
            partial = 4 * shape.batch * (model.heads // lay.tp) * (model.head_dim + 1)
            t_dec = collective_time(hw, "all-gather", partial * lay.cp, lay.cp, cp_link, cp_nics, "cp")[1]
            prefill += count * t_pre
            decode += count * t_dec
            comm["cp"] += count * t_dec
        if moe and lay.ep > 1:
            # dispatch and combine; the experts are whole on every tp rank (as in training), so each
            # tp rank sends its replica's every routed row to its own ep peers
            link, local = ep_link(lay, gpn), ep_members_per_node(lay, gpn)
            per_token = BYTES * model.experts_per_token * model.hidden
            t_dec = 2 * collective_time(hw, "all-to-all", per_token * shape.batch, lay.ep, link, local)[1]
            t_pre = 2 * collective_time(hw, "all-to-all", per_token * tokens, lay.ep, link, local)[1]
            prefill += count * t_pre
            decode += count * t_dec
            comm["ep"] += count * t_dec
    if model.is_moe and lay.ep > 1:
        # the replicas sharing experts meet in every MoE layer, so they step together: each token
        # they agree whether any still decodes (one all-reduce of a flag over ep)
        link, local = ep_link(lay, gpn), ep_members_per_node(lay, gpn)
        t_flag = collective_time(hw, "all-reduce", 8, lay.ep, link, local)[1]
        decode += t_flag
        comm["ep"] += t_flag
    head = shape.weight_bytes * model.vocab * model.hidden / lay.tp
    decode += max(head / hbm, 2 * shape.batch * model.vocab * model.hidden / lay.tp / rates.flops)
    prefill += 2 * shape.batch * model.vocab * model.hidden / lay.tp / rates.flops
    if lay.pp > 1:
        link = kinds.get("pp", "inter")
        t_dec = (lay.pp - 1) * collective_time(hw, "send-recv", BYTES * shape.batch * model.hidden, 2, link)[
            1
        ]
        prefill += (lay.pp - 1) * collective_time(hw, "send-recv", BYTES * tokens * model.hidden, 2, link)[1]
        decode += t_dec
        comm["pp"] = t_dec
    replicas = layout.dp * layout.fsdp
    fits = worst_weights + worst_kv + activations <= capacity(hw)
    return InferencePlan(
        model=model,
        hardware=hw,
        layout=layout,
        shape=shape,
        replicas=replicas,
        weights=worst_weights,
        kv_cache=worst_kv,
        activations=activations,
        fits=fits,
        prefill_time_s=prefill,
        decode_time_per_token_s=decode,
        decode_tokens_per_s=shape.batch * replicas / decode,
        comm=comm,
        notes=serving_notes(model, arch, lay, block, fits),
    )


def serving_notes(model: ModelSpec, arch: Arch, lay: Layout, block: str, fits: bool) -> list[str]:
    """What a serving plan's figures assume that its numbers do not show: how the layers and KV heads
    split, the block `auto` guessed, and how one batch crosses a pipeline."""
    notes = []
    if model.layers % lay.pp:
        held = sorted({len(stage_layers(model, lay, s)) for s in range(lay.pp)})
        notes.append(
            f"{model.layers} layers do not split evenly over pp {lay.pp}: stages hold {held[0]} to "
            f"{held[-1]}; memory is the fullest stage's"
        )
    if lay.tp > model.kv_heads:
        copies = lay.tp // model.kv_heads
        notes.append(
            f"tp {lay.tp} over {model.kv_heads} KV head(s): each head's cache is whole on {copies} ranks, "
            f"so the KV cache shrinks with tp only up to tp {model.kv_heads}"
        )
    if gpt_block_guessed(model, arch, block):
        notes.append(GPT_GUESS_NOTE.format(command="generate"))
    if lay.pp > 1 and fits:
        notes.append(
            f"the throughput is one batch passing the {lay.pp} stages in turn, as fivefold generate "
            f"decodes; an engine that keeps {lay.pp} batches in flight (each stage on another) decodes "
            f"up to {lay.pp}× the tokens/s, with {lay.pp}× the KV cache"
        )
    return notes


def _layer_weights(model: ModelSpec, arch: Arch, layout: Layout, moe: bool) -> tuple[float, float, float]:
    from fivefold.plan.spec import layer_shard

    shard = layer_shard(model, arch, layout, moe)
    return shard.dense + shard.replicated, shard.experts, 0.0  # (dense, experts, unused)


# --------------------------------------------------------------------------------------------
# the serving recipe as a search

OBJECTIVES = ("latency", "throughput")
LONG_CONTEXT = 32768  # contexts from here on also try splitting the sequence (cp)


@dataclass
class ServingSearch:
    objective: str
    plans: list[InferencePlan]  # the fitting layouts, best first
    considered: int
    fitting: int
    explanation: list[str]


def _pow2_up_to(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def serving_candidates(
    model: ModelSpec, gpus: int, gpus_per_node: int, context: int, cp: int | None = None
) -> list[Layout]:
    """Every serving layout of the recipe's axes on `gpus`: tp inside a node (dividing the heads, KV
    heads split or replicated evenly), pp up to the layers, cp only for long contexts (or the `cp`
    asked for), ep for MoE (folded onto replicas × cp); the replicas take what is left."""
    out = []
    tps = [
        t
        for t in _pow2_up_to(min(gpus, gpus_per_node))
        if model.heads % t == 0 and (t <= model.kv_heads or t % model.kv_heads == 0)
    ]
    cps = [cp] if cp is not None else _pow2_up_to(gpus) if context >= LONG_CONTEXT else [1]
    for tp in tps:
        for pp in range(1, min(model.layers, gpus // tp) + 1):
            for cp in cps:
                if gpus % (tp * pp * cp):
                    continue
                replicas = gpus // (tp * pp * cp)
                eps = (
                    [e for e in _pow2_up_to(replicas * cp) if model.experts % e == 0] if model.is_moe else [1]
                )
                for ep in eps:
                    if (replicas * cp) % ep:
                        continue
                    out.append(Layout(tp=tp, pp=pp, cp=cp, ep=ep, fsdp=replicas, dp=1).resolve(gpus))
    return out


def search_serving(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: InferenceShape,
    gpus_per_node: int | None = None,
    objective: str = "latency",
    top: int = 5,
    pins: dict[str, int | None] | None = None,
    block: str = "auto",
) -> ServingSearch:
    """Rank the serving layouts that fit by `objective`: latency (decode time per token, then time to
    first token) or throughput (decoded tokens/s over all replicas). Layouts that do not fit are
    counted but never ranked. `pins` fixes tp/pp/cp/ep where given."""
    if objective not in OBJECTIVES:
        raise FivefoldError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    shape.validate()
    gpn = gpus_per_node or hw.gpus_per_node
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    Layout(ep=pins.get("ep", 1)).check_experts(model)
    candidates = list(serving_candidates(model, gpus, gpn, shape.context, pins.get("cp")))
    for key, value in pins.items():  # a pin no serving layout has is named, not "none fits"
        held = sorted({getattr(lay, key) for lay in candidates})
        if value not in held:
            raise FivefoldError(
                f"no serving layout of {model.name} on {gpus} GPUs has --{key} {value}; valid {key}: "
                f"{', '.join(map(str, held))}"
            )
    considered, fitting = 0, []
    for lay in candidates:
        if any(getattr(lay, k) != v for k, v in pins.items()):
            continue
        try:
            p = inference_plan(model, hw, lay, shape, gpn, block)
        except FivefoldError:
            continue
        considered += 1
        if p.fits:
            fitting.append(p)
    if objective == "latency":
        fitting.sort(key=lambda p: (p.decode_time_per_token_s, p.prefill_time_s, -p.decode_tokens_per_s))
    else:
        fitting.sort(key=lambda p: (-p.decode_tokens_per_s, p.decode_time_per_token_s))
    return ServingSearch(
        objective,
        fitting[:top] if top > 0 else fitting,  # 0: every layout that fits
        considered,
        len(fitting),
        _recipe(model, hw, gpus, shape, gpn, block),
    )


def _recipe(
    model: ModelSpec, hw: HardwareSpec, gpus: int, shape: InferenceShape, gpn: int, block: str = "auto"
) -> list[str]:
    """The serving recipe's reasoning for this model: the smallest model-parallel group that fits."""
    cap = capacity(hw)
    steps = []
    whole = Layout().resolve(1)
    one = inference_plan(model, hw, whole, shape, gpn, block)
    need = one.weights + one.kv_cache + one.activations
    if one.fits:
        steps.append(
            f"one GPU holds the model ({size_words(need)} of {size_words(cap)}): serve {gpus} replicas; "
            "tp still cuts the time per token where latency matters"
        )
    else:
        steps.append(f"one GPU would need {size_words(need)} of {size_words(cap)}: split the model")
        group = None
        for tp in _pow2_up_to(min(gpus, gpn)):
            try:
                if inference_plan(model, hw, Layout(tp=tp).resolve(tp), shape, gpn, block).fits:
                    group = ("tp", tp)
                    break
            except FivefoldError:
                continue
        if group is not None:
            steps.append(f"tp {group[1]} inside a node fits: the rest of the GPUs become replicas")
        else:
            steps.append(f"tp up to a node ({gpn} GPUs) does not fit: add pipeline stages across nodes")
    if shape.context >= LONG_CONTEXT:
        steps.append(f"context {shape.context} ≥ {LONG_CONTEXT}: cp splits the prompt and the KV cache")
    if model.is_moe:
        steps.append(
            "mixture of experts: ep spreads the experts over the replicas × cp (all-to-all per layer)"
        )
    return steps
