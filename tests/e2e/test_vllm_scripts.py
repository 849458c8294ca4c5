"""vLLM's offline examples, run with `vllm` replaced by `kiln` (helper-124's migration scripts),
kept where they caught a break: their imports and the calls they make, on a tiny checkpoint."""
import pytest

from kiln import LLM, SamplingParams

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

ENGINE = dict(enforce_eager=True, max_model_len=64, max_num_seqs=8, kv_cache_memory=0.02)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


def test_vllm_inputs_prompt_types(llm):
    """`from vllm.inputs import TokensPrompt` (vLLM's prefix-caching and token-id examples) was
    a ModuleNotFoundError as kiln.inputs."""
    from kiln.inputs import TextPrompt, TokensPrompt

    greedy = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.get_tokenizer().encode("w5 w6 w7")
    by_ids, by_text = llm.generate([TokensPrompt(prompt_token_ids=ids),
                                    TextPrompt(prompt="w5 w6 w7")], greedy, use_tqdm=False)
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_vllm_beam_search_example(llm):
    """examples/offline_inference's beam search (llm.beam_search with BeamSearchParams from
    vllm.sampling_params): a TypeError once priority scheduling made _run_batch's priorities
    required."""
    from kiln.sampling_params import BeamSearchParams

    outs = llm.beam_search([{"prompt": "w5 w6"}, "w7"], BeamSearchParams(beam_width=2,
                                                                        max_tokens=3))
    assert [len(o.sequences) for o in outs] == [2, 2]
    for o in outs:
        assert o.sequences[0].cum_logprob >= o.sequences[1].cum_logprob
