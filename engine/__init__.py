"""cbserve's continuous-batching engine for HuggingFace transformers causal LMs."""

from engine.config import ContinuousBatchingConfig
from engine.compat import use_cbserve
from engine.generate import generate_batch
from engine.llm_engine import LLMEngine
from engine.manager import ContinuousBatchingManager
from engine.request import GenerationOutput, ParamError, QueueFullError, RequestStatus, SamplingParams
from engine.structured import StructuredOutput

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "LLMEngine",
    "ParamError",
    "QueueFullError",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutput",
    "generate_batch",
    "use_cbserve",
]
