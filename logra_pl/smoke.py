"""A twenty-second look at the LoGRA sketch core on a tiny offline Qwen2: ``python -m logra_pl.smoke``.

It trains only through sketches — no dense gradient ever exists for the 14 attention/MLP matrices — on
reasoning-gym ``chain_sum`` answers (supervised, answer tokens only), and prints:

- the held-out answer loss before and after;
- memory by kind against what dense fp32 gradients and Adam state would hold;
- bytes shipped per update as factor payloads against full bf16 tensors;
- that a receiver applying only the payloads to its own copy ends bit-identical to the trainer.

``make smoke`` runs it; the RL demo is ``make demo``. Every number it prints is measured here.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

import reasoning_gym
import torch

from logra_pl.models import load_policy
from logra_pl.sketch import LoGRAConfig, LoGRASketcher, apply_payload, memory_report
from logra_pl.sketch.memory import MiB
from logra_pl.train.warm_start import answer_batch

SMALL_CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def chain_sum_batch(tokenizer, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` chat-formatted chain_sum problems with their answers (loss on answer tokens only)."""
    return answer_batch(tokenizer, reasoning_gym.create_dataset("chain_sum", size=n, seed=seed, **SMALL_CHAIN_SUM))


def answer_loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy on the answer tokens; left padding is masked out of attention."""
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="tiny", help="policy source (default: the offline tiny Qwen2)")
    parser.add_argument("--updates", type=int, default=100, help="LoGRA updates to run (default 100)")
    parser.add_argument("--batch", type=int, default=64, help="problems per update (default 64)")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per update (default 2)")
    parser.add_argument("--rank", type=int, default=32, help="sketch rank r (default 32)")
    parser.add_argument("--update-ratio", type=float, default=5e-3, help="relative step size (default 5e-3)")
    parser.add_argument("--seed", type=int, default=0, help="data and projection seed (default 0)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.perf_counter()
    model, tok = load_policy(args.policy)
    model.train()
    receiver = copy.deepcopy(model)  # a rollout engine's copy, updated from payloads only
    cfg = LoGRAConfig(rank=args.rank, update_ratio=args.update_ratio, base_seed=args.seed)
    sketcher = LoGRASketcher(model, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    sketched = sum(m.d_out * m.d_in for m in sketcher.matrices.values())
    print(
        f"policy {args.policy}: {n_params / 1e6:.2f}M parameters, {len(sketcher.matrices)} matrices sketched "
        f"({sketched / 1e6:.2f}M weights) at rank {cfg.rank}, {cfg.update_rule}, {cfg.distribution} projections"
    )

    eval_batch = chain_sum_batch(tok, 256, seed=10_000 + args.seed)
    with torch.no_grad():
        loss_before = float(answer_loss(model, *eval_batch))

    shipped = 0
    for update in range(args.updates):
        batch = chain_sum_batch(tok, args.batch, seed=args.seed * 100_003 + update)
        for mb in zip(*(t.chunk(args.microbatches) for t in batch), strict=True):
            (answer_loss(model, *mb) / args.microbatches).backward()
        if update == 0:
            mem = memory_report(model, sketcher=sketcher)
        payload = sketcher.step()
        if payload is None:
            print(f"update {update}: skipped ({sketcher.last_skip_reason})")
            continue
        shipped += len(payload.to_bytes())
        apply_payload(payload, receiver)
        if update % 20 == 0 or update == args.updates - 1:
            with torch.no_grad():
                loss = float(answer_loss(model, *batch))
            print(f"update {update:3d}: train answer loss {loss:.4f}")

    with torch.no_grad():
        loss_after = float(answer_loss(model, *eval_batch))
    identical = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), receiver.state_dict().values(), strict=True)
    )
    dense_adam = 2 * mem.dense_gradient_equivalent  # two fp32 moments per sketched weight
    full_bytes = sketched * 2 * sketcher.num_applied  # bf16 tensors per update
    print(
        f"\nheld-out answer loss: {loss_before:.4f} -> {loss_after:.4f} (uniform guessing: "
        f"{math.log(len(tok)):.2f}; {sketcher.num_applied} updates applied, {sketcher.num_skipped} skipped)"
    )
    print("training state during backward (sketched matrices):")
    print(
        f"  sketches {mem.sketches / MiB:.3f} MiB + projections {mem.projections / MiB:.3f} MiB + row stats "
        f"{mem.row_statistics / MiB:.4f} MiB  vs  dense fp32 gradients {mem.dense_gradient_equivalent / MiB:.3f} "
        f"MiB + Adam moments {dense_adam / MiB:.3f} MiB"
    )
    print(
        f"weight sync: {shipped / MiB:.3f} MiB of factor payloads vs {full_bytes / MiB:.3f} MiB of full bf16 "
        f"tensors ({full_bytes / max(shipped, 1):.1f}x less)"
    )
    print(f"receiver updated from payloads only is bit-identical to the trainer: {identical}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    if not identical or not loss_after < loss_before:
        raise SystemExit("smoke run failed: the receiver diverged or the loss did not go down")


if __name__ == "__main__":
    main()
