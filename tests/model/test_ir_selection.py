"""Choosing the IR ops' implementations: priority lists and their errors, platform defaults,
the CLI flag, and that a choice binds what eager forwards run."""
import argparse

import pytest
import torch

from kiln import ir
from kiln.engine.arg_utils import EngineArgs
from kiln.ir import selection


def test_cpu_defaults_take_the_native_kernels_and_torch_first_on_request(monkeypatch):
    chosen = ir.resolve({}, "cpu", torch.float32).as_dict()
    # every op with a CPU kernel takes it; the all-reduce is torch.distributed's alone
    assert chosen == {name: "native" if "native" in op.impls else "torch"
                      for name, op in ir.REGISTRY.items()}
    assert chosen["all_reduce"] == "torch"
    assert set(ir.resolve({}, "cpu", torch.bfloat16).as_dict().values()) == {"native", "torch"}
    monkeypatch.setenv("KILN_NATIVE_CPU_OPS", "0")  # the shorthand for torch first
    assert set(ir.resolve({}, "cpu", torch.float32).as_dict().values()) == {"torch"}


def test_an_override_changes_the_choice_and_unsupported_providers_are_passed_over():
    chosen = ir.resolve({"rms_norm": ["torch", "native"]}, "cpu", torch.float32).as_dict()
    assert chosen["rms_norm"] == "torch" and chosen["linear"] == "native"
    # float16: no CPU kernel takes it, so the first supported entry is the reference
    assert ir.resolve({"rms_norm": ["native"]}, "cpu", torch.float16).provider("rms_norm") == (
        "torch")
    # no cuda provider yet: the next entry of the list
    assert ir.resolve({"linear": ["cuda", "native"]}, "cpu", torch.float32).provider(
        "linear") == "native"


@pytest.mark.parametrize("priority, message", [
    ({"rms_nrom": ["torch"]},
     r"unknown IR op 'rms_nrom'; valid ops: all_reduce, dynamic_fp8_quant, dynamic_int8_quant, "
     r".*linear"),
    ({"rms_norm": ["triton"]}, r"unknown provider 'triton'; valid providers: native, cuda, torch"),
    ({"rms_norm": []}, r"non-empty list"),
    (["rms_norm"], r"must be a dict"),
])
def test_unknown_names_are_errors_listing_the_valid_ones(priority, message):
    with pytest.raises(ValueError, match=message):
        ir.check_priority(priority)


def test_cli_flag_is_repeatable_and_checked():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ir-op-priority", "rms_norm=native,torch",
                              "--ir-op-priority", "linear=torch",
                              "--ir-op-priority", "rms_norm=torch"])
    assert EngineArgs.from_cli_args(args).ir_op_priority == {"rms_norm": ["torch"],
                                                             "linear": ["torch"]}
    for bad in ("rms_norm", "nope=torch", "rms_norm=gpu"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--ir-op-priority", bad])
    assert selection.parse_cli(["silu_and_mul = torch , native"]) == {
        "silu_and_mul": ["torch", "native"]}


def test_vllm_custom_ops_choose_the_torch_reference_or_the_kernel():
    """compilation_config.custom_ops as vLLM users write it (it was taken and did nothing):
    "none" / "all" for every op, then "-op" / "+op", whatever their order."""
    all_torch = selection.custom_ops_priority(["+rms_norm", "none"], "cpu")
    assert all_torch["rms_norm"] == ["native", "torch"]
    assert {k: v for k, v in all_torch.items() if k != "rms_norm"} == {
        name: ["torch"] for name in ir.REGISTRY if name != "rms_norm"}
    assert selection.custom_ops_priority(["all", "-linear"], "cpu")["linear"] == ["torch"]
    assert selection.custom_ops_priority(["-silu_and_mul"], "cuda") == {"silu_and_mul": ["torch"]}
    assert selection.custom_ops_priority([], "cpu") == {}
    for bad in (["rms_norm"], ["-rmsnorm"], ["None"]):
        with pytest.raises(ValueError, match="custom_ops: .* is none of 'all', 'none'"):
            selection.custom_ops_priority(bad, "cpu")
    # Contradictions are refused, as vLLM asserts, not settled by order.
    with pytest.raises(ValueError, match="custom_ops holds both 'all' and 'none'"):
        selection.custom_ops_priority(["all", "none"], "cpu")
    with pytest.raises(ValueError, match=r"turns rms_norm both on \(\+\) and off \(-\)"):
        selection.custom_ops_priority(["+rms_norm", "-rms_norm"], "cpu")


def test_custom_ops_reach_the_engine_under_an_explicit_priority(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir),
                        compilation_config={"custom_ops": ["none"]},
                        ir_op_priority={"linear": ["native"]}).create_kiln_config()
    chosen = config.ir_selection.as_dict()
    assert chosen["linear"] == "native" and chosen["rms_norm"] == "torch"
    with pytest.raises(ValueError, match="compilation_config.custom_ops must be"):
        EngineArgs(compilation_config={"custom_ops": "none"}).create_kiln_config()


def test_engine_args_refuse_an_unknown_op_before_loading_anything():
    with pytest.raises(ValueError, match="unknown IR op 'rmsnorm'"):
        EngineArgs(ir_op_priority={"rmsnorm": ["torch"]}).create_kiln_config()


def test_apply_binds_what_eager_calls_run():
    torch_first = ir.resolve({name: ["torch"] for name in ir.REGISTRY}, "cpu", torch.float32)
    default = ir.resolve({}, "cpu", torch.float32)
    x, w = torch.randn(2, 64), torch.randn(64)
    try:
        ir.apply(torch_first)
        assert ir.applied()["rms_norm"] == "torch"
        assert ir.rms_norm.bound is ir.rms_norm.reference
        ir.apply(default)
        assert ir.applied() == default.as_dict()
        # the native op itself: an eager call goes from the IR op to the dispatcher directly
        assert ir.rms_norm.bound is torch.ops.kiln.rms_norm_native.default
        torch.testing.assert_close(ir.rms_norm(x, w, 1e-6), ir.rms_norm.reference(x, w, 1e-6),
                                   rtol=1e-5, atol=1e-6)
    finally:
        ir.apply(default)


def test_a_traced_call_is_the_ir_op_itself():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda x, w: ir.rms_norm(x, w, 1e-6), backend=backend, fullgraph=True)
    fn(torch.randn(2, 8), torch.randn(8))
    assert seen == [torch.ops.kiln.rms_norm.default]


def test_building_a_model_waits_for_another_engines_forward(tiny_llama_dir):
    """Two in-process engines with different op choices: one building its model while the
    other's forward runs in another thread must not rebind the running forward's ops."""
    import threading

    from kiln.forward_context import set_forward_context
    from kiln.model.loader import get_model

    running = EngineArgs(model=str(tiny_llama_dir),
                         ir_op_priority={"rms_norm": ["native"]}).create_kiln_config()
    building = EngineArgs(model=str(tiny_llama_dir),
                          ir_op_priority={"rms_norm": ["torch"]}).create_kiln_config()
    built = threading.Event()
    thread = threading.Thread(target=lambda: (get_model(building), built.set()))
    try:
        with set_forward_context(None, running, layers={}):
            thread.start()
            built.wait(5)  # the build ends before this unless it waits for the turn
            assert ir.applied()["rms_norm"] == "native"
            assert not built.is_set()
        thread.join(120)
        assert built.is_set() and ir.applied()["rms_norm"] == "torch"
    finally:
        thread.join(120)
        ir.apply(ir.resolve({}, "cpu", torch.float32))
