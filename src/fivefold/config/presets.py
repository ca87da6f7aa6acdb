"""The bundled model and hardware presets, and loading a preset, a TOML file or an HF config."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from fivefold.config.files import _from_dict, read_settings_text, read_toml
from fivefold.config.hardware import HardwareSpec
from fivefold.config.hf import NotBuilt, model_spec_from_hf, model_spec_from_hf_shape
from fivefold.config.model import ModelSpec, check_buildable
from fivefold.errors import FivefoldError, did_you_mean, reason, suggest


def _preset_dir(kind: str) -> Any:
    return resources.files("fivefold") / "presets" / kind


def preset_names(kind: str) -> list[str]:
    return sorted(p.name[:-5] for p in _preset_dir(kind).iterdir() if p.name.endswith(".toml"))


def load_model(name_or_path: str) -> ModelSpec:
    """A model preset name, a model TOML, an HF `config.json`, or an HF checkpoint directory."""
    path = Path(name_or_path)
    if name_or_path in preset_names("models"):
        data = tomllib.loads((_preset_dir("models") / f"{name_or_path}.toml").read_text())
        data.setdefault("name", name_or_path)
        return _from_dict(ModelSpec, data, f"model preset {name_or_path}").validate()
    hf = _hf_json(path)
    if hf is not None:
        return model_spec_from_hf(hf[0], name=hf[1]).validate()
    if name_or_path and path.is_dir():  # not an HF directory: _hf_json looked for its config.json
        raise FivefoldError(
            f"model {name_or_path!r} is a directory without a config.json; a model is a preset, a .toml, "
            f"a config.json or an HF directory; presets: {suggest(preset_names('models'), 20)}"
        )
    if path.suffix == ".toml" or path.exists():
        data = read_toml(path)
        data = data.get("model", data)
        if not isinstance(data, dict):  # `model = 5`: a key where the [model] table belongs
            raise FivefoldError(f"model file {path}: model must be a [model] table, got {data!r}")
        data.setdefault("name", path.stem)
        return _from_dict(ModelSpec, data, f"model file {path}").validate()
    # an HF hub id ("meta-llama/Llama-3-8B"): nothing is downloaded, the checkpoint must be here
    hub = (
        " (nothing is downloaded: give a checkpoint directory or its config.json)"
        if "/" in name_or_path
        else ""
    )
    raise FivefoldError(
        f"unknown model {name_or_path!r}{did_you_mean(name_or_path, preset_names('models'))}: not a preset, "
        f"a .toml, a config.json or an HF directory{hub}; presets: {suggest(preset_names('models'), 20)}"
    )


def _hf_json(path: Path) -> tuple[Any, str] | None:
    """(the parsed config, the model's name) where `path` is an HF config.json or a folder holding one."""
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix != ".json":
        return None
    text = read_settings_text(path, "JSON file")
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, a 5000-digit number, nesting 10^5 deep
        raise FivefoldError(f"malformed JSON in {path}: {reason(exc)}") from None
    return cfg, path.parent.name or "hf"


def load_model_shape(name_or_path: str) -> tuple[ModelSpec, str]:
    """A model to plan: what `load_model` reads, or an HF config.json it does not (another architecture:
    Gemma, Qwen2, GPT-2, Falcon, ...) read by its shape, with a line saying so ("" otherwise)."""
    try:
        spec = load_model(name_or_path)
    except NotBuilt as strict:  # a malformed config is refused as `load_model` refuses it
        hf = _hf_json(Path(name_or_path))
        if hf is None:
            raise
        cfg, name = hf
        spec = model_spec_from_hf_shape(cfg, name=name).validate()
        archs = cfg.get("architectures") or []
        archs = archs if isinstance(archs, list) else [archs]  # a bare name, where a list belongs
        arch = ", ".join(map(str, archs)) or str(cfg.get("model_type") or name)
        return (
            spec,
            f"{arch} is planned by its shape (layers, widths, heads, experts); train refuses it: {strict}",
        )
    try:  # a model file the runtime cannot build (a GELU MLP) is planned, and said to be
        check_buildable(spec)
    except FivefoldError as exc:
        return spec, str(exc)
    return spec, ""


def load_hardware(name_or_path: str) -> HardwareSpec:
    if name_or_path in preset_names("hardware"):
        data = tomllib.loads((_preset_dir("hardware") / f"{name_or_path}.toml").read_text())
        data.setdefault("name", name_or_path)
        return _from_dict(HardwareSpec, data, f"hardware preset {name_or_path}", implied=("name",)).validate()
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        data = read_toml(path)
        data = data.get("hardware", data)
        if not isinstance(data, dict):
            raise FivefoldError(f"hardware file {path}: hardware must be a [hardware] table, got {data!r}")
        data.setdefault("name", path.stem)
        return _from_dict(HardwareSpec, data, f"hardware file {path}", implied=("name",)).validate()
    raise FivefoldError(
        f"unknown hardware {name_or_path!r}{did_you_mean(name_or_path, preset_names('hardware'))}; presets: "
        f"{suggest(preset_names('hardware'), 30)} (or a .toml file)"
    )
