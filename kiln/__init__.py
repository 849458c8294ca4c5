"""Kiln: an LLM inference engine built around torch.compile, with vLLM's public API shape."""
from kiln.version import __version__

__all__ = ["LLM", "SamplingParams", "CompilationConfig", "RequestOutput", "CompletionOutput",
           "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "ClassificationOutput",
           "ScoringOutput", "__version__"]


def __getattr__(name):
    # Lazy, so `import kiln` stays cheap and subpackages import without cycles.
    if name == "LLM":
        from kiln.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kiln.sampling_params import SamplingParams
        return SamplingParams
    if name == "CompilationConfig":
        from kiln.config.compilation_config import CompilationConfig
        return CompilationConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from kiln import outputs
        return getattr(outputs, name)
    if name in ("PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput"):
        from kiln.pooling import outputs as pooling_outputs  # vLLM's names, as `from vllm`
        return getattr(pooling_outputs, name)
    if name in ("ClassificationRequestOutput", "ScoringRequestOutput", "ClassificationOutput",
                "ScoringOutput"):
        from kiln.pooling import classify_outputs
        return getattr(classify_outputs, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
