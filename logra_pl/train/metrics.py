"""pass@k evaluation metrics: the unbiased estimator, a data-parallel ``PassAtK`` and the macro mean over tasks.

The evaluation protocol samples ``n`` responses per problem. With ``c`` of them correct, the unbiased estimate of the
probability that at least one of ``j`` responses drawn without replacement is correct is

    pass@j = 1 − C(n − c, j) / C(n, j)

(:func:`pass_at_k`), averaged over problems. ``pass@1`` is the mean correctness over all responses, which with the
same ``n`` for every problem equals the estimator at ``j = 1``. :class:`MacroPassAt1` keeps ``pass@1`` per task of a
mixture and their equally weighted mean (the "RG-Hard score").

Every state is a sum reduced with ``dist_reduce_fx="sum"``, so ``compute()`` on data-parallel ranks gives the value
of one process that saw every problem. Both metrics return a dict of scalar tensors for ``LightningModule.log_dict``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["MacroPassAt1", "PassAtK", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one problem: ``1 − C(n − c, k) / C(n, k)``.

    The ratio of binomials is evaluated as the product ``Π_{i=n−c+1}^{n} (1 − k / i)``, which never forms a large
    binomial coefficient; when ``n − c < k`` every ``k``-subset holds a correct response and the result is exactly 1.0.

    Arguments:
        n: responses sampled for the problem (``n ≥ 1``).
        c: how many of them are correct (``0 ≤ c ≤ n``).
        k: responses per attempt (``1 ≤ k ≤ n``).

    Returns:
        The probability that ``k`` of the ``n`` responses, drawn without replacement, contain a correct one.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``c`` or ``k`` is out of range.
    """
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    # C(n−c, k) / C(n, k) = Π_{i=n−c+1}^{n} (i − k) / i
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _correct_matrix(correct: Tensor) -> Tensor:
    """Check that ``correct`` is a (problems, n) matrix of 0/1 (or bool) values; return it as int64."""
    if not isinstance(correct, Tensor):
        raise TypeError(f"correct must be a torch.Tensor, got {type(correct).__name__}")
    if correct.ndim != 2:
        raise ValueError(f"correct must have shape (problems, responses), got shape {tuple(correct.shape)}")
    if correct.is_floating_point() or correct.is_complex():
        if not bool(((correct == 0) | (correct == 1)).all()):
            raise ValueError("correct must hold only 0 and 1 (or be a bool tensor)")
    elif correct.dtype != torch.bool and bool(((correct < 0) | (correct > 1)).any()):
        raise ValueError("correct must hold only 0 and 1 (or be a bool tensor)")
    return correct.to(torch.int64)


class PassAtK(Metric):
    """pass@1 (mean correctness over all responses) and the unbiased pass@j for each requested ``j``.

    ``update`` takes a (problems, n) matrix of correctness per response; ``n`` is fixed for the metric (it is the
    number of validation responses per problem). ``compute`` returns ``{"pass@1": …, "pass@j": …}``: ``pass@1`` is
    always present, the others for each ``j`` of ``ks`` other than 1.

    Arguments:
        ks: the ``j`` of pass@j to report (positive, unique). ``1`` is always reported.
        samples: responses per problem (``val_responses``). When given, every ``j`` must be at most ``samples`` and
            every update must have ``samples`` columns; when omitted, the first update fixes ``n`` for the metric's
            lifetime (``reset`` clears the sums, not ``n``).
        kwargs: passed to :class:`torchmetrics.Metric`.

    Raises:
        ValueError: a ``j`` is not positive, is repeated, or exceeds ``samples``.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    problems: Tensor
    responses: Tensor
    correct: Tensor
    estimator_sums: Tensor

    def __init__(self, ks: Sequence[int] = (1,), samples: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        ks = [operator.index(j) for j in ks]
        if not ks:
            raise ValueError("PassAtK needs at least one k")
        if any(j < 1 for j in ks):
            raise ValueError(f"pass@k needs positive k, got {ks}")
        if len(set(ks)) != len(ks):
            raise ValueError(f"pass@k values must be unique, got {ks}")
        if samples is not None:
            samples = operator.index(samples)
            if samples < 1:
                raise ValueError(f"samples must be at least 1, got {samples}")
            _check_ks_fit(ks, samples)
        self.ks: tuple[int, ...] = tuple(ks)
        self.samples = samples
        # pass@1 comes from the correct/response counts; only the other j need estimator sums.
        self._extra_ks: tuple[int, ...] = tuple(j for j in ks if j != 1)
        self._n: int | None = samples
        self._tables: dict[int, Tensor] = {}
        self.add_state("problems", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("responses", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("correct", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("estimator_sums", torch.zeros(len(self._extra_ks), dtype=torch.float64), dist_reduce_fx="sum")

    def _table(self, n: int) -> Tensor:
        """``table[m, c]`` = pass_at_k(n, c, extra_ks[m]) for c = 0 … n, in float64 (CPU, cached per ``n``)."""
        if n not in self._tables:
            rows = [[pass_at_k(n, c, j) for c in range(n + 1)] for j in self._extra_ks]
            self._tables[n] = torch.tensor(rows, dtype=torch.float64).reshape(len(self._extra_ks), n + 1)
        return self._tables[n]

    def update(self, correct: Tensor) -> None:
        """Add problems and their responses' correctness.

        Arguments:
            correct: bool or 0/1 tensor of shape (problems, n), one row per problem, one column per response.

        Raises:
            ValueError: the tensor is not (problems, n) with 0/1 values, ``n`` differs from earlier updates (or from
                ``samples``), or a requested ``j`` exceeds ``n``.
        """
        matrix = _correct_matrix(correct)
        n = matrix.shape[1]
        if n < 1:
            raise ValueError("correct needs at least one response per problem")
        if self._n is None:
            _check_ks_fit(self.ks, n)
            self._n = n
        elif n != self._n:
            raise ValueError(
                f"PassAtK got {n} responses per problem after {self._n}: n must be the same for every update"
            )
        per_problem = matrix.sum(dim=1)
        self.problems += matrix.shape[0]
        self.responses += matrix.numel()
        self.correct += per_problem.sum()
        if self._extra_ks and matrix.shape[0]:
            table = self._table(n).to(self.estimator_sums.device)
            self.estimator_sums += table[:, per_problem.to(table.device)].sum(dim=1)

    def compute(self) -> dict[str, Tensor]:
        """``{"pass@1": mean correctness over all responses, "pass@j": mean estimate over problems}``.

        Values are float32 scalars; NaN before any problem was added.
        """
        dtype = torch.get_default_dtype()
        out = {"pass@1": (self.correct.double() / self.responses.double()).to(dtype)}
        for m, j in enumerate(self._extra_ks):
            out[f"pass@{j}"] = (self.estimator_sums[m] / self.problems.double()).to(dtype)
        return out


def _check_ks_fit(ks: Sequence[int], samples: int) -> None:
    """Refuse a pass@j with more responses than a problem has."""
    too_large = [j for j in ks if j > samples]
    if too_large:
        raise ValueError(
            f"val_responses={samples} is smaller than the requested pass@{max(too_large)}: "
            f"pass@j needs at least j responses per problem"
        )


class MacroPassAt1(Metric):
    """pass@1 per task of a mixture and their macro mean (each task with samples weighted equally).

    ``compute`` returns ``"<task>/pass@1"`` for each task that has samples and ``"macro_pass@1"``, the mean of those
    task values (NaN when no task has samples).

    Arguments:
        tasks: the mixture's task names (non-empty, unique); updates may only name these.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Raises:
        ValueError: ``tasks`` is empty or has repeats.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    correct: Tensor
    total: Tensor

    def __init__(self, tasks: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(tasks, str):
            raise TypeError("tasks must be a sequence of task names, not one string")
        tasks = [str(t) for t in tasks]
        if not tasks:
            raise ValueError("MacroPassAt1 needs at least one task")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"task names must be unique, got {tasks}")
        self.tasks: tuple[str, ...] = tuple(tasks)
        self._index = {t: i for i, t in enumerate(tasks)}
        self.add_state("correct", torch.zeros(len(tasks), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(len(tasks), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, correct: Tensor, tasks: Sequence[str]) -> None:
        """Add problems with the task each belongs to.

        Arguments:
            correct: bool or 0/1 tensor of shape (problems, n), one row per problem, one column per response.
            tasks: one task name per row of ``correct``.

        Raises:
            ValueError: a task name is not one of the metric's tasks, or the number of names is not the number of rows.
        """
        matrix = _correct_matrix(correct)
        if isinstance(tasks, str):
            raise TypeError("tasks must be a sequence with one task name per problem, not one string")
        tasks = list(tasks)
        if len(tasks) != matrix.shape[0]:
            raise ValueError(f"got {len(tasks)} task names for {matrix.shape[0]} problems: one name per row needed")
        unknown = sorted({t for t in tasks if t not in self._index})
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}: MacroPassAt1 was built for {list(self.tasks)}")
        index = torch.tensor([self._index[t] for t in tasks], dtype=torch.int64, device=self.correct.device)
        per_problem = matrix.sum(dim=1).to(self.correct.device)
        self.correct += torch.zeros_like(self.correct).index_add_(0, index, per_problem)
        responses = torch.full_like(per_problem, matrix.shape[1])
        self.total += torch.zeros_like(self.total).index_add_(0, index, responses)

    def compute(self) -> dict[str, Tensor]:
        """``{"<task>/pass@1": …, "macro_pass@1": …}`` as float32 scalars, over the tasks that have samples."""
        dtype = torch.get_default_dtype()
        out: dict[str, Tensor] = {}
        means = []
        for i, task in enumerate(self.tasks):
            if int(self.total[i]) > 0:
                value = self.correct[i].double() / self.total[i].double()
                means.append(value)
                out[f"{task}/pass@1"] = value.to(dtype)
        macro = torch.stack(means).mean() if means else torch.tensor(float("nan"), dtype=torch.float64)
        out["macro_pass@1"] = macro.to(dtype=dtype, device=self.correct.device)
        return out


class MacroMean(Metric):
    """The mean of a per-response value (e.g. the verifier reward, partial credit included) per task, and the macro
    mean over tasks — the paper's RG-Hard score is this over rewards: the equally weighted mean of the task means.

    ``compute`` returns ``"<task>/<name>"`` for each task with samples and ``"macro_<name>"``.

    Arguments:
        tasks: the mixture's task names (non-empty, unique).
        name: the value's name in the keys (``"reward"``).
        kwargs: passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    sums: Tensor
    counts: Tensor

    def __init__(self, tasks: Sequence[str], name: str = "reward", **kwargs) -> None:
        super().__init__(**kwargs)
        tasks = [str(t) for t in tasks]
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"MacroMean needs unique task names, got {tasks}")
        self.tasks: tuple[str, ...] = tuple(tasks)
        self.name = name
        self._index = {t: i for i, t in enumerate(tasks)}
        self.add_state("sums", torch.zeros(len(tasks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", torch.zeros(len(tasks), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor, tasks: Sequence[str], mask: Tensor | None = None) -> None:
        """Add ``values`` of shape (problems, n) — one row per problem — with each row's task.

        Arguments:
            values: the values, (problems, n).
            tasks: one task name per row.
            mask: (problems, n) bool, the values to count (e.g. the responses that have a reward); None: all.
        """
        values = torch.as_tensor(values, dtype=torch.float64)
        if values.ndim != 2 or len(tasks) != values.shape[0]:
            raise ValueError(f"values must be (problems, n) with one task per row; got {tuple(values.shape)}")
        unknown = sorted({t for t in tasks if t not in self._index})
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}: MacroMean was built for {list(self.tasks)}")
        index = torch.tensor([self._index[t] for t in tasks], dtype=torch.int64, device=self.sums.device)
        if mask is None:
            sums = values.sum(dim=1)
            rows = torch.full((values.shape[0],), float(values.shape[1]), dtype=torch.float64)
        else:
            mask = torch.as_tensor(mask, dtype=torch.bool)
            sums = torch.where(mask, values, 0.0).sum(dim=1)
            rows = mask.sum(dim=1).to(torch.float64)
        self.sums += torch.zeros_like(self.sums).index_add_(0, index, sums.to(self.sums.device))
        self.counts += torch.zeros_like(self.counts).index_add_(0, index, rows.to(self.counts.device))

    def compute(self) -> dict[str, Tensor]:
        """``{"<task>/<name>": …, "macro_<name>": …}`` over the tasks that have samples."""
        dtype = torch.get_default_dtype()
        out: dict[str, Tensor] = {}
        seen = self.counts > 0
        means = self.sums[seen] / self.counts[seen]
        for task, mean in zip([t for t, s in zip(self.tasks, seen.tolist(), strict=True) if s], means, strict=True):
            out[f"{task}/{self.name}"] = mean.to(dtype)
        macro = means.mean() if len(means) else torch.tensor(float("nan"), dtype=torch.float64)
        out[f"macro_{self.name}"] = macro.to(dtype=dtype, device=self.sums.device)
        return out
