"""Published training runs (`fivefold-reference-runs` TOML) turned into planner inputs.

A run states its model, hardware, layout and what it measured; keys it does not publish are absent
(never zero) and listed under `unknown`. The planner needs a few of them; those it fills with the
defaults a practitioner would use (`FILL` below), never with a value that only makes the prediction
better. A run that lacks a field the planner cannot do without, or whose facts contradict each other
(world size ≠ product of the axes, batch not divisible), raises one `FivefoldError` line naming the
run and the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fivefold.config import CP_IMPLS, HardwareSpec, Layout, ModelSpec, load_hardware
from fivefold.config.files import read_settings_text
from fivefold.config.hardware import GPU_NAME_PRESETS, preset_for_gpu_name
from fivefold.config.run import MAX_BATCH
from fivefold.errors import FivefoldError, did_you_mean, reason
from fivefold.plan.spec import ATTENTION, TrainShape
from fivefold.plan.trainers import (
    FIRST_SP_YEAR,
    TRAINERS,
    named_trainer,
    published_trainer,
    runs_on_xla,
    shape_facts,
)

BUILTIN = ("published_runs.toml", "public_runs_2.toml")  # the bundled reference sets
FILL = {  # what an unpublished layout field defaults to (see docs/planner.md, "Unknowns")
    "micro_batch": 1,
    "vocab": 32000,
}
SHAPE_KEYS = (
    "layers",
    "hidden",
    "heads",
    "vocab",
    "ffn_hidden",
    "kv_heads",
    "head_dim",
    "experts",
    "experts_per_token",
    "expert_ffn_hidden",
    "shared_experts",
    "moe_layers",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
)


MOE_KEYS = ("experts_per_token", "expert_ffn_hidden", "shared_experts", "moe_layers")  # beside `experts`

# a key under the name another framework's config gives it (HF's, Megatron's arguments) -> this file's,
# read as the key it names where the run does not also state that one
ALIASES = {
    "model": {
        "num_layers": "layers",
        "num_hidden_layers": "layers",
        "hidden_size": "hidden",
        "num_attention_heads": "heads",
        "num_key_value_heads": "kv_heads",
        "num_query_groups": "kv_heads",
        "ffn_hidden_size": "ffn_hidden",
        "intermediate_size": "ffn_hidden",
        "vocab_size": "vocab",
        "seq_length": "seq_len",
        "sequence_length": "seq_len",
        "max_position_embeddings": "seq_len",
        "num_experts": "experts",
        "num_local_experts": "experts",
        "n_routed_experts": "experts",
        "num_experts_per_tok": "experts_per_token",
        "top_k": "experts_per_token",
        "moe_ffn_hidden_size": "expert_ffn_hidden",
        "moe_intermediate_size": "expert_ffn_hidden",
    },
    "layout": {
        "global_batch_size": "global_batch",
        "micro_batch_size": "micro_batch",
        "tensor_parallel": "tp",
        "tensor_model_parallel_size": "tp",
        "pipeline_parallel": "pp",
        "pipeline_model_parallel_size": "pp",
        "context_parallel": "cp",
        "context_parallel_size": "cp",
        "expert_parallel": "ep",
        "expert_model_parallel_size": "ep",
        "data_parallel": "dp",
        "gradient_accumulation_steps": "grad_accum",
        "zero": "zero_stage",
        "virtual_pipeline_model_parallel_size": "virtual_stages",
    },
}


def with_aliases(run: dict[str, Any]) -> dict[str, Any]:
    """`run` with each aliased key (ALIASES) under this file's name, where that one is not stated."""
    out = dict(run)
    for table, names in ALIASES.items():
        data = run.get(table)
        if not isinstance(data, dict) or not any(k in data for k in names):
            continue
        renamed = dict(data)
        for alias, key in names.items():
            if alias in renamed and key not in renamed:
                renamed[key] = renamed.pop(alias)
        out[table] = renamed
    return out


def unread_keys(run: dict[str, Any]) -> list[str]:
    """One line for each key of the run the reader does not take: planned as if it were not there."""
    out = []
    for table, known in KNOWN_KEYS.items():
        data = run if table == "run" else run.get(table)
        if not known or not isinstance(data, dict):
            continue
        for key in data:
            if key in known or key.startswith("_") or (table == "run" and isinstance(data[key], dict)):
                continue
            where = key if table == "run" else f"{table}.{key}"
            out.append(f"run {run['id']}: {where} is not read (planned without it){did_you_mean(key, known)}")
    return out


def builtin_paths() -> list[Path]:
    base = resources.files("fivefold") / "presets" / "runs"
    return [Path(str(base / name)) for name in BUILTIN]


RUNS_FORMAT, RUNS_VERSION = "fivefold-reference-runs", 1  # the `format` and `version` a runs file may state


MAX_ID = 200  # characters in a run's id (a directory's name is at most 255 bytes)


def _shown(text: str) -> str:
    """A run's id as an error may print it: escapes visible, at most 60 characters."""
    shown = ascii(text)[1:-1] if not text.isprintable() else text
    return shown if len(shown) <= 60 else shown[:50] + f"... ({len(text):,} characters)"


def load_runs(*paths: str | Path) -> list[dict[str, Any]]:
    """Every `[[run]]` of the files, each tagged with `_file`; one line on a malformed file."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            what = "not a regular file" if p.exists() else "not found"
            if not p.exists() and p.is_symlink():  # dangling, or a loop of links
                what = "a symbolic link to nothing readable (missing, or leading back to itself)"
            raise FivefoldError(f"runs file {p}: {what}")
        text = read_settings_text(p, "runs file")  # bounded: not a settings file beyond 16 MB
        try:
            data = tomllib.loads(text)
        except (ValueError, RecursionError) as exc:  # not TOML, a 5000-digit number, deep nesting
            raise FivefoldError(f"runs file {p}: not valid TOML ({reason(exc)})") from None
        # a file that says what it is must say this format: another schema read as this one would
        # be planned from fields that mean something else
        if data.get("format", RUNS_FORMAT) != RUNS_FORMAT:
            raise FivefoldError(f"runs file {p}: format {data['format']!r} is not {RUNS_FORMAT!r}")
        version = data.get("version", RUNS_VERSION)  # `true` and 1.0 equal 1 in Python, not in TOML
        if type(version) is not int or version != RUNS_VERSION:
            raise FivefoldError(
                f"runs file {p}: version {data['version']!r}; this fivefold reads version {RUNS_VERSION}"
            )
        if not isinstance(data.get("run"), list) or not data["run"]:
            raise FivefoldError(f"runs file {p}: no [[run]] tables (format fivefold-reference-runs)")
        for i, run in enumerate(data["run"]):
            if not isinstance(run, dict):
                raise FivefoldError(f"runs file {p}: run #{i + 1} is not a table ([[run]]), got {run!r}")
            name = _shown(run["id"]) if isinstance(run.get("id"), str) else run.get("id", f"#{i + 1}")
            for key in ("id", "source", "model", "layout", "measured"):
                if key not in run:
                    raise FivefoldError(f"runs file {p}: run {name} has no {key!r}")
            for key in ("id", "source"):
                if not isinstance(run[key], str) or not run[key].strip():
                    raise FivefoldError(f"runs file {p}: run {name}: {key} must be a non-empty string")
                # both are printed in tables and errors: a newline or an escape sequence would forge or
                # garble a line of them, 10 kB of id would push every column off the screen
                if not run[key].isprintable():
                    raise FivefoldError(
                        f"runs file {p}: run {_shown(run['id'])}: {key} has a control character "
                        "(a newline, tab or escape); ids and sources are one line of text"
                    )
            if len(run["id"]) > MAX_ID:
                raise FivefoldError(
                    f"runs file {p}: run {_shown(run['id'])}: id is {len(run['id']):,} characters; "
                    f"at most {MAX_ID}"
                )
            for key in ("model", "layout", "measured", "hardware"):
                if key in run and not isinstance(run[key], dict):
                    raise FivefoldError(f"runs file {p}: run {name}: {key} must be a table ([run.{key}])")
            kind = run.get("kind", "measured")  # a file of one's own runs need not say they were measured
            if not isinstance(kind, str):
                raise FivefoldError(
                    f'runs file {p}: run {name}: kind must be "measured", "mixed" or "analytic", got {kind!r}'
                )
            if any(r["id"] == run["id"] for r in runs):
                raise FivefoldError(f"runs file {p}: run id {run['id']!r} is given twice; ids must be unique")
            basis = run["measured"].get("tflops_basis")
            if isinstance(
                basis, str
            ):  # "Hardware", "model FLOPs", "hardware (incl. recompute)": its first word
                word = basis.strip().lower().split(" ")[0].strip(",;:()")
                if word in ("model", "hardware"):
                    run = {**run, "measured": {**run["measured"], "tflops_basis": word}}
            runs.append(with_aliases({**run, "kind": kind, "_file": str(p)}))
    return runs


def published_year(run: dict[str, Any]) -> int | None:
    """The year a run was published, read from its `source` ("Korthikanti et al. 2022",
    "README @50a4b5fa (2021-04-08)", "2022-07-26-deepspeed-azure.md", "llama3_h100_202412_..."): the
    latest plausible year named, or None where it names none."""
    source = str(run.get("source", ""))
    years = [int(y) for y in re.findall(r"(?<!\d)(20[12]\d)(?:\d\d)?(?!\d)", source)]
    # an arXiv id (2211.05100, arxiv.org/abs/2407.21783) begins with its year and month
    years += [
        2000 + int(y) for y in re.findall(r"arxiv[.:/a-z]*?(\d\d)(?:0[1-9]|1[0-2])\.\d{4,5}", source.lower())
    ]
    return max(years) if years else None


# a FLOP count's word against the causal half, up to three words before "causal": "no causal halving",
# "non-causal", "without causal masking", "not halved for causality"
NOT_CAUSAL = re.compile(r"\bnon-?causal|\b(?:non|no|not|without)\b(?:[\s_-]+[a-z]+){0,3}?[\s_-]+causal")


def counts_causal_half(run: dict[str, Any]) -> bool:
    """Whether the source counts attention's FLOPs for the causal half of the scores only: its
    flops_definition speaks of the causal mask and does not say it is not taken."""
    definition = str(run.get("flops_definition", "")).lower()
    return "causal" in definition and not NOT_CAUSAL.search(definition)


def states_fp8(precision: str) -> bool:
    """Whether a run's precision says its linears ran in fp8 ("fp8 (TE hybrid)", "bf16 + float8
    linears"), and not that they did not ("bf16, no fp8", "without fp8")."""
    low = precision.lower()
    named = re.search(r"fp8|float8", low)
    return bool(named) and not re.search(r"\b(?:no|not|without|non)\b[\s_-]*(?:fp8|float8)", low)


def source_of(run: dict[str, Any]) -> str:
    """The publisher a run comes from: a repository (owner/name) or a paper's first author, whole
    where the source cites a paper by it ("Le Scao et al. 2022" is Le Scao's, not Le's)."""
    text = str(run["source"]).strip()
    cited = re.match(r"([^,;()]+?)\s+et al\b", text)
    if cited:
        return cited.group(1).strip()
    return text.split()[0].rstrip(",") if text else ""


def trainer_name(run: dict[str, Any]) -> str:
    """The key of TRAINERS whose facts a run's trainer has: fivefold's own run directories, a bundled
    source, or a trainer the run's source or framework names; otherwise its source (no known facts)."""
    framework = str(run.get("layout", {}).get("framework", "")).lower()
    if framework == "fivefold":
        return "fivefold"
    source = source_of(run)
    if source in TRAINERS:
        return source
    return named_trainer(f"{framework} {run.get('source', '')}") or source


def _need(run: dict[str, Any], table: str, key: str) -> Any:
    data = run.get(table, {})
    if key in data:
        return data[key]
    raise FivefoldError(f"run {run['id']}: {table}.{key} is missing (needed to plan it)")


MAX_COUNT = MAX_BATCH  # the largest count a run may state (the CLI's ceiling on --global-batch, --seq-len)


def _int(run: dict[str, Any], table: str, key: str, value: Any) -> int:
    try:
        out = int(value)
        if isinstance(value, bool) or out != value and not isinstance(value, str):
            raise ValueError  # true, 2.5: not a count
    except (TypeError, ValueError, OverflowError):  # OverflowError: inf
        raise FivefoldError(f"run {run['id']}: {table}.{key} must be an integer, got {value!r}") from None
    if out <= 0:
        raise FivefoldError(f"run {run['id']}: {table}.{key} must be positive, got {out}")
    # no layer count, batch, sequence or world comes near this; beyond it the planner's float arithmetic
    # overflows (1e308 tokens) and a message would print a 300-digit number
    if out > MAX_COUNT:
        big = isinstance(value, float) or out < 1e300  # (a float of it would overflow)
        got = f"{float(value):.3g}" if big else f"a {len(str(out))}-digit number"
        raise FivefoldError(f"run {run['id']}: {table}.{key} must be at most {MAX_COUNT:,}, got {got}")
    return out


def _count(run: dict[str, Any], table: str, key: str) -> int | None:
    """A positive integer the run states under `table.key`, or None where it states none."""
    value = (run.get(table) or {}).get(key)
    return None if value is None else _int(run, table, key, value)


# a runs file's [run.hardware] keys -> the HardwareSpec fields they set, and how they are read
HARDWARE_KEYS = (
    ("peak_bf16_tflops", "peak_tflops", float),
    ("gpu_memory_gb", "gpu_memory_gb", float),
    ("gpus_per_node", "gpus_per_node", int),
    ("inter_node_gbs_per_gpu", "inter_node_gbps", float),
    ("intra_node_gbs_per_gpu", "intra_node_gbps", float),
    ("hbm_gbs", "hbm_gbps", float),
    ("power_limit_w", "power_limit_w", float),
    # a CPU run's threads per rank (`run.json` of a fivefold run directory)
    ("threads_per_rank", "threads_per_rank", float),
)

# every key the reader takes or the reference files state (read or kept as a record), per table: a key
# outside it is named once, with the one it most likely meant (`unread_keys`)
KNOWN_KEYS = {
    "run": {"id", "source", "kind", "flops_definition", "notes", "uncertain", "unknown"},
    # the hardware a plan reads (HARDWARE_KEYS) and what the reference files record beside it
    "hardware": {key for key, _, _ in HARDWARE_KEYS}
    | {"gpu", "peak_fp8_tflops", "cluster", "inter_node", "intra_node", "host_pcie"}
    | {"host_memory_tb_per_node"},
    "model": set(SHAPE_KEYS)
    | {
        "arch",
        "seq_len",
        "tie_word_embeddings",
        "tie_embeddings",
        "moe_experts",
        "moe_topk",
        "params",
        "params_b",
        "attention_bias",
        "qk_norm",
        "mlp",
        "name",
    },
    "layout": {
        "gpus",
        "dp",
        "fsdp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero_stage",
        "sequence_parallel",
        "micro_batch",
        "global_batch",
        "global_batch_tokens",
        "grad_accum",
        "local_batch",
        "pipeline_schedule",
        "virtual_stages",
        "layers_per_virtual_stage",
        "recompute",
        "activation_checkpointing",
        "recompute_layers",
        "recompute_policy",
        "cp_impl",
        "precision",
        "framework",
        "torch_compile",
        "torch_version",
        "async_tp",
        "attention",
        "cpu_offload",
        "offload_optimizer",
        "activation_cpu_offload",
        "distributed_optimizer",
        "fsdp_mixed_precision",
        "optimizer",
        "optimizer_bytes_per_param",
        "optimizer_state_dtype",
        "sharding_strategy",
    },
    "measured": set(),  # its keys are the source's to name (a throughput, memory, per-layer times)
}


def hardware(run: dict[str, Any]) -> HardwareSpec:
    """The run's GPU: the matching preset with the run's published numbers laid over it, or, for a GPU
    without a preset, a spec from the run alone (the planner's default knobs)."""
    table = run.get("hardware", {})
    if not isinstance(table, dict):
        raise FivefoldError(f"run {run['id']}: hardware must be a table ([run.hardware]), got {table!r}")
    gpu = table.get("gpu", "")
    if not isinstance(gpu, str):  # a table's text would be searched for a GPU's name
        raise FivefoldError(f'run {run["id"]}: hardware.gpu must be a name like "H100 80GB", got {gpu!r}')
    fp8_peak = table.get("peak_fp8_tflops")
    if fp8_peak is not None and not _positive_number(fp8_peak):  # an fp8 row's MFU is divided by it
        raise FivefoldError(
            f"run {run['id']}: hardware.peak_fp8_tflops must be a positive number, got {fp8_peak!r}"
        )
    preset = preset_for_gpu_name(gpu)
    changes: dict[str, Any] = {}
    for key, field_name, kind in HARDWARE_KEYS:
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise FivefoldError(f"run {run['id']}: hardware.{key} must be a number, got {value!r}")
            # 8.5 GPUs a node would be read as 8
            if kind is int and isinstance(value, float) and math.isfinite(value) and not value.is_integer():
                raise FivefoldError(f"run {run['id']}: hardware.{key} must be a whole number, got {value!r}")
            try:
                changes[field_name] = kind(value)
            except (ValueError, OverflowError):  # "fast", or inf where a count belongs
                raise FivefoldError(
                    f"run {run['id']}: hardware.{key} must be a number, got {value!r}"
                ) from None
    if "gpu_memory_gb" not in changes and preset is not None:
        sized = re.search(r"(\d+)\s*GI?B", gpu.upper())  # "V100 16GB", "A100-SXM4-40GB", "A100 (40 GiB)"
        if sized and 8 <= int(sized.group(1)) <= 512:  # one device's memory, not a node's
            changes["gpu_memory_gb"] = float(sized.group(1))
    if preset is None:
        if "peak_tflops" not in changes or "gpu_memory_gb" not in changes:
            raise FivefoldError(
                f"run {run['id']}: hardware.gpu {gpu!r} has no preset; give hardware.peak_bf16_tflops "
                "and hardware.gpu_memory_gb"
            )
        spec = HardwareSpec(name=gpu or "gpu", **changes)
    else:
        base = load_hardware(preset)
        memory = changes.get("gpu_memory_gb")
        if memory is not None and memory != base.gpu_memory_gb:
            # the name a plan prints says the memory the run had ("h100-96gb", not the preset's 80)
            changes["name"] = re.sub(r"-\d+gb$", "", base.name) + f"-{memory:g}gb"
        spec = dataclasses.replace(base, **changes)
    try:
        return spec.validate()
    except FivefoldError as exc:  # named as the runs file names it: hardware.hbm_gbs, not hbm_gbps
        message = str(exc).replace(f"hardware {spec.name}: ", "hardware.", 1)
        for key, field_name, _ in HARDWARE_KEYS:
            message = message.replace(f"hardware.{field_name} ", f"hardware.{key} ", 1)
        raise FivefoldError(f"run {run['id']}: {message}") from None


def family(hw: HardwareSpec) -> str:
    """The GPU generation a run's matmul knob belongs to: a100 (A100/A800), hopper (H100/H200/H800/H20)
    or other."""
    name = hw.name.lower()
    if "a100" in name or name.startswith("a800"):
        return "a100"
    if name.startswith(("h100", "h200", "h800", "h20")) or "hopper" in name:
        return "hopper"
    return "other"


# what a runs file may call its pipeline schedule (letters and digits only, lower case): any name
# holding one of these words
SCHEDULE_WORDS = (
    "1f1b",
    "interleav",
    "gpipe",
    "afab",
    "allforwardallbackward",
    "fthenb",
    "pipedream",
    "zerobubble",
    "zb",
    "dualpipe",
    "vpp",  # Megatron's virtual pipeline, torchtitan's looped breadth-first: chunks a rank
    "virtual",
    "bfs",
    "breadthfirst",
)
CHUNKED_WORDS = ("interleav", "vpp", "virtual", "bfs", "breadthfirst")
# a run's recompute: Megatron's three policies, or MaxText's named ("custom") ones between them
RECOMPUTE_WORDS = ("none", "selective", "full", "custom")
RECOMPUTE_YES_NO = {"true": "full", "yes": "full", "on": "full", "false": "none", "no": "none", "off": "none"}
# the technique's own names, said without a policy, checkpoint every block ("activation checkpointing",
# "gradient checkpointing", "remat"); a policy or a no before them is read first
RECOMPUTE_YES_NO |= {"activation": "full", "checkpointing": "full", "gradient": "full", "remat": "full"}


def _schedule(value: Any, pp: int, v: int) -> str:
    if value is not None and not isinstance(value, str):
        raise FivefoldError(f'must be a name like "1F1B" or "interleaved-1F1B", got {value!r}')
    s = "".join(ch for ch in str(value or "1f1b").lower() if ch.isalnum())
    if not any(word in s for word in SCHEDULE_WORDS):
        raise FivefoldError(
            f"{value!r} names no schedule fivefold knows: give one of 1F1B, interleaved-1F1B, GPipe "
            "(all-forward-all-backward), ZB-H1 (zero bubble), ZB-V, DualPipe"
        )
    if "dualpipe" in s:  # DualPipe and its V-shaped half: both overlap a chunk's all-to-all with another's
        return "dualpipev"
    if "zbv" in s or "zerobubblev" in s:  # two chunks a rank in a V, whatever v the run states
        return "zbv"
    denied = re.search(r"(?:non|no|not|without)(?:interleav|virtual|vpp)", s)  # "non-interleaved 1F1B"
    if pp > 1 and (v > 1 or (any(word in s for word in CHUNKED_WORDS) and not denied)):
        return "interleaved-1f1b" if "zero" not in s and "zb" not in s else "zero-bubble"
    if "zero" in s or s.startswith("zb"):
        return "zero-bubble"
    return "gpipe" if any(w in s for w in ("gpipe", "afab", "allforwardallbackward", "fthenb")) else "1f1b"


# a run's context-parallel attention in its source's words: the all-gather of keys and values (Llama 3's
# "all-gather based"), heads exchanged all-to-all (DeepSpeed-Ulysses), or blocks passed round a ring
# (ring attention, Megatron's and torchtitan's p2p; zigzag is a ring's causal balancing), tested in that order
CP_IMPL_WORDS = (
    (("allgather",), "allgather"),
    (("ulysses", "alltoall", "a2a"), "ulysses"),
    (("ring", "p2p", "zigzag"), "ring"),
)


def _cp_impl(value: Any) -> str:
    if value is None:
        return "ring"  # published runs: ring unless stated
    s = "".join(ch for ch in str(value).lower() if ch.isalnum()) if isinstance(value, str) else ""
    found = next((impl for words, impl in CP_IMPL_WORDS if any(w in s for w in words)), None)
    if found is None:
        raise FivefoldError(
            f"must name one of {', '.join(CP_IMPLS)} (all-gather, all-to-all, p2p and zigzag read too), "
            f"got {value!r}"
        )
    return found


@dataclass
class RunInputs:
    model: ModelSpec
    hw: HardwareSpec
    layout: Layout
    shape: TrainShape
    recompute_known: bool  # False: the planner picks the least recompute that fits
    offload_known: bool = True  # False: optimizer offload unpublished; tried when nothing else fits
    # other layout facts the run does not publish (micro_batch, pipeline_schedule, zero_stage):
    # the planner fills them with its own best choice (plan/validation.py, `fill`)
    free: tuple[str, ...] = ()
    interleaved: bool = True  # whether the trainer can run an interleaved pipeline, if unpublished
    selective: bool = True  # whether the trainer had selective recompute, if the recompute is unpublished


# keys whose value is read as a yes or no, and keys read as words (a list or a number there would be
# read as its text: `torch_compile = "no"` as compiled, `precision = ["fp8"]` as 16-bit)
FLAG_KEYS = (("layout", "torch_compile"), ("layout", "async_tp"))
WORD_KEYS = (("layout", "precision"), ("layout", "framework"), ("layout", "attention"), ("model", "arch"))


def _check_kinds(run: dict[str, Any]) -> None:
    """One line for a flag that is not true or false, or a word that is not a string."""
    for table, key in FLAG_KEYS:
        value = run.get(table, {}).get(key)
        if value is not None and not isinstance(value, bool):
            raise FivefoldError(f"run {run['id']}: {table}.{key} must be true or false, got {value!r}")
    for table, key in WORD_KEYS:
        value = run.get(table, {}).get(key)
        if value is not None and not isinstance(value, str):
            raise FivefoldError(f"run {run['id']}: {table}.{key} must be a string, got {value!r}")
    for key in ("cpu_offload", "offload_optimizer"):
        value = run.get("layout", {}).get(key)
        if value is not None and not isinstance(value, (bool, str)):
            raise FivefoldError(
                f'run {run["id"]}: layout.{key} must be true, false or a word like "optimizer", got {value!r}'
            )


def build(run: dict[str, Any]) -> RunInputs | None:
    """The planner's inputs for a run, or None for a memory-only example without a model shape."""
    mt, lt = run.get("model", {}), run.get("layout", {})
    if "layers" not in mt:
        return None
    rid = run["id"]
    shape_vals = {k: mt[k] for k in SHAPE_KEYS if k in mt}
    if "moe_experts" in mt:  # a file that names the MoE keys after the paper
        shape_vals.setdefault("experts", mt["moe_experts"])
        shape_vals.setdefault("experts_per_token", mt.get("moe_topk", 1))
    if shape_vals.get("experts") and mt.get("ffn_hidden"):
        # an expert without its own width has the model's (Mixtral's, Switch's): `ffn_hidden` is the
        # experts' when every MLP is a mixture
        shape_vals.setdefault("expert_ffn_hidden", mt["ffn_hidden"])
    for key in ("layers", "hidden", "heads"):
        _need(run, "model", key)
    # the keys of a mixture of experts without its expert count: a dense model would be planned in silence
    half = [k for k in MOE_KEYS if shape_vals.get(k)] + (["moe_topk"] if mt.get("moe_topk") else [])
    half = half if not shape_vals.get("experts") else []
    if half:
        raise FivefoldError(
            f"run {rid}: model.{half[0]} describes experts, but model.experts (how many) is not given"
        )
    if "vocab" not in shape_vals:
        shape_vals["vocab"] = FILL["vocab"]  # the head is a few % of a large model's FLOPs
    if "ffn_hidden" not in shape_vals:
        shape_vals["ffn_hidden"] = 4 * int(mt["hidden"])
    ints = {k: _int(run, "model", k, v) for k, v in shape_vals.items()}
    tied = mt.get("tie_embeddings", mt.get("tie_word_embeddings", False))  # fivefold's name, or HF's
    if not isinstance(tied, bool):
        raise FivefoldError(f"run {rid}: model.tie_embeddings must be true or false, got {tied!r}")
    try:
        model = ModelSpec(name=rid, tie_embeddings=tied, **ints).validate()
    except FivefoldError as exc:
        raise FivefoldError(f"run {rid}: {exc}") from None
    gpus = _int(run, "layout", "gpus", _need(run, "layout", "gpus"))

    def axis(key: str, default: int) -> int:
        return _int(run, "layout", key, lt[key]) if key in lt else default

    pp = axis("pp", 1)
    v = axis("virtual_stages", 1)  # checked whatever pp is
    v = v if pp > 1 else 1
    try:
        schedule = _schedule(lt.get("pipeline_schedule"), pp, v)
    except FivefoldError as exc:
        raise FivefoldError(f"run {rid}: layout.pipeline_schedule {exc}") from None
    if schedule == "interleaved-1f1b" and v < 2:
        v = 2  # an interleaved schedule without a published chunk count: torch's and Megatron's least
    ep, cp, tp = axis("ep", 1), axis("cp", 1), axis("tp", 1)
    fsdp = axis("fsdp", 1)
    dp = axis("dp", -1 if "fsdp" not in lt else 1)
    _check_kinds(run)
    if "zero_stage" in lt:
        zero = lt["zero_stage"]
        if not isinstance(zero, int) or isinstance(zero, bool) or zero not in (0, 1, 2, 3):
            raise FivefoldError(f"run {rid}: layout.zero_stage must be 0, 1, 2 or 3, got {zero!r}")
    else:  # unpublished: FSDP shards everything, Megatron/NeMo use the distributed optimizer
        zero = 3 if fsdp > 1 else (1 if dp != 1 else 0)
        if zero == 3 and pp > 1:  # with a pipeline FSDP keeps the weights gathered across the
            zero = 2  # micro-batches (torchtitan's default there, Llama 3's "no reshard after forward")
    if ep > 1 and (fsdp * cp) % ep:  # experts fold onto sharded data ranks in fivefold's vocabulary
        dp, fsdp, zero = 1, -1 if dp == -1 else dp, max(zero, 2)
    # DeepSpeed's ZeRO-2 stated over the data ranks keeps every weight whole on every rank and
    # gathers the updated shards once a step; FSDP's SHARD_GRAD_OP (a run's `fsdp` axis) gathers them
    # again for every micro-batch
    params_kept = zero == 2 and fsdp == 1 and dp > 1
    if zero >= 2 and fsdp == 1 and dp > 1:  # ZeRO-2/3 over the data ranks is fsdp in fivefold's words
        dp, fsdp = 1, dp
    sp = lt.get("sequence_parallel")
    if sp is not None and not isinstance(sp, bool):
        raise FivefoldError(f"run {rid}: layout.sequence_parallel must be true or false, got {sp!r}")
    # Megatron/NeMo/torchtitan turn SP on with TP. A run published before its trainer had SP (and
    # selective recompute, which came with it) replicated its norms, dropout and residuals over tp;
    # XLA's partitioner shards activations wherever it pays, whatever the year
    name, year = trainer_name(run), published_year(run)
    since = int(TRAINERS.get(name, {}).get("sp_since", FIRST_SP_YEAR))
    had_sp = year is None or year >= since or _on_xla(run)
    sp = sp if sp is not None else tp > 1 and had_sp
    listed = run.get("unknown", [])
    if not isinstance(listed, list) or not all(isinstance(k, str) for k in listed):
        raise FivefoldError(f'run {rid}: unknown must be a list of field names, like ["micro_batch"]')
    unknown = {k.lower() for k in listed}
    # the policy's word, whatever follows it ("full (uniform)", "selective, attention only"); a yes or
    # no (`activation_checkpointing = true`, as MosaicML's tables say) checkpoints every block or none
    key = (
        "recompute"
        if "recompute" in lt or "activation_checkpointing" not in lt
        else "activation_checkpointing"
    )
    raw = lt.get(key, "none")
    raw = ("full" if raw else "none") if isinstance(raw, bool) else raw
    rc = re.split(r"[^a-z]", str(raw).lower().strip() + " ")[0]
    rc = RECOMPUTE_YES_NO.get(rc, rc)
    if rc not in RECOMPUTE_WORDS:
        raise FivefoldError(
            f"run {rid}: layout.{key} must be one of {', '.join(RECOMPUTE_WORDS)} (or true/false), "
            f"got {lt[key]!r}"
        )
    # unpublished, or a policy outside the three (MaxText's "custom" remat): the planner picks
    recompute_known = key in lt and key not in unknown and rc in ("none", "selective", "full")
    rc = rc if recompute_known else "none"
    # full recompute of only the first N blocks of each chunk (Megatron's --recompute-num-layers)
    rc_layers = lt.get("recompute_layers", 0)
    if rc_layers != 0:  # 0 (all blocks) or a positive count
        rc_layers = _int(run, "layout", "recompute_layers", rc_layers)
    if rc_layers and rc != "full":
        raise FivefoldError(f'run {rid}: layout.recompute_layers = {rc_layers} needs recompute = "full"')
    try:
        cp_impl = _cp_impl(lt.get("cp_impl"))
    except FivefoldError as exc:
        raise FivefoldError(f"run {rid}: layout.cp_impl {exc}") from None
    layout = Layout(
        dp=dp,
        fsdp=fsdp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        cp_impl=cp_impl,
        zero=zero,
        sp=sp and tp > 1,
        pp_schedule=schedule,
        virtual_stages=v,
        recompute=rc,
        recompute_layers=rc_layers,
    )
    try:
        layout = layout.resolve(gpus)
    except FivefoldError as exc:
        raise FivefoldError(f"run {rid}: layout contradicts gpus = {gpus}: {exc}") from None
    seq = mt.get("seq_len") or lt.get("seq_len")
    if not seq:
        raise FivefoldError(f"run {rid}: model.seq_len is missing (needed to plan it)")
    seq = _int(run, "model", "seq_len", seq)
    data = layout.dp * layout.fsdp
    mb = _int(run, "layout", "micro_batch", lt.get("micro_batch", FILL["micro_batch"]))
    accumulation = _int(run, "layout", "grad_accum", lt.get("grad_accum", 1))
    batch_published = True
    if lt.get("global_batch"):
        batch = _int(run, "layout", "global_batch", lt["global_batch"])
    elif lt.get("global_batch_tokens"):
        batch = _int(run, "layout", "global_batch_tokens", lt["global_batch_tokens"]) // seq
        if batch < 1:
            raise FivefoldError(
                f"run {rid}: layout.global_batch_tokens {lt['global_batch_tokens']} is less than one "
                f"sequence of {seq} tokens"
            )
    elif lt.get("local_batch"):
        batch = _int(run, "layout", "local_batch", lt["local_batch"]) * data
    else:  # unpublished: the micro-batches a data rank accumulates (one, unless the run says)
        batch, batch_published = mb * data * accumulation, False
    if batch % data:
        raise FivefoldError(
            f"run {rid}: global_batch {batch} is not a multiple of the data-parallel ranks {data}"
        )
    if (batch // data) % mb:
        mb = 1  # a published micro-batch that does not divide the local batch (a short last one)
    precision = str(lt.get("precision", "")).lower()
    gpu_name = str(run.get("hardware", {}).get("gpu", ""))
    torch_version = str(lt["torch_version"]) if "torch_version" in lt else None
    trainer, attention = published_trainer(name, gpu_name, str(lt.get("framework", "")), year, torch_version)
    arch = str(mt.get("arch", "")).lower()
    gated = any(w in arch for w in ("swiglu", "geglu", "swi-glu"))
    plain = any(w in arch for w in ("gelu", "relu", "mpt")) or arch.startswith("gpt")
    facts = shape_facts(trainer)
    uneven = (seq // layout.cp) % layout.tp
    if lt.get("sequence_parallel") is None and layout.sp and uneven and not facts["sp_any_length"]:
        # Megatron's SP splits each sequence evenly over tp: a run whose tp does not divide it shards
        # its activations some other way, or not at all (XLA's partitioner pads: `sp_any_length`)
        layout = dataclasses.replace(layout, sp=False)
    facts["fused"] = bool(lt.get("torch_compile", facts["fused"]))
    # a compiled fivefold run keeps what its fused kernels keep, not its eager code's tensors
    facts["saved_as_eager"] = facts["saved_as_eager"] and not lt.get("torch_compile", False)
    facts["tp_overlap"] = bool(lt.get("async_tp", facts["tp_overlap"]))
    if "attention" in lt and lt["attention"] not in ATTENTION:
        valid = ", ".join(ATTENTION)
        raise FivefoldError(f"run {rid}: layout.attention must be one of {valid}, got {lt['attention']!r}")
    shape = TrainShape(
        block="llama" if gated else ("gpt" if plain else "auto"),
        seq_len=seq,
        global_batch=batch,
        micro_batch=mb,
        attention=str(lt.get("attention", attention)),
        fp8=states_fp8(precision),
        # an fp32 run (fivefold's default on a CPU) computes, gathers and sends 4-byte elements;
        # mixed precision ("bf16", "amp_fp8", ...) 16-bit ones
        act_bytes=STATE_DTYPE_BYTES.get(precision, 2),
        param_bytes=STATE_DTYPE_BYTES.get(precision, 2),
        optimizer_bytes=optimizer_bytes(run),
        # published MoE runs (Megatron and the like) split the experts over tp too; fivefold's runtime
        # keeps the MoE block whole on every tp rank
        expert_tp=bool(trainer.get("expert_tp", True)),
        offload_optimizer=_offload(lt.get("cpu_offload", lt.get("offload_optimizer", False))),
        params_kept=params_kept,
        sac="op" if str(lt.get("recompute_policy", "")).lower().startswith("op") else "attention",
        **facts,
    )
    offload_known = not ({"cpu_offload", "offload_optimizer", "offload"} & unknown)
    free = []
    if "micro_batch" not in lt or {"micro_batch", "num_microbatches"} & unknown:
        if trainer.get("microbatches") == "pp" and layout.pp > 1 and (batch // data) % layout.pp == 0:
            shape = dataclasses.replace(shape, micro_batch=batch // data // layout.pp)
        else:
            free.append("micro_batch")
            if not batch_published:  # the global batch is the micro-batch times what the run states
                free.append("global_batch")
    if (
        layout.pp > 1
        and "virtual_stages" not in lt
        and ("pipeline_schedule" not in lt or "pipeline_schedule" in unknown)
    ):
        free.append("pipeline_schedule")
    elif (
        schedule == "interleaved-1f1b"
        and ("virtual_stages" not in lt or "virtual_stages" in unknown)
        and model.layers >= 2 * pp
    ):
        if "virtual_stages" in trainer:  # the trainer's default chunk count, where it has one
            layout = dataclasses.replace(layout, virtual_stages=trainer["virtual_stages"])
        else:
            free.append("virtual_stages")  # interleaved, with the chunk count its authors tuned unpublished
    megatron_like = trainer.get("grad_bytes") == 2 or name in ("NVIDIA/Megatron-LM", "Korthikanti")
    # DeepSpeed's pipeline engine takes ZeRO-1 at most: with a pipeline the stage is not the planner's pick
    pinned = layout.pp > 1 and trainer.get("zero_with_pipeline") == 1
    if "zero_stage" not in lt and layout.dp > 1 and layout.fsdp == 1 and not megatron_like and not pinned:
        free.append("zero_stage")  # a distributed optimizer, and whether it also shards gradients
    # whether the trainer's schedules include interleaving (a trainer we know nothing of: Megatron's)
    interleaved = "interleaved-1f1b" in trainer.get("schedules", ("interleaved-1f1b",))
    try:  # what no framework runs (heads tp does not divide, more stages than layers): this run, named
        layout.check_model(model, seq, even_sp=not facts["sp_any_length"])
    except FivefoldError as exc:
        raise FivefoldError(f"run {rid}: {exc}") from None
    return RunInputs(
        model, hardware(run), layout, shape, recompute_known, offload_known, tuple(free), interleaved, had_sp
    )


# bytes of one optimizer-state tensor per parameter, by a run's stated optimizer_state_dtype
STATE_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def optimizer_bytes(run: dict[str, Any]) -> int:
    """Bytes of optimizer state per parameter (the ZeRO paper's K): a master copy and Adam's two
    moments, fp32 unless the run states `optimizer_bytes_per_param` or `optimizer_state_dtype` (NeMo's
    apex DistributedFusedAdam with `dtype: bf16` keeps all three in bf16: K = 6)."""
    lt = run.get("layout", {})
    if "optimizer_bytes_per_param" in lt:
        return _int(run, "layout", "optimizer_bytes_per_param", lt["optimizer_bytes_per_param"])
    value = lt.get("optimizer_state_dtype")
    if value is None:
        return 12
    key = str(value).strip().lower()
    if key not in STATE_DTYPE_BYTES:
        raise FivefoldError(
            f"run {run['id']}: layout.optimizer_state_dtype = {value!r} is not a dtype this planner "
            f"knows; use one of {', '.join(sorted(set(STATE_DTYPE_BYTES)))}"
        )
    return 3 * STATE_DTYPE_BYTES[key]


def _offload(value: Any) -> bool:
    """A published offload setting: a bool, or words such as "optimizer" / "none"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "false", "no", "off", "0")
    return bool(value)


@dataclass(frozen=True)
class Throughput:
    """The throughput a run published, in the unit it was published in."""

    metric: str  # tokens/s/GPU | step time s | TFLOP/s (model|hardware) | MFU
    value: float


def throughput(run: dict[str, Any]) -> Throughput | None:
    """The most definition-free throughput the run publishes: tokens/s, then step time, then
    TFLOP/s, then MFU (the last two depend on a FLOP convention and a peak)."""
    meas, gpus = measured_numbers(run), _count(run, "layout", "gpus")
    if meas.get("tflops_basis", "model") not in ("model", "hardware"):
        basis = meas["tflops_basis"]
        raise FivefoldError(
            f'run {run["id"]}: measured.tflops_basis must be "model" or "hardware", got {basis!r}'
        )
    for key in ("mfu", "hfu"):
        if meas.get(key, 0) > 1:
            raise FivefoldError(
                f"run {run['id']}: measured.{key} is a fraction of the peak (0 to 1), got {meas[key]}"
            )
    if meas.get("tokens_per_s_per_gpu"):
        return Throughput("tokens/s/GPU", float(meas["tokens_per_s_per_gpu"]))
    if meas.get("tokens_per_s_total") and gpus:
        return Throughput("tokens/s/GPU", float(meas["tokens_per_s_total"]) / int(gpus))
    if meas.get("iteration_time_s"):
        return Throughput("step time s", float(meas["iteration_time_s"]))
    basis = meas.get("tflops_basis", "model")
    if meas.get("tflops_per_gpu"):
        return Throughput(f"TFLOP/s ({basis})", float(meas["tflops_per_gpu"]))
    if meas.get("aggregate_pflops") and gpus:  # the whole job's rate
        return Throughput(f"TFLOP/s ({basis})", 1000 * float(meas["aggregate_pflops"]) / int(gpus))
    if meas.get("mfu"):
        return Throughput("MFU", float(meas["mfu"]))
    if meas.get("hfu"):  # hardware FLOPs (recomputation included) over the source's peak
        return Throughput("HFU", float(meas["hfu"]))
    return None


def measured_numbers(run: dict[str, Any]) -> dict[str, float]:
    """The run's [measured] table with each throughput it states checked to be a positive number."""
    meas = run.get("measured", {})
    if not isinstance(meas, dict):
        raise FivefoldError(f"run {run['id']}: measured must be a table")
    out = dict(meas)
    for key in THROUGHPUT_KEYS:
        if key in meas:
            value = meas[key]
            if not _positive_number(value):
                raise FivefoldError(
                    f"run {run['id']}: measured.{key} must be a positive number, got {value!r}"
                )
    return out


def _positive_number(value: Any) -> bool:
    """A finite number above zero, not a bool, a string or NaN."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


# the kinds of run a throughput is compared with: a measurement, or one whose figures are partly
# measured (`analytic` runs publish what a formula gives, which no planner should be judged by)
COMPARED_KINDS = ("measured", "mixed")
THROUGHPUT_KEYS = (
    "tokens_per_s_per_gpu",
    "tokens_per_s_total",
    "iteration_time_s",
    "tflops_per_gpu",
    "aggregate_pflops",
    "mfu",
    "hfu",
)


def states_fp8_peak(run: dict[str, Any], fp8: bool) -> bool:
    """Whether an fp8 row gives the fp8 peak its MFU is over (else it is over the 16-bit one)."""
    return fp8 and "peak_fp8_tflops" in run.get("hardware", {})


def source_peak(run: dict[str, Any], hw: HardwareSpec, fp8: bool) -> float:
    """The peak (TFLOP/s) the source divided by for its MFU: the fp8 peak for fp8 rows that give one."""
    table = run.get("hardware", {})
    if states_fp8_peak(run, fp8):
        return float(table["peak_fp8_tflops"])
    return float(table.get("peak_bf16_tflops", hw.peak_tflops))


def _on_xla(run: dict[str, Any]) -> bool:
    """Whether the run compiled through XLA, by the framework and the device it names."""
    return runs_on_xla(
        str(run.get("layout", {}).get("framework", "")), str(run.get("hardware", {}).get("gpu", ""))
    )


def contradictions(run: dict[str, Any]) -> list[str]:
    """Stated facts of a run that disagree with each other by more than rounding (2%)."""
    meas, lt, out = measured_numbers(run), run.get("layout", {}), []
    gpus = _count(run, "layout", "gpus")
    per, total = meas.get("tokens_per_s_per_gpu"), meas.get("tokens_per_s_total")
    if per and total and gpus and abs(per * gpus / total - 1) > 0.02:
        out.append(f"tokens_per_s_per_gpu × gpus = {per * gpus:.4g} but tokens_per_s_total = {total:.4g}")
    step, seq = meas.get("iteration_time_s"), _count(run, "model", "seq_len")
    batch = _count(run, "layout", "global_batch")
    if step and total and seq and batch and abs(batch * seq / step / total - 1) > 0.02:
        out.append(
            f"global_batch × seq_len / iteration_time_s = {batch * seq / step:.4g} tokens/s but "
            f"tokens_per_s_total = {total:.4g}"
        )
    # with dp stated nothing is left to fill the world: an axis left out is 1 (cp and fsdp mostly are)
    axes = [lt.get(a, 1) for a in ("dp", "fsdp", "tp", "pp", "cp")]
    if gpus and "dp" in lt and all(isinstance(a, int) and a > 0 for a in axes):
        world = math.prod(axes)
        if world != gpus:
            out.append(f"dp×fsdp×tp×pp×cp = {world} but gpus = {gpus}")
    tp, cp = _count(run, "layout", "tp") or 1, _count(run, "layout", "cp") or 1
    xla = _on_xla(run)  # pads uneven shards (`sp_any_length`)
    if lt.get("sequence_parallel") is True and tp > 1 and seq and (seq // cp) % tp and not xla:
        per_rank = f" ({seq // cp} per cp rank)" if cp > 1 else ""
        out.append(
            f"sequence_parallel splits each sequence evenly over tp {tp}, but seq_len {seq}{per_rank} "
            f"is not a multiple of {tp}"
        )
    micro = _count(run, "layout", "micro_batch")
    pp = _count(run, "layout", "pp") or 1
    data = None
    if isinstance(lt.get("dp"), int) or isinstance(lt.get("fsdp"), int):
        data = (_count(run, "layout", "dp") or 1) * (_count(run, "layout", "fsdp") or 1)  # positive
    elif gpus and gpus % (tp * pp * cp) == 0:
        data = gpus // (tp * pp * cp)
    if micro and batch and data and micro * data > batch:  # a micro-batch is part of a rank's batch
        out.append(
            f"micro_batch {micro} × {data} data-parallel ranks = {micro * data} sequences, more than "
            f"global_batch {batch}"
        )
    out.extend(_utilisation_mismatch(run, meas))
    return out


# how far two statements of one run's throughput, each read as an MFU, may part before they contradict:
# FLOP conventions (causal halving, embeddings, the head) and peaks (dense or sparse, boost clocks) move
# an MFU by up to ~40% between sources, a unit slip (percent for a fraction, per job for per GPU) by 8×+
UTILISATION_SPREAD = 2.0
FP8_PEAK_RATIO = 2.0  # an fp8 tensor core's dense peak over its 16-bit one (Hopper, Ada, Blackwell)
# the least MFU a published training run is taken to state: the bundled runs' lowest is 5%; below 0.2%
# a rate is a unit slip (per job for per GPU, a percent divided twice) or a typo, not a measurement
MIN_UTILISATION = 0.002


def _utilisation_mismatch(run: dict[str, Any], meas: dict[str, Any]) -> list[str]:
    """A run's tokens/s, model TFLOP/s and MFU, each turned into an MFU range (the FLOPs per token with
    and without the causal half of attention, over the source's peak); ranges more than
    UTILISATION_SPREAD apart, or one wholly above the peak, mean one of the numbers is wrong."""
    from fivefold.flops import model_flops_per_token

    try:
        inputs = build(run)
        peak = source_peak(run, inputs.hw, inputs.shape.fp8) if inputs else 0.0
    except (FivefoldError, KeyError, TypeError, ValueError):
        return []  # what `build` refuses is reported by the command that plans the run
    if inputs is None or peak <= 0:
        return []
    gpus = inputs.layout.world
    ranges: dict[str, tuple[float, float]] = {}
    if meas.get("mfu"):
        ranges["mfu"] = (float(meas["mfu"]), float(meas["mfu"]))
    if meas.get("tflops_per_gpu") and meas.get("tflops_basis", "model") == "model":
        ranges["tflops_per_gpu"] = (float(meas["tflops_per_gpu"]) / peak,) * 2
    per_gpu = meas.get("tokens_per_s_per_gpu") or (meas.get("tokens_per_s_total") or 0) / gpus
    if per_gpu:
        seq = inputs.shape.seq_len
        lo, hi = (model_flops_per_token(inputs.model, seq, causal=c) for c in (True, False))
        key = "tokens_per_s_per_gpu" if meas.get("tokens_per_s_per_gpu") else "tokens_per_s_total"
        ranges[key] = (per_gpu * lo / 1e12 / peak, per_gpu * hi / 1e12 / peak)
    # rates held to the peak but not compared with the others: a step time (over a published batch), and
    # TFLOP/s on the hardware basis (recomputation counted) or of the whole job; no FLOP convention puts
    # any of them above what the tensor cores can do
    capped = dict(ranges)
    step, basis = meas.get("iteration_time_s"), meas.get("tflops_basis", "model")
    if step and "global_batch" not in inputs.free:
        tokens = inputs.shape.global_batch * inputs.shape.seq_len / step / gpus
        causal = model_flops_per_token(inputs.model, inputs.shape.seq_len, causal=True)
        capped["iteration_time_s"] = (tokens * causal / 1e12 / peak,) * 2
    if meas.get("tflops_per_gpu") and basis != "model":
        capped["tflops_per_gpu"] = (float(meas["tflops_per_gpu"]) / peak,) * 2
    if meas.get("aggregate_pflops"):
        capped["aggregate_pflops"] = (1000 * float(meas["aggregate_pflops"]) / gpus / peak,) * 2
    # the fewest FLOPs a rate can stand for (the causal half) still over what the tensor cores can do (fp8
    # ones run at twice the 16-bit peak an fp8 row's MFU is usually given against): a unit slip or a typo
    fp8_ceiling = inputs.shape.fp8 and not states_fp8_peak(run, inputs.shape.fp8)
    ceiling = FP8_PEAK_RATIO if fp8_ceiling else 1.0
    out = [
        f"measured.{name} means an MFU of at least {lo:.3g}, above the {peak * ceiling:g} TFLOP/s peak"
        if math.isfinite(lo)
        else f"measured.{name} is beyond any rate a {peak * ceiling:g} TFLOP/s peak allows"
        for name, (lo, _) in capped.items()
        if lo > ceiling and name != "mfu"  # an MFU over 1 is refused where it is read, as a fraction
    ]
    # and the most FLOPs it can stand for still a sliver of a GPU's peak: no published run ran that idle.
    # fivefold's own run directories may (a tiny model's step is the host's per-op work, on a CPU or a
    # GPU, which calibration fits), and their rates come from its own clock, not a reader's units
    own = str(run.get("layout", {}).get("framework", "")).lower() == "fivefold"
    out += [
        f"measured.{name} means an MFU of at most {hi:.3g}, below the {MIN_UTILISATION:.1%} any published "
        "run reaches (a unit slip?)"
        for name, (_, hi) in capped.items()
        if hi < MIN_UTILISATION and inputs.hw.comm_overlap and not own
    ]
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (alo, ahi), (blo, bhi) = ranges[a], ranges[b]
            if alo > UTILISATION_SPREAD * bhi or blo > UTILISATION_SPREAD * ahi:
                out.append(
                    f"measured.{a} means an MFU of {_span(alo, ahi)} but measured.{b} one of "
                    f"{_span(blo, bhi)} (on a {peak:g} TFLOP/s peak)"
                )
    return out


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3g}" if abs(hi - lo) <= 0.005 * hi else f"{lo:.3g}–{hi:.3g}"


def _run_facts(run_dir: Path) -> dict[str, Any]:
    """`run.json` as `fivefold train` writes it (the world, the preset its MFU was measured against,
    the threads each rank computed with, the torch it ran under); empty where it is missing or not a
    JSON object."""
    import json

    try:
        facts = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return facts if isinstance(facts, dict) else {}


def _threads(facts: dict[str, Any]) -> dict[str, float]:
    """The threads each rank computed with, as `run.json` recorded them (a run directory from before
    it did: none, and the plan assumes what a run gets on this machine)."""
    threads = facts.get("threads_per_rank")
    ok = isinstance(threads, int | float) and not isinstance(threads, bool) and 1 <= threads <= 4096
    return {"threads_per_rank": float(threads)} if ok else {}


def _measured_on(facts: dict[str, Any], device: str) -> str:
    """The hardware preset the run measured its MFU against (`run.json`, written by `fivefold train`
    from the device's name), else the `cpu` preset, or H100 for a cuda run that does not say."""
    named = facts.get("mfu_peak_from")
    if isinstance(named, str) and named in GPU_NAME_PRESETS.values():  # a preset's name, nothing else
        return named
    return "H100" if device == "cuda" else "cpu"


# what a run directory's metrics.jsonl measures of rank 0's memory, as the plan names it
MEASURED_PARTS = ("params", "grads", "optimizer", "activations")


def run_from_dir(path: str | Path) -> dict[str, Any]:
    """A fivefold run directory (`config.toml` + `metrics.jsonl`) as a run of the reference schema:
    its model, layout and batch, on the machine it ran on (`_measured_on`), with fused kernels if it
    ran compiled, and the median step time after the first step."""
    import statistics

    from fivefold.config import RunConfig, to_dict
    from fivefold.runlog import json_lines
    from fivefold.support import run_micro_batch

    p = Path(path)
    for name in ("config.toml", "metrics.jsonl"):
        if not (p / name).is_file():
            raise FivefoldError(f"run directory {p}: no {name} (a `fivefold train` run directory has both)")
    cfg = RunConfig.from_toml(p / "config.toml")
    times = []
    memory: dict[str, int] = {}  # rank 0's state and saved activations, as its last records give them
    try:
        text = (p / "metrics.jsonl").read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"run directory {p}: cannot read metrics.jsonl ({type(exc).__name__})") from None
    for _, rec in json_lines(text, f"run directory {p}: metrics.jsonl"):
        if not isinstance(rec, dict):
            raise FivefoldError(f"run directory {p}: metrics.jsonl has a line that is not a JSON object")
        if "step_time_s" in rec:
            t = rec["step_time_s"]
            if not _positive_number(t):
                step = rec.get("step", "?")
                raise FivefoldError(
                    f"run directory {p}: metrics.jsonl step {step}: step_time_s must be a positive "
                    f"number of seconds, got {t!r}"
                )
            times.append(float(t))
        held = rec.get("memory")
        if isinstance(held, dict):
            memory.update(
                {
                    k: int(v)
                    for k, v in held.items()
                    if k in MEASURED_PARTS and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                }
            )
    if len(times) < 2:
        raise FivefoldError(f"run directory {p}: metrics.jsonl needs step_time_s on at least 2 steps")
    m, lay, tr = to_dict(cfg.model), cfg.layout, cfg.train
    world = lay.dp * lay.fsdp * lay.tp * lay.pp * lay.cp
    if min(lay.dp, lay.fsdp) < 1:
        raise FivefoldError(f"run directory {p}: config.toml [layout] is not resolved (dp/fsdp = -1)")
    model = {k: m[k] for k in SHAPE_KEYS if m.get(k)}
    model.update(
        seq_len=tr.seq_len, arch="fivefold Llama block (SwiGLU)", tie_embeddings=bool(m["tie_embeddings"])
    )
    batch = tr.step_batch(lay.data_parallel)
    micro = run_micro_batch(lay, tr.micro_batch, batch)
    facts = _run_facts(p)
    return {
        "id": p.name,
        "source": f"run-directory/{p.name}",
        "kind": "measured",
        "flops_definition": "fivefold (non-causal)",
        "hardware": {"gpu": _measured_on(facts, tr.device), "gpus_per_node": world, **_threads(facts)},
        "model": model,
        "layout": {
            "gpus": world,
            "dp": lay.dp,
            "fsdp": lay.fsdp,
            "tp": lay.tp,
            "pp": lay.pp,
            "cp": lay.cp,
            "ep": lay.ep,
            "zero_stage": lay.zero if lay.zero >= 0 else (3 if lay.fsdp > 1 else 0),
            "sequence_parallel": lay.sp,
            "recompute": lay.recompute,
            **({"recompute_layers": lay.recompute_layers} if lay.recompute_layers else {}),
            "micro_batch": micro,
            "global_batch": batch,
            "pipeline_schedule": lay.pp_schedule,
            "virtual_stages": lay.virtual_stages,
            "cp_impl": lay.cp_impl,
            "torch_compile": tr.compile,
            **({"torch_version": facts["torch"]} if isinstance(facts.get("torch"), str) else {}),
            "precision": tr.dtype,
            "framework": "fivefold",
        },
        "measured": {
            "iteration_time_s": statistics.median(times[1:]),
            **({"rank0_memory_bytes": memory} if memory else {}),
        },
    }
