"""`kiln bench throughput --backend hf`'s baseline: the same checkpoint, prompts and sampling
through HF transformers generate, in batches of max_num_seqs.
"""
import time

from kiln.benchmarks.throughput import RunResult


def load_hf_model(kiln_config):
    """The same checkpoint through transformers (random weights for --load-format dummy)."""
    from transformers import AutoModelForCausalLM

    mc = kiln_config.model_config
    if kiln_config.load_config.load_format == "dummy":
        from kiln.config.hf_config_snapshot import as_transformers_config

        model = AutoModelForCausalLM.from_config(as_transformers_config(mc.hf_config),
                                                 dtype=mc.torch_dtype)
    elif mc.gguf_file is not None:
        model = AutoModelForCausalLM.from_pretrained(mc.gguf_file.parent,
                                                     gguf_file=mc.gguf_file.name,
                                                     dtype=mc.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(mc.model_path, dtype=mc.torch_dtype)
    return model.to(kiln_config.device_config.device_obj).eval()


def left_pad(batch: list[list[int]], pad_id: int):
    import torch

    width = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return ids, mask


def run_hf(model, prompts: list[list[int]], params, batch_size: int, pad_id: int,
           seed: int = 0) -> RunResult:
    """The same sampling as Kiln's run (bench_params), seeded by --seed."""
    import torch

    output_len = params.max_tokens
    # top_k 0: a checkpoint's generation config (HF's default: 50) would cut what Kiln samples
    sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                    top_k=0) if params.temperature > 0 else dict(do_sample=False)
    # Nor may its other sampling defaults apply (Kiln's requests take none: vLLM's bench
    # neither): a generation_config.json's repetition_penalty made HF's run other work.
    sampling.update(repetition_penalty=1.0, min_p=None, typical_p=1.0, no_repeat_ngram_size=0)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    with torch.inference_mode():  # untimed warm-up, as Kiln warms up while it is built
        ids, mask = left_pad(prompts[:1], pad_id)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **sampling,
                       max_new_tokens=2, min_new_tokens=2, pad_token_id=pad_id)
    num_out = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids, mask = left_pad(prompts[i:i + batch_size], pad_id)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 **sampling, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=pad_id)
            num_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return RunResult(elapsed, len(prompts), sum(map(len, prompts)), num_out)
