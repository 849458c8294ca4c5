"""A GGUF model's weights as loaded (dequantized, in the model dtype, the kernel's blocks laid
out) kept as one safetensors file, so a restart maps them instead of converting the file again.

The first start saves the model's parameters and buffers right after loading; later starts map
that file (zero-copy) and check its CRC (in its name) on a thread while the weights are packed.
The file sits beside the GGUF's other conversions (gguf_metadata.converted_dir), keyed by
everything the conversion depends on: the file, dtype, kernel choice, CPU, torch and Kiln's
loading code.
"""
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln import envs
from kiln.atomic_write import temporary_beside
from kiln.logger import init_logger
from kiln.model.loader.snapshot_crc import Check, file_crc, find

logger = init_logger(__name__)

# Of the file's layout; bump when what is saved changes meaning.
_FORMAT = 1
_PRIMITIVES = (bool, int, float, str)
# Disk space a snapshot leaves free, or it is not kept.
_FREE_MARGIN = 2 << 30
# Snapshots kept per GGUF file (dtypes, kernel choices); older ones go when a new one is saved.
_KEEP = 3
# Kiln's code that decides what loading leaves in the model (besides the C++ sources).
_LOADING_CODE = ("model", "native", "ir")
# Characters of an error's text a warning quotes.
_BRIEF = 200


@functools.cache
def _loading_code_digest() -> str:
    root = Path(__file__).resolve().parents[2]  # the kiln package
    h = hashlib.sha256()
    for part in _LOADING_CODE:
        for p in sorted((root / part).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def snapshot_path(kiln_config) -> Path | None:
    """Where this GGUF model's loaded weights are kept under this config; None where they are
    not (not a GGUF load on CPU, quantized on load, split across ranks, KILN_WEIGHT_SNAPSHOT=0)."""
    from kiln.config.gguf_metadata import converted_dir
    from kiln.model.layers.longrope import rope_variant
    from kiln.native import build

    mc, pc = kiln_config.model_config, kiln_config.parallel_config
    load_format = kiln_config.load_config.load_format
    if load_format == "auto":
        load_format = mc.load_format
    if (not envs.weight_snapshot() or load_format != "gguf" or mc.gguf_file is None
            or mc.quantization is not None or kiln_config.device_config.device_obj.type != "cpu"
            or pc.tensor_parallel_size * pc.pipeline_parallel_size != 1):
        return None
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else vars(mc.hf_config)
    build.available()  # loads the kernels (once) if nothing has yet
    # the kernels' build key covers their sources, compiler, CPU and torch
    factors = [_FORMAT, str(mc.torch_dtype),
               repr(sorted((k, repr(v)) for k, v in hf.items() if k != "_name_or_path")),
               repr(kiln_config.ir_selection.chosen), torch.__version__,
               torch.get_float32_matmul_precision(), build.loaded_key(),
               _loading_code_digest(), np.__version__,
               # the rotary cache (a buffer, kept) of longrope's factors max_model_len chose
               rope_variant(mc.hf_config, mc.max_model_len)]
    key = hashlib.sha256(repr(factors).encode()).hexdigest()[:16]
    return converted_dir(mc.gguf_file) / f"weights-{key}.safetensors"


def _slots(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, str]]:
    """(slot name, kind, module, attribute) for every parameter, buffer and plain tensor
    attribute (a rotary layer's inv_freq), tied ones included."""
    for path, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for name in table:
                yield f"{path}|{kind}|{name}", kind, module, name
        for name, value in vars(module).items():
            if not name.startswith("_") and isinstance(value, torch.Tensor):
                yield f"{path}|a|{name}", "a", module, name


def primitive_attrs(model: nn.Module) -> dict[str, dict]:
    """Each module's plain (bool, int, float, str) attributes: what loading may set besides
    tensors (a layer's block type, say)."""
    return {path: {k: v for k, v in vars(m).items()
                   if not k.startswith("_") and type(v) in _PRIMITIVES}
            for path, m in model.named_modules(remove_duplicate=False)}


def save(model: nn.Module, path: Path, attrs_before: dict[str, dict]) -> bool:
    """Keep the model's tensors and the plain attributes loading changed (against
    `attrs_before`, from `primitive_attrs` before loading); False where it cannot."""
    from safetensors.torch import save_file

    from kiln.config import gguf_cache_cleanup

    if find(path) is not None:  # a damaged one that could not be removed, or a racing save's
        logger.debug("weight snapshot not saved: %s already holds one for this key", path.parent)
        return False
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # id of a tensor -> the slot that saved it
    slots: dict[str, str | None] = {}  # slot -> its tensor's key, the slot it ties to, or None
    for slot, _, module, name in _slots(model):
        value = getattr(module, name)
        if value is None:
            slots[slot] = None
        elif id(value) in first:
            slots[slot] = "=" + first[id(value)]
        elif value.is_meta or value.layout != torch.strided or value.device.type != "cpu":
            logger.debug("weight snapshot skipped: %s is not a plain CPU tensor", slot)
            return False
        else:
            first[id(value)] = slot
            key = f"t{len(tensors)}"
            value = value.detach().contiguous()
            if value.untyped_storage().nbytes() != value.nbytes:  # a view: saved on its own
                value = value.clone()
            tensors[key] = value
            slots[slot] = key
    size = sum(t.nbytes for t in tensors.values())
    gguf_cache_cleanup.sweep(path.parent)  # a killed save's temporary holds the space checked
    try:
        free = shutil.disk_usage(path.parent if path.parent.exists() else envs.cache_root()).free
    except OSError:
        free = 0
    if free - size < _FREE_MARGIN:
        logger.info("weight snapshot not kept: it needs %.2f GB and %s has %.2f GB free (a "
                    "margin of %.0f GB is left)", size / 1e9, path.parent, free / 1e9,
                    _FREE_MARGIN / 1e9)
        return False
    after = primitive_attrs(model)
    changed = {p: {k: v for k, v in a.items() if attrs_before.get(p, {}).get(k, ...) != v}
               for p, a in after.items()}
    manifest = {"slots": slots, "attrs": {p: a for p, a in changed.items() if a}}
    tmp = temporary_beside(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"manifest": json.dumps(manifest)})
        with open(tmp, "rb") as f:
            crc = file_crc(f)
        # the CRC (of the whole file, header included) goes in the name
        os.replace(tmp, path.with_name(f"{path.stem}-{crc:08x}{path.suffix}"))
        _prune(path.parent)
    except Exception as e:  # noqa: BLE001 - a cache must never stop the model loading
        tmp.unlink(missing_ok=True)
        logger.warning("could not keep the weight snapshot at %s (%s: %s); later starts load "
                       "the model file", path, type(e).__name__, e)
        return False
    logger.info("kept the loaded weights at %s for later starts", path.parent)
    return True


def _prune(folder: Path) -> None:
    """Remove all but the `_KEEP` most recently used snapshots (a code change makes new keys)."""
    def last_used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # another process pruned it first
            return 0.0

    for old in sorted(folder.glob("weights-*.safetensors"), key=last_used, reverse=True)[_KEEP:]:
        old.unlink(missing_ok=True)


def restore(model: nn.Module, path: Path) -> Check | None:
    """Map the snapshot saved for `path` into the freshly built `model`; a started CRC check,
    or None (the model untouched) when there is none or it does not fit the model."""
    from safetensors import safe_open

    found = find(path)
    if found is None:
        return None
    file, crc = found
    handle = None
    try:
        handle = open(file, "rb")  # noqa: SIM115 - the CRC thread reads and closes it
        with safe_open(str(file), framework="pt") as f:
            manifest = json.loads(f.metadata()["manifest"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # views of the mapped file
        plan = _assignments(model, manifest, tensors)
    except Exception as e:  # a damaged or stale file must not stop the engine: load instead
        if handle is not None:
            handle.close()
        if isinstance(e, FileNotFoundError):  # pruned by another process as we looked
            return None
        logger.warning("weight snapshot %s unusable (%s); loading the model file", file,
                       _brief(e))
        discard(file)
        return None
    for apply in plan:
        apply()
    try:
        os.utime(file)  # recently used: kept by _prune
    except OSError:  # a read-only or shared cache: still usable
        pass
    return Check(file, handle, crc)


def _brief(e: Exception) -> str:
    """An error's type and the start of its text: a damaged header's may quote all of it."""
    text = str(e)
    return f"{type(e).__name__}: {text[:_BRIEF] + ' ...' if len(text) > _BRIEF else text}"


def discard(file: Path) -> bool:
    """Remove an unusable snapshot; False, with a warning, where it cannot be (a read-only or
    another user's cache): loading goes on from the model file."""
    try:
        file.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("could not remove the unusable weight snapshot %s (%s); starts load the "
                       "model file until it is removed", file, e)
        return False
    return True


def _assignments(model: nn.Module, manifest: dict,
                 tensors: dict) -> list[Callable[[], None]]:
    """What restoring does, after checking that every slot and attribute fits the model
    (raises where one does not)."""
    saved, plan, seen = manifest["slots"], [], set()
    here: dict[str, object] = {}  # slot -> what the fresh model holds there
    value_of: dict[str, torch.Tensor | None] = {}  # slot -> what it will hold
    for slot, kind, module, name in _slots(model):
        if slot not in saved:
            raise ValueError(f"{slot} is not in the snapshot")
        seen.add(slot)
        entry, current = saved[slot], getattr(module, name)
        here[slot] = current
        if entry is not None and entry.startswith("="):  # shares an earlier slot's tensor
            first = entry[1:]
            value = value_of[first]
            if kind == "p" and current is not here[first]:
                raise ValueError(f"{slot} is tied to {first} in the snapshot, not here")
        else:
            value = None if entry is None else tensors[entry]
        value_of[slot] = value
        if kind == "p":
            if value is None and current is None:
                continue  # a parameter slot left empty (a layer without bias)
            if value is None or current is None:
                raise ValueError(f"{slot}: a parameter is missing on one side")
            if tuple(current.shape) != tuple(value.shape) or current.dtype != value.dtype:
                raise ValueError(f"{slot}: {tuple(value.shape)} {value.dtype} saved, the model "
                                 f"has {tuple(current.shape)} {current.dtype}")
            plan.append(functools.partial(setattr, current, "data", value))
        elif kind == "b":
            plan.append(functools.partial(module._buffers.__setitem__, name, value))
        else:
            plan.append(functools.partial(setattr, module, name, value))
    if seen != set(saved):
        raise ValueError(f"{len(set(saved) - seen)} saved slots are not in the model")
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, attrs in manifest["attrs"].items():
        if path not in modules:
            raise ValueError(f"module {path} is not in the model")
        plan.extend(functools.partial(setattr, modules[path], k, v) for k, v in attrs.items())
    return plan
