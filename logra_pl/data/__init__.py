"""LightningDataModules of prompts for RL."""

from logra_pl.data.reasoning_gym import ReasoningGymDataModule

__all__ = ["ReasoningGymDataModule"]
