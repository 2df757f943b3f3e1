"""Distil a DFlash block drafter from a target: ``dflash2 train-drafter`` or :func:`train_drafter`."""

from dflash2.drafters.dflash import spread_layers
from dflash2.train.config import TrainConfig
from dflash2.train.trainer import train_drafter

__all__ = ["TrainConfig", "spread_layers", "train_drafter"]
