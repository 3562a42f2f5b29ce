"""Seeded random projections ``P`` (algorithm.md §2): rebuilt bit-identically from an integer seed on any process."""

from __future__ import annotations

import functools
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


@functools.cache
def rademacher_scale(rank: int) -> float:
    """``fp32(1/sqrt(r))``, the magnitude of every Rademacher entry, as a Python float (exact; cached per rank)."""
    return float(torch.tensor(1.0 / rank**0.5, dtype=torch.float32))


def rademacher_words(seed: int, rank: int, d_in: int, pin_memory: bool = False) -> torch.Tensor:
    """The random bits of a Rademacher ``P``: ``ceil(r·d_in / 64)`` int64 words from a CPU generator.

    Every word uses all 64 bits (``random_`` over the full int64 range: one draw of the generator per word, not
    per entry). Entry ``k`` of ``P`` (row-major) is bit ``k mod 64`` of word ``k // 64``, least significant first.
    ``pin_memory`` puts them in page-locked memory, so that the copy to a GPU can be asynchronous.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    words = torch.empty(-(-rank * d_in // 64), dtype=torch.int64, pin_memory=pin_memory)
    return words.random_(-(2**63), None, generator=gen)


def unpack_signs(words: torch.Tensor, rank: int, d_in: int) -> torch.Tensor:
    """``P`` of shape ``(rank, d_in)`` from :func:`rademacher_words`, on ``words``' device: set bit → ``+1/sqrt(r)``.

    Integer shifts split each word into its 8 bytes; each byte selects a row of a ``256 × 8`` table of
    ``±fp32(1/sqrt(r))`` built from the same integer ops. No floating-point arithmetic touches the drawn bits,
    so the result is bit-identical on every device.
    """
    device = words.device
    byte_shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=device)
    byte_values = (words.unsqueeze(1) >> byte_shifts) & 0xFF  # (words, 8): byte j holds bits 8j..8j+7
    bit_shifts = torch.arange(8, dtype=torch.int64, device=device)
    table_bits = (torch.arange(256, dtype=torch.int64, device=device).unsqueeze(1) >> bit_shifts) & 1
    scale = rademacher_scale(rank)
    table = torch.where(table_bits.bool(), scale, -scale).to(torch.float32)  # (256, 8): row b = the bits of b
    entries = table.index_select(0, byte_values.reshape(-1)).reshape(-1)
    return entries[: rank * d_in].reshape(rank, d_in)


def make_projection(
    seed: int, rank: int, d_in: int, distribution: str = "rademacher", device: torch.device | str | None = None
) -> torch.Tensor:
    """Draw ``P`` of shape ``(rank, d_in)`` in fp32 with ``E[PᵀP] = I``, on ``device`` (default CPU).

    ``P`` depends only on ``(seed, rank, d_in, distribution)`` and is bit-identical on every machine and
    device: the randomness always comes from a CPU ``torch.Generator`` seeded with ``seed``.

    - Rademacher (entries ``±1/sqrt(r)``): the signs are drawn packed, 64 per int64 word
      (:func:`rademacher_words`), only the words are moved to ``device``, and they are unpacked there with
      integer ops (:func:`unpack_signs`). One generator draw per 64 entries and 1/32 of the fp32 transfer.
      For CUDA the words are pinned and copied asynchronously: a copy from pageable memory would synchronise
      the stream, once per matrix per update.
    - Gaussian (entries ``N(0, 1/r)``): drawn in fp32 on the CPU (into pinned memory when ``device`` is CUDA,
      so the copy is asynchronous) and scaled there.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoGRAConfigError(f"projection rank must be a positive integer, got {rank!r}")
    if rank > d_in:
        raise LoGRAConfigError(f"projection rank {rank} exceeds the input dimension {d_in}: use rank <= {d_in}")
    device = None if device is None else torch.device(device)
    pinned = device is not None and device.type == "cuda"
    if distribution == "rademacher":
        words = rademacher_words(seed, rank, d_in, pin_memory=pinned)
        return unpack_signs(words if device is None else words.to(device, non_blocking=pinned), rank, d_in)
    if distribution == "gaussian":
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        proj = torch.randn((rank, d_in), generator=gen, dtype=torch.float32, pin_memory=pinned)
        proj.mul_(1.0 / rank**0.5)
        return proj if device is None else proj.to(device, non_blocking=pinned)
    raise LoGRAConfigError(f"unknown projection distribution {distribution!r}: use 'rademacher' or 'gaussian'")
