"""The optimizers' settings: the choice of optimizer, Kaldi's max-change defaults and the
[ngsgd] section (labavg.optim.ngsgd). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from labavg.base.schema import FINITE_POSITIVE, POSITIVE, integer, real, setting

OPTIMIZERS = ("sgd", "ngsgd")
# (max_change_per_sample, max_param_change) unless set: nnet2/3 for NG-SGD; nnet1 SGD has none.
MAX_CHANGE_DEFAULTS = {"sgd": (0.0, 0.0), "ngsgd": (0.075, 2.0)}


@dataclass(frozen=True)
class NGConfig:
    """Settings of OnlineNaturalGradient (defaults: nnet2/nnet3 NaturalGradientAffineComponent)."""

    # The bounds of OnlineNaturalGradient::InitDefault (checked again in __post_init__).
    rank_in: int = setting(20, "rank of the input-side Fisher estimate", POSITIVE)
    rank_out: int = setting(80, "rank of the output-side Fisher estimate", POSITIVE)
    update_period: int = setting(4, "minibatches between Fisher updates", POSITIVE)
    num_samples_history: float = setting(2000.0, "samples the Fisher estimate remembers",
                                         real(0, 1e6, low_open=True))
    alpha: float = setting(4.0, "smoothing of the Fisher matrix towards the identity", real(0))
    epsilon: float = setting(1.0e-10, "floor of the eigenvalues", real(0, 1e-5, low_open=True))
    delta: float = setting(5.0e-4, "relative floor of the eigenvalues", real(0, 1e-2, low_open=True))
    # Eta(): "don't let eta approach 1 too closely"
    max_eta: float = setting(0.9, "cap of the forgetting rate",
                             real(0, 1, low_open=True, high_open=True))
    num_initial_updates: int = setting(10, "minibatches updated every time at first (Kaldi: 10)",
                                       integer(0))
    condition_threshold: float = setting(1.0e6, "PreconditionDirectionsInternal's condition limit",
                                         FINITE_POSITIVE)
    orthogonality_threshold: float = setting(1.0e-3, "ReorthogonalizeRt1's threshold",
                                             FINITE_POSITIVE)

    def __post_init__(self) -> None:
        # The same plausibility checks as OnlineNaturalGradient::InitDefault.
        checks = {
            "rank_in": self.rank_in > 0,
            "rank_out": self.rank_out > 0,
            "update_period": self.update_period > 0,
            "num_samples_history": 0.0 < self.num_samples_history <= 1.0e6,
            "alpha": self.alpha >= 0.0,
            "epsilon": 0.0 < self.epsilon <= 1.0e-5,
            "delta": 0.0 < self.delta <= 1.0e-2,
            "max_eta": 0.0 < self.max_eta < 1.0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad NGConfig value(s) {', '.join(f'{k}={getattr(self, k)}' for k in bad)}")
