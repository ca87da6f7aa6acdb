"""Configuration: model, hardware, layout and run specs, read from presets, TOML, HF configs and flags.

Each concern has its module; everything is re-exported here, so callers import from
`fivefold.config` alone."""

from fivefold.config.files import T, _coerce, _from_dict, dumps_toml, read_toml, to_dict
from fivefold.config.flags import add_layout_arguments, layout_from_args, say_idle_flags
from fivefold.config.hardware import HardwareSpec
from fivefold.config.hf import _HF_ARCH, _model_spec_from_hf, _qwen3_moe_spec, model_spec_from_hf
from fivefold.config.layout import (
    ALL_AXES,
    AXES,
    CP_IMPLS,
    DEFAULT_ORDER,
    PP_SCHEDULES,
    RECOMPUTE,
    Layout,
    check_gpus,
    check_pins,
    complete_order,
    recomputed_blocks,
)
from fivefold.config.model import ModelSpec, check_buildable, check_seq_len
from fivefold.config.presets import _preset_dir, load_hardware, load_model, load_model_shape, preset_names
from fivefold.config.run import DTYPES, RunConfig, TrainSpec, run_tables

__all__ = [
    "ALL_AXES",
    "AXES",
    "CP_IMPLS",
    "DEFAULT_ORDER",
    "DTYPES",
    "HardwareSpec",
    "Layout",
    "ModelSpec",
    "PP_SCHEDULES",
    "RECOMPUTE",
    "RunConfig",
    "run_tables",
    "T",
    "TrainSpec",
    "_HF_ARCH",
    "_coerce",
    "_from_dict",
    "_model_spec_from_hf",
    "_preset_dir",
    "_qwen3_moe_spec",
    "add_layout_arguments",
    "check_gpus",
    "check_pins",
    "check_buildable",
    "check_seq_len",
    "complete_order",
    "dumps_toml",
    "layout_from_args",
    "say_idle_flags",
    "load_hardware",
    "load_model",
    "load_model_shape",
    "model_spec_from_hf",
    "preset_names",
    "recomputed_blocks",
    "read_toml",
    "to_dict",
]
