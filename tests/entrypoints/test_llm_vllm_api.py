"""vLLM's LLM keywords and methods that Kiln has no feature for: taken at the values that ask
for nothing, refused by name otherwise (not a TypeError or AttributeError)."""
import signal

import pytest
from tqdm import tqdm

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

ENGINE = dict(enforce_eager=True, max_model_len=64, max_num_seqs=2, kv_cache_memory=0.02)
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
PARAMS = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


def test_priority_under_fcfs_is_taken_and_ignored_bad_ones_are_refused(llm):
    # vLLM V1 takes any int priority under its default fcfs policy and ignores it (V0 refused
    # a non-zero one); tests/core/test_priority_e2e.py runs scheduling_policy="priority".
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 0])
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9]]
    plain = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=None)
    ranked = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[5, -3])
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    with pytest.raises(ValueError, match=r"priority must be a list of one int per prompt \(2\)"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match=r"priority\[1\]: priority must be an int, got 1.5"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1.5])
    with pytest.raises(ValueError, match=r"priority\[0\]: .*64-bit"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[2**70, 0])
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_methods_without_a_feature_are_refused_by_name(llm):
    with pytest.raises(ValueError, match=r"LLM\.reward\(\) is not supported: "):
        llm.reward(["hi"], None)
    # a generate engine's classify / score name what serves them
    with pytest.raises(ValueError, match="start it with --runner pooling .*classification"):
        llm.classify(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="start it with --runner pooling"):
        llm.score("hi", ["there"], use_tqdm=False)


def test_use_tqdm_callable_makes_the_bar_and_lora_list_of_nones(llm):
    made = []

    class Bar(tqdm):  # vLLM's use_tqdm may be a bar factory (e.g. tqdm.notebook.tqdm)
        def __init__(self, *args, **kwargs):
            made.append(kwargs["total"])
            super().__init__(*args, **kwargs)

    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=Bar, lora_request=[None, None])
    assert len(outs) == 2 and made == [2]
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[None, object()])


def test_vllms_fields_for_features_kiln_lacks_read_as_vllm_gives_them(llm):
    """Code ported from vLLM read out.lora_request or out.encoder_prompt: an AttributeError."""
    (out,) = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.multi_modal_placeholders, out.kv_transfer_params) == (None, None, None, {}, None)
    assert out.outputs[0].lora_request is None


def test_generate_from_inside_its_own_batch_is_refused_not_a_hang(llm):
    """A use_tqdm bar (or a signal handler) that calls back into the LLM on the batch's own
    thread used to wait on the batch lock it held: a silent hang, forever."""
    inner = []

    def hung(signum, frame):
        raise TimeoutError("the call from inside the batch waited on the batch's own lock")

    class Bar(tqdm):
        def update(self, n=1):
            for call in (lambda: llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False),
                         llm.reset_prefix_cache):
                with pytest.raises(RuntimeError, match="inside this LLM's running generate"):
                    call()
                inner.append(True)
            return super().update(n)

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=Bar)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert len(outs) == 2 and inner
    # the outer batch finished and the LLM takes the next call
    assert len(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == 2
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_has_vllms_config_views_over_its_own_config(llm, kiln_logs):
    """What vLLM scripts read off llm.llm_engine (RL trainers, lm-eval's vllm backend): views of
    the one KilnConfig, whose sub-configs carry vLLM's names."""
    engine = llm.llm_engine
    assert engine.vllm_config is engine.kiln_config is engine.get_vllm_config()
    assert engine.get_model_config() is engine.model_config is engine.vllm_config.model_config
    assert llm.model_config is engine.model_config
    assert engine.get_supported_tasks() == ("generate",)
    assert engine.cache_config is engine.kiln_config.cache_config
    assert engine.cache_config.block_size == 16
    assert engine.scheduler_config.max_num_seqs == 2
    assert engine.parallel_config.tensor_parallel_size == 1
    with pytest.raises(AttributeError):  # read-only: no second copy to fall out of step
        engine.cache_config = None
    hf = engine.model_config.hf_config
    mc = engine.model_config
    assert (mc.get_vocab_size(), mc.get_hidden_size(), mc.get_head_size(),
            mc.get_total_num_kv_heads(), mc.get_total_num_hidden_layers()) == (
        hf.vocab_size, hf.hidden_size, hf.hidden_size // hf.num_attention_heads,
        hf.num_key_value_heads, hf.num_hidden_layers)
    assert mc.get_sliding_window() is None and mc.max_model_len == 64
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine.do_log_stats()
    assert "Avg generation throughput" in kiln_logs.text and "Running: 0 reqs" in kiln_logs.text


def test_vllm_arguments_that_ask_for_nothing_are_taken(tiny_llama_dir):
    """lm-eval's vllm backend always passes max_lora_rank=16 and, without max_batch_size,
    max_num_seqs=None; vLLM's LLM defaults mm_processor_kwargs=None and
    allowed_local_media_path="": each was refused as unknown or of the wrong type."""
    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.vllm_flags import VllmOnlyFlagError, check_vllm_only_kwargs

    taken = dict(max_lora_rank=16, max_loras=1, enable_lora=False, mm_processor_kwargs=None,
                 allowed_local_media_path="", calculate_kv_scales=False)
    # the LoRA sizes are engine arguments (kiln/lora/), read only with enable_lora
    assert check_vllm_only_kwargs(taken) == dict(max_lora_rank=16, max_loras=1,
                                                 enable_lora=False)
    for key, value in [("mm_processor_kwargs", {"num_crops": 4}),
                       ("allowed_local_media_path", "/data")]:
        with pytest.raises(VllmOnlyFlagError, match=rf"{key}=.* is vLLM's argument"):
            check_vllm_only_kwargs({key: value})
    config = EngineArgs(model=str(tiny_llama_dir), max_num_seqs=None).create_kiln_config()
    assert config.scheduler_config.max_num_seqs == EngineArgs.max_num_seqs
