"""Averagers: what one averaging round does with the workers' models.

An averager owns the averaging policy of a run: the interval K, the global model every worker
starts the next block of K minibatches from, any outer-optimizer state, and what each round
measured (divergence, seconds, bytes). `round(flat)` runs one round on this rank's flat
parameter buffer; a method differs from plain averaging only in `update`, which turns the
global model and the new average into the next global model. Every method averages with ONE
allreduce (`labavg.averaging.mean.average_parameters`), which also leaves non-finite ranks out; the
run's `reduce` setting picks how that mean is computed (labavg.comm.reduce), for every method.
With a lossy `payload` (labavg.averaging.payload) the average is instead W_g plus the mean of the ranks'
compressed changes, gathered with one allgather; `update` runs on it the same way.

Notation (the papers'): N workers, W_i(t) worker i's model after block t, W̄(t) their average.

model (Su & Chen 2015, Sec. 2; the default)
    the next block starts from the average: W_g(t) = W̄(t).

bmuf (Chen & Huo 2016, "Scalable training of deep learning machines by incremental block
training with intra-block parallel optimization and blockwise model-update filtering", Sec. 2;
numbered here in the order Sec. 2 introduces them, not checked against the paper's own numbers)
    G(t) = W̄(t) - W_g(t-1)                    (1)  the block's model update
    Δ(t) = η Δ(t-1) + ζ G(t),  0 <= η < 1, ζ > 0   (2)  blockwise model-update filtering
    W(t) = W(t-1) + Δ(t)                       (3)
    W_g(t) = W(t)                              (4)  classical block momentum (CBM)
    W_g(t) = W(t) + η Δ(t)                     (5)  Nesterov block momentum (NBM)
    with η the block momentum, ζ the block learning rate, and W_g(t) the model the workers
    start block t+1 from. Over many blocks a steady G is amplified by ζ / (1 - η).

diloco (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", Algorithm 1)
    Δ(t) = (1/N) Σ_i (θ(t-1) - θ_i(t)) = θ(t-1) - θ̄(t)     the outer gradient
    θ(t) = OuterOpt(θ(t-1), Δ(t)), OuterOpt = SGD with Nesterov momentum (Sutskever et al.
    2013, as torch.optim.SGD): m(t) = μ m(t-1) + Δ(t);  θ(t) = θ(t-1) - α (Δ(t) + μ m(t)),
    or θ(t) = θ(t-1) - α m(t) without Nesterov; α the outer learning rate, μ the momentum.

Both outer updates are computed as an offset from the average rather than from the global
model: in real numbers W(t-1) + Δ(t) (or θ(t-1) - α Δ(t)) equals W̄(t) + (ζ - 1) G(t) + ...,
but in floating point W + (W̄ - W) is not W̄. Written around W̄, the settings that reduce a
method to plain averaging (η = 0, ζ = 1; α = 1, μ = 0) give the average bit for bit.

With one rank there is nothing to average (no allreduce, no bytes), but bmuf and diloco still
apply their outer step to the one worker's block: DiLoCo with one worker is a method of its
own (the paper's k = 1), and a 1-rank run of a method is the baseline of its N-rank runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar

import torch

from labavg.averaging.interface import AveragerInfo
from labavg.averaging.mean import AverageStats, average_parameters
from labavg.comm.base import Communicator
from labavg.comm.reduce import ALGORITHMS as REDUCE_ALGORITHMS
from labavg.averaging.payload import average_changes, check as check_payload, lossy, payload_bytes
from labavg.averaging.registry import BMUFConfig, DiLoCoConfig

# The scopes of a round (`due`): the ranks of one node, or every rank.
NODE, ALL = "node", "all"


class Averager:
    """Plain model averaging (the paper's): the next block starts from the average.

    `average_every` is K, the minibatches between rounds (a round also ends every epoch). With
    `restore` the averager keeps the global model the block started from, which every rank
    takes back if all of them diverge at once; without, that case raises FloatingPointError.
    `reduce` is the algorithm that computes the mean (labavg.comm.reduce.ALGORITHMS).
    `payload` and `bits` what a round sends (labavg.averaging.payload); a lossy payload needs the global
    model (the changes are taken from it) and, with `error_feedback`, keeps this rank's
    compression residual, which differs between ranks and is checkpointed with each rank.
    """

    # The `averaging` name; what else the house shows of a method (help, settings table,
    # labels, memory) is its declaration in labavg.averaging.registry, read without torch.
    method: ClassVar[str] = "model"

    def __init__(self, flat: torch.Tensor, comm: Communicator, average_every: int = 1,
                 restore: bool = True, reduce: str = "allreduce", payload: str = "fp32",
                 bits: int = 8, error_feedback: bool = True) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be >= 1, got {average_every}")
        if reduce not in REDUCE_ALGORITHMS:
            raise ValueError(f"unknown reduce algorithm {reduce!r}; known: "
                             f"{', '.join(REDUCE_ALGORITHMS)}")
        check_payload(payload, bits)
        if lossy(payload) and reduce != "allreduce":
            raise ValueError(f"payload {payload!r} is gathered, not reduced: it cannot use "
                             f"reduce {reduce!r}")
        self.comm = comm
        self.average_every = average_every
        self.reduce = reduce
        self.payload, self.bits = payload, bits
        self.restore = restore or self.keeps_global or lossy(payload)
        # The global model the current block started from (W_g(t-1) above).
        self.global_model = flat.clone() if self.restore else None
        # This rank's error-feedback residual e_i (labavg.averaging.payload).
        self.residual = (torch.zeros_like(flat) if lossy(payload) and error_feedback
                         else None)

    # What a subclass changes ------------------------------------------------------------------

    keeps_global: ClassVar[bool] = False  # True when `update` needs the block's starting model

    def update(self, global_model: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        """The model the next block starts from, given the one this block started from and the
        workers' average (which it may overwrite in place and return)."""
        return average

    def reset(self) -> None:
        """Forget the outer optimizer's state (none for plain averaging)."""

    def outer_state(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's tensors, for the checkpoint."""
        return {}

    # The round --------------------------------------------------------------------------------

    def observe(self, loss_sum: float, frames: int) -> None:
        """A constant K needs no loss (labavg.averaging.schedule)."""

    def due(self, step: int, end_of_epoch: bool) -> str | None:
        """The round after minibatch `step`: ALL every K-th and every epoch end, else None."""
        return ALL if step % self.average_every == 0 or end_of_epoch else None

    def round(self, flat: torch.Tensor, stop: bool = False, scope: str = ALL) -> AverageStats:
        """One averaging round on this rank's parameters `flat` (in place, every rank at once).

        Afterwards `flat` holds the model the next block starts from, the same on every rank.
        `comm_seconds` of the result covers the whole round, the outer update included.
        """
        start = time.perf_counter()
        if lossy(self.payload):
            stats = average_changes(flat, self.comm, self.global_model, self.residual,
                                    self.payload, self.bits, stop=stop)
        else:
            stats = average_parameters(flat, self.comm, stop=stop, fallback=self.global_model,
                                       reduce=self.reduce)
        # When every rank diverged there is no average: all restart from the old global model
        # and the outer state stays as it was, as if the block had not happened.
        if stats.dropped < self.comm.size and self.keeps_global:
            new = self.update(self.global_model, flat)
            if new is not flat:
                flat.copy_(new)
        if self.global_model is not None:
            self.global_model.copy_(flat)
        return dataclasses.replace(stats, comm_seconds=time.perf_counter() - start)

    def bytes_per_round(self, flat: torch.Tensor) -> int:
        """What `round` puts into the collective from this rank (0 with one rank)."""
        if self.comm.size == 1:
            return 0
        if lossy(self.payload):
            return payload_bytes(flat.numel(), self.payload, self.bits)
        return flat.numel() * flat.element_size()

    def describe(self, flat: torch.Tensor) -> AveragerInfo:
        """The method, reduce, payload (int with its bits) and bytes of a round."""
        payload = f"int{self.bits}" if self.payload == "int" else self.payload
        return AveragerInfo(self.method, self.reduce, payload, self.bytes_per_round(flat))

    def restart(self, flat: torch.Tensor) -> None:
        """Start the next block from `flat` (Newbob's rolled-back model) with a fresh outer
        optimizer: the momentum of a rejected epoch points the way Newbob just refused, and
        the residual holds what compression dropped of the rejected changes."""
        if self.global_model is not None:
            self.global_model.copy_(flat)
        if self.residual is not None:
            self.residual.zero_()
        self.reset()

    # Checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides the parameters (loadable with weights_only=True).

        A checkpoint is taken right after a round, when every rank's parameters are the global
        model; so the global model itself is not saved again, only the outer optimizer's state.
        """
        return {"method": self.method,
                **{k: v.detach().cpu().clone() for k, v in self._state().items()}}

    def _state(self) -> dict[str, torch.Tensor]:
        state = dict(self.outer_state())
        if self.residual is not None:
            state["residual"] = self.residual
        return state

    def load_state_dict(self, state: dict[str, Any] | None, flat: torch.Tensor) -> None:
        """Continue from a checkpoint whose parameters `flat` has just been loaded.

        `state` None is a checkpoint written before averagers had a state: plain averaging.
        """
        method = "model" if state is None else state.get("method")
        if method != self.method:
            raise ValueError(f"the checkpoint was trained with averaging {method!r}, "
                             f"this run uses {self.method!r}")
        if state is not None and "schedule" in state:  # a ScheduledAverager's checkpoint
            raise ValueError(f"the checkpoint was trained with averaging schedule "
                             f"{state['schedule'].get('name')!r}, this run uses 'constant'")
        if self.global_model is not None:
            self.global_model.copy_(flat)
        for name, tensor in self._state().items():
            if name == "residual" and (state is None or name not in state):
                # A checkpoint of an fp32 run (or one without error feedback): nothing dropped.
                tensor.zero_()
                continue
            saved = state[name]
            if saved.shape != tensor.shape:
                raise ValueError(f"the checkpoint's averager state {name} holds {saved.numel()} "
                                 f"values, the model has {tensor.numel()}")
            tensor.copy_(saved.to(tensor.device))


class BMUFAverager(Averager):
    """Blockwise model-update filtering (Chen & Huo 2016, equations (1)-(5) above)."""

    method: ClassVar[str] = "bmuf"
    keeps_global: ClassVar[bool] = True

    def __init__(self, flat: torch.Tensor, comm: Communicator, average_every: int = 1,
                 restore: bool = True, config: BMUFConfig | None = None,
                 reduce: str = "allreduce", **payload: Any) -> None:
        super().__init__(flat, comm, average_every, restore, reduce, **payload)
        config = config or BMUFConfig()
        self.eta, self.zeta, self.nesterov = config.momentum, config.block_lr, config.nesterov
        self.delta = torch.zeros_like(flat)  # Δ(t-1), the same on every rank

    def update(self, global_model: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        eta, zeta = self.eta, self.zeta
        g = average - global_model  # G(t), eq. (1)
        # W(t) by eq. (3) with Δ(t) from eq. (2), around W̄(t) (see the module docstring):
        # NBM: W_g(t-1) = W(t-1) + η Δ(t-1), so W(t) = W̄(t) + (ζ - 1) G(t);
        # CBM: W_g(t-1) = W(t-1),            so W(t) = W̄(t) + (ζ - 1) G(t) + η Δ(t-1).
        w = average.add_(g, alpha=zeta - 1.0)
        if not self.nesterov:
            w.add_(self.delta, alpha=eta)
        self.delta.mul_(eta).add_(g, alpha=zeta)  # eq. (2)
        if self.nesterov:
            w.add_(self.delta, alpha=eta)  # eq. (5); eq. (4) is w itself
        return w

    def reset(self) -> None:
        self.delta.zero_()

    def outer_state(self) -> dict[str, torch.Tensor]:
        return {"delta": self.delta}


class DiLoCoAverager(Averager):
    """DiLoCo's outer step (Douillard et al. 2023, Algorithm 1): Nesterov SGD on the outer
    gradient, the global model minus the average."""

    method: ClassVar[str] = "diloco"
    keeps_global: ClassVar[bool] = True

    def __init__(self, flat: torch.Tensor, comm: Communicator, average_every: int = 1,
                 restore: bool = True, config: DiLoCoConfig | None = None,
                 reduce: str = "allreduce", **payload: Any) -> None:
        super().__init__(flat, comm, average_every, restore, reduce, **payload)
        config = config or DiLoCoConfig()
        self.alpha, self.mu, self.nesterov = config.outer_lr, config.momentum, config.nesterov
        self.momentum = torch.zeros_like(flat)  # m(t-1), the same on every rank

    def update(self, global_model: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        alpha, mu = self.alpha, self.mu
        outer_grad = global_model - average  # Δ(t)
        # θ(t) = θ(t-1) - α (Δ(t) + μ m(t))  = θ̄(t) + (1 - α) Δ(t) - α μ m(t)    (Nesterov)
        # θ(t) = θ(t-1) - α m(t)             = θ̄(t) + (1 - α) Δ(t) - α μ m(t-1)  (plain)
        theta = average.add_(outer_grad, alpha=1.0 - alpha)
        if not self.nesterov:
            theta.add_(self.momentum, alpha=-alpha * mu)
        self.momentum.mul_(mu).add_(outer_grad)
        if self.nesterov:
            theta.add_(self.momentum, alpha=-alpha * mu)
        return theta

    def reset(self) -> None:
        self.momentum.zero_()

    def outer_state(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum}

