"""nanoengine: a small, readable LLM inference engine in the style of vLLM."""

from nanoengine.engine import LLM, LLMEngine
from nanoengine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
