"""The int8 weight packed into VNNI panels at load (kiln/ir/int8_panels.py): the layout packs and
unpacks exactly, the IR op int8_scaled_mm_panels's native kernel equals its reference (the
int8_scaled_mm reference on the unpacked weight) bit for bit at every row count, and which CPUs
pack (int8_ops.packs_weights), only where the panel op's native kernel is chosen. On a CPU
without AVX512-VNNI the native op is not supported and the reference runs; the layout tests run
everywhere.
"""
import pytest
import torch

from kiln import ir
from kiln.config import DeviceConfig, KilnConfig, ModelConfig
from kiln.ir import int8_panels, quant
from kiln.model.layers.linear import LinearBase
from kiln.model.loader import get_model
from kiln.native import build
from kiln.native import int8_ops as native

DTYPES = [torch.float32, torch.bfloat16]
# rows: one token (the decode kernel's two chains per column group), each register-tile height
# (1-6) and past it, a decode batch, a prefill chunk (a 96-row task and more). Where the CPU
# grants AMX tiles (from native.amx_min_rows(), 12): 11 and 12 either side of it; 12 and 17 a
# padded copy of the rows (16 of them in one tile, and two tiles); 32 and 40 rows read in place
# (40: and 8 padded after them); 257 and 1031 many blocks of rows, the half panels copied.
# (K, N): K a multiple of 4 but not of 64 (the group loop's end; the tiles' k tail), N past a
# panel's 64 columns and below one (a last panel with no second half of 32 channels).
ROWS = [1, 2, 5, 6, 7, 11, 12, 17, 32, 40, 97, 257, 1031]
KN = [(576, 960), (100, 13), (64, 130), (4, 1)]


def _w(n, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)


def test_layout_holds_each_byte_plus_128_by_panel_group_and_column():
    w = _w(70, 12)
    panels = int8_panels.pack_int8_panels(w)
    assert panels.dtype == torch.uint8 and panels.shape == (2, 3, 64, 4)
    for p, g, c, b in [(0, 0, 0, 0), (0, 2, 63, 3), (1, 1, 5, 2), (1, 0, 5, 0)]:
        assert panels[p, g, c, b].item() == w[64 * p + c, 4 * g + b].item() + 128
    assert (panels[1, :, 6:] == 0).all()  # past N
    assert torch.equal(int8_panels.unpack_int8_panels(panels, 70), w)


def test_pack_refuses_k_not_a_multiple_of_4():
    with pytest.raises(ValueError, match="multiple of 4"):
        int8_panels.pack_int8_panels(_w(8, 6))


def _operands(rows, k, n, dtype):
    g = torch.Generator().manual_seed(rows * 7 + k)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    q, scale = quant.dynamic_int8_quant.reference(x)
    w = _w(n, k)
    return q, scale, w, torch.rand(n, generator=g) * 0.02, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", KN)
@pytest.mark.parametrize("rows", ROWS)
def test_native_equals_reference(rows, k, n, dtype):
    q, scale, w, w_scale, bias = _operands(rows, k, n, dtype)
    panels = int8_panels.pack_int8_panels(w)
    op = int8_panels.int8_scaled_mm_panels
    for b in (None, bias):
        args = (q, scale, panels, w_scale, b, dtype)
        want = quant.int8_scaled_mm.reference(q, scale, w, w_scale, b, dtype)
        assert torch.equal(op.reference(*args), want)
        assert native.panels_gemm_supported(*args) == (native.isa() is not None)
        if native.isa() is not None:
            assert torch.equal(native.int8_scaled_mm_panels(*args), want)


# Rows either side of native.mm_silu_quant_min_rows() (256, wherever the kernels run): below
# it the three kernels in turn, from it blocks of 64 rows per thread, the last one short (257,
# 300) or whole (256, 1024). N even: [gate | up], a last panel of 32 channels or fewer (26, 130).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(576, 960), (100, 26), (64, 130)])
@pytest.mark.parametrize("rows", [1, 12, 255, 256, 257, 300, 1024])
def test_mm_silu_quant_equals_the_unfused_native_ops(rows, k, n, dtype):
    """Bit for bit the unfused native GEMM then SiLU-and-mul + quant (the fused op computes
    blocks of rows with the same kernels); within one int8 step of the reference composition,
    as the SiLU-and-mul + quant kernel alone is (tests/quantization/test_int8_ops.py)."""
    q, scale, w, w_scale, bias = _operands(rows, k, n, dtype)
    panels = int8_panels.pack_int8_panels(w)
    op = int8_panels.int8_scaled_mm_panels_silu_quant
    for b in (None, bias):
        args = (q, scale, panels, w_scale, b, dtype)
        rq, rs = op.reference(*args)
        assert rq.shape == (rows, n // 2) and rs.shape == (rows, 1)
        if native.isa() is None:
            continue
        got_q, got_s = native.int8_scaled_mm_panels_silu_quant(*args)
        want_q, want_s = native.silu_and_mul_dynamic_int8_quant(
            native.int8_scaled_mm_panels(*args))
        assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
        assert (got_q.int() - rq.int()).abs().max() <= 1
        assert torch.allclose(got_s, rs, rtol=2 ** -7, atol=0)


def test_mm_silu_quant_blocks_rows_on_amx_tiles_and_vnni_registers_alike():
    # VNNI register tiles too (Zen 4): the block's [gate | up] stays in L2 either way
    assert native.mm_silu_quant_min_rows() == (256 if native.isa() is not None else 0)
    if native.isa() is None:
        return
    q, scale, w, w_scale, _ = _operands(2, 64, 70, torch.float32)
    with pytest.raises(ValueError, match="must be even"):  # 69 channels: no [gate | up] halves
        native.int8_scaled_mm_panels_silu_quant(q, scale, int8_panels.pack_int8_panels(w[:69]),
                                                w_scale[:69], None, torch.float32)


@pytest.mark.parametrize("rows", [3, 40])  # the VNNI register tiles, the AMX tiles where granted
def test_native_keeps_subnormal_outputs_in_bfloat16(rows):
    """Outputs below float32's smallest normal (scales of 1e-21): the epilogue's one-instruction
    bfloat16 conversion would flush them to zero; they round as the reference's do."""
    q, _, w, _, _ = _operands(rows, 64, 64, torch.bfloat16)
    scale, w_scale = torch.full((rows, 1), 1e-21), torch.full((64,), 1e-21)
    panels = int8_panels.pack_int8_panels(w)
    want = quant.int8_scaled_mm.reference(q, scale, w, w_scale, None, torch.bfloat16)
    assert (want != 0).sum() > rows * 32  # mostly subnormal, not zero
    if native.isa() is not None:
        got = native.int8_scaled_mm_panels(q, scale, panels, w_scale, None, torch.bfloat16)
        assert torch.equal(got, want)


def test_native_takes_panels_off_a_64_byte_boundary_and_no_columns():
    if native.isa() is None:
        return
    q, scale, w, w_scale, _ = _operands(3, 64, 70, torch.float32)
    panels = int8_panels.pack_int8_panels(w)
    store = torch.empty(panels.numel() + 1, dtype=torch.uint8)
    shifted = store[1:].view(panels.shape)  # one byte past the allocation's alignment
    shifted.copy_(panels)
    want = quant.int8_scaled_mm.reference(q, scale, w, w_scale, None, torch.float32)
    assert torch.equal(native.int8_scaled_mm_panels(q, scale, shifted, w_scale, None,
                                                    torch.float32), want)
    # K == 0: every output is the bias
    empty = int8_panels.pack_int8_panels(torch.zeros(5, 0, dtype=torch.int8))
    bias = torch.randn(5)
    got = native.int8_scaled_mm_panels(torch.zeros(4, 0, dtype=torch.int8), torch.rand(4, 1),
                                       empty, torch.rand(5), bias, torch.float32)
    assert torch.equal(got, bias.expand(4, 5))


def test_native_refuses_panels_that_do_not_fit():
    if native.isa() is None:
        return
    q, scale, w, w_scale, _ = _operands(2, 64, 70, torch.float32)
    panels = int8_panels.pack_int8_panels(w)
    with pytest.raises(ValueError, match="do not fit together"):  # N says one panel, not two
        native.int8_scaled_mm_panels(q, scale, panels, w_scale[:60], None, torch.float32)
    with pytest.raises(ValueError, match="do not fit together"):  # K 64 against panels of 68
        native.int8_scaled_mm_panels(q, scale, int8_panels.pack_int8_panels(_w(70, 68)),
                                     w_scale, None, torch.float32)


def test_which_cpus_pack():
    """Packed wherever the int8 kernels run (VNNI register tiles, AMX tiles from
    native.amx_min_rows() rows), K a multiple of 4, on the CPU."""
    # from the CPU's flags, not the code's own answer (isa): AMX machines pack too
    kernels = build.available() and {"avx512f", "avx512bw", "avx512vl",
                                     "avx512_vnni"} <= build.cpu_flags()
    assert native.packs_weights(576, "cpu") == kernels
    assert not native.packs_weights(6, "cpu")
    assert not native.packs_weights(576, "meta")


def _packed(model_dir, **kw) -> set[bool]:
    cfg = KilnConfig(ModelConfig(model=str(model_dir), dtype="float32", quantization="int8"),
                     device_config=DeviceConfig("cpu"), enforce_eager=True, **kw)
    return {m.weight_panels is not None for m in get_model(cfg).modules()
            if isinstance(m, LinearBase)}


@pytest.fixture
def default_ir_selection_after(monkeypatch):
    """get_model binds its config's IR selection process-wide (here torch for some ops): the
    tests after this one get the default back, resolved without this test's environment."""
    yield
    monkeypatch.undo()
    ir.apply(ir.resolve({}, "cpu", torch.float32))


def test_packed_only_where_the_panel_kernel_is_chosen(tiny_llama_dir, monkeypatch,
                                                      default_ir_selection_after):
    """With the torch reference chosen for the panel op (KILN_NATIVE_CPU_OPS=0, or a priority
    naming it), packing would unpack the whole weight on every call: the weight stays as
    stored and int8_scaled_mm (with its own selection) runs."""
    assert _packed(tiny_llama_dir) == {native.packs_weights(64, "cpu")}
    assert _packed(tiny_llama_dir, ir_op_priority={"int8_scaled_mm_panels": ["torch"]}) == {False}
    monkeypatch.setenv("KILN_NATIVE_CPU_OPS", "0")
    assert _packed(tiny_llama_dir) == {False}
