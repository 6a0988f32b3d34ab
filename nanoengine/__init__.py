"""nanoengine: a small, readable LLM inference engine in the style of vLLM."""

from nanoengine.engine import LLMEngine
from nanoengine.llm import LLM
from nanoengine.pooler import PoolingParams
from nanoengine.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "PoolingParams"]
