"""Generation engines: the pipelines that turn a prompt into chunks of new token ids."""

from dflash2.engine.sync import SyncPipeline

__all__ = ["SyncPipeline"]
