"""ratchetlm: an LLM inference engine whose decode step computes many tentative tokens and
commits only the accepted ones."""

from ratchetlm.engine.llm import LLM, StreamEvent
from ratchetlm.models.deepseek_v4 import runner as _deepseek_v4_runner  # noqa: F401  (registers its cache layout)
from ratchetlm.outputs import CompletionOutput, Logprob, RequestOutput
from ratchetlm.parallel import launch as _tensor_parallel  # noqa: F401  (registers LLM(tensor_parallel_size=N))
from ratchetlm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StreamEvent", "StructuredOutputsParams", "__version__"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ratchetlm")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "0.1.0"


__version__ = _version()
