"""Averagers (labavg.averaging.methods): plain model averaging, BMUF and DiLoCo.

One round's arithmetic against the papers' equations, the settings that reduce BMUF and DiLoCo
to plain averaging (bit for bit, inproc, MPI and torchrun ranks), resume, and the settings.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labavg.averaging.methods import Averager, BMUFAverager, DiLoCoAverager

from labavg.averaging.factory import make_averager, make_pretraining_averager
from labavg.comm.inproc import run_inproc
from labavg.averaging.registry import BMUFConfig, DiLoCoConfig
from labavg.training.config import TrainConfig, estimate_memory, load_config, validate
from labavg.base.settings import with_overrides
from labavg.data.dataset import open_dataset
from labavg.base.errors import UserError
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary
from labavg.studies.sweep import load_sweep, run_sweep
from labavg.training.runner import train

from test_train import SMALL, final_params, small_config
from support import cli_refusal, stopped_then_resumed

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# The settings under which each method is plain averaging.
PLAIN = {
    "bmuf": BMUFConfig(momentum=0.0, block_lr=1.0),
    "diloco": DiLoCoConfig(outer_lr=1.0, momentum=0.0),
}
PLAIN_FLAGS = {
    "bmuf": ["--averaging", "bmuf", "--set", "averaging.bmuf.momentum=0",
             "--set", "averaging.bmuf.block_lr=1"],
    "diloco": ["--averaging", "diloco", "--set", "averaging.diloco.outer_lr=1",
               "--set", "averaging.diloco.momentum=0"],
}


def _env() -> dict[str, str]:
    # This checkout's labavg in every process the test starts (mpiexec and torchrun ranks too).
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _rounds(make, starts: torch.Tensor, blocks: list[list[torch.Tensor]]):
    """Run one averager per rank over `blocks` (per round, each rank's model after the block,
    as an offset from where the rank started it); every rank's parameters after every round."""
    size = len(blocks[0])

    def work(comm):
        flat = starts.clone()
        averager = make(flat, comm)
        seen = []
        for block in blocks:
            flat += block[comm.rank]
            averager.round(flat)
            seen.append(flat.clone())
        return seen

    ranks = run_inproc(size, work)
    for other in ranks[1:]:  # every rank holds the same model after each round
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], other))
    return ranks[0]


# --- one round's arithmetic -------------------------------------------------------------------


def test_bmuf_rounds_by_hand():
    # Two workers start at 0. Block 1 takes them to [1, 2] and [3, 2]: average [2, 2],
    # G(1) = [2, 2], Δ(1) = 0.5 * 0 + 1 * G(1) = [2, 2], W(1) = [2, 2], and with Nesterov the
    # workers start block 2 at W(1) + 0.5 Δ(1) = [3, 3]. Block 2 moves them by [1, 0] and
    # [1, 2]: average [4, 4], G(2) = [1, 1], Δ(2) = 0.5 [2, 2] + [1, 1] = [2, 2],
    # W(2) = [4, 4], start of block 3: [5, 5]. Without Nesterov the workers start block 2 at
    # W(1) = [2, 2]; block 2 takes them to [3, 2] and [3, 4], average [3, 3], G(2) = [1, 1],
    # Δ(2) = [2, 2], W(2) = W(1) + Δ(2) = [4, 4].
    blocks = [[torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0])],
              [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0])]]
    for nesterov, expected in ((True, [[3.0, 3.0], [5.0, 5.0]]), (False, [[2.0, 2.0], [4.0, 4.0]])):
        config = BMUFConfig(momentum=0.5, block_lr=1.0, nesterov=nesterov)
        seen = _rounds(lambda f, c: BMUFAverager(f, c, config=config), torch.zeros(2), blocks)
        assert [s.tolist() for s in seen] == expected, nesterov


def test_diloco_rounds_by_hand():
    # Two workers start at 0 and reach average [2, 2]: outer gradient Δ(1) = -2, m(1) = -2.
    # Nesterov, outer lr 0.5, momentum 0.5: θ(1) = 0 - 0.5 (-2 + 0.5 (-2)) = 1.5. Block 2 moves
    # the workers by 2 on average (to 3.5): Δ(2) = -2, m(2) = 0.5 (-2) - 2 = -3,
    # θ(2) = 1.5 - 0.5 (-2 + 0.5 (-3)) = 3.25. Plain momentum: θ(1) = 0 - 0.5 (-2) = 1;
    # block 2 reaches 3: Δ(2) = -2, m(2) = -3, θ(2) = 1 - 0.5 (-3) = 2.5.
    blocks = [[torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0])],
              [torch.tensor([2.0, 1.0]), torch.tensor([2.0, 3.0])]]
    for nesterov, expected in ((True, [[1.5, 1.5], [3.25, 3.25]]), (False, [[1.0, 1.0], [2.5, 2.5]])):
        config = DiLoCoConfig(outer_lr=0.5, momentum=0.5, nesterov=nesterov)
        seen = _rounds(lambda f, c: DiLoCoAverager(f, c, config=config), torch.zeros(2), blocks)
        assert [s.tolist() for s in seen] == expected, nesterov


def _bmuf_as_written(starts, blocks, eta, zeta, nesterov):
    """Chen & Huo's equations (1)-(5) literally, in float64."""
    w = starts.double()
    start, delta, out = w.clone(), torch.zeros_like(w), []
    for block in blocks:
        average = torch.stack([start + b.double() for b in block]).mean(0)
        g = average - start  # (1)
        delta = eta * delta + zeta * g  # (2)
        w = w + delta  # (3)
        start = w + eta * delta if nesterov else w.clone()  # (5) / (4)
        out.append(start)
    return out


def _diloco_as_written(starts, blocks, alpha, mu, nesterov):
    """DiLoCo's Algorithm 1 with torch.optim.SGD's (Nesterov) momentum, in float64."""
    theta = starts.double()
    m, out = torch.zeros_like(theta), []
    for block in blocks:
        outer_grad = torch.stack([-b.double() for b in block]).mean(0)  # θ(t-1) - θ_i(t)
        m = mu * m + outer_grad
        theta = theta - alpha * (outer_grad + mu * m if nesterov else m)
        out.append(theta)
    return out


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("nesterov", [True, False])
def test_rounds_follow_the_papers_equations(size, nesterov):
    gen = torch.Generator().manual_seed(size)
    starts = torch.randn(257, generator=gen)
    blocks = [[0.1 * torch.randn(257, generator=gen) for _ in range(size)] for _ in range(5)]
    bmuf = BMUFConfig(momentum=0.75, block_lr=1.3, nesterov=nesterov)
    seen = _rounds(lambda f, c: BMUFAverager(f, c, config=bmuf), starts, blocks)
    for got, want in zip(seen, _bmuf_as_written(starts, blocks, 0.75, 1.3, nesterov)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    diloco = DiLoCoConfig(outer_lr=0.7, momentum=0.9, nesterov=nesterov)
    seen = _rounds(lambda f, c: DiLoCoAverager(f, c, config=diloco), starts, blocks)
    for got, want in zip(seen, _diloco_as_written(starts, blocks, 0.7, 0.9, nesterov)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_nesterov_and_plain_momentum_differ():
    gen = torch.Generator().manual_seed(5)
    starts = torch.randn(64, generator=gen)
    blocks = [[0.1 * torch.randn(64, generator=gen) for _ in range(2)] for _ in range(3)]
    for make in (lambda n: (lambda f, c: BMUFAverager(f, c, config=BMUFConfig(nesterov=n))),
                 lambda n: (lambda f, c: DiLoCoAverager(f, c, config=DiLoCoConfig(nesterov=n)))):
        with_nesterov, plain = _rounds(make(True), starts, blocks), _rounds(make(False), starts, blocks)
        assert all(not torch.allclose(a, b) for a, b in zip(with_nesterov, plain))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_plain_settings_give_the_average_bit_for_bit(size):
    gen = torch.Generator().manual_seed(size)
    starts = torch.randn(1000, generator=gen)
    blocks = [[0.01 * torch.randn(1000, generator=gen) for _ in range(size)] for _ in range(6)]
    plain = _rounds(lambda f, c: Averager(f, c), starts, blocks)
    for nesterov in (True, False):
        bmuf = BMUFConfig(momentum=0.0, block_lr=1.0, nesterov=nesterov)
        diloco = DiLoCoConfig(outer_lr=1.0, momentum=0.0, nesterov=nesterov)
        for make in (lambda f, c: BMUFAverager(f, c, config=bmuf),
                     lambda f, c: DiLoCoAverager(f, c, config=diloco)):
            assert all(torch.equal(a, b) for a, b in zip(plain, _rounds(make, starts, blocks)))
    # ...which the other settings are not.
    other = _rounds(lambda f, c: BMUFAverager(f, c, config=BMUFConfig(momentum=0.5)), starts, blocks)
    assert not torch.equal(plain[-1], other[-1])


def test_non_finite_ranks_are_left_out_for_every_method():
    starts = torch.zeros(3)
    steps = [torch.tensor([1.0, 2.0, 3.0]), torch.full((3,), float("nan"))]
    for cls, config in ((BMUFAverager, BMUFConfig(momentum=0.5)),
                        (DiLoCoAverager, DiLoCoConfig(outer_lr=0.5, momentum=0.5))):
        def work(comm):
            flat = starts.clone()
            averager = cls(flat, comm, config=config)
            flat += steps[comm.rank]
            first = averager.round(flat)
            after_one = flat.clone()
            flat.fill_(float("nan"))  # every rank diverges: all go back, the state stays
            second = averager.round(flat)
            return first, after_one, second, flat.clone(), averager.state_dict()

        alone = _rounds(lambda f, c: cls(f, c, config=config), starts, [[steps[0]]])[0]
        for rank, (first, after_one, second, flat, state) in enumerate(run_inproc(2, work)):
            assert (first.finite, first.dropped) == (rank == 0, 1)
            assert torch.equal(after_one, alone)  # the outer step on rank 0's block alone
            assert second.dropped == 2 and torch.equal(flat, after_one)
            saved = state.get("delta", state.get("momentum"))
            assert torch.equal(saved, steps[0] if cls is BMUFAverager else -steps[0])


def test_state_dict_continues_the_rounds():
    gen = torch.Generator().manual_seed(9)
    starts = torch.randn(50, generator=gen)
    blocks = [[0.1 * torch.randn(50, generator=gen) for _ in range(2)] for _ in range(4)]
    for make in (lambda f, c: BMUFAverager(f, c), lambda f, c: DiLoCoAverager(f, c)):
        uninterrupted = _rounds(make, starts, blocks)

        def work(comm):
            flat = starts.clone()
            first = make(flat, comm)
            for block in blocks[:2]:
                flat += block[comm.rank]
                first.round(flat)
            state = first.state_dict()
            second = make(flat, comm)  # a resumed run: the checkpoint's parameters and state
            second.load_state_dict(state, flat)
            for block in blocks[2:]:
                flat += block[comm.rank]
                second.round(flat)
            return flat

        for flat in run_inproc(2, work):
            assert torch.equal(flat, uninterrupted[-1])


def test_restart_starts_from_the_given_model_without_momentum():
    # Newbob's roll-back: the next block starts from the accepted model with no momentum, so
    # its first round is the same as a fresh averager's.
    gen = torch.Generator().manual_seed(4)
    starts, accepted = torch.randn(20, generator=gen), torch.randn(20, generator=gen)
    blocks = [[0.1 * torch.randn(20, generator=gen) for _ in range(2)] for _ in range(3)]
    for make in (lambda f, c: BMUFAverager(f, c), lambda f, c: DiLoCoAverager(f, c)):
        fresh = _rounds(make, accepted, blocks[2:])[0]

        def work(comm):
            flat = starts.clone()
            averager = make(flat, comm)
            for block in blocks[:2]:
                flat += block[comm.rank]
                averager.round(flat)
            flat.copy_(accepted)
            averager.restart(flat)
            flat += blocks[2][comm.rank]
            averager.round(flat)
            return flat

        for flat in run_inproc(2, work):
            assert torch.equal(flat, fresh)


def test_a_checkpoint_of_another_method_is_refused():
    flat = torch.zeros(4)

    def work(comm):
        state = Averager(flat.clone(), comm).state_dict()
        with pytest.raises(ValueError, match="'model'.*'bmuf'"):
            BMUFAverager(flat.clone(), comm).load_state_dict(state, flat)
        with pytest.raises(ValueError, match="'model'.*'diloco'"):
            DiLoCoAverager(flat.clone(), comm).load_state_dict(None, flat)  # an old checkpoint
        Averager(flat.clone(), comm).load_state_dict(None, flat)

    run_inproc(1, work)


def test_make_averager_follows_the_settings():
    flat = torch.zeros(3)

    def work(comm):
        cfg = with_overrides(TrainConfig(), {"averaging.method": "bmuf",
                                             "averaging.bmuf.momentum": 0.25,
                                             "averaging.average_every_frames": 2560,
                                             "minibatch": 256})
        averager = make_averager(cfg.averaging, cfg.minibatch, flat, comm)
        assert isinstance(averager, BMUFAverager) and averager.eta == 0.25
        assert averager.average_every == 10 and averager.due(20, False) and not averager.due(21, False)
        assert averager.due(21, True)
        cfg = with_overrides(TrainConfig(), {"averaging.method": "diloco",
                                             "averaging.diloco.outer_lr": 0.5})
        assert make_averager(cfg.averaging, cfg.minibatch, flat, comm).alpha == 0.5
        cfg = TrainConfig()
        assert type(make_averager(cfg.averaging, cfg.minibatch, flat, comm)) is Averager

    run_inproc(1, work)


def test_pretraining_averages_plainly_without_a_global_copy():
    # RBM pretraining's averager comes from the factory too: plain averaging every K RBM
    # minibatches with the run's reduce, and no global model to fall back on.
    def work(comm):
        flat = torch.full((3,), float(comm.rank))
        averager = make_pretraining_averager(flat, comm, 5, "ring")
        averager.round(flat)
        return type(averager), averager.average_every, averager.reduce, averager.global_model, flat

    for kind, k, reduce, kept, flat in run_inproc(2, work):
        assert (kind, k, reduce, kept) == (Averager, 5, "ring", None)
        assert torch.equal(flat, torch.full((3,), 0.5))


# --- training: identities, resume ---------------------------------------------------------------


def _trained(cfg: TrainConfig) -> list[torch.Tensor]:
    list(train(cfg, open_dataset(cfg.data.data), Path(cfg.out)))
    return [final_params(Path(cfg.out), rank) for rank in range(cfg.ranks)]


def _config(corpus, out, method, table=None, **changes) -> TrainConfig:
    """small_config averaging by `method` with `table` (else its defaults) as its table."""
    cfg = small_config(corpus, out, **changes)
    averaging = replace(cfg.averaging, method=method)
    averaging = averaging if table is None else averaging.with_table(table)
    return validate(replace(cfg, averaging=averaging))


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_plain_settings_train_the_same_model_inproc(corpus, tmp_path, ranks):
    def trained(name, method="model", table=None):
        return _trained(_config(corpus, tmp_path / name, method, table, ranks=ranks, epochs=1))

    plain = trained("model")
    assert all(torch.equal(p, plain[0]) for p in plain)
    for method, table in PLAIN.items():
        same = trained(method, method, table)
        assert all(torch.equal(p, plain[0]) for p in same), method
    # The methods are wired into training: their own settings change the model.
    assert not torch.equal(trained("bmuf-default", "bmuf")[0], plain[0])


@pytest.mark.slow
def test_plain_settings_train_the_same_model_on_mpi_ranks(corpus, tmp_path):
    common = ["train", "--data", str(corpus), "--ranks", "2", "--backend", "mpi", *SMALL]
    models = {}
    for name, flags in (("model", []), *PLAIN_FLAGS.items(), ("bmuf-default", ["--averaging", "bmuf"])):
        proc = _cli(*common, *flags, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        models[name] = [final_params(tmp_path / name, r) for r in range(2)]
        assert torch.equal(models[name][0], models[name][1])
        assert {e["rank"] for e in read_events(tmp_path / name) if e["type"] == "average"} == {0, 1}
    assert torch.equal(models["bmuf"][0], models["model"][0])
    assert torch.equal(models["diloco"][0], models["model"][0])
    assert not torch.equal(models["bmuf-default"][0], models["model"][0])
    assert load_summary(tmp_path / "bmuf").averaging == "bmuf"


@pytest.mark.slow
def test_plain_settings_train_the_same_model_on_torchrun_ranks(corpus, tmp_path):
    torchrun = Path(PYTHON).parent / "torchrun"
    common = ["--data", str(corpus), "--ranks", "2", "--backend", "torch", *SMALL]
    models = {}
    for name, flags in (("model", []), ("bmuf", PLAIN_FLAGS["bmuf"])):
        proc = subprocess.run(
            [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(29600 + (os.getpid() + len(models)) % 1000), "-m", "labavg",
             "train", *common, *flags, "--out", str(tmp_path / name)],
            capture_output=True, text=True, timeout=300, env=_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        models[name] = final_params(tmp_path / name)
    assert torch.equal(models["bmuf"], models["model"])


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("method, table", [
    ("bmuf", BMUFConfig(momentum=0.5)),
    ("diloco", DiLoCoConfig()),
])
def test_stopped_and_resumed_run_matches_uninterrupted(corpus, tmp_path, method, table):
    full = _config(corpus, tmp_path / "full", method, table)
    summary = run_training(full, progress=False)
    cfg = _config(corpus, tmp_path / "run", method, table)
    stopped, resumed = stopped_then_resumed(cfg)
    assert stopped.stopped is True and 0 < stopped.steps < summary.steps
    assert torch.equal(final_params(tmp_path / "run"), final_params(tmp_path / "full"))
    assert torch.equal(final_params(tmp_path / "run", 1), final_params(tmp_path / "full", 1))
    # The summary names the method and what it sent: one float32 buffer per round.
    assert summary.averaging == method
    assert summary.bytes_per_round == 4 * summary.num_params
    assert summary.bytes_sent == summary.averaging_rounds * summary.bytes_per_round
    assert resumed.bytes_sent == summary.bytes_sent
    rounds = [e for e in read_events(tmp_path / "full") if e["type"] == "average"]
    assert {e["bytes_sent"] for e in rounds} == {summary.bytes_per_round}
    info = _cli("info", str(tmp_path / "full"))
    table = " ".join(info.stdout.split())  # without the padding that aligns the columns
    assert info.returncode == 0 and "| method |" in table
    assert f"| {method} |" in table


# --- settings -----------------------------------------------------------------------------------


def _refused(overrides: dict) -> str:
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("key, value, shown", [
    ("averaging.method", "bmfu", "'bmfu'"),
    ("averaging.bmuf.momentum", 1.0, "1.0"),
    ("averaging.bmuf.momentum", -0.1, "-0.1"),
    ("averaging.bmuf.momentum", float("nan"), "nan"),
    ("averaging.bmuf.block_lr", 0.0, "0.0"),
    ("averaging.bmuf.block_lr", -1.0, "-1.0"),
    ("averaging.diloco.momentum", 1.5, "1.5"),
    ("averaging.diloco.outer_lr", 0.0, "0.0"),
    ("averaging.diloco.outer_lr", float("inf"), "inf"),
])
def test_bad_averaging_settings_name_key_and_value(key, value, shown):
    message = _refused({key: value})
    assert f"{key} must be" in message and message.endswith(f"got {shown}")
    if key == "averaging.method":
        assert "one of model, bmuf, diloco" in message


@pytest.mark.parametrize("args, named", [
    (["--averaging", "bmfu"], "averaging.method must be one of model, bmuf, diloco; got 'bmfu'"),
    (["--set", "averaging.bmuf.momentum=1.0"],
     "averaging.bmuf.momentum must be in [0, 1); got 1.0"),
    (["--set", "averaging.diloco.outer_lr=0"],
     "averaging.diloco.outer_lr must be positive and finite; got 0.0"),
    (["--set", "averaging.bmuf.momentun=0.5"], "unknown setting 'averaging.bmuf.momentun'"),
    (["--set", "bmuf.momentum=0.5"],
     "setting 'bmuf.momentum' has moved: it is now 'averaging.bmuf.momentum'"),
])
def test_cli_bad_averaging_settings_exit_2_with_one_line(tmp_path, args, named):
    assert named in cli_refusal(tmp_path, args)


def test_toml_tables_flags_and_set(tmp_path):
    from labavg.cli.commands import train_config
    from labavg.cli.parser import build_parser

    path = tmp_path / "c.toml"
    path.write_text('[averaging]\nmethod = "bmuf"\n[averaging.bmuf]\nmomentum = 0.5\n'
                    'nesterov = false\n[averaging.diloco]\nouter_lr = 0.3\n')
    plan = load_config(path).averaging
    assert plan.method == "bmuf" and plan.table() == BMUFConfig(momentum=0.5, nesterov=False)
    assert plan.table("diloco").outer_lr == 0.3 and plan.table("diloco").momentum == 0.9
    args = build_parser().parse_args(["train", str(path), "--averaging", "diloco",
                                      "--set", "averaging.diloco.momentum=0.5",
                                      "--set", "averaging.bmuf.block_lr=2"])
    plan = train_config(args).averaging
    diloco = plan.table()
    assert (plan.method, diloco.momentum, diloco.outer_lr, plan.table("bmuf").block_lr) == (
        "diloco", 0.5, 0.3, 2.0)
    assert TrainConfig().averaging.method == "model"  # the paper's method stays the default
    path.write_text("[averaging.bmuf]\nmomentun = 0.5\n")
    with pytest.raises(UserError, match="unknown key averaging.bmuf.momentun"):
        load_config(path)


def test_outer_state_counts_in_the_memory_estimate():
    plain = estimate_memory(TrainConfig(), 440, 3000)
    for method in ("bmuf", "diloco"):
        cfg = with_overrides(TrainConfig(), {"averaging.method": method})
        assert estimate_memory(cfg, 440, 3000) > plain


def test_sweep_grid_of_methods(corpus, tmp_path):
    from test_sweep import write_sweep

    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, 'ranks = [2]\n"averaging.average_every" = [4]\n'
                '"averaging.method" = ["model", "bmuf"]')
    sweep = load_sweep(spec)
    assert [n for n, _ in sweep.points()] == ["ranks_2-average_every_4-method_model",
                                               "ranks_2-average_every_4-method_bmuf"]
    run_sweep(sweep, tmp_path / "out")
    table = list(csv.DictReader((tmp_path / "out" / "results.csv").read_text().splitlines()))
    assert [r["averaging"] for r in table] == ["model", "bmuf"]
    assert table[0]["bytes_sent"] == table[1]["bytes_sent"] != ""
    write_sweep(spec, corpus, '"averaging.method" = ["model", "bmfu"]')
    with pytest.raises(UserError, match="grid point method_bmfu: averaging.method must be one of"):
        load_sweep(spec)
