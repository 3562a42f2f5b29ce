"""Verifiers that turn responses into rewards in [0, 1]: the contract (:class:`Verifier`) and its implementations."""

from logra_pl.rewards.base import ExactMatch, Verifier, WeightedRewards, check_verifier, verifier_name
from logra_pl.rewards.bounded import BoundedVerifier
from logra_pl.rewards.math import MathVerifier
from logra_pl.rewards.reasoning_gym import ReasoningGymVerifier

__all__ = [
    "BoundedVerifier",
    "ExactMatch",
    "MathVerifier",
    "ReasoningGymVerifier",
    "Verifier",
    "WeightedRewards",
    "check_verifier",
    "verifier_name",
]
