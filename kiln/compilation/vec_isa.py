"""Inductor's CPU vector-ISA probe, run once per machine instead of once per process.

Before its first CPU kernel, Inductor builds a test library per candidate ISA (AVX2, AVX-512, ...)
and dlopens each in a child process: ~0.4 s apiece, 1.1 s of every warm start on the 2-core dev
host. The answer depends only on the CPU, the C++ compiler and torch, so Kiln keeps it under its
cache root; when every candidate passed, later processes set Inductor's `cpp.vec_isa_ok` (what the
probe would have concluded) and skip it. The AVX-512 and VNNI candidates probe extensions on top
(bf16 conversions, dot products: ~0.07 s apiece) whatever the flag says; their results are kept
in the same verdict. Any surprise leaves Inductor to probe as usual.
"""
import hashlib
import json
import platform
import subprocess
from pathlib import Path

import torch

from kiln import envs
from kiln.atomic_write import atomic_write_text
from kiln.compilation import inductor_patches
from kiln.logger import init_logger

logger = init_logger(__name__)


def _compiler_identity() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    return f"{compiler}\n{version}"


def machine_key() -> str:
    """What the probe's answer depends on: torch, the CPU's ISA flags, the C++ compiler."""
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    factors = [torch.__version__, platform.machine(), sorted(x86_isa_checker()),
               _compiler_identity()]
    return hashlib.sha256(repr(factors).encode()).hexdigest()[:16]


def _probed_equals_assumed() -> bool:
    """Probe every candidate ISA (Inductor's own valid_vec_isa_list), and compare with what
    Inductor assumes when told `vec_isa_ok`: the same list means the flag changes nothing."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    probed = [str(isa) for isa in valid_vec_isa_list()]
    with config.patch({"cpp.vec_isa_ok": True}):
        assumed = [str(isa) for isa in valid_vec_isa_list.__wrapped__()]
    return bool(probed) and probed == assumed


def settle(verdict_dir: Path | None = None) -> bool:
    """Set `cpp.vec_isa_ok` when this machine's probe is known (or now proved) to pass for
    every candidate; returns whether it did. Call before hashing Inductor's config, in every
    process alike, so the compile cache key does not depend on which process probed."""
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return False  # the user decided (TORCHINDUCTOR_VEC_ISA_OK), or no probe to save
    if envs.disable_compile_cache():
        return False
    if verdict_dir is None and _gave_up["root"] == envs.cache_root():
        # This process already let Inductor probe: setting the flag now would change Inductor's
        # config hash, so the compile cache key, between this process's compiles.
        return False
    try:
        verdict = (verdict_dir or envs.cache_root() / "inductor_vec_isa") / f"{machine_key()}.json"
        passes = _read_verdict(verdict)
        if passes is None:  # none yet, or damaged: probe and write it (again)
            if not _probed_equals_assumed():
                return _give_up(verdict_dir)
            atomic_write_text(verdict, json.dumps({"all_candidates_pass": True}))
        elif not passes:
            return _give_up(verdict_dir)
    except Exception as e:  # an optimisation only: on any surprise Inductor probes as usual
        logger.debug("vector-ISA verdict unavailable (%s: %s); Inductor probes", type(e).__name__,
                     e)
        return _give_up(verdict_dir)
    config.cpp.vec_isa_ok = True
    _remember_extension_probes(verdict)
    return True


# The cache root whose verdict this process did without (Inductor probes as usual): decided
# once, as a later success would leave the process's earlier cache keys unreachable.
_gave_up: dict = {"root": None}


def _give_up(verdict_dir: Path | None) -> bool:
    if verdict_dir is None:
        _gave_up["root"] = envs.cache_root()
    return False


def _read_verdict(verdict: Path) -> bool | None:
    """The verdict's all_candidates_pass; None when there is no file or it is damaged (a
    damaged one changes Inductor's config hash, so every compile cache would miss: say so)."""
    try:
        data = json.loads(verdict.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("vector-ISA verdict %s is damaged (%s); probing again", verdict, e)
        return None
    if not isinstance(data, dict):
        logger.warning("vector-ISA verdict %s is damaged (not an object); probing again", verdict)
        return None
    return bool(data.get("all_candidates_pass"))


# The verdict file the extension probes are remembered in (the latest settle's); one process
# has one machine, so this state is process-wide.
_probe_memo: dict = {"verdict": None}


def _remember_extension_probes(verdict: Path) -> None:
    """Have Inductor's per-ISA build probe read an answer this machine gave from `verdict`."""
    _probe_memo["verdict"] = verdict
    inductor_patches.remember_isa_build_probes(_recall_build)


def _recall_build(isa, code: str, probe) -> bool:
    """The recorded answer of `probe(isa, code)`, probed and recorded when there is none."""
    path = _probe_memo["verdict"]
    key = hashlib.sha256(f"{isa}|{isa.build_arch_flags()}|{code}".encode()).hexdigest()[:16]
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return probe(isa, code)
    builds = known.setdefault("builds", {}) if isinstance(known, dict) else None
    if not isinstance(builds, dict):  # valid JSON of another shape: damaged all the same
        return probe(isa, code)
    if key not in builds:
        builds[key] = bool(probe(isa, code))
        try:
            atomic_write_text(path, json.dumps(known))
        except OSError as e:  # unremembered, not wrong: the next process probes again
            logger.debug("could not record a vector-ISA probe in %s: %s", path, e)
    return builds[key]
