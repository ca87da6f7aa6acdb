"""`Layout`: the degree of every parallel axis and how they are ordered and scheduled."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.config.model import ModelSpec
from fivefold.errors import FivefoldError, divisors, suggest

AXES = ("dp", "fsdp", "cp", "tp", "pp")  # axes whose product is the world size


ALL_AXES = AXES + ("ep",)


DEFAULT_ORDER = "tp,cp,fsdp,dp,pp"


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


RECOMPUTE = ("none", "selective", "full")


CP_IMPLS = ("ring", "allgather", "ulysses")


def recomputed_blocks(recompute: str, recompute_layers: int, blocks: int) -> int:
    """How many of a chunk's `blocks` recompute re-runs whole: under full recompute the first
    `recompute_layers` of them (all when 0 or more than the chunk has), none otherwise. The runtime
    wraps these blocks and the planner counts them: one rule for both."""
    if recompute != "full":
        return 0
    return blocks if recompute_layers <= 0 else min(recompute_layers, blocks)


def complete_order(order: str) -> str:
    """`order` with the axes it leaves out appended in the default order: "cp,tp" -> "cp,tp,fsdp,dp,pp"."""
    if not isinstance(order, str):
        raise FivefoldError(f"--order must be comma-separated axes such as {DEFAULT_ORDER}, got {order!r}")
    fields = [a.strip() for a in order.split(",")]
    given = [a for a in fields if a]
    if (order.strip() and not given) or "" in fields[:-1]:  # ",,," or "tp,,cp": a slip, said so
        raise FivefoldError(f"--order lists axes innermost first, such as {DEFAULT_ORDER}; got {order!r}")
    unknown = [a for a in given if a not in AXES]
    repeated = sorted({a for a in given if given.count(a) > 1})
    if unknown or repeated:
        what = f"unknown axis {', '.join(unknown)}" if unknown else f"{', '.join(repeated)} given twice"
        raise FivefoldError(
            f"--order lists axes innermost first, each at most once, from {','.join(AXES)} "
            f"(the rest follow in the default order {DEFAULT_ORDER}); {what} in {order!r}"
        )
    return ",".join(given + [a for a in DEFAULT_ORDER.split(",") if a not in given])


MAX_GPUS = 1 << 20  # a million GPUs: ten times the largest cluster trained on so far


def check_gpus(gpus: int, flag: str = "--gpus") -> None:
    """A world size the planner and the mesh can reason about: 1 to MAX_GPUS."""
    if gpus <= 0:
        raise FivefoldError(f"{flag} must be a positive integer, got {gpus}")
    if gpus > MAX_GPUS:
        raise FivefoldError(f"{flag} must be at most {MAX_GPUS:,} (a million GPUs), got {gpus:,}")


def check_degree(axis: str, value: int) -> None:
    """A mesh degree as a flag gives it: a positive integer, or -1 (fill the rest) on dp or fsdp."""
    if value == 0 or value < -1 or (value == -1 and axis not in ("dp", "fsdp")):
        raise FivefoldError(f"--{axis} must be a positive integer (or -1 on dp/fsdp), got {value}")
    if value > MAX_GPUS:  # a degree is a number of GPUs: suggestions built on it would be as absurd
        raise FivefoldError(f"--{axis} must be at most {MAX_GPUS:,} (a million GPUs), got {value:.3g}")


def check_pins(pins: dict[str, int | None], world: int) -> None:
    """Mesh degrees a search is told to keep: each a positive integer (-1, fill, on dp/fsdp), their
    product a divisor of the world, as a layout's axes must multiply to it; else name valid values."""
    fixed: dict[str, int] = {}
    for a in AXES + ("ep",):
        v = pins.get(a)
        if v is None:
            continue
        check_degree(a, v)
        if v > 0:
            fixed[a] = v
    mesh = {a: v for a, v in fixed.items() if a != "ep"}
    product = math.prod(mesh.values())
    if world % product:
        if len(mesh) == 1:
            ((a, v),) = mesh.items()
            raise FivefoldError(
                f"--{a} {v} does not divide the {world} GPUs; valid {a}: {suggest(divisors(world))}"
            )
        hints = [
            f"--{a} {suggest(divisors(world // (product // v)))}"
            for a, v in mesh.items()
            if world % (product // v) == 0
        ]
        said = " × ".join(f"--{a} {v}" for a, v in mesh.items())
        raise FivefoldError(
            f"{said} = {product} does not divide the {world} GPUs, so no layout keeps them; "
            f"valid with the other flags kept: {'; '.join(hints) if hints else 'none, drop one of them'}"
        )
    if "ep" in fixed and world % fixed["ep"]:
        raise FivefoldError(
            f"--ep {fixed['ep']} does not divide the {world} GPUs; valid ep: {suggest(divisors(world))}"
        )


def split_fields(text: str) -> list[str]:
    """The comma-separated fields of a `--pp-split` (spaces and empty fields dropped): the layout's
    count check, `fivefold.layout_math.parse_split` and the activation plan read them alike."""
    return [x for x in text.replace(" ", "").split(",") if x]


@dataclass
class Layout:
    """How the world is split. `-1` on dp or fsdp takes whatever the other axes leave."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    zero: int = -1  # -1: 3 when fsdp > 1, else 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int = 0  # 0: pp (or 1 without pipelining)
    virtual_stages: int = 1
    pp_split: str = ""  # manual split: comma-separated layer counts per stage
    cp_impl: str = "ring"
    recompute: str = "none"
    recompute_layers: int = 0  # under full recompute: the first N blocks of every chunk (0: all)

    @property
    def world(self) -> int:
        return math.prod(getattr(self, a) for a in AXES)

    @property
    def order_list(self) -> list[str]:
        """Every world axis, innermost first: the given order, then the rest in the default order."""
        return complete_order(self.order).split(",")

    @property
    def recompute_label(self) -> str:
        """The recompute in words: none, selective, full, or "full (first 3 blocks per chunk)"."""
        if self.recompute == "full" and self.recompute_layers > 0:
            n = self.recompute_layers
            return f"full (first {n} block{'s' if n > 1 else ''} per chunk)"
        return self.recompute

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches (dp × fsdp)."""
        return self.dp * self.fsdp

    def resolve(self, world: int | None = None) -> Layout:
        """Fill -1 factors from the world size, resolve defaults, and validate the factors."""
        lay = dataclasses.replace(self)
        free = [a for a in ("dp", "fsdp") if getattr(lay, a) == -1]
        for a in AXES + ("ep",):
            check_degree(a, getattr(lay, a))
        if len(free) > 1:
            raise FivefoldError("only one of --dp and --fsdp may be -1 (fill the rest)")
        if free:
            if world is None:
                raise FivefoldError(f"--{free[0]} -1 needs a world size (--gpus or --nproc)")
            rest = math.prod(getattr(lay, a) for a in AXES if a != free[0])
            if world % rest:
                raise FivefoldError(
                    f"cannot fill --{free[0]}: the other axes multiply to {rest}, which does not divide "
                    f"the world size {world}; use a world that {rest} divides ({rest}, {2 * rest}, "
                    f"{4 * rest}, ...) or degrees whose product divides {world}"
                )
            setattr(lay, free[0], world // rest)
        if world is not None and lay.world != world:
            raise FivefoldError(
                f"dp×fsdp×cp×tp×pp = {lay.dp}×{lay.fsdp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world} must equal "
                f"the world size {world}; e.g. set --fsdp -1 or --dp -1 to fill it, or use world "
                f"{lay.world}"
            )
        lay.order = complete_order(lay.order)
        if lay.zero == -1:
            lay.zero = 3 if lay.fsdp > 1 else 0
        if lay.zero not in (0, 1, 2, 3):
            raise FivefoldError(f"--zero must be 0, 1, 2 or 3, got {lay.zero}")
        if lay.fsdp > 1 and lay.zero in (0, 1):
            raise FivefoldError(
                f"--fsdp {lay.fsdp} shards parameters, so --zero must be 2 or 3 (got {lay.zero}); "
                "for a sharded optimizer on replicated params use --dp N --zero 1"
            )
        if (lay.fsdp * lay.cp) % lay.ep:
            # plain replicas can become sharded ones, which ep may then re-use
            shard_all = lay.dp > 1 and (lay.dp * lay.fsdp * lay.cp) % lay.ep == 0
            # sharded replicas take ZeRO 2 or 3: a ZeRO-1 layout's hint says so, not a pair it refuses
            zero = " --zero 2" if lay.zero == 1 else ""
            hint = (
                f", or shard the replicas too: --fsdp {lay.dp * lay.fsdp} --dp 1{zero}" if shard_all else ""
            )
            raise FivefoldError(
                f"--ep {lay.ep} must divide fsdp×cp = {lay.fsdp * lay.cp} (expert parallelism re-uses the "
                f"data-parallel ranks); valid ep: {suggest(divisors(lay.fsdp * lay.cp))}{hint}"
            )
        if lay.pp_schedule not in PP_SCHEDULES:
            raise FivefoldError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}")
        if lay.recompute not in RECOMPUTE:
            raise FivefoldError(f"--recompute must be one of {', '.join(RECOMPUTE)}")
        if (
            not isinstance(lay.recompute_layers, int)
            or isinstance(lay.recompute_layers, bool)
            or lay.recompute_layers < 0
        ):
            raise FivefoldError(
                f"--recompute-layers must be a count of blocks >= 0 (0: all), got {lay.recompute_layers!r}"
            )
        if lay.recompute_layers and lay.recompute != "full":
            raise FivefoldError(
                f"--recompute-layers {lay.recompute_layers} chooses how many blocks of each chunk full "
                f"recompute re-runs; add --recompute full (got --recompute {lay.recompute})"
            )
        if lay.cp_impl not in CP_IMPLS:
            raise FivefoldError(f"--cp-impl must be one of {', '.join(CP_IMPLS)}")
        if lay.virtual_stages < 1:
            raise FivefoldError("--virtual-stages must be >= 1")
        if lay.pp == 1 and lay.virtual_stages > 1:
            raise FivefoldError(
                f"--virtual-stages {lay.virtual_stages} splits each pipeline rank's layers into chunks and "
                "needs --pp > 1; add --pp or drop --virtual-stages"
            )
        if lay.pp_schedule in ("zbv", "dualpipev") and lay.pp > 1 and lay.virtual_stages not in (1, 2):
            raise FivefoldError(f"--pp-schedule {lay.pp_schedule} uses exactly 2 virtual stages per rank")
        if lay.pp_schedule in ("zbv", "dualpipev") and lay.pp > 1:
            lay.virtual_stages = 2
        if not isinstance(lay.pp_split, str):
            raise FivefoldError(f"--pp-split takes layer counts like 2,2; got {lay.pp_split!r}")
        given = split_fields(lay.pp_split)
        if given and len(given) != lay.pp * lay.virtual_stages:  # else a split for other stages is ignored
            raise FivefoldError(
                f"--pp-split {lay.pp_split} names {len(given)} chunks but pp × virtual_stages = "
                f"{lay.pp} × {lay.virtual_stages} = {lay.pp * lay.virtual_stages}; give that many layer "
                "counts, or the --pp (and --virtual-stages) this split is for"
            )
        if lay.microbatches < 0:
            raise FivefoldError(f"--microbatches must be >= 1 (or 0: the default), got {lay.microbatches}")
        if lay.microbatches == 0:
            lay.microbatches = max(lay.pp, 1) * (1 if lay.pp == 1 else 2)
        if lay.sp and lay.tp == 1:
            lay.sp = False  # sequence parallel is a TP refinement; nothing to shard without TP
        return lay

    def check_experts(self, model: ModelSpec) -> None:
        """--ep on a dense model: no other factor cures it, so it is checked before the world is split."""
        if self.ep > 1 and not model.is_moe:
            raise FivefoldError(
                f"--ep {self.ep} needs a mixture-of-experts model; {model.name} is dense (leave out --ep, "
                "or pick a model with experts: tiny-moe, mixtral-8x7b, qwen3-30b-a3b; deepseek-v3 plans only)"
            )

    def check_model(self, model: ModelSpec, seq_len: int | None = None, even_sp: bool = True) -> None:
        """Constraints that depend on the model's shape. `even_sp`: SP splits each sequence evenly over
        tp, as fivefold's runtime and Megatron do (XLA's partitioner pads; its published runs say no)."""
        if model.heads % self.tp:
            raise FivefoldError(
                f"--tp {self.tp} must divide the {model.heads} attention heads of {model.name}; "
                f"valid tp: {suggest(divisors(model.heads))}"
            )
        if self.tp > model.kv_heads and self.tp % model.kv_heads:
            valid = [d for d in divisors(model.heads) if d <= model.kv_heads or d % model.kv_heads == 0]
            raise FivefoldError(
                f"--tp {self.tp} exceeds kv_heads {model.kv_heads} but is not a multiple of it, so KV heads "
                f"cannot be replicated evenly; valid tp: {suggest(valid)}"
            )
        stages = self.pp * self.virtual_stages
        if stages > model.layers:
            if self.virtual_stages <= model.layers // 2:  # fewer stages would do
                valid = f"valid pp: {suggest(list(range(1, model.layers // self.virtual_stages + 1))[:12])}"
            else:  # no pipeline holds that many chunks: fewer chunks would do
                chunks = list(range(1, model.layers // self.pp + 1))[:12]
                valid = f"valid virtual-stages with pp {self.pp}: {suggest(chunks)}"
            raise FivefoldError(
                f"--pp {self.pp} × --virtual-stages {self.virtual_stages} = {stages} stages exceeds the "
                f"{model.layers} layers of {model.name}; {valid}"
            )
        if self.ep > 1:
            self.check_experts(model)
            if model.experts % self.ep:
                raise FivefoldError(
                    f"--ep {self.ep} must divide the {model.experts} experts of {model.name}; "
                    f"valid ep: {suggest(divisors(model.experts))}"
                )
        if seq_len is not None and self.cp > 1:
            need = 2 * self.cp if self.cp_impl == "ring" else self.cp
            if seq_len % need:
                raise FivefoldError(
                    f"--seq-len {seq_len} must be divisible by {need} for --cp {self.cp} ({self.cp_impl}: "
                    f"{'two chunks per rank, for balance' if self.cp_impl == 'ring' else 'a chunk per rank'})"
                )
            if self.cp_impl == "ulysses" and model.heads % (self.cp * self.tp):
                raise FivefoldError(
                    f"--cp-impl ulysses splits heads: cp×tp = {self.cp * self.tp} must divide "
                    f"{model.heads} heads"
                )
        if even_sp and seq_len is not None and self.sp and self.tp > 1 and (seq_len // self.cp) % self.tp:
            # uneven shards would be padded by DTensor, in every collective and every pipeline send
            need = math.lcm(self.tp * self.cp, 2 * self.cp if self.cp > 1 and self.cp_impl == "ring" else 1)
            near = sorted({max(need, seq_len // need * need), -(-seq_len // need) * need})
            raise FivefoldError(
                f"--sp shards each sequence's {seq_len // self.cp} tokens (per cp rank) over --tp "
                f"{self.tp}: --seq-len must be a multiple of {need}, e.g. {' or '.join(map(str, near))}"
            )
