"""Every view of max_model_len says the length the engine accepts once the KV cache capped it
(lm-eval reads `llm.llm_engine.model_config.max_model_len`)."""
import dataclasses

from kiln import LLM


def test_a_cache_capped_max_model_len_shows_in_every_config_view(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, block_size=16,
              num_gpu_blocks_override=2)  # 32 tokens, under the model's 512
    try:
        engine = llm.llm_engine
        assert engine.max_model_len == 32
        assert engine.model_config.max_model_len == 32
        assert llm.model_config.max_model_len == 32
        assert engine.get_model_config().max_model_len == 32
        assert engine.vllm_config.model_config.max_model_len == 32
        assert engine.vllm_config.scheduler_config.max_model_len == 32
        assert engine.scheduler_config.max_model_len == 32
        # still frozen, and the other settings are the resolved ones
        assert engine.model_config.frozen and engine.kiln_config.frozen
        assert dataclasses.replace(engine.model_config).max_model_len == 32
        assert engine.kiln_config.cache_config.num_gpu_blocks_override == 2
    finally:
        llm.shutdown()
