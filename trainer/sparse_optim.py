"""The embedding tables' optimiser (``trainer.embedding_optimizer``), in one process and fused into TorchRec's kernels.

Both paths run one rule, so a sharded run follows a one-process run on the same global batches:

    rowwise_adagrad  one process: :class:`RowWiseAdagrad` (this module) on sparse gradients;
                     sharded: torchrec.optim.RowWiseAdagrad, which TorchRec runs as fbgemm's EXACT_ROWWISE_ADAGRAD
    adagrad          one process: torch.optim.Adagrad (its sparse path);
                     sharded: torch.optim.Adagrad, run as fbgemm's EXACT_ADAGRAD

torchrec.optim.RowWiseAdagrad itself cannot stand in for the one-process path: it raises on sparse gradients
("RowWise adagrad cannot be used with sparse gradients", torchrec 1.8), and the tables' gradients are sparse
(trainer.loop.sparse_table_gradients) so that no step materializes a whole table's gradient.

Column-wise sharding: TorchRec keeps one row-wise accumulator per row *per column shard*, each the mean of
g**2 over that shard's columns (torchrec.distributed.batched_embedding_kernel,
get_optimizer_rowwise_shard_metadata_and_global_metadata), so a column-wise sharded table under
rowwise_adagrad steps differently from the one-process rule; table-wise (and row-wise) sharding steps the same.
Measured on CPU (the ranker of tests/trainer/test_distributed.py at embedding_dim 8 split into two column shards
by ``ParameterConstraints(min_partition=4)``, 2 ranks, 3 steps at lr 0.02): ``momentum1`` holds 2 x rows values and
table rows end up to 0.032 from the one-process run's (losses within 3e-4 relative); table-wise, the tables match to
1e-5 (but reduction-order noise on rows of ~1e-8 gradients: tests/trainer/test_distributed.py) and the
accumulators to 1e-4 relative. Production TorchRec runs column-wise tables this way; nothing here
refuses it. (At this repo's small dims the planner keeps a column-wise table in one shard.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from trainer.config import TrainerConfig


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad of 2-D embedding tables, on sparse (or dense) gradients: one accumulator per row.

    For each row r a step's gradient touches, with g_r (D,) float32 the row's gradient summed over every lookup
    of the step, in lookup order (:func:`row_gradients`; fbgemm's "exact" variants also sum a row's lookups first)::

        acc_r += mean_d g_r[d] ** 2
        w_r   -= lr * g_r / (sqrt(acc_r) + eps)

    Rows the step did not touch keep their value and accumulator (with a dense gradient their g_r is 0, which
    leaves both unchanged too). Sources: Adagrad, Duchi, Hazan and Singer, JMLR 12 (2011), with the
    per-row accumulator of fbgemm_gpu's ``EXACT_ROWWISE_ADAGRAD`` (the kernel TorchRec's fused RowWiseAdagrad
    runs; also torchrec.optim.RowWiseAdagrad, which takes dense gradients only). No weight decay or lr decay.

    State per table (rows, D): ``state[p]["sum"]`` (rows,) float32, zeros at the start: D times smaller than
    torch.optim.Adagrad's (rows, D).

    Raises:
        ValueError: ``lr`` or ``eps`` not > 0, or a parameter that is not a 2-D table.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-2, eps: float = 1e-10) -> None:
        if not lr > 0 or not eps > 0:
            raise ValueError(f"RowWiseAdagrad needs lr > 0 and eps > 0, got lr={lr}, eps={eps}")
        super().__init__(params, {"lr": lr, "eps": eps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad optimises 2-D tables (rows, D), got a parameter of shape {tuple(p.shape)}")
                self.state[p]["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every table with a gradient (the rule of the class docstring); returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is not None:
                    _step_table(p, p.grad, self.state[p]["sum"], lr, eps)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking every saved accumulator is (rows,) of its table.

        Raises:
            ValueError: a saved state that is not this optimiser's (e.g. torch.optim.Adagrad's (rows, D) sums,
                a checkpoint written under ``trainer.embedding_optimizer = "adagrad"``) or of other tables.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, saved_ids):
            acc = state_dict["state"].get(i, {}).get("sum")
            if acc is None or tuple(acc.shape) != (p.shape[0],):
                got = "no accumulator" if acc is None else f"an accumulator of shape {tuple(acc.shape)}"
                raise ValueError(
                    f"the saved embedding optimiser state has {got} for a table of shape {tuple(p.shape)}, not a "
                    f"row-wise Adagrad one of ({p.shape[0]},): it was written by another trainer.embedding_optimizer "
                    "(or other tables); resume with the optimiser that wrote it, or start from scratch"
                )
        super().load_state_dict(state_dict)


class RowSparseAdam(torch.optim.SparseAdam):
    """``torch.optim.SparseAdam`` with its step done by row index operations: the same rule, the same state
    (``step``, ``exp_avg``, ``exp_avg_sq`` per table, so either loads the other's ``state_dict``) and the same
    float32 results bit for bit (tested), at about a third of the CPU on 256-lookup steps of 16,384 x 16 tables.

    SparseAdam (PyTorch 2.13, ``torch.optim._functional.sparse_adam``) coalesces the gradient, then reads the
    moments through ``sparse_mask`` and writes each update through a new sparse tensor; per table that is several
    sparse-tensor constructions and checks, most of a distill student's step (5.4 of 9.2 CPU-ms with five
    tables, 2026-12-03). Here the coalesced gradient's rows (unique) index the moments and the table directly:
    ``index_select`` reads what ``sparse_mask`` reads and ``index_add_`` on unique rows adds what the sparse
    ``add_`` adds, one float32 addition per element. A gradient of more than one sparse dimension takes the
    library's own update.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a (sparse) gradient; ``closure`` as in ``torch.optim``.

        Raises:
            RuntimeError: a dense gradient (as SparseAdam).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            eps, lr, maximize = group["eps"], float(group["lr"]), group.get("maximize", False)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                grad = -p.grad if maximize else p.grad
                if grad.sparse_dim() != 1:
                    torch.optim._functional.sparse_adam([p], [grad], [state["exp_avg"]], [state["exp_avg_sq"]],
                                                        [state["step"]], eps=eps, beta1=beta1, beta2=beta2, lr=lr,
                                                        maximize=False)
                    continue
                _adam_rows(p, grad.coalesce(), state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1,
                           beta2, eps)
        return loss


def _adam_rows(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
               lr: float, beta1: float, beta2: float, eps: float) -> None:
    """SparseAdam's update of the rows of ``grad`` (coalesced, one sparse dimension), in its order of operations."""
    values = grad._values()
    if values.numel() == 0:
        return
    rows = grad._indices()[0]
    old_exp_avg = exp_avg.index_select(0, rows)
    exp_avg_update = values.sub(old_exp_avg).mul_(1 - beta1)
    exp_avg.index_add_(0, rows, exp_avg_update)
    old_exp_avg_sq = exp_avg_sq.index_select(0, rows)
    exp_avg_sq_update = values.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2)
    exp_avg_sq.index_add_(0, rows, exp_avg_sq_update)
    numer = exp_avg_update.add_(old_exp_avg)
    denom = exp_avg_sq_update.add_(old_exp_avg_sq).sqrt_().add_(eps)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    p.index_add_(0, rows, -step_size * numer.div_(denom))


def row_gradients(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO gradient of a table (rows, D) as (rows (R,) int64 ascending and unique, their summed gradients
    (R, D)): each row's lookups added in the order the gradient lists them, from +0.

    What ``grad.coalesce()`` gives up to float re-association: coalesce adds a row's lookups in the order of an
    unstable sort of the indices (torch 2.13's CPU sort of int64 is not stable), so its sum depends on every other
    index of the gradient, and a gradient with exact-zero rows added (the events a model looks up but does not
    read) sums differently. Summed in lookup order, zero rows anywhere leave every sum as it is (x + 0 == x, and a
    sum started at +0 is never -0), which is what makes :class:`trainer.models.gem.SparseArch`'s ``history_len``
    cut exact. ``index_add_`` on the CPU adds source rows one by one in index order (tested against a Python loop in
    tests/trainer/test_sparse_optim.py).
    """
    indices, values = grad._indices()[0], grad._values()
    rows, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    return rows, values.new_zeros((rows.numel(), *values.shape[1:])).index_add_(0, inverse, values)


def _step_table(p: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor, lr: float, eps: float) -> None:
    """Update table ``p`` (rows, D) and its accumulator ``acc`` (rows,) in place with ``grad`` (sparse COO or dense)."""
    if grad.is_sparse:
        rows, values = row_gradients(grad)  # one summed gradient per row looked up (a row seen twice is updated once)
        acc.index_add_(0, rows, values.pow(2).mean(dim=1))
        p.index_add_(0, rows, values / (acc[rows].sqrt() + eps).unsqueeze(1), alpha=-lr)
    else:
        acc.add_(grad.pow(2).mean(dim=1))
        p.addcdiv_(grad, (acc.sqrt() + eps).unsqueeze(1), value=-lr)


def embedding_learning_rate(tc: TrainerConfig) -> float:
    """The tables' learning rate: :attr:`trainer.config.TrainerConfig.table_learning_rate` (GEM's own when set, else
    ``trainer.embedding_learning_rate``, else ``trainer.learning_rate``)."""
    return tc.table_learning_rate


def embedding_optimizer(tc: TrainerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The one-process optimiser of the tables ``params`` under :attr:`trainer.config.TrainerConfig.table_optimizer`
    (``trainer.embedding_optimizer``, or GEM's own ``trainer.gem.embedding_optimizer``; both take sparse gradients)."""
    if tc.table_optimizer == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=embedding_learning_rate(tc), eps=tc.embedding_eps)
    return torch.optim.Adagrad(params, lr=embedding_learning_rate(tc), eps=tc.embedding_eps)


def fused_optimizer(tc: TrainerConfig) -> tuple[type[torch.optim.Optimizer], dict[str, float]]:
    """(class, kwargs) for TorchRec's ``apply_optimizer_in_backward`` under :attr:`TrainerConfig.table_optimizer`.

    TorchRec maps the class to the fbgemm kernel's optimiser (torchrec.distributed.utils,
    ``_OPTIMIZER_CLASS_TO_EMB_OPT_TYPE``): torchrec.optim.RowWiseAdagrad -> EXACT_ROWWISE_ADAGRAD,
    torch.optim.Adagrad -> EXACT_ADAGRAD; lr and eps go to the kernel as its fused parameters.
    """
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad

    kwargs = {"lr": embedding_learning_rate(tc), "eps": tc.embedding_eps}
    if tc.table_optimizer == "rowwise_adagrad":
        return TorchRecRowWiseAdagrad, kwargs
    return torch.optim.Adagrad, kwargs
