"""Export a trained policy as a Hugging Face folder, what ``vllm serve``, ``transformers`` and harnesses load.

One writer, :func:`save_policy_folder`, used by ``logra-pl export`` (:func:`export_checkpoint`), the
:class:`~logra_pl.callbacks.HFExport` callback and the vLLM engine's cache. A folder is written whole or not at all:

1. everything goes into a temporary sibling ``.<name>.tmp-<pid>-<random>`` in the same parent folder (same file
   system, so a rename moves it): ``config.json``, ``model.safetensors`` (or shards and their index),
   ``generation_config.json``, the tokenizer files with the chat template, and ``logra_export.json`` (provenance);
2. every file is flushed to disk (``fsync``);
3. the temporary folder is renamed to the target. An existing target is first renamed away (to
   ``.<name>.tmp-<pid>-<random>-old``), the new folder renamed in, then the old one deleted.

An exception anywhere removes the temporary folder. A killed writer cannot clean up after itself: the next write to
the same target removes temporary siblings whose process is gone (and puts a previous export back if the kill fell
between the two renames). A folder at the target is therefore always a complete export.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from logra_pl.errors import LoGRAError
from logra_pl.runtime import compat
from logra_pl.runtime.dtypes import dtypes_of

PROVENANCE_FILE = "logra_export.json"
# Export dtypes of the CLI (a training dtype such as float64 is also accepted by the functions).
DTYPES: dict[str, torch.dtype] = dtypes_of("float32", "bfloat16", "float16")
# Lightning writes a distributed checkpoint as a folder: torch.distributed.checkpoint shards + this pickled file.
_DCP_META_FILE = compat.DISTRIBUTED_METADATA
_POLICY_PREFIX = "policy."


class ExportError(LoGRAError, RuntimeError):
    """An export that cannot be done; the message says why and what to do instead."""


# ------------------------------------------------------------------------------------------------- folders
def policy_folder_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds ``config.json`` and all its safetensors weights (one file, or every indexed shard).

    Arguments:
        folder: a ``save_pretrained`` folder.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return False
    if (folder / "model.safetensors").is_file():
        return True
    index = folder / "model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    return bool(shards) and all((folder / shard).is_file() for shard in shards)


def _temp_pattern(name: str) -> re.Pattern[str]:
    """Names of the temporary siblings of a target called ``name``: ``.<name>.tmp-<pid>-<random>[-old]``."""
    return re.compile(rf"\.{re.escape(name)}\.tmp-(\d+)-[0-9a-f]+(-old)?")


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(target: str | os.PathLike[str]) -> list[Path]:
    """Delete temporary siblings of ``target`` left by writers that were killed; return what was removed.

    A ``-old`` sibling is a previous export renamed away just before the new one was renamed in: if the target is
    missing (the kill fell between the two renames), it is renamed back instead of deleted.

    Arguments:
        target: the folder an export is written to.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return []
    pattern = _temp_pattern(target.name)
    removed = []
    for sibling in sorted(target.parent.iterdir()):
        match = pattern.fullmatch(sibling.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if match.group(2) and not target.exists() and policy_folder_complete(sibling):
            sibling.rename(target)
            continue
        shutil.rmtree(sibling, ignore_errors=True)
        removed.append(sibling)
    return removed


def remove_policy_folder(folder: str | os.PathLike[str]) -> None:
    """Delete an export without ever leaving a half-deleted folder at its name: rename it away, then delete it.

    Arguments:
        folder: the export to delete.
    """
    folder = Path(folder)
    away = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    folder.rename(away)
    shutil.rmtree(away, ignore_errors=True)


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a file or a non-empty folder that holds no model (``--out ~`` must not delete a home)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder: choose another output path")
    if (out / "config.json").exists() or (out / PROVENANCE_FILE).exists() or not any(out.iterdir()):
        return
    raise ExportError(
        f"refusing to replace {out}: it is a non-empty folder without a model (no config.json); "
        "choose a new or empty folder, or an earlier export to overwrite"
    )


def _fsync(path: Path) -> None:
    """Flush a file's bytes, or a folder's entry list, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself, so the rename publishes written bytes only."""
    for path in [*sorted(p for p in folder.rglob("*") if p.is_file()), folder]:
        _fsync(path)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is renamed away first and deleted after."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f"{tmp.name}-old"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- tensors
def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` → ``torch.bfloat16``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown floating dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return value


def drop_gguf_quantizer(model: torch.nn.Module) -> bool:
    """Forget that ``model`` was read from a GGUF file; return whether it was.

    transformers dequantises GGUF weights to plain tensors on load but keeps its GGUF quantizer on the model, and
    ``save_pretrained`` then refuses to save ("quantized with QuantizationMethod.GGUF and is not serializable"). The
    quantizer only describes how the file was read, so it is removed — ``hf_quantizer``, ``is_quantized``,
    ``quantization_method`` and the configs' ``quantization_config`` — and the weights save as regular tensors.
    Models quantized for real (bitsandbytes, GPTQ, ...) are left alone.

    Arguments:
        model: a transformers model, possibly loaded with ``gguf_file=...``.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return False
    for module in model.modules():
        if getattr(module, "hf_quantizer", None) is quantizer:
            module.hf_quantizer = None
        if "is_quantized" in vars(module):
            module.is_quantized = False
        if "quantization_method" in vars(module):
            del module.quantization_method
        config = getattr(module, "config", None)
        if config is not None and "quantization_config" in vars(config):
            del config.quantization_config
        if config is not None and getattr(config, "_is_quantized", False):
            config._is_quantized = False
    return True


def _export_state(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The tensors to save: whole (not sharded), one copy per tied pair, floating ones cast to ``dtype``."""
    state = dict(model.state_dict() if state_dict is None else state_dict)
    sharded = [k for k, v in state.items() if hasattr(v, "full_tensor")]
    if sharded:
        raise ExportError(
            f"{len(sharded)} tensors are sharded DTensors (e.g. {sharded[0]!r}): pass the gathered full tensors as "
            "state_dict (the update method's full_state(policy) gathers them on every rank)"
        )
    # transformers drops a tied copy only when both names share storage; gathered or cast tensors do not. A tied
    # target (lm_head.weight for tied embeddings) is left out here after checking it equals its source, and
    # from_pretrained / vLLM tie it again on load.
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state and source in state:
            if not torch.equal(state[target], state[source]):
                raise ExportError(f"{target} is tied to {source} in the model's config, but the two tensors differ")
            del state[target]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def _logra_pl_version() -> str:
    try:
        return importlib.metadata.version("logra-pl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def save_policy_folder(
    model: torch.nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | str | None = None,
    provenance: Mapping[str, Any] | None = None,
    max_shard_size: int | str = "50GB",
) -> Path:
    """Write ``model`` and ``tokenizer`` as a ``save_pretrained`` folder at ``out_dir``, atomically (module docstring).

    The folder holds ``config.json``, ``model.safetensors`` (shards + index above ``max_shard_size``),
    ``generation_config.json``, the tokenizer files with the chat template and ``logra_export.json``: the dtype,
    the logra-pl version, the time, and ``provenance``. An existing export at ``out_dir`` is replaced; a non-empty
    folder without a ``config.json`` is refused. Only one process may write a given ``out_dir`` at a time.

    Arguments:
        model: a transformers causal LM. A GGUF-loaded model saves its (already dequantised) weights as regular
            tensors; its GGUF quantizer is dropped from the model (:func:`drop_gguf_quantizer`).
        tokenizer: its tokenizer.
        out_dir: the folder to write (its parent is created).
        state_dict: tensors to save instead of the model's own, e.g. FSDP shards gathered whole; the model then
            supplies only the config, the class and the tied-weight names.
        dtype: cast floating tensors to this dtype (``"bfloat16"``...) and record it in ``config.json``; None
            keeps the tensors' dtype.
        provenance: extra JSON-serialisable fields for ``logra_export.json`` (source checkpoint, global step...).
        max_shard_size: largest safetensors file before transformers shards the weights.

    Returns:
        The absolute path of the written folder.
    """
    out = Path(out_dir).expanduser().absolute()
    cast = as_dtype(dtype)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    state = _export_state(model, state_dict, cast)
    drop_gguf_quantizer(model)
    saved_dtype = cast if cast is not None else getattr(model, "dtype", None)
    record = {
        "dtype": str(saved_dtype).removeprefix("torch."),
        "logra_pl_version": _logra_pl_version(),
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **(provenance or {}),
    }
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        del state  # save_pretrained consumed it
        tokenizer.save_pretrained(tmp)
        if cast is not None:  # save_pretrained records the model's own dtype; the tensors were cast
            config_file = tmp / "config.json"
            config = json.loads(config_file.read_text())
            config["dtype"] = record["dtype"]
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        _fsync_tree(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(out.parent)  # the rename itself
    return out


# --------------------------------------------------------------------------------------------- checkpoints
def _read_checkpoint(path: Path) -> tuple[dict[str, Any], Mapping[str, Any] | None]:
    """``(checkpoint without tensors needed, state_dict)`` of a file; ``state_dict`` is None for a folder (DCP)."""
    if not path.exists():
        raise ExportError(f"checkpoint {path} does not exist")
    if path.is_dir():
        if (path / "config.json").is_file():
            raise ExportError(f"{path} is already a Hugging Face folder (config.json): load or serve it as it is")
        if not (path / ".metadata").is_file() or not (path / _DCP_META_FILE).is_file():
            raise ExportError(
                f"{path} is a folder but not a Lightning distributed checkpoint (.metadata and {_DCP_META_FILE}): "
                "pass a .ckpt file or a folder saved with save_distributed_checkpoint=True"
            )
        return torch.load(path / _DCP_META_FILE, weights_only=False, map_location="cpu"), None
    try:
        # mmap: tensors are read from the file when used, so the optimizer state is never loaded.
        checkpoint = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    except (RuntimeError, ValueError, EOFError, OSError) as err:
        raise ExportError(f"{path} is not a PyTorch checkpoint that torch.load can read: {err}") from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise ExportError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    return checkpoint, checkpoint["state_dict"]


def _module_hparams(checkpoint: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The LoGRAPolicyModule hyper-parameters saved in the checkpoint (``policy``, ``dtype``, ...)."""
    hp = checkpoint.get("hyper_parameters") or {}
    class_path = compat.hparams_class_path(hp, "LoGRAPolicyModule")
    if "policy" not in hp or "dtype" not in hp or not class_path.endswith("LoGRAPolicyModule"):
        raise ExportError(
            f"{path} is not a LoGRAPolicyModule checkpoint: its hyper_parameters have no 'policy' and 'dtype' "
            f"(found {sorted(hp)})"
        )
    return dict(hp)


def _check_keys(path: Path, policy: str, expected: Mapping[str, tuple[int, ...]], found: Mapping[str, Any]) -> None:
    """Strict match of the checkpoint's policy tensors against the base policy's, with the differences named."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if tuple(found[k]) != tuple(expected[k]))
    if not found:
        raise ExportError(f"{path} holds no policy tensors ('{_POLICY_PREFIX}*'): not a LoGRAPolicyModule checkpoint")
    if missing or unexpected or wrong:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
            if keys
        ]
        raise ExportError(f"the policy tensors in {path} do not match the base policy {policy!r}: " + "; ".join(parts))


def _load_policy_tensors(model: torch.nn.Module, state: Mapping[str, Any], path: Path, policy: str) -> None:
    """Copy ``policy.*`` tensors of a (memory-mapped) Lightning state dict into ``model``."""
    tensors = {k.removeprefix(_POLICY_PREFIX): v for k, v in state.items() if k.startswith(_POLICY_PREFIX)}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _check_keys(path, policy, expected, {k: tuple(v.shape) for k, v in tensors.items()})
    model.load_state_dict(tensors, strict=True)


def _load_distributed_policy_tensors(model: torch.nn.Module, path: Path, policy: str) -> None:
    """Read a distributed checkpoint's ``policy.*`` shards straight into ``model`` (one process, no group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(path))
    prefix = f"state_dict.{_POLICY_PREFIX}"
    stored = {
        k.removeprefix(prefix): tuple(v.size)
        for k, v in reader.read_metadata().state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    template = model.state_dict()  # views of the parameters: DCP fills them in place
    _check_keys(path, policy, {k: tuple(v.shape) for k, v in template.items()}, stored)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to load in a single process")
        dcp_load(
            {"state_dict": {_POLICY_PREFIX + k: v for k, v in template.items()}}, storage_reader=reader, no_dist=True
        )


def export_checkpoint(
    ckpt_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: torch.dtype | str | None = None
) -> Path:
    """Turn a :class:`~logra_pl.module.LoGRAPolicyModule` checkpoint into a Hugging Face folder.

    The model skeleton, generation config and tokenizer come from the checkpoint's *base* policy
    (``hyper_parameters["policy"]``, loaded with :func:`~logra_pl.models.load_policy` in the training dtype); a
    warm start changed only weights, so it is not re-run. The checkpoint's ``policy.*`` tensors then replace every
    weight (strictly: missing, unexpected or mis-shaped tensors are an error naming them). The checkpoint file is
    memory-mapped, so its optimizer state is never read; peak memory is about one copy of the policy.

    Arguments:
        ckpt_path: a ``.ckpt`` file (``trainer.save_checkpoint``, ``ModelCheckpoint``, FSDP full checkpoints) or the
            folder of a distributed checkpoint (``LoGRAStrategy(save_distributed_checkpoint=True)``).
        out_dir: the folder to write (atomically; an earlier export there is replaced).
        dtype: cast the exported weights (``"bfloat16"``...); None keeps the training dtype.

    Returns:
        The absolute path of the written folder.
    """
    from logra_pl.methods import UpdateMethod, checkpoint_kind, method_class
    from logra_pl.models.load import PolicyLoadError, load_policy

    path = Path(ckpt_path).expanduser()
    cast = as_dtype(dtype)
    checkpoint, state = _read_checkpoint(path)
    hp = _module_hparams(checkpoint, path)
    policy = str(hp["policy"])
    try:
        model, tokenizer = load_policy(policy, dtype=as_dtype(hp["dtype"]) or torch.float32)
    except (PolicyLoadError, OSError) as err:
        raise ExportError(f"the checkpoint's base policy {policy!r} cannot be loaded here: {err}") from err
    # The method writes its tensors as a plain model holds them (LoRA: its adapters merged into the matrices).
    method = method_class(checkpoint_kind(checkpoint) or "") or UpdateMethod
    if state is not None:
        plain = {k.removeprefix(_POLICY_PREFIX): v for k, v in state.items() if k.startswith(_POLICY_PREFIX)}
        state = {_POLICY_PREFIX + k: v for k, v in method.exported_tensors(plain, hp).items()}
    elif method.exported_tensors.__func__ is not UpdateMethod.exported_tensors.__func__:
        raise ExportError(f"{path}: exporting a sharded {method.name} checkpoint is not supported; save a full one")
    if state is None:
        _load_distributed_policy_tensors(model, path, policy)
    else:
        _load_policy_tensors(model, state, path, policy)
    del state
    checkpoint.pop("state_dict", None)
    if cast is not None:
        model.to(cast)  # in place: no second copy of the weights
    warm = hp.get("warm_start")
    provenance = {
        "source_checkpoint": str(path.absolute()),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "base_policy": policy,
        "training_dtype": hp["dtype"],
        "warm_start": dataclasses.asdict(warm) if dataclasses.is_dataclass(warm) else warm,
    }
    return save_policy_folder(model, tokenizer, out_dir, provenance=provenance)


def main(argv: Sequence[str] | None = None) -> None:
    """``logra-pl export --ckpt PATH --out DIR [--dtype {bfloat16,float16,float32}]``.

    Arguments:
        argv: the arguments after ``export`` (None: ``sys.argv[1:]``, as in ``python -m logra_pl.runs.export``).
    """
    parser = argparse.ArgumentParser(
        prog="logra-pl export",
        description="Write a LoGRAPolicyModule checkpoint as a Hugging Face folder (vllm serve, transformers).",
    )
    parser.add_argument("--ckpt", required=True, help="a .ckpt file or a distributed checkpoint folder")
    parser.add_argument("--out", required=True, help="the folder to write (replaced atomically if it is an export)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as trained)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = export_checkpoint(args.ckpt, args.out, dtype=args.dtype)
    except ExportError as err:
        parser.exit(2, f"logra-pl export: error: {err}\n")
    record = json.loads((out / PROVENANCE_FILE).read_text())
    print(
        f"exported update {record['global_step']} of {args.ckpt} ({record['dtype']}) to {out} "
        f"in {time.perf_counter() - start:.1f} s\n"
        f"  serve it: vllm serve {out}\n"
        f'  load it:  AutoModelForCausalLM.from_pretrained("{out}"), AutoTokenizer.from_pretrained("{out}")'
    )


if __name__ == "__main__":
    main()
