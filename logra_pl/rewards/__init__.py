"""Verifiers that turn responses into rewards in [0, 1]."""

from logra_pl.rewards.bounded import BoundedVerifier
from logra_pl.rewards.reasoning_gym import ReasoningGymVerifier

__all__ = ["BoundedVerifier", "ReasoningGymVerifier"]
