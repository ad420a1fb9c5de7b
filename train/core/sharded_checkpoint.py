"""The model and optimizer part of a sharded checkpoint: each process writes what it holds through
torch.distributed.checkpoint (DCP), with no gather onto one process, and any process count reads it
back (DCP reshards on load). Under FSDP2 a process writes its own shards; under DDP, where every
process holds everything, DCP's planner still spreads the tensors so each is written once.

Nothing in it is unpickled unchecked. DCP reads its `.metadata` with pickle.load and the non-tensor
values (the optimizer's hyperparameters) with torch.load(weights_only=False); both would run code
planted in a checkpoint. Through DCP's own extension points (a StorageReader and a LoadPlanner),
the metadata is read by an unpickler that builds DCP's metadata classes and nothing else, and the
values by torch.load(weights_only=True). The metadata is checked against the model before any
tensor is read, so another model's checkpoint, a missing shard or a cut-short one is one line.
"""

import contextlib
import functools
import io
import os
import pickle
import shutil
import threading
import warnings

import torch

from data.errors import UserError, fail

STATE = "state"  # the DCP folder inside a checkpoint

# what DCP 2.15 pickles into .metadata (read from its own save), and nothing more
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


@functools.cache
def _checked():
    """DCP's file reader and load planner with the checks above, as classes. Defined on first use:
    importing DCP takes over a second (DTensor, sympy), paid by every process that imports a script,
    the server of its DataLoader workers included (data/worker_server.py)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class CheckedReader(FileSystemReader):
        """DCP's file reader, reading `.metadata` through the allowlist above."""

        def read_metadata(self, *args, **kwargs):
            path = os.path.join(self.path, ".metadata")
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                fail(f"refused to load {path}: {e}; it was not written by these scripts; delete that checkpoint")
            except Exception as e:  # a damaged file meets the unpickler as EOFError, ValueError, ...
                fail(
                    f"{path} is unreadable ({type(e).__name__}); delete that checkpoint and resume from an earlier one"
                )
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class CheckedPlanner(DefaultLoadPlanner):
        """DCP's planner, loading non-tensor values with torch.load(weights_only=True)."""

        def load_bytes(self, read_item, value):
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                fail(
                    f"refused a value of {read_item.dest_index.fqn} in a checkpoint: it holds pickled objects "
                    f"({str(e).splitlines()[0]}); delete that checkpoint"
                )
            super().load_bytes(read_item, io.BytesIO(_as_bytes(loaded)))

    return CheckedReader, CheckedPlanner


def _as_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer.read()


def with_frozen(model, weights, options=None):
    """`weights`, a checkpoint's parameters that train, completed with the frozen ones as the model
    holds them now (the script built them): torch 2.15's set_model_state_dict wants every parameter
    under a process group or without full_state_dict, whatever ignore_frozen_params says."""
    if all(p.requires_grad for p in model.parameters()):
        return weights
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    current = get_model_state_dict(model, options=options)  # a collective under FSDP2: every rank is here
    return {**{name: value for name, value in current.items() if name not in weights}, **weights}


def sharded_state(model, optimizer):
    """What a sharded checkpoint holds: {"model": ..., "optimizer": ...} state dicts keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # collectives under FSDP2; DTensor shards there, whole tensors under DDP or in one process. The
    # parameters that train only: frozen ones come back from where the script built them
    return {
        "model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns at every save and load in one process without a process group; that case is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _cause(error):
    """DCP gathers every rank's exception into a CheckpointException, a BaseException that no
    `except Exception` sees: the first rank's own error (an OSError such as a full disk, or a
    refusal), to raise instead, so the run reports it in one line and a failed save cleans up."""
    first = next(iter(error.failures.values()), None)
    cause = first[0] if isinstance(first, tuple) else first
    return cause if isinstance(cause, Exception) else RuntimeError(" ".join(str(error).split())[:200])


def save_sharded(folder, model, optimizer, writer=None, group=None):
    """Every process writes its part of the model and optimizer into folder/state (a collective).
    With `writer` (a one-thread executor that lives as long as the run) this call copies the state
    and returns a Future: the writer thread saves the copy through DCP on `group`, a process group
    of its own so its collectives never meet the training's, while training changes the model.
    Not DCP's async_save, which starts a thread per save: one writer also keeps the saves in order."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def write(state):
        with _one_process_is_meant():
            dcp.save(state, checkpoint_id=os.path.join(folder, STATE), process_group=group)

    state = sharded_state(model, optimizer)
    if writer is not None:
        return writer.submit(write, _copy(state))
    try:
        write(state)
    except CheckpointException as e:
        raise _failed(e, folder) from None


def _copy(tree):
    """The state as it is now: tensors cloned (a DTensor clones its local shard), the rest copied."""
    import copy

    if isinstance(tree, dict):
        return {key: _copy(value) for key, value in tree.items()}
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else copy.deepcopy(tree)


def wait_sharded(future, folder):
    """Wait for a background save; its failure raised as save_sharded raises it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        future.result()
    except CheckpointException as e:
        raise _failed(e, folder) from None


def _failed(error, folder):
    cause = _cause(error)
    if not isinstance(cause, OSError):  # torch.save inside DCP turns a failed write (ENOSPC) into RuntimeError
        from train.core.accelerator import check_writable  # 'unexpected pos': the disk says which OSError it was

        check_writable(folder)
    return cause


def _tensors(tree, prefix=""):
    """(DCP's key, tensor) for every tensor in nested dicts: DCP names them by their dotted path."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def _describe(checkpoint_path, metadata, state):
    """A one-line reason the checkpoint cannot be read into `state`, or None."""
    stored = metadata.state_dict_metadata
    tensors = dict(_tensors(state))
    missing = [k for k in tensors if k not in stored]
    extra = [k for k in stored if k.startswith("model.") and k not in tensors]
    wrong = [
        f"{k} {tuple(stored[k].size)} vs {tuple(v.shape)}"
        for k, v in tensors.items()
        if k in stored and hasattr(stored[k], "size") and tuple(stored[k].size) != tuple(v.shape)
    ]
    if missing or extra or wrong:
        detail = "; ".join(
            filter(
                None,
                [
                    f"this model has {len(missing)} tensors it lacks, e.g. {missing[0]}" if missing else "",
                    f"it holds {len(extra)} this model has not, e.g. {extra[0]}" if extra else "",
                    f"shapes differ: {wrong[0]}" if wrong else "",
                ],
            )
        )
        return (
            f"{checkpoint_path} does not fit this model ({detail}); resume with the model arguments it was saved with"
        )
    for info in {(i.relative_path, i.offset + i.length) for i in metadata.storage_data.values()}:
        if os.path.basename(info[0]) != info[0] or info[0] in ("", ".", ".."):  # a crafted path out of state/
            return f"refused to load {checkpoint_path}: its metadata names the file {info[0]!r} outside {STATE}/"
        file = os.path.join(checkpoint_path, STATE, info[0])
        if not os.path.isfile(file):
            return (
                f"{checkpoint_path} is missing the shard {STATE}/{info[0]}; delete that checkpoint and resume "
                "from an earlier one"
            )
        if os.path.getsize(file) < info[1]:
            return (
                f"{checkpoint_path}: its shard {STATE}/{info[0]} is cut short ({os.path.getsize(file)} of at least "
                f"{info[1]} bytes); delete that checkpoint and resume from an earlier one"
            )
    return None


def load_sharded(checkpoint_path, model, optimizer):
    """Read checkpoint_path/state into the model and optimizer, whatever process count wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    CheckedReader, CheckedPlanner = _checked()
    reader = CheckedReader(os.path.join(checkpoint_path, STATE))
    if not os.path.isfile(os.path.join(checkpoint_path, STATE, ".metadata")):
        fail(
            f"{checkpoint_path} has no {STATE}/.metadata: it is not a complete sharded checkpoint; delete it and "
            "resume from an earlier one"
        )
    state, metadata = sharded_state(model, optimizer), reader.read_metadata()
    # get_optimizer_state_dict gives a fresh optimizer state for every trainable parameter; a
    # parameter that had no gradient before the save has none in the checkpoint, and keeps none
    saved = metadata.state_dict_metadata
    for name, values in list(state["optimizer"]["state"].items()):
        for key in [
            k for k, v in values.items() if isinstance(v, torch.Tensor) and f"optimizer.state.{name}.{k}" not in saved
        ]:
            del values[key]
        if not values:
            del state["optimizer"]["state"][name]
    problem = _describe(checkpoint_path, metadata, state)
    if problem:
        fail(problem)
    try:
        with _one_process_is_meant():
            dcp.load(state, storage_reader=reader, planner=CheckedPlanner())
    except CheckpointException as e:
        cause = _cause(e)
        if isinstance(cause, UserError):
            raise cause from None
        fail(
            f"{checkpoint_path} is unreadable ({type(cause).__name__}: {' '.join(str(cause).split())[:160]}); "
            "delete that checkpoint and resume from an earlier one"
        )
    set_model_state_dict(model, with_frozen(model, state["model"]))
    # not strict: the parameters left without state above (the model's own tensors were checked)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))


class Checkpoint:
    """A checkpoint save_checkpoint wrote, or is writing in the background: its final `path`, and
    wait(), which returns once its files are written and it is published (and raises what failed).
    The main process publishes it (renames it to `path`) as soon as every rank's part is on disk:
    DCP's coordinator completes its Future only after every rank reported its writes and the
    metadata is written. The Future's callback publishes it then; wait() makes sure it did."""

    def __init__(self, path, future=None, tmp=None, publish=None):
        self.path, self.future, self.tmp = path, future, tmp
        self._publish, self._lock, self._error = publish, threading.Lock(), None
        if future is not None and publish is not None:
            future.add_done_callback(lambda done: self.publish() if done.exception() is None else None)

    def publish(self):
        with self._lock:  # once, from DCP's thread or from wait(), whichever comes first
            publish, self._publish = self._publish, None
            if publish is not None:
                try:
                    publish()
                except Exception as e:  # raised by wait(); in DCP's thread it would only be logged
                    self._error = e

    def wait(self):
        future, self.future = self.future, None
        if future is None:
            return
        try:
            wait_sharded(future, self.tmp)
        except BaseException:
            if self._publish is not None:  # the main process, the one writer of the checkpoints folder
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.publish()
        if self._error is not None:
            raise self._error
