"""minisarathi: a small, fast LLM inference server with Sarathi-Serve scheduling."""

from minisarathi.config import EngineConfig
from minisarathi.outputs import CompletionOutput, Logprob, RequestOutput
from minisarathi.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM and LLMEngine pull in the model code; load them on first use so `import minisarathi` stays light.
    if name == "LLM":
        from minisarathi.llm import LLM

        return LLM
    if name == "LLMEngine":
        from minisarathi.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'minisarathi' has no attribute {name!r}")
