"""N-gram speculative decoding in compile mode 3 (the verification step is a general token
range of the piecewise graph), beside a grammar-constrained request, and in /metrics."""
from kiln import SamplingParams
from kiln.sampling_params import StructuredOutputsParams

from .test_spec_decode_e2e import PROMPTS, SPEC, generate, make, spec_totals


def test_mode_3_greedy_is_hf_greedy_with_drafts_accepted(inprocess_core, tiny_llama_dir):
    from checkpoints import hf_greedy

    llm = make(tiny_llama_dir, SPEC, mode=3)  # piecewise, Inductor's compile left out
    assert llm.llm_engine.kiln_config.compilation_config.mode == 3
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = generate(llm, PROMPTS, params)
    assert spec_totals(llm)["spec_decode_num_accepted_tokens"] > 0
    assert [list(o.token_ids) for o in outs] == hf_greedy(tiny_llama_dir, PROMPTS, 20)
    # a grammar's request is decoded token by token (no drafts) beside drafted ones
    regex = SamplingParams(temperature=0, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex="(w[3-9])+"))
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                         [regex, params], use_tqdm=False)
    tokens = mixed[0].outputs[0].token_ids
    assert len(tokens) == 12 and set(tokens) <= set(range(3, 10)), tokens
    assert list(mixed[1].outputs[0].token_ids) == hf_greedy(tiny_llama_dir, PROMPTS[1:2], 20)[0]


def test_spec_decode_counters_in_metrics():
    from kiln.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m", log_interval=None)
    metrics.update_gauges({"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 11,
                           "spec_decode_num_accepted_tokens": 6,
                           "spec_decode_num_accepted_tokens_per_pos": [4, 2, 0]})
    metrics.update_gauges({"spec_decode_num_accepted_tokens_per_pos": [5, 2, 1]})
    text = metrics.render().decode()
    for line in ('kiln:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0',
                 'kiln:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 11.0',
                 'kiln:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0',
                 'kiln:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="0"} 5.0',
                 'kiln:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="2"} 1.0'):
        assert line in text
