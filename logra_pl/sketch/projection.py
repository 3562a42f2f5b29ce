"""Seeded random projections ``P`` (algorithm.md §2): rebuilt bit-identically from an integer seed on any process."""

from __future__ import annotations

import hashlib

import torch

from logra_pl.sketch.config import LoGRAConfigError
from logra_pl.sketch.targets import canonical_name

_SEED_MOD = 2**62


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a wrapper-free module name (blake2b, 8 bytes): unlike ``hash()``, not salted."""
    digest = hashlib.blake2b(canonical_name(name).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def projection_seed(base_seed: int, update_index: int, name: str) -> int:
    """Seed of the projection of matrix ``name`` at update ``update_index``.

    ``(base·1_000_003 + update·7_919 + blake2b8(name)) mod 2⁶²`` — depends on nothing but its arguments, so
    every rank and the rollout engine agree on it.
    """
    return (base_seed * 1_000_003 + update_index * 7_919 + name_hash(name)) % _SEED_MOD


def make_projection(
    seed: int, rank: int, d_in: int, distribution: str = "rademacher", device: torch.device | str | None = None
) -> torch.Tensor:
    """Draw ``P`` of shape ``(rank, d_in)`` in fp32 with ``E[PᵀP] = I``.

    Rademacher entries are ``±1/sqrt(r)``, Gaussian entries ``N(0, 1/r)``. The draw uses a CPU
    ``torch.Generator`` (identical on every machine) and is then moved to ``device``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoGRAConfigError(f"projection rank must be a positive integer, got {rank!r}")
    if rank > d_in:
        raise LoGRAConfigError(f"projection rank {rank} exceeds the input dimension {d_in}: use rank <= {d_in}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    if distribution == "rademacher":
        signs = torch.randint(0, 2, (rank, d_in), generator=gen, dtype=torch.int8)
        proj = (signs.to(torch.float32) * 2.0 - 1.0) * (1.0 / rank**0.5)
    elif distribution == "gaussian":
        proj = torch.randn((rank, d_in), generator=gen, dtype=torch.float32) * (1.0 / rank**0.5)
    else:
        raise LoGRAConfigError(f"unknown projection distribution {distribution!r}: use 'rademacher' or 'gaussian'")
    return proj if device is None else proj.to(device)
