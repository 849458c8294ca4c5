"""Which CUDA graphs exist and which one a step uses: capture sizes, padding, mode resolution.

The decisions are pure functions; `CudagraphDispatcher` holds their result for one worker.
"""
import bisect

from kiln.config.compilation_config import CompilationMode
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

MAX_DEFAULT_CAPTURE_SIZE = 512


# ---- capture sizes and padding --------------------------------------------------------------

def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                          max_capture_size: int | None = None) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to min(2 x max_num_seqs, 512) (or up to
    max_capture_size when given), none above max_num_batched_tokens."""
    limit = max_capture_size if max_capture_size is not None else min(
        2 * max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    limit = min(limit, max_num_batched_tokens)
    candidates = [1, 2, 4] + list(range(8, limit + 1, 8))
    return [s for s in candidates if s <= limit]


def resolve_capture_sizes(explicit: list[int] | None, max_num_seqs: int,
                          max_num_batched_tokens: int,
                          max_capture_size: int | None = None) -> list[int]:
    """The sorted, de-duplicated capture sizes: the explicit list if given, else the default."""
    if max_capture_size is not None and (not isinstance(max_capture_size, int)
                                         or max_capture_size < 0):
        raise ConfigError(f"compilation_config.max_cudagraph_capture_size must be a non-negative "
                          f"integer; got {max_capture_size!r}")
    if explicit is None:
        return default_capture_sizes(max_num_seqs, max_num_batched_tokens, max_capture_size)
    for size in explicit:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"compilation_config.cudagraph_capture_sizes entries must be "
                              f"positive integers; got {size!r}")
        if size > max_num_batched_tokens:
            raise ConfigError(f"cudagraph capture size {size} exceeds max_num_batched_tokens "
                              f"({max_num_batched_tokens}); drop it from "
                              f"compilation_config.cudagraph_capture_sizes or raise "
                              f"--max-num-batched-tokens")
        if max_capture_size is not None and size > max_capture_size:
            raise ConfigError(f"cudagraph capture size {size} exceeds compilation_config."
                              f"max_cudagraph_capture_size ({max_capture_size}); drop it from "
                              f"compilation_config.cudagraph_capture_sizes or raise the maximum")
    return sorted(set(explicit))


def pad_to_capture_size(num_tokens: int, capture_sizes: list[int]) -> int | None:
    """The smallest capture size >= num_tokens, or None above the largest (run eagerly)."""
    i = bisect.bisect_left(capture_sizes, num_tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def build_padding_table(capture_sizes: list[int]) -> list[int]:
    """table[n] = padded size for n tokens, for n in 0..max(capture_sizes); table[0] = 0."""
    table = [0]
    for n in range(1, (capture_sizes[-1] if capture_sizes else 0) + 1):
        table.append(pad_to_capture_size(n, capture_sizes))
    return table


# ---- mode resolution ------------------------------------------------------------------------

def default_cudagraph_mode(compilation_mode: int) -> CUDAGraphMode:
    """vLLM's default: FULL_AND_PIECEWISE on top of the piecewise stack, otherwise NONE."""
    if compilation_mode == CompilationMode.KILN_COMPILE:
        return CUDAGraphMode.FULL_AND_PIECEWISE
    return CUDAGraphMode.NONE


def resolve_cudagraph_mode(requested, *, platform_supports_cudagraph: bool, enforce_eager: bool,
                           compilation_mode: int, has_splitting_ops: bool,
                           attn_supports_full: bool) -> tuple[CUDAGraphMode, list[str]]:
    """The mode a worker really uses, and why it differs from the request (empty: it doesn't).

    `requested` None means the default for the compilation mode. PIECEWISE graphs need the
    piecewise stack (mode 3 with splitting ops); FULL graphs need an attention backend that
    declares `supports_full_cudagraph`; a FULL graph over an uncompiled model is allowed.
    """
    M = CUDAGraphMode
    if requested is None:
        if enforce_eager:
            return M.NONE, []  # eager was asked for; nothing to explain
        mode = default_cudagraph_mode(compilation_mode)
    else:
        mode = M.parse(requested)
    if mode is M.NONE:
        return mode, []
    if not platform_supports_cudagraph:
        return M.NONE, ["this platform has no CUDA graphs"]
    if enforce_eager:
        return M.NONE, ["enforce_eager=True"]
    reasons = []
    piecewise_ok = compilation_mode == CompilationMode.KILN_COMPILE and has_splitting_ops
    if mode.has_piecewise_cudagraphs() and not piecewise_ok:
        # Drop the piecewise half; a FULL half survives on its own.
        mode = M.FULL_DECODE_ONLY if mode is M.FULL_AND_PIECEWISE else M.NONE
        reasons.append(f"PIECEWISE graphs need compilation mode 3 with splitting_ops (mode is "
                       f"{int(compilation_mode)})")
    if mode.has_full_cudagraphs() and not attn_supports_full:
        downgraded = {M.FULL: M.PIECEWISE if piecewise_ok else M.NONE,
                      M.FULL_DECODE_ONLY: M.NONE,
                      M.FULL_AND_PIECEWISE: M.PIECEWISE}[mode]
        reasons.append(f"the attention backend does not support FULL graphs "
                       f"({mode.name} -> {downgraded.name})")
        mode = downgraded
    return mode, reasons


def attention_supports_full_cudagraph(platform=None) -> bool:
    """The `supports_full_cudagraph` flag of the platform's attention backend."""
    from kiln.attention.backend import get_attn_backend

    return bool(getattr(get_attn_backend(platform), "supports_full_cudagraph", False))


def resolve_cudagraph_config(kiln_config, platform=None, attn_supports_full: bool | None = None
                             ) -> tuple[CUDAGraphMode, list[int]]:
    """The mode a worker really uses and the sorted capture sizes, from the (frozen) config's
    request; logs one line when the mode differs from it. The result is the dispatcher's state
    (CudagraphDispatcher.from_config), never written back into the config."""
    if platform is None:
        platform = kiln_config.platform
    cc, sched = kiln_config.compilation_config, kiln_config.scheduler_config
    if attn_supports_full is None:
        attn_supports_full = attention_supports_full_cudagraph(platform)
    requested = cc.cudagraph_mode
    compilation_mode = cc.mode if cc.mode is not None else (
        CompilationMode.NONE if kiln_config.enforce_eager else CompilationMode.KILN_COMPILE)
    mode, reasons = resolve_cudagraph_mode(
        requested, platform_supports_cudagraph=platform.supports_cudagraph,
        enforce_eager=kiln_config.enforce_eager, compilation_mode=compilation_mode,
        has_splitting_ops=bool(cc.splitting_ops), attn_supports_full=attn_supports_full)
    if reasons:
        asked = CUDAGraphMode.parse(requested).name if requested is not None else "default"
        logger.info("cudagraph_mode %s resolves to %s on %s: %s", asked, mode.name,
                    platform.device_type, "; ".join(reasons))
    sizes = resolve_capture_sizes(cc.cudagraph_capture_sizes, sched.max_num_seqs,
                                  sched.max_num_batched_tokens, cc.max_cudagraph_capture_size)
    return mode, sizes


# ---- the dispatcher -------------------------------------------------------------------------

class CudagraphDispatcher:
    """The single source of truth for which graphs exist; maps each step to (mode, key).

    Keys per runtime mode: the mixed half (PIECEWISE or FULL) gets one token-count key per
    capture size; a separate FULL decode half gets all-decode keys (num_reqs == num_tokens) for
    the capture sizes that fit max_num_seqs requests.
    """

    def __init__(self, cudagraph_mode: "CUDAGraphMode | str | int", capture_sizes: list[int],
                 max_num_seqs: int):
        self.cudagraph_mode = CUDAGraphMode.parse(cudagraph_mode)
        self.capture_sizes = sorted(set(capture_sizes))
        self.max_num_seqs = max_num_seqs
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
        mixed = self.cudagraph_mode.mixed_mode()
        if mixed is not CUDAGraphMode.NONE:
            self.keys[mixed].update(BatchDescriptor(s) for s in self.capture_sizes)
        if self.cudagraph_mode.separate_routine() and \
                self.cudagraph_mode.decode_mode() is CUDAGraphMode.FULL:
            self.keys[CUDAGraphMode.FULL].update(
                BatchDescriptor(s, s, True) for s in self.capture_sizes if s <= max_num_seqs)
        self._padding = build_padding_table(self.capture_sizes)

    @classmethod
    def from_config(cls, kiln_config, platform=None,
                    attn_supports_full: bool | None = None) -> "CudagraphDispatcher":
        """The dispatcher of the mode and sizes resolve_cudagraph_config resolves."""
        mode, sizes = resolve_cudagraph_config(kiln_config, platform, attn_supports_full)
        return cls(mode, sizes, kiln_config.scheduler_config.max_num_seqs)

    @property
    def max_capture_size(self) -> int:
        """Largest size any graph was planned for (0: no graphs)."""
        if not any(self.keys.values()):
            return 0
        return max(d.num_tokens for keys in self.keys.values() for d in keys)

    def dispatch(self, num_tokens: int, num_reqs: int,
                 uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """(runtime mode, descriptor) for a batch: FULL key first, then PIECEWISE, else NONE.

        With a graph, the descriptor is padded (run num_tokens tokens; decode keys also pad
        num_reqs); with NONE it is the batch as given.
        """
        if num_tokens < 1:
            raise ValueError(f"dispatch needs num_tokens >= 1; got {num_tokens}")
        if uniform_decode and num_reqs != num_tokens:
            raise ValueError(f"an all-decode batch has one token per request; got num_tokens="
                             f"{num_tokens}, num_reqs={num_reqs}")
        eager = (CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform_decode))
        if num_tokens >= len(self._padding):
            return eager
        padded = self._padding[num_tokens]
        if uniform_decode:
            key = BatchDescriptor(padded, padded, True)
            if key in self.keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, key
        key = BatchDescriptor(padded)
        for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            if key in self.keys[mode]:
                return mode, key
        return eager

    def capture_plan(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every key to record before serving: PIECEWISE before FULL, largest first in each."""
        plan = []
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            keys = sorted(self.keys[mode], key=lambda d: (d.num_tokens, d.uniform_decode),
                          reverse=True)
            plan.extend((mode, d) for d in keys)
        return plan
