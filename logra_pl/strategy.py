"""``LoGRAStrategy`` (``logra_fsdp``): FSDP2 data parallelism that owns LoGRA's distributed steps.

It shards every decoder layer and then the root with ``fully_shard`` on the data-parallel mesh (the module
does not need to know). It names no update method: an optimizer whose state is replicated on every rank
(:class:`~logra_pl.methods.base.ReplicatedStateOptimizer`) is saved and loaded whole and wires its own collectives
through the strategy (:class:`~logra_pl.methods.base.DataParallelRanks`: world size, device, stats, row offsets).
LoGRA's optimizer (:meth:`~logra_pl.methods.logra.LoGRAOptimizer.wire_ranks`) then:

- before each proposal, all-reduces every sketch ``S`` (sum — the loss is already normalised by the
  token count of all ranks, so the sum is the gradient sketch of the global token-mean loss);
- sums ``Σ‖W_i‖²`` over the ranks' row shards, so RowAdam and the global scale see whole matrices and
  every rank forms the identical proposal;
- merges only each rank's local row shard, at the shard's global row offset (dim-0 sharding).

A KL penalty's reference policy (``loss.reference_device: same``) is sharded the same way (:meth:`shard_reference`);
one kept on the CPU is refused here, since every process would hold all of it.

World size 1 runs through the same code, so a config does not change between a laptop and a node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from typing_extensions import override

from logra_pl.errors import ConfigError
from logra_pl.methods.base import ReplicatedStateOptimizer
from logra_pl.runtime import compat
from logra_pl.runtime.checkpointing import checkpointed_layers, decoder_layers, enable_activation_checkpointing
from logra_pl.runtime.dtypes import dtypes_of
from logra_pl.sketch.memory import local_state_bytes

__all__ = ["LoGRAStrategy", "decoder_layers", "row_offset"]

_DTYPES = dtypes_of("float32", "bfloat16", "float16")


def row_offset(weight: torch.Tensor) -> int:
    """Global index of the first row this rank holds of a dim-0-sharded DTensor (0 for a plain tensor)."""
    if not hasattr(weight, "device_mesh"):
        return 0
    mesh = weight.device_mesh
    rank = mesh.get_local_rank()
    rows = weight.shape[0]
    chunk = -(-rows // mesh.size())  # torch.chunk sizes: ceil(rows / world)
    return min(rank * chunk, rows)


class LoGRAStrategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) data parallelism with LoGRA sketch all-reduce and shard-local merges.

    Arguments:
        data_parallel_size: ranks that shard the model (``"auto"``: all devices).
        tensor_parallel_size: must be 1 (tensor parallelism is not supported yet).
        activation_checkpointing: non-reentrant checkpointing of every decoder layer.
        param_dtype: compute dtype of the sharded parameters during forward/backward (``"bfloat16"`` on GPU);
            None keeps the storage dtype (fp32 master weights are always kept).
        save_distributed_checkpoint: save one shard per rank instead of one full checkpoint (both resume).
    """

    strategy_name = "logra_fsdp"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The strategy names itself, as Lightning's strategies do: ``--trainer.strategy logra_fsdp``."""
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 + LoGRA sketch all-reduce")

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = 1,
        activation_checkpointing: bool = False,
        param_dtype: str | None = None,
        save_distributed_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size not in (1, "1"):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size!r}: LoGRAStrategy supports data parallelism only "
                "(tensor parallelism is not supported yet); use tensor_parallel_size=1"
            )
        if param_dtype is not None and param_dtype not in _DTYPES:
            raise ValueError(f"unknown param_dtype {param_dtype!r}: use one of {sorted(_DTYPES)} or None")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.activation_checkpointing = activation_checkpointing
        self.param_dtype = param_dtype
        # What collectives wired through this strategy last did ({name: value}, e.g. the sketch all-reduce's bytes).
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------- setup
    @override
    def setup_environment(self) -> None:
        # Every process is a data-parallel rank ("auto" in ModelParallelStrategy means one rank per node).
        if compat.data_parallel_size(self) == "auto":
            compat.set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def shard(self, policy: nn.Module) -> None:
        """``fully_shard`` every decoder layer, then the root, on the data-parallel mesh."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.activation_checkpointing:
            enable_activation_checkpointing(policy)
        # Shard each decoder layer — through its checkpoint wrapper when there is one, so the replay re-gathers.
        layers = checkpointed_layers(policy) or decoder_layers(policy)
        mesh = self.device_mesh["data_parallel"]
        kwargs: dict[str, Any] = {"mesh": mesh}
        if self.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=_DTYPES[self.param_dtype], reduce_dtype=torch.float32
            )
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(policy, **kwargs)
        # The loss of every rank is already a token sum over the whole update's count (algorithm.md §8), so the
        # gradient of the update's loss is the SUM of the ranks' gradients, as LoGRA's sketches are summed; FSDP2
        # averages by default, which would shrink the dense gradients (dense AdamW/SGD, logra.dense_params) by the rank
        # count.
        for module in (*layers, policy):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    @staticmethod
    def check_reference(reference: Any) -> None:
        """A KL penalty's reference policy can be sharded here only where the policy is: ``reference_device: cpu``
        would keep a whole copy in every process (:class:`~logra_pl.errors.ConfigError` naming the alternative)."""
        if reference.placement != "same":
            raise ConfigError(
                f"loss.reference_device: {reference.placement} keeps a whole copy of the KL penalty's reference policy "
                "in every process; under the logra_fsdp strategy set loss.reference_device: same, which shards it over "
                "the ranks like the policy (1/N of it per rank; loss.reference_dtype: bfloat16 halves that again)"
            )

    def shard_reference(self, reference: Any) -> None:
        """``fully_shard`` the reference policy's decoder layers and root on the data-parallel mesh, as the policy's
        (frozen: no gradients, no mixed precision beyond its own dtype), and move its shards to this rank's device."""
        from torch.distributed.fsdp import fully_shard

        self.check_reference(reference)
        mesh = self.device_mesh["data_parallel"]
        for layer in decoder_layers(reference.model):
            fully_shard(layer, mesh=mesh)
        fully_shard(reference.model, mesh=mesh)
        reference.model.to(self.root_device)
        reference.sharded = True
        reference.nbytes = local_state_bytes(reference.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        policy = getattr(module, "policy", None)
        if policy is None:
            raise TypeError("LoGRAStrategy trains a LoGRAPolicyModule (a module with a `policy` causal LM)")
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(policy, FSDPModule):  # a second setup (validate after fit) finds it sharded already
            self.shard(policy)
        reference = getattr(module, "reference_policy", None)
        if reference is not None and not reference.sharded:
            self.shard_reference(reference)
        super().setup(trainer)
        self._wire_optimizers()

    def _wire_optimizers(self) -> None:
        """Let every optimizer that keeps a replicated state wire its own collectives into this strategy."""
        for opt in self.optimizers:
            inner = compat.inner_optimizer(opt)
            if isinstance(inner, ReplicatedStateOptimizer):
                inner.wire_ranks(self)

    def row_offset(self, weight: torch.Tensor) -> int:
        """Global index of the first row of ``weight`` this rank holds (:func:`row_offset`; the ranks' contract,
        :class:`~logra_pl.methods.base.DataParallelRanks`)."""
        return row_offset(weight)

    # ------------------------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        inner = compat.inner_optimizer(optimizer)
        if isinstance(inner, ReplicatedStateOptimizer):
            return inner.state_dict()  # replicated: identical on every rank
        return super().optimizer_state(optimizer)

    def _load_distributed_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Load a sharded checkpoint: each rank reads its model shard; the LoGRA state is replicated."""
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.lightning_module
        assert module is not None
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        inners = [compat.inner_optimizer(o) for o in self.optimizers]
        for idx, inner in enumerate(inners):
            if isinstance(inner, ReplicatedStateOptimizer):
                state[f"optimizer_{idx}"] = inner.state_dict()  # the template DCP fills in place
            else:
                state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, inner)
        dcp_load(state, checkpoint_id=path)
        set_model_state_dict(module, state["state_dict"])
        for idx, inner in enumerate(inners):
            if isinstance(inner, ReplicatedStateOptimizer):
                inner.load_state_dict(state[f"optimizer_{idx}"])
            else:
                set_optimizer_state_dict(module, inner, state[f"optimizer_{idx}"])
        return torch.load(compat.distributed_checkpoint_metadata(path), weights_only=False)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a full (single-file) or distributed (one shard per rank) checkpoint, LoGRA state included."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            return self._load_distributed_checkpoint(path, weights_only)
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        assert self.lightning_module is not None
        set_model_state_dict(
            self.lightning_module,
            checkpoint.pop("state_dict"),
            options=StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading),
        )
        states = checkpoint.pop("optimizer_states", [])
        if len(states) != len(self.optimizers):
            raise ValueError(f"checkpoint has {len(states)} optimizer states, the run has {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, states, strict=True):
            inner = compat.inner_optimizer(opt)
            if isinstance(inner, ReplicatedStateOptimizer):
                inner.load_state_dict(state)
            else:
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(
                    self.lightning_module, inner, state, options=StateDictOptions(full_state_dict=True)
                )
        return checkpoint


LoGRAStrategy.register_strategies(StrategyRegistry)
