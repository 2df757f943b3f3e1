"""dflash2: lossless asynchronous speculative decoding for Hugging Face causal LMs."""

from dflash2.api import Model, load
from dflash2.config import GenerationConfig, GenerationOptions, GraphConfig, SamplingConfig, SpeculativeConfig
from dflash2.errors import (
    CacheDirectoryError,
    ContextLengthError,
    CorruptCheckpointError,
    DFlash2Error,
    DrafterError,
    InvalidOptionError,
    InvalidPromptError,
    MissingDependencyError,
    ModelNotFoundError,
    OfflineModelError,
    OutputDirectoryError,
    StreamStateError,
    TokenizerMismatchError,
    UnsupportedModelError,
)
from dflash2.stream import BlockingTokenStream, Completion, Stats, Token, TokenStream

__version__ = "0.1.0"

__all__ = [
    "BlockingTokenStream",
    "CacheDirectoryError",
    "Completion",
    "ContextLengthError",
    "CorruptCheckpointError",
    "DFlash2Error",
    "DrafterError",
    "GenerationConfig",
    "GenerationOptions",
    "GraphConfig",
    "InvalidOptionError",
    "InvalidPromptError",
    "MissingDependencyError",
    "Model",
    "ModelNotFoundError",
    "OfflineModelError",
    "OutputDirectoryError",
    "SamplingConfig",
    "SpeculativeConfig",
    "Stats",
    "StreamStateError",
    "Token",
    "TokenStream",
    "TokenizerMismatchError",
    "UnsupportedModelError",
    "__version__",
    "load",
]
