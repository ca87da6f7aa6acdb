"""Read a DCP checkpoint without running code from it.

DCP stores its index (`.metadata`) as a pickle, and `pickle.load` calls whatever a crafted file
names; its default planner also unpickles non-tensor values (optimizer hyper-parameters) with
`weights_only=False`. A run directory may come from anyone (a download, a shared disk), so
`--resume` and `generate --from` read the index through an unpickler that resolves only the classes
DCP's own metadata is made of (its dataclasses, torch dtypes, `torch.Size`, layouts and paths), and
non-tensor values through torch's `weights_only` loader. Anything else is refused before it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


# what a user is told when torch's `weights_only` loader refuses a shard: torch's own message advises
# turning that safety off and ends in a pointer to torch.load's documentation, neither of which helps
NOT_TENSORS = (
    "a shard does not read as tensors alone (damaged, or it holds other objects, which are not loaded)"
)


def refused_as_unsafe(exc: BaseException) -> bool:
    """Whether `exc` is torch's `weights_only` loader refusing a file (also inside DCP's wrapping of
    each rank's traceback)."""
    return "Weights only load failed" in str(exc)


class UnsafeMetadata(pickle.UnpicklingError):
    """The file names something a DCP index never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_MODULES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadata(f"refused to load {module}.{name} from the checkpoint index")


def load_metadata(data: bytes) -> Metadata:
    """The `Metadata` pickled in `data`, or UnsafeMetadata / UnpicklingError."""
    value = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(value, Metadata):
        raise UnsafeMetadata(f"the checkpoint index holds a {type(value).__name__}, not DCP metadata")
    return value


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values read by torch's `weights_only` loader."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(path: str | Path) -> Metadata:
    return SafeFileSystemReader(str(path)).read_metadata()


def safe_load(state: dict[str, Any], path: str | Path) -> None:
    """`dcp.load(state, checkpoint_id=path)` without unpickling anything but DCP's own types."""
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())


def load_weights(weights: dict[str, Any], path: str | Path) -> None:
    """`safe_load` of a model's weights (in place, cast to their dtype) for serving; a deleted or
    damaged shard is one line naming the checkpoint, on every rank that reads it."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    from fivefold.errors import FivefoldError

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            safe_load({"model": weights}, path)
    except (Exception, CheckpointException) as exc:  # DCP raises several kinds; all mean the same here
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        if refused_as_unsafe(exc):
            detail = NOT_TENSORS
        raise FivefoldError(f"checkpoint {path} is corrupt or incomplete ({detail})") from None
