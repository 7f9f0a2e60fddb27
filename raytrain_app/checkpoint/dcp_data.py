"""A sharded checkpoint's DCP files read as data: nothing in them can run code.

DCP reads two kinds of pickle: ``.metadata`` (plain ``pickle.load``) and the non-tensor
items of the ``.distcp`` files, such as the optimizer's ``param_groups`` (``torch.load``
with ``weights_only=False``, in ``DefaultLoadPlanner.load_bytes``). A run directory is
shared, and anyone who can write there can replace either and rewrite ``manifest.json``:
every rank that resumes would run their pickle. Here the metadata is unpickled with only
DCP's own classes allowed, and every non-tensor item with torch's ``weights_only`` loader
(tensors and plain values, plus what the user allowed with
``torch.serialization.add_safe_globals``); anything else is refused in one line.

Imported only by an FSDP run (``sharded.py`` imports it where it loads): importing
``torch.distributed.checkpoint`` costs every other process some 0.7 s.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata, planner
from torch.distributed.checkpoint._traverse import set_element

from raytrain_app.checkpoint.store import _refused
from raytrain_app.errors import BadInputError, first_line

_START_OVER = "use a checkpoint written by raytrain, or start a new run (experiment.name)"


class CheckedReader(dcp.FileSystemReader):
    """DCP's file reader serving metadata that was already read as data
    (``load_dcp_metadata``) instead of unpickling ``.metadata`` itself."""

    def __init__(self, directory: Path, checked: metadata.Metadata) -> None:
        super().__init__(str(directory))
        self.metadata = checked

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        # What FileSystemReader.read_metadata does after its pickle.load.
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class DataLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items load as data."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: planner.ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with weights_only=True instead of False.
        item = self._as_data(read_item, value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item

    def _as_data(self, read_item: planner.ReadItem, value: io.BytesIO) -> Any:
        """One item unpickled with torch's weights-only loader.

        Raises:
            BadInputError: it holds anything but tensors and plain values, or is damaged.
        """
        try:
            return torch.load(value, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            why = _refused(exc) if isinstance(exc, pickle.UnpicklingError) else first_line(exc)
            stored = self.metadata.storage_data[read_item.storage_index]
            raise BadInputError(
                f"'{self.directory / stored.relative_path}' holds its item "
                f"'{read_item.dest_index.fqn}' as something other than tensors and plain "
                f"values ({why}), so it was not loaded (unpickling it could run code); "
                f"{_START_OVER}"
            ) from None


def refusal(exc: BaseException) -> BadInputError | None:
    """The one-line refusal a rank raised inside DCP, which wraps every rank's exception
    into one ``CheckpointException`` with their tracebacks (None if there is none)."""
    for failure, _trace in getattr(exc, "failures", {}).values():
        if isinstance(failure, BadInputError):
            return failure
    return None


def load_dcp_metadata(path: Path) -> metadata.Metadata:
    """A DCP ``.metadata`` file, unpickled with only the classes it may hold.

    Raises:
        BadInputError: the file names anything else (it was replaced or edited).
    """
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise BadInputError(
            f"'{path}' is not a sharded checkpoint's metadata ({exc}), so it was not loaded "
            f"(unpickling it could run code); {_START_OVER}"
        ) from None


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What DCP's metadata pickles reference: its dataclasses and enums, torch's sizes,
    dtypes, layouts and memory formats, and the standard reconstructors."""
    classes = [
        metadata.ChunkStorageMetadata,
        metadata._MEM_FORMAT_ENCODING,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.StorageMeta,
        metadata.Metadata,
        metadata.MetadataIndex,
        filesystem._StorageInfo,
        planner.LoadItemType,
        planner.WriteItemType,
        torch.Size,
        collections.OrderedDict,
        pathlib.PosixPath,  # StorageMeta.checkpoint_id: the directory DCP wrote to
        object,
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("copyreg", "_reconstructor")] = copyreg._reconstructor
    # A layout pickles as a call of this lookup by name (torch.serialization).
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):  # dtypes (torch.float32), layouts, memory formats
        value = getattr(torch, name)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``_allowed_globals`` (Python's documented
    way of restricting what a pickle may call)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}") from None
