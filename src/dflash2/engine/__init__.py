"""Generation engines: the pipelines that turn a prompt into chunks of new token ids."""

from dflash2.engine.batch import Batcher
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.engine.pipeline import AsyncPipeline
from dflash2.engine.policy import OverlapPolicy
from dflash2.engine.request import Request
from dflash2.engine.resident import ResidentPipeline
from dflash2.engine.sync import SyncPipeline

__all__ = [
    "AsyncPipeline",
    "Batcher",
    "DraftLengthPolicy",
    "OverlapPolicy",
    "Request",
    "ResidentPipeline",
    "SyncPipeline",
]
