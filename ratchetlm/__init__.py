"""ratchetlm: an LLM inference engine whose decode step computes many tentative tokens and
commits only the accepted ones."""

from ratchetlm.engine.llm import LLM, RequestOutput, StreamEvent
from ratchetlm.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
__version__ = "0.1.0"
