"""Parallel generation: tensor-parallel shards, pipeline stages per token, data-parallel replicas,
experts split over replicas, and the sequence split over context-parallel ranks.

One rank of a `dp × cp × pp × tp` world (the training mesh, `fivefold.parallel.device_mesh`):

* **Weights.** The rank builds its pipeline chunk on the meta device (`pipeline.build_chunk`, the
  training split), shards it with the training tensor-parallel plan (`tensor.apply_tensor_parallel`,
  no sequence parallelism) and materialises only its shards: from the per-name seeded init (a
  preset), from an HF directory (read whole, each rank keeps its slice), or from a DCP checkpoint of
  any training layout (DCP reads just this rank's shards).
* **KV cache.** Attention reads its head counts from the sharded projections, so each rank's cache
  holds its own KV heads: sharded over tp, or the one KV head its query heads read where
  tp > kv_heads (that head is then replicated on tp / kv_heads ranks).
* **Per token.** Stage 0 embeds the new tokens, each stage runs its layers (two all-reduces per
  layer over tp) and sends the hidden states to the next stage (plain send/recv between the stage
  groups); the last stage gathers the vocabulary-sharded logits, picks the tokens and broadcasts
  them over pp, so every rank of the replica feeds the same tokens to the next step.
* **Replicas.** Prompt i goes to replica i mod dp; without ep, replicas never talk while generating.
* **Experts.** With ep, each group of ep replicas shares one copy of the experts: the MoE layers are
  split with the training `ExpertParallel` (each rank owns E/ep experts; a layer's rows go to their
  experts' ranks and back by all-to-all), so every replica of the group routes its own prompts to
  all E experts. The replicas are the mesh's fsdp ranks (dp 1), as the planner's serving layout
  folds ep onto them, and ep takes the innermost of replicas × cp (cp first) as in training. Their
  steps meet in every
  MoE layer, so they decode in lockstep (`ExpertPeers`): each step they agree, by one all-reduce
  over ep, whether any still decodes, and a replica that is done runs only its experts, on the
  rows its peers send.
* **Sequence.** With cp, the cp ranks of a replica split its prompts' columns and its KV cache
  (`fivefold.parallel.context_decode`): prefill runs each rank's columns, decode runs the new token
  on every cp rank and merges the attention over the cached shards.

Everything runs under `torch.no_grad()` (not inference mode, whose tensors skip the ledger's
collective kernels), so the communication ledger records generation as it records training.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fivefold.config import Layout, ModelSpec, load_model
from fivefold.errors import FivefoldError, divisors, suggest
from fivefold.model.generate import Sampler, decode
from fivefold.model.moe import moe_layers
from fivefold.parallel.expert import ExpertPeers
from fivefold.parallel.serve_plan import planned_cache, planned_traffic, planned_weights
from fivefold.parallel.spawn import MAX_LOCAL_RANKS


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: an HF directory, a run directory (DCP), or a preset at random."""

    kind: str  # "hf", "run" or "preset"
    path: str = ""  # the directory, or the preset name
    checkpoint: str = "latest"
    init_seed: int = 0
    dtype: str | None = None

    def spec(self) -> ModelSpec:
        if self.kind == "run":
            from fivefold.config import RunConfig

            return RunConfig.from_toml(Path(self.path) / "config.toml").model
        return load_model(self.path)


@dataclass(frozen=True)
class ServeJob:
    source: ModelSource
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int | tuple[int, ...]  # one for all prompts, or one per prompt
    sampler: Sampler
    eos_ids: tuple[int, ...] | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1  # replicas, each decoding its own prompts
    ep: int = 1  # replicas sharing one copy of the experts (divides dp)
    cp: int = 1  # ranks splitting each replica's sequence and KV cache
    device: str = "cpu"
    stream: bool = False
    ledger: bool = False
    tokenizer: str | None = None  # for streaming text: "bytes", a tokenizer.json or its directory

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def resolve_degrees(
    nproc: int, tp: int, pp: int, dp: int | None, ep: int = 1, cp: int = 1
) -> tuple[int, int, int]:
    """(tp, pp, dp) with dp filled from nproc; one line naming the constraint otherwise."""
    given = (("--nproc", nproc), ("--tp", tp), ("--pp", pp), ("--dp", dp or 1), ("--ep", ep), ("--cp", cp))
    for name, value in given:
        if value < 1:
            raise FivefoldError(f"{name} must be a positive integer, got {value}")
    if nproc > MAX_LOCAL_RANKS:  # each is a process: a typo must not start thousands
        raise FivefoldError(f"--nproc must be in 1..{MAX_LOCAL_RANKS} local ranks, got {nproc}")
    split = tp * pp * cp  # the ranks of one replica
    if split > MAX_LOCAL_RANKS:
        raise FivefoldError(
            f"tp×pp×cp = {tp}×{pp}×{cp} = {split} ranks a replica, more than the {MAX_LOCAL_RANKS} local "
            "ranks --nproc may start"
        )
    if dp is None:
        if nproc % split:
            fits = [split * k for k in range(1, 5) if split * k <= MAX_LOCAL_RANKS]
            raise FivefoldError(
                f"--nproc {nproc} is not a multiple of tp×pp×cp = {tp}×{pp}×{cp}; "
                f"valid nproc: {suggest(fits)}"
            )
        dp = nproc // split
    if split * dp != nproc:
        raise FivefoldError(f"dp×tp×pp×cp = {dp}×{tp}×{pp}×{cp} = {dp * split} must equal --nproc {nproc}")
    if (dp * cp) % ep:
        enough = split * ep // math.gcd(ep, cp)  # the fewest ranks whose replicas × cp ep divides
        raise FivefoldError(
            f"--ep {ep} must divide replicas×cp = {dp}×{cp} = {dp * cp} (dp = nproc / (tp×pp×cp)): "
            f"expert parallelism spreads the experts over the replicas' sequence ranks; valid ep: "
            f"{suggest(divisors(dp * cp))}, or --nproc {enough} and up in steps of {enough}"
        )
    return tp, pp, dp


def check_job(spec: ModelSpec, job: ServeJob) -> None:
    """Everything that can be refused before any rank starts."""
    from fivefold.config import check_buildable
    from fivefold.parallel.tensor import check_tensor_parallel

    check_buildable(spec)
    if job.tp > 1:
        check_tensor_parallel(spec, job.tp)
    if job.ep > 1:
        serving_layout(job).check_model(spec)  # a MoE model whose experts ep divides
    if job.pp > spec.layers:
        raise FivefoldError(
            f"--pp {job.pp} exceeds the {spec.layers} layers of {spec.name}: every stage needs a layer; "
            f"valid pp: {suggest(range(1, spec.layers + 1))}"
        )
    check_context(spec, job.prompts, job.max_new_tokens)
    if job.dp > len(job.prompts):
        n, split = len(job.prompts), job.tp * job.pp * job.cp
        raise FivefoldError(
            f"{job.dp} replicas (dp = nproc / (tp×pp×cp)) for {n} prompt(s): every replica needs a "
            f"prompt; give at least {job.dp} prompts, or at most {n} replicas (--nproc {n * split} with "
            f"tp×pp×cp = {split}, or a wider tp, pp or cp)"
        )


def check_context(spec: ModelSpec, prompts: Any, max_new_tokens: int | Sequence[int]) -> None:
    """Prompts and the tokens to generate must fit the model's context."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise FivefoldError(
            f"--max-new-tokens gives {len(limits)} limits for {len(prompts)} prompts; "
            "give one, or one per prompt"
        )
    longest = max(len(p) for p in prompts)
    need = max(len(p) + n for p, n in zip(prompts, limits))
    if longest > spec.max_seq_len:
        room = spec.max_seq_len - limits[next(i for i, p in enumerate(prompts) if len(p) == longest)]
        raise FivefoldError(
            f"a prompt of {longest} tokens is longer than the context of {spec.name} "
            f"({spec.max_seq_len} tokens); shorten it to at most {max(room, 1)} tokens, which leaves "
            "room for --max-new-tokens"
        )
    if need > spec.max_seq_len:
        row = next(i for i, (p, n) in enumerate(zip(prompts, limits)) if len(p) + n == need)
        raise FivefoldError(
            f"prompt {row} ({len(prompts[row])} tokens) + --max-new-tokens {limits[row]} exceeds the context "
            f"of {spec.name} ({spec.max_seq_len}); valid --max-new-tokens there: "
            f"0..{spec.max_seq_len - len(prompts[row])}"
        )


# --------------------------------------------------------------------------------------------
# one rank


def serve_rank(rank: int, world: int, job: ServeJob) -> dict[str, Any] | None:
    """Build this rank's shard, generate its replica's prompts; the replica's leader returns them."""
    from fivefold.parallel.device_mesh import build_runtime_mesh

    device = _device(job.device)
    layout = serving_layout(job).resolve(world)
    runtime = build_runtime_mesh(layout, device.type)
    spec = job.source.spec()
    stage = runtime.coord("pp")
    chunk = build_stage(spec, job.source, runtime, layout, device)
    replica = runtime.coord("dp") * runtime.size("fsdp") + runtime.coord("fsdp")
    mine = [i for i in range(len(job.prompts)) if i % job.dp == replica]
    pp_group = runtime.group("pp")
    pp_ranks = dist.get_process_group_ranks(pp_group) if job.pp > 1 else [rank]
    step = StageStep(chunk, job, stage, pp_ranks, pp_group, job.sampler.generators(mine), device)
    if job.cp > 1:
        step.split_sequence(runtime)
    # a stage without MoE layers meets no peer: its replica's own stages are all it talks to
    peers = ExpertPeers(chunk, device) if job.ep > 1 and moe_layers(chunk) else None
    leader = stage == job.pp - 1 and runtime.coord("tp") == 0 and runtime.coord("cp") == 0
    on_token = None
    if job.stream and leader:
        from fivefold.train.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(job.tokenizer) if job.tokenizer is not None else None
        on_token = StreamPrinter(tokenizer, len(job.prompts), mine)
    ledger = None
    if job.ledger:
        from fivefold.measure.ledger import CommLedger

        ledger = CommLedger(runtime)
        if peers is not None:  # a step ends after the peers' flag for the next, so each step holds one
            peers.ledger = ledger
        else:
            step.ledger = ledger
    prompts = [job.prompts[i] for i in mine]
    limits = job.max_new_tokens
    limits = limits if isinstance(limits, int) else [limits[i] for i in mine]
    if ledger is not None:
        with ledger:
            got = decode(step, prompts, limits, job.eos_ids, on_token, peers)
        ledger.close()
    else:
        got = decode(step, prompts, limits, job.eos_ids, on_token, peers)
    if on_token is not None:
        on_token.finish()
    cache = step.caches[0]
    out: dict[str, Any] = {
        "rank": rank,
        "leader": leader,
        "prompts": mine,
        # this rank's KV cache: heads held per layer, and bytes over its layers
        "kv_heads": 0 if cache.k is None else cache.k.shape[1],
        "kv_cache_bytes": sum(2 * c.k.numel() * c.k.element_size() for c in step.caches if c.k is not None),
        "steps": step.calls,
        # the weights this rank holds: its shard of each (a DTensor's local piece), a tied pair once
        "param_bytes": sum(_local(p).numel() * p.element_size() for p in chunk.parameters()),
    }
    if ledger is not None:
        steps = ledger.per_step()
        # a step of a replica that is done serves only its peers' experts: kept apart from its own
        idle = frozenset(peers.idle_steps) if peers is not None else frozenset()
        if step.calls == 0:  # every limit 0: its steps (the peers' flags) are all idle
            idle = frozenset(range(len(steps)))
        decoded = [i for i in range(1, len(steps)) if i not in idle]  # the prefill is step 0
        prefill = steps[0] if steps and 0 not in idle else []  # a replica with nothing to decode idles
        out["ledger"] = {"prefill": prefill, "per_token": ledger.mean(decoded)}
        if idle:
            out["ledger"]["idle_per_step"] = ledger.mean(sorted(idle))
    # what the plan needs to predict this rank's traffic and cache: its stage, its replica, its cp
    # rank, the bytes of an activation
    out["plan_facts"] = {
        "stage": stage,
        "replica": replica,
        "cp_rank": runtime.coord("cp"),
        "act_bytes": step.dtype.itemsize,
    }
    if leader:
        out["tokens"] = got.tokens
        out["timings"] = [got.timings(r) for r in range(len(mine))]
    return out


def serving_layout(job: ServeJob) -> Layout:
    """The mesh of a serving job: without ep, dp replicas; with ep, the replicas as fsdp ranks (no
    FSDP is applied: the dim only places them) so that ep can fold onto them and cp, cp first, as in
    training and in the planner's serving layouts."""
    if job.ep == 1:
        return Layout(dp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp)
    return Layout(fsdp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp, ep=job.ep)


def build_stage(spec: ModelSpec, source: ModelSource, runtime: Any, layout: Layout, device: torch.device):
    """This rank's pipeline chunk, tensor-parallel sharded, experts split over ep, holding the
    source's weights."""
    from fivefold.model import build_model, materialize
    from fivefold.model.hf import DTYPES
    from fivefold.parallel.pipeline import build_chunk, stage_split
    from fivefold.parallel.tensor import apply_tensor_parallel

    counts = stage_split(spec, layout, spec.max_seq_len) if layout.pp > 1 else [spec.layers]
    stage = runtime.coord("pp")
    start = sum(counts[:stage])
    chunk = build_chunk(
        build_model(spec), range(start, start + counts[stage]), stage == 0, stage == layout.pp - 1
    )
    if layout.tp > 1:
        apply_tensor_parallel(chunk, runtime.get("tp"), spec, sp=False)
    if layout.ep > 1:
        from fivefold.parallel.expert import apply_expert_parallel

        apply_expert_parallel(chunk, runtime)
    materialize(chunk, device, source.init_seed)
    _tie_split_head(chunk, spec, source.init_seed)
    dtype = DTYPES[source.dtype or "fp32"]
    if source.kind == "hf":
        from fivefold.model.hf import load_hf
        from fivefold.parallel.pipeline import _copy_from

        _, full = load_hf(source.path, dtype=source.dtype, device="cpu")  # None: the checkpoint's dtype
        dtype = next(full.parameters()).dtype
        if spec.tie_embeddings and chunk.model.embed_tokens is None and chunk.lm_head is not None:
            full.lm_head.weight = torch.nn.Parameter(full.model.embed_tokens.weight.detach())
        _copy_from(chunk, full.float())
        del full
    elif source.kind == "run":
        _load_dcp(chunk, spec, source)
    return chunk.to(dtype).eval()


def _tie_split_head(chunk: Any, spec: ModelSpec, seed: int) -> None:
    """A last stage without the embedding holds its own copy of a tied head: the embedding's init."""
    if not (spec.tie_embeddings and chunk.model.embed_tokens is None and chunk.lm_head is not None):
        return
    from fivefold.model.transformer import _copy_into, _name_seed

    gen = torch.Generator().manual_seed(_name_seed(seed, "model.embed_tokens.weight"))
    weight = chunk.lm_head.weight
    with torch.no_grad():
        _copy_into(weight, torch.randn(tuple(weight.shape), generator=gen) * spec.init_std)


def _load_dcp(chunk: Any, spec: ModelSpec, source: ModelSource) -> None:
    """Read this rank's shards from a training checkpoint (DCP reshards any saved layout)."""

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fivefold.model.hf import EARLIER_CHECKPOINT, NON_FINITE_CHECKPOINT, refuse_non_finite
    from fivefold.train.checkpoint import check_not_damaged, find_checkpoint, first_problem_of_all
    from fivefold.train.safe_metadata import load_weights, read_metadata

    path = find_checkpoint(Path(source.path), source.checkpoint)
    try:
        stored = read_metadata(path).state_dict_metadata  # untrusted: nothing but DCP's own types
    except Exception as exc:  # a missing or unreadable .metadata: DCP raises several kinds
        raise FivefoldError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc})") from None
    weights = get_model_state_dict(chunk)
    if spec.tie_embeddings and "model.lm_head.weight" not in stored and "lm_head.weight" in weights:
        head = weights.pop("lm_head.weight")
        if "model.embed_tokens.weight" not in weights:  # a last stage: read the embedding into the head
            weights["model.embed_tokens.weight"] = head
    missing = sorted(k for k in weights if f"model.{k}" not in stored)
    if missing:
        raise FivefoldError(
            f"checkpoint {path} does not hold the weights of this model; "
            f"missing e.g. {', '.join(missing[:3])}"
        )
    check_not_damaged(path, EARLIER_CHECKPOINT)
    load_weights(weights, path)
    # one rank's shard may hold the damage while its peers' do not: all of them refuse together
    try:
        refuse_non_finite(weights.items(), f"checkpoint {path}", NON_FINITE_CHECKPOINT)
        problem = None
    except FivefoldError as exc:
        problem = str(exc)
    if (first := first_problem_of_all(problem)) is not None:
        raise FivefoldError(first)
    if "model.embed_tokens.weight" in weights and chunk.model.embed_tokens is None:
        weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    # a tied head is the embedding's tensor: filled with it, so it may be absent here
    set_model_state_dict(chunk, weights, options=StateDictOptions(strict=False))


class StageStep:
    """`step` of the decoding loop for one rank: its layers, then the hand-over to the next stage."""

    def __init__(
        self,
        chunk: Any,
        job: ServeJob,
        stage: int,
        pp_ranks: list[int],
        pp_group: Any,
        generators: list[torch.Generator],
        device: torch.device,
    ) -> None:
        from fivefold.model.attention import KVCache

        self.chunk = chunk
        self.job = job
        self.stage = stage
        self.pp_ranks = pp_ranks
        self.pp_group = pp_group
        self.generators = generators
        self.device = device
        self.caches: list[KVCache] = [KVCache() for _ in chunk.model.layers]
        self.dtype = next(chunk.parameters()).dtype
        self.hidden = chunk.spec.hidden
        self.ledger: Any = None
        self.split: Any = None  # cp's side (`context_decode.SequenceSplit`) once the sequence is split
        self.calls = 0  # decoding steps run (the prefill the first)

    def split_sequence(self, runtime: Any) -> None:
        """Split each prompt's columns and its KV cache over the cp ranks (`context_decode`)."""
        from fivefold.parallel.context_decode import SequenceSplit

        self.split = SequenceSplit(self.chunk, runtime.group("cp"), self.job.cp, runtime.coord("cp"))
        self.caches = list(self.split.caches)

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None):
        from torch.distributed.tensor import DTensor

        pp, last = self.job.pp, self.stage == self.job.pp - 1
        if self.split is not None:
            inputs, positions, key_mask = self.split.columns(inputs, positions, key_mask)
        self.calls += 1
        b, s = inputs.shape
        mask = None if key_mask is None else key_mask.to(self.device)
        for cache in self.caches:
            cache.key_mask = mask
        if self.stage == 0:
            x = inputs.to(self.device)
        else:
            x = torch.empty(b, s, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.pp_ranks[self.stage - 1])
        out = self.chunk(x, positions.to(self.device), caches=self.caches)
        if not last:
            dist.send(out.contiguous(), dst=self.pp_ranks[self.stage + 1])
            token = torch.empty(b, dtype=torch.long, device=self.device)
        elif self.split is None or self.split.picks:
            logits = out[:, -1, :]
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()  # the vocabulary shards gathered
            token = self.job.sampler.pick(logits, self.generators).to(self.device)
        else:
            token = torch.empty(b, dtype=torch.long, device=self.device)
        if last and self.split is not None:
            self.split.share(token)
        if pp > 1:
            dist.broadcast(token, src=self.pp_ranks[-1], group=self.pp_group)
        if self.ledger is not None:
            self.ledger.next_step()
        return token.cpu()


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


class StreamPrinter:
    """`on_token` printing each token as it is chosen: text where a tokenizer is known, else ids;
    with several prompts one line per token, tagged with the prompt's index. One prompt's text is
    its tokens decoded together, printed as it grows: a character whose bytes span tokens (a byte
    tokenizer's é is two) is held back until whole, so the stream reads as the final text does;
    `finish` prints what is still held."""

    def __init__(self, tokenizer: Any, total: int, indices: list[int]) -> None:
        self.tokenizer, self.total, self.indices = tokenizer, total, indices
        self.tokens: list[int] = []
        self.printed = 0  # characters of the decoded text already written

    def __call__(self, row: int, token: int) -> None:
        if self.tokenizer is None:
            piece = f"{token} "
        elif self.total > 1:
            piece = self.tokenizer.decode([token])
        else:
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens).rstrip("\ufffd")  # an unfinished character
            piece, self.printed = text[self.printed :], max(self.printed, len(text))
        sys.stdout.write(piece if self.total == 1 else f"[{self.indices[row]}] {piece!r}\n")
        sys.stdout.flush()

    def finish(self) -> None:
        if self.tokenizer is not None and self.total == 1 and self.tokens:
            sys.stdout.write(self.tokenizer.decode(self.tokens)[self.printed :])
            sys.stdout.flush()


def _device(name: str) -> torch.device:
    if name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# the launch


def serve(job: ServeJob, nproc: int) -> dict[str, Any]:
    """Run `job` on `nproc` local ranks (gloo on CPU, NCCL on GPU); see `collect`."""
    from fivefold.parallel.spawn import spawn_ranks

    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    backend = "nccl" if job.device == "cuda" else "gloo"
    if job.device == "cuda" and nproc > torch.cuda.device_count():
        raise FivefoldError(
            f"--nproc {nproc} needs {nproc} GPUs but {torch.cuda.device_count()} are visible; "
            "use --device cpu for gloo ranks on the CPU"
        )
    results = spawn_ranks(serve_rank, nproc, job, backend=backend)
    return collect(job, results)


def collect(job: ServeJob, results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """{"prompts": per prompt in order, its tokens and timings (from its replica's leader),
    "ledger": each rank's communication (prefill, and the mean per decoded token) beside the
    planner's per decoded token,
    "kv_cache": each rank's KV heads per layer and cache bytes}."""
    rows: list[dict[str, Any]] = [{} for _ in job.prompts]
    for res in results:
        if res is None or not res["leader"]:
            continue
        for row, index in enumerate(res["prompts"]):
            rows[index] = {"prompt": index, "tokens": res["tokens"][row], **res["timings"][row]}
    spec = job.source.spec()  # read once: a run's config.toml or an HF config.json
    ledger = [
        {
            "rank": r["rank"],
            **r["ledger"],
            "planned_prefill": planned_traffic(job, spec, **r["plan_facts"], prefill=True, steps=r["steps"]),
            "planned_per_token": planned_traffic(
                job, spec, **r["plan_facts"], prefill=False, steps=r["steps"]
            ),
        }
        for r in results
        if r is not None and "ledger" in r
    ]
    kv = [
        {
            "rank": r["rank"],
            "heads": r["kv_heads"],
            "bytes": r["kv_cache_bytes"],
            "planned_bytes": planned_cache(job, spec, r["steps"], **r["plan_facts"]),
            "weight_bytes": r["param_bytes"],
            "planned_weight_bytes": planned_weights(
                job, spec, r["plan_facts"]["stage"], r["plan_facts"]["act_bytes"]
            ),
        }
        for r in results
        if r
    ]
    return {"prompts": rows, "ledger": ledger, "kv_cache": kv}
