"""Seeded random projections ``P`` (algorithm.md §2): rebuilt bit-identically from an integer seed on any process."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

import torch

from logra_pl.sketch.config import LoGRAConfigError, check_distribution
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


def projection_index(update_index: int, refresh_every: int) -> int:
    """The update index a projection is seeded with: ``(u // N)·N`` for ``N ≥ 1``, ``0`` for ``N = 0`` (fixed basis).

    With ``N = 1`` (the default) it is ``u`` itself, a new ``P`` every update; with ``N = 10``, updates 0-9 share
    the projection of update 0, 10-19 that of update 10, and so on.
    """
    return (update_index // refresh_every) * refresh_every if refresh_every else 0


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


@functools.cache
def _sign_table(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(byte shifts, table)`` of :func:`unpack_signs` on ``device`` (cached: the same few tensors every update)."""
    byte_shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=device)
    bit_shifts = torch.arange(8, dtype=torch.int64, device=device)
    table_bits = (torch.arange(256, dtype=torch.int64, device=device).unsqueeze(1) >> bit_shifts) & 1
    scale = rademacher_scale(rank)
    table = torch.where(table_bits.bool(), scale, -scale).to(torch.float32)  # (256, 8): row b = the bits of b
    return byte_shifts, table


def unpack_signs(words: torch.Tensor, rank: int, d_in: int) -> torch.Tensor:
    """``P`` of shape ``(..., rank, d_in)`` from :func:`rademacher_words` (``(..., words)``, one row per ``P``), on
    ``words``' device: set bit → ``+1/sqrt(r)``.

    Integer shifts split each word into its 8 bytes; each byte selects a row of a ``256 × 8`` table of
    ``±fp32(1/sqrt(r))`` built from the same integer ops. No floating-point arithmetic touches the drawn bits,
    so the result is bit-identical on every device, and a stack of words unpacks to the stack of their ``P``.
    """
    batch = words.shape[:-1]
    byte_shifts, table = _sign_table(rank, words.device)
    byte_values = (words.unsqueeze(-1) >> byte_shifts) & 0xFF  # (..., words, 8): byte j holds bits 8j..8j+7
    entries = table.index_select(0, byte_values.reshape(-1)).reshape(*batch, -1)
    if entries.shape[-1] != rank * d_in:  # the last word's unused bits
        entries = entries[..., : rank * d_in]
    return entries.reshape(*batch, rank, d_in)


def odd_factor(d_in: int) -> tuple[int, int]:
    """``(k, m)`` with ``d_in = 2^k · m`` and ``m`` odd: the Hadamard block size ``2^k`` and the block count ``m``."""
    if d_in <= 0:
        raise LoGRAConfigError(f"projection input dimension must be positive, got {d_in}")
    k = (d_in & -d_in).bit_length() - 1
    return k, d_in >> k


@functools.cache
def hadamard_scale(rank: int, d_in: int) -> float:
    """``c = fp32(sqrt(m / r))``, the magnitude of every non-zero Hadamard entry (``m`` the odd part of ``d_in``).

    Each row of ``P`` has ``2^k`` entries ``±c``, so ``‖row‖² = 2^k·m/r = d_in/r`` (up to ``c``'s rounding) and
    ``E[PᵀP] = I`` (algorithm.md §2). A Python float, exactly the fp32 value; cached per ``(rank, d_in)``.
    """
    _, m = odd_factor(d_in)
    return float(torch.tensor(math.sqrt(m / rank), dtype=torch.float32))


def hadamard_draws(seed: int, rank: int, d_in: int, pin_memory: bool = False) -> torch.Tensor:
    """The randomness of a Hadamard ``P``, from a CPU generator seeded with ``seed``: one int64 vector.

    In the order drawn: ``rank`` distinct rows of ``B = I_m ⊗ H`` (``randperm(d_in)[:rank]``), a column
    permutation ``π`` of ``d_in`` (``randperm(d_in)``), and ``d_in`` sign bits (``randint(0, 2)``; 1 flips the
    column's sign). Laid out ``[rows | π | signs]``, ``rank + 2·d_in`` integers: only these move to the device.
    ``pin_memory`` puts them in page-locked memory, so that the copy to a GPU can be asynchronous.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    rows = torch.randperm(d_in, generator=gen)[:rank]
    perm = torch.randperm(d_in, generator=gen)
    signs = torch.randint(0, 2, (d_in,), generator=gen, dtype=torch.int64)
    out = torch.empty(rank + 2 * d_in, dtype=torch.int64, pin_memory=pin_memory)
    return torch.cat([rows, perm, signs], out=out)


def hadamard_entries(draws: torch.Tensor, rank: int, d_in: int) -> torch.Tensor:
    """``P`` of shape ``(..., rank, d_in)`` from :func:`hadamard_draws` (``(..., r + 2·d_in)``, one row per ``P``),
    on ``draws``' device, by integer ops only.

    ``P[a, x] = c · B[row_a, π(x)] · d_x`` with ``B = I_m ⊗ H``, ``H[i, j] = (−1)^popcount(i & j)`` the
    ``2^k × 2^k`` Sylvester Hadamard matrix and ``c`` :func:`hadamard_scale`. So ``B[p, q]`` is non-zero only when
    ``p`` and ``q`` lie in the same ``2^k`` block (``p >> k == q >> k``), and its sign is the parity of the bits
    the two in-block indices share, folded with shifts and xors. The result picks ``0``, ``+c`` or ``−c`` from a
    3-entry fp32 table: no floating-point arithmetic touches the drawn integers, so ``P`` is bit-identical on
    every device, and a stack of draws gives the stack of their ``P``.
    """
    k, _ = odd_factor(d_in)
    idx = draws.to(torch.int32)  # every value < d_in < 2³¹: half the bytes of int64 for the (r, d_in) temporaries
    rows = idx[..., :rank].unsqueeze(-1)  # (..., r, 1)
    cols = idx[..., rank : rank + d_in].unsqueeze(-2)  # (..., 1, d_in)
    flips = idx[..., rank + d_in :].unsqueeze(-2)  # (..., 1, d_in)
    mask = (1 << k) - 1
    same_block = (rows >> k) == (cols >> k)
    shared = (rows & mask) & (cols & mask)  # (..., r, d_in): bits of i & j, fewer than k of them
    for j in reversed(range(max(k - 1, 0).bit_length())):  # xor-fold: bit 0 ends up the parity of k bits
        shared = shared ^ (shared >> (1 << j))
    negative = (shared & 1) ^ flips  # (−1)^popcount · d_x: 1 is a minus sign
    index = same_block.to(torch.int32) * (1 + negative)  # 0 → 0, 1 → +c, 2 → −c
    c = hadamard_scale(rank, d_in)
    table = torch.tensor([0.0, c, -c], dtype=torch.float32, device=draws.device)
    return table[index.long()]


def sign_scale(distribution: str, rank: int, d_in: int) -> float | None:
    """``c`` with ``P = c·M`` and ``M`` of entries in ``{0, ±1}``, for the distributions drawn that way; else None.

    Rademacher: ``fp32(1/sqrt(r))`` (:func:`rademacher_scale`); Hadamard: ``fp32(sqrt(m/r))``
    (:func:`hadamard_scale`); Gaussian: ``None``. The merge (§5) multiplies exact sums ``F M`` by ``c`` once.
    """
    if distribution == "rademacher":
        return rademacher_scale(rank)
    if distribution == "hadamard":
        return hadamard_scale(rank, d_in)
    return None


def projection_draws(
    seeds: Sequence[int], rank: int, d_in: int, distribution: str, pin_memory: bool = False
) -> torch.Tensor:
    """What the CPU generator contributes to the ``P`` of each seed, stacked: one row per seed, in ``seeds`` order.

    Rademacher: the packed words of :func:`rademacher_words` (``(k, words)`` int64). Hadamard: the integers of
    :func:`hadamard_draws` (``(k, r + 2·d_in)`` int64). Gaussian: ``P`` itself (``(k, r, d_in)`` fp32), drawn with
    ``normal_`` and scaled by ``fp32(1/sqrt(r))`` on the CPU. One generator is reseeded for every seed (a reseeded
    generator is a fresh one), and the rows end in one buffer (``pin_memory``: page-locked, so that one
    asynchronous copy takes the whole stack to a GPU).
    """
    gen = torch.Generator(device="cpu")
    k = len(seeds)
    if distribution == "rademacher":
        words = -(-rank * d_in // 64)
        parts = []
        for seed in seeds:
            gen.manual_seed(seed)
            parts.append(
                torch.empty(words, dtype=torch.int64).random_(-(2**63), None, generator=gen)
            )  # as rademacher_words
        out = torch.empty(k * words, dtype=torch.int64, pin_memory=pin_memory)
        return torch.cat(parts, out=out).view(k, words)
    if distribution == "gaussian":
        out = torch.empty(k, rank, d_in, dtype=torch.float32, pin_memory=pin_memory)
        for row, seed in zip(out, seeds, strict=True):
            gen.manual_seed(seed)
            row.normal_(generator=gen)  # what torch.randn((rank, d_in), generator=gen) draws
        return out.mul_(1.0 / rank**0.5)
    if distribution == "hadamard":
        parts = []
        for seed in seeds:
            gen.manual_seed(seed)
            parts.append(torch.randperm(d_in, generator=gen)[:rank])  # as hadamard_draws, in its order
            parts.append(torch.randperm(d_in, generator=gen))
            parts.append(torch.randint(0, 2, (d_in,), generator=gen, dtype=torch.int64))
        out = torch.empty(k * (rank + 2 * d_in), dtype=torch.int64, pin_memory=pin_memory)
        return torch.cat(parts, out=out).view(k, rank + 2 * d_in)
    check_distribution(distribution)
    raise AssertionError(f"distribution {distribution!r} is listed but has no construction")  # unreachable


def make_projections(
    seeds: Sequence[int],
    rank: int,
    d_in: int,
    distribution: str = "rademacher",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The projections of several seeds, stacked ``(k, rank, d_in)``: row ``i`` is ``make_projection(seeds[i], ...)``
    bit for bit.

    The CPU generator runs once per seed (:func:`projection_draws`); everything after it runs once for the stack:
    one copy to ``device`` (asynchronous from pinned memory on CUDA) and, for Rademacher and Hadamard, one
    unpacking on the device by integer ops (:func:`unpack_signs`, :func:`hadamard_entries`).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoGRAConfigError(f"projection rank must be a positive integer, got {rank!r}")
    if rank > d_in:
        raise LoGRAConfigError(f"projection rank {rank} exceeds the input dimension {d_in}: use rank <= {d_in}")
    check_distribution(distribution)
    return expand_draws(device_draws(seeds, rank, d_in, distribution, device), rank, d_in, distribution)


def device_draws(
    seeds: Sequence[int], rank: int, d_in: int, distribution: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """:func:`projection_draws` of ``seeds`` on ``device`` (from pinned memory, asynchronously, on CUDA)."""
    device = None if device is None else torch.device(device)
    pinned = device is not None and device.type == "cuda"
    draws = projection_draws(seeds, rank, d_in, distribution, pin_memory=pinned)
    return draws if device is None else draws.to(device, non_blocking=pinned)


def expand_draws(draws: torch.Tensor, rank: int, d_in: int, distribution: str) -> torch.Tensor:
    """The ``(..., rank, d_in)`` fp32 projections of a stack of :func:`projection_draws` rows, on their device:
    Rademacher words unpacked (:func:`unpack_signs`), Hadamard integers expanded (:func:`hadamard_entries`),
    Gaussian rows as they are (they are ``P``)."""
    if distribution == "rademacher":
        return unpack_signs(draws, rank, d_in)
    if distribution == "hadamard":
        return hadamard_entries(draws, rank, d_in)
    return draws


PACKABLE = ("rademacher", "hadamard")


class PackedProjections:
    """A stack of ``k`` projections kept as their draws (``logra.projection_storage: packed``), expanded where read.

    Rademacher ``P`` are ``r·d_in`` sign bits, 64 to an int64 word (1/32 of the fp32 ``P``); Hadamard ``P`` are
    ``r + 2·d_in`` integers. :meth:`expand` and ``packed[i]`` build the fp32 ``P`` from them by the integer ops
    :func:`make_projections` uses, so every reader gets ``P`` bit for bit, as a new tensor that lives as long as its
    reader keeps it. Immutable: a new basis is a new object (readers that compare bases compare identities).

    Arguments:
        draws: ``(k, ·)`` int64 rows of :func:`projection_draws`, on the device the ``P`` are needed on.
        rank: ``r``.
        d_in: the projections' width.
        distribution: ``rademacher`` or ``hadamard`` (:data:`PACKABLE`; Gaussian draws are the fp32 ``P``).
    """

    def __init__(self, draws: torch.Tensor, rank: int, d_in: int, distribution: str) -> None:
        if distribution not in PACKABLE:
            raise LoGRAConfigError(
                f"{distribution!r} projections have no packed form (their draws are the fp32 P): use one of "
                f"{PACKABLE} or logra.projection_storage: dense"
            )
        self.draws, self.rank, self.d_in, self.distribution = draws, rank, d_in, distribution

    @classmethod
    def draw(
        cls, seeds: Sequence[int], rank: int, d_in: int, distribution: str, device: torch.device | str | None = None
    ) -> PackedProjections:
        """The packed projections of ``seeds`` on ``device``: what :func:`make_projections` draws, not expanded."""
        return cls(device_draws(seeds, rank, d_in, distribution, device), rank, d_in, distribution)

    def __len__(self) -> int:
        return self.draws.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        """``P`` of one row, ``(r, d_in)`` fp32, built now."""
        return expand_draws(self.draws[row], self.rank, self.d_in, self.distribution)

    def expand(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """The ``(k, r, d_in)`` fp32 stack (``rows``: only those), built now."""
        draws = self.draws if rows is None else self.draws[list(rows)]
        return expand_draws(draws, self.rank, self.d_in, self.distribution)

    def replace_rows(self, rows: Sequence[int], other: PackedProjections) -> PackedProjections:
        """A new stack: this one with ``rows`` taken from ``other`` (one row of ``other`` per row, in order)."""
        draws = self.draws.clone()
        draws[list(rows)] = other.draws
        return PackedProjections(draws, self.rank, self.d_in, self.distribution)

    @property
    def device(self) -> torch.device:
        return self.draws.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the draws."""
        return self.draws.numel() * self.draws.element_size()


def packed_bytes(rank: int, d_in: int, distribution: str) -> int:
    """Bytes of one packed projection (:class:`PackedProjections`): ``ceil(r·d_in/64)`` int64 words for Rademacher,
    ``r + 2·d_in`` int64 for Hadamard."""
    if distribution == "rademacher":
        return -(-rank * d_in // 64) * 8
    if distribution == "hadamard":
        return (rank + 2 * d_in) * 8
    raise LoGRAConfigError(f"{distribution!r} projections have no packed form: use one of {PACKABLE}")


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
      so the copy is asynchronous) and scaled there. Its entries need ``log``, ``sin`` and ``cos``, whose float32
      results differ between torch's CPU sampler and elementwise ops (or CUDA's math library), so a device draw
      could not rebuild the same ``P`` everywhere (algorithm.md §2).
    - Hadamard (``r`` distinct rows of ``I_m ⊗ H``, columns permuted and sign-flipped, times ``sqrt(m/r)``;
      ``P Pᵀ = (d_in/r)·I``): the rows, permutation and signs are drawn as ``r + 2·d_in`` integers on the CPU
      (:func:`hadamard_draws`, pinned for CUDA), moved, and expanded on ``device`` with integer ops
      (:func:`hadamard_entries`).

    The same as :func:`make_projections` of one seed; the sketcher draws a whole group of matrices at once.
    """
    return make_projections([seed], rank, d_in, distribution, device)[0]
