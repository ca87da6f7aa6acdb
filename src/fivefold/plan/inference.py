"""Serving a model: weights + KV cache per GPU, prefill time and decode time per token.

KV cache per GPU = 2 (K and V) · layers on the stage · kv heads on the rank · head_dim · bytes ·
context · batch / cp, with kv heads split by tp (replicated when tp > kv_heads); multi-head latent
attention caches the compressed latent (kv_lora_rank + rope dim) per token instead, on every tp rank.
Prefill is compute-bound: the layers' forward over batch × prompt tokens on the roofline. Decode is
memory-bound: each new token reads the rank's weights (only the experts some token of the batch is
routed to) and the whole KV cache, plus two tp all-reduces per layer that cost mostly latency.
Pipeline stages run one after the other for one token, so their times add.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.plan.comm import collective_time, ep_link, links
from fivefold.plan.compute import Rates, layer_time
from fivefold.plan.memory import stage_counts, stage_params
from fivefold.plan.result import capacity
from fivefold.plan.spec import Arch, resolve_arch

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
            raise FivefoldError(f"--prompt {self.prompt} cannot exceed --context {self.context}")
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

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations

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
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "comm_time_s": self.comm,
        }


def kv_bytes_per_token(model: ModelSpec, layout: Layout, kv_bytes: int = 2) -> float:
    """KV-cache bytes per token per layer on one rank."""
    if model.is_mla:
        return kv_bytes * (model.kv_lora_rank + model.qk_rope_head_dim)
    return 2 * kv_bytes * max(model.kv_heads / layout.tp, 1.0) * model.head_dim


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
    for stage in ["only"] if lay.pp == 1 else ["first", "last"]:
        dense, experts, _ = stage_params(model, arch, lay, stage)
        n_dense, n_moe = stage_counts(model, lay.pp, stage)
        weights = shape.weight_bytes * (dense + experts)
        kv = (
            kv_bytes_per_token(model, lay, shape.kv_bytes)
            * (n_dense + n_moe)
            * shape.context
            * shape.batch
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
        if moe:  # decode reads only the local experts some routed token of the batch hits
            touched = shard_exp * (1 - (1 - 1 / model.experts) ** (shape.batch * model.experts_per_token))
            routed_flops = model.experts_per_token * model.expert_params() / (lay.tp * lay.ep)
        read = shape.weight_bytes * (shard_dense + touched) + kv_token_layer
        flops = 2 * shape.batch * (shard_dense + routed_flops)
        decode += count * max(read / hbm, flops / rates.flops)
        if lay.tp > 1:
            t_pre = 2 * collective_time(hw, "all-reduce", BYTES * tokens * model.hidden, lay.tp, tp_link)[1]
            t_dec = (
                2 * collective_time(hw, "all-reduce", BYTES * shape.batch * model.hidden, lay.tp, tp_link)[1]
            )
            prefill += count * t_pre
            decode += count * t_dec
            comm["tp"] += count * t_dec
        if moe and lay.ep > 1:  # dispatch and combine; tp ranks split the tokens they send
            link = ep_link(lay, gpn)
            per_token = BYTES * model.experts_per_token * model.hidden / lay.tp
            t_dec = 2 * collective_time(hw, "all-to-all", per_token * shape.batch, lay.ep, link)[1]
            t_pre = 2 * collective_time(hw, "all-to-all", per_token * tokens, lay.ep, link)[1]
            prefill += count * t_pre
            decode += count * t_dec
            comm["ep"] += count * t_dec
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
    return InferencePlan(
        model=model,
        hardware=hw,
        layout=layout,
        shape=shape,
        replicas=replicas,
        weights=worst_weights,
        kv_cache=worst_kv,
        activations=activations,
        fits=worst_weights + worst_kv + activations <= capacity(hw),
        prefill_time_s=prefill,
        decode_time_per_token_s=decode,
        decode_tokens_per_s=shape.batch * replicas / decode,
        comm=comm,
    )


def _layer_weights(model: ModelSpec, arch: Arch, layout: Layout, moe: bool) -> tuple[float, float, float]:
    from fivefold.plan.spec import layer_shard

    shard = layer_shard(model, arch, layout, moe)
    return shard.dense + shard.replicated, shard.experts, 0.0  # (dense, experts, unused)
