"""Inductor options a compiled model's numerics need, under the user's inductor_compile_config
(a pure function of the config: kiln/compilation/backend.py passes them to each piece).

W8A8 int8 in bfloat16 / float16 with an activation quantization on its torch reference
(compilation_config custom_ops ["none"], "-rms_norm_dynamic_int8_quant", ...): the references
round to the model dtype right before quantizing (rms_norm's dtype(x32 * rsqrt(...)), SiLU in
the model dtype), and Inductor, fusing the inlined references, keeps those intermediates in
float32 unless told to emulate the casts. The int8 value then moves a step from eager's on
some elements, and mode 3's greedy tokens differed from mode 0's (logprobs by up to 0.57 on a
tiny Qwen3), where the native kernels give identical ones. With the casts emulated, the tiny
Llama and Qwen3 checkpoints give bit-identical logprobs in modes 0 and 3. What still differs:
Inductor sums RMSNorm's float32 squares in another order than ATen (the last bit of about a
third of rows, which no option changes), moving about one value in 10^6 by a bfloat16 / int8
step (the default model quantized on load: same tokens, logprobs within 2e-3).

Gemma, Gemma-2 and OLMo-2 in a 16-bit dtype: their norms (kiln/ir/f32_scale_norm.py) are
torch references that round to the model dtype as HF's do, and Inductor kept float32 there
too: bfloat16 logprobs differed from mode 0's by up to 0.03 where Llama's are bit-identical.

Other float models and the native kernels are left as they are: no rounding there turns a
float32 ulp into a token.
"""
import torch

# IR ops that quantize an activation computed in the model dtype (kiln/ir/quant.py,
# kiln/ir/int8_panels.py)
INT8_ACT_QUANT_OPS = ("dynamic_int8_quant", "rms_norm_dynamic_int8_quant",
                      "fused_add_rms_norm_dynamic_int8_quant",
                      "silu_and_mul_dynamic_int8_quant", "int8_scaled_mm_panels_silu_quant")


def needs_emulated_casts(kiln_config) -> bool:
    """A 16-bit model with an int8 activation quantization on its torch reference, or a family
    whose own norms round to the model dtype (F32_SCALE_NORM_OPS, torch references only)."""
    from kiln.model.registry import F32_SCALE_NORM_OPS, ir_ops_not_called

    model_config = kiln_config.model_config
    if model_config.torch_dtype not in (torch.bfloat16, torch.float16):
        return False
    if set(F32_SCALE_NORM_OPS) - ir_ops_not_called(model_config.architecture):
        return True
    chosen = kiln_config.ir_selection.as_dict()
    return (model_config.quant_kind == "int8"
            and any(chosen.get(op) == "torch" for op in INT8_ACT_QUANT_OPS))


def inductor_options(kiln_config) -> dict:
    """compilation_config.inductor_compile_config over the options this model's numerics need
    (the user's value wins: emulate_precision_casts False turns it off)."""
    options = {"emulate_precision_casts": True} if needs_emulated_casts(kiln_config) else {}
    return {**options, **kiln_config.compilation_config.inductor_compile_config}
