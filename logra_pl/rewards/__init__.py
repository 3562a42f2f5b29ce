"""Verifiers that turn responses into rewards (any finite float): the contract (:class:`Verifier`), the runner with
its failure policy, and the implementations — rule-based checks, a reward model, an LLM judge."""

from logra_pl.rewards.base import ExactMatch, Verifier, WeightedRewards, check_verifier, verifier_name
from logra_pl.rewards.bounded import BoundedVerifier
from logra_pl.rewards.failures import Failure, FailurePolicy, Scores
from logra_pl.rewards.judge import LLMJudge
from logra_pl.rewards.math import MathVerifier
from logra_pl.rewards.reasoning_gym import ReasoningGymVerifier
from logra_pl.rewards.reward_model import RewardModelVerifier

__all__ = [
    "BoundedVerifier",
    "ExactMatch",
    "Failure",
    "FailurePolicy",
    "LLMJudge",
    "MathVerifier",
    "ReasoningGymVerifier",
    "RewardModelVerifier",
    "Scores",
    "Verifier",
    "WeightedRewards",
    "check_verifier",
    "verifier_name",
]
