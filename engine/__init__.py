"""cbserve's continuous-batching engine for HuggingFace transformers causal LMs.

The public names below are imported on first use (PEP 562), not with the package: `import engine`
alone, or a light submodule such as `engine.settings_table` or `engine.cli`'s argument parsing,
does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ContinuousBatchingConfig": "engine.config",
    "ContinuousBatchingManager": "engine.manager",
    "GenerationOutput": "engine.request",
    "LLMEngine": "engine.llm_engine",
    "ParamError": "engine.request",
    "QueueFullError": "engine.request",
    "RequestStatus": "engine.request",
    "SamplingParams": "engine.request",
    "StructuredOutput": "engine.structured",
    "generate_batch": "engine.generate",
    "use_cbserve": "engine.compat",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.compat import use_cbserve
    from engine.config import ContinuousBatchingConfig
    from engine.generate import generate_batch
    from engine.llm_engine import LLMEngine
    from engine.manager import ContinuousBatchingManager
    from engine.request import GenerationOutput, ParamError, QueueFullError, RequestStatus, SamplingParams
    from engine.structured import StructuredOutput


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
