"""Each rank computes under the engine's torch float32 matmul precision: a rank's interpreter
(spawned by mp, or a Ray actor) started at torch's default, so docs/models.md's
set_float32_matmul_precision("high") before building reached the core but not its ranks, and a
GGUF model's float32 kernels (gguf_matmul.float32_limbs) ran another path at tp 2 than at tp 1."""
import torch

from parallel_helpers import make_llm, shutdown_and_check_ranks_exit


def test_ranks_run_under_the_engines_float32_matmul_precision(tiny_llama_dir, bounded, capfd):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        llm = make_llm(tiny_llama_dir, tensor_parallel_size=2)
    finally:
        torch.set_float32_matmul_precision(before)
    try:
        err = capfd.readouterr().err
        ready = [line for line in err.splitlines() if "ready (tp rank" in line]
        assert len(ready) == 2 and all("float32 matmul precision high)" in line
                                       for line in ready), ready
    finally:
        shutdown_and_check_ranks_exit(llm)
