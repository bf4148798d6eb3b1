"""RBM pretraining (Kaldi nnet1 pretrain_dbn.sh / rbm-train-cd1-frmshuff / nnet-rbm.h)."""

from __future__ import annotations

import itertools
import json
import math

import kaldiio
import numpy as np
import pytest
import torch

from labavg.comm.inproc import InProcCommunicator
from labavg.comm.inproc_group import InProcGroup
from labavg.data.frames import splice
from labavg.training.model import DNN
from labavg.training.settings import ModelConfig
from labavg.training.rbm import (RBM, CD1Trainer, momentum_at, pretrain_dbn, rbm_cd1_gradients,
                                 reconstruction_runaway)
from labavg.training.settings import RBMConfig

try:
    from labavg.comm.inproc import RankFailed, run_inproc
except ImportError:  # the in-process backend is written elsewhere; 2-rank tests skip without it
    run_inproc = None
    RankFailed = None


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: keep torch to one intra-op thread per test (and per inproc rank)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sigmoid(a: float) -> float:
    return 1.0 / (1.0 + math.exp(-a))


def _tiny_rbm(num_vis: int, num_hid: int, seed: int, gaussian: bool):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(num_hid, num_vis, generator=g, dtype=torch.float64) * 0.7
    vb = torch.randn(num_vis, generator=g, dtype=torch.float64) * 0.3
    hb = torch.randn(num_hid, generator=g, dtype=torch.float64) * 0.3
    if gaussian:
        v0 = torch.randn(4, num_vis, generator=g, dtype=torch.float64)
    else:
        v0 = torch.rand(4, num_vis, generator=g, dtype=torch.float64)
    return W, vb, hb, v0


def _brute_force_cd1(W, vb, hb, v0, h0_state, gaussian):
    """Element by element, in Python floats, from the formulas of Rbm::RbmUpdate."""
    H, V = W.shape
    N = v0.shape[0]
    W, vb, hb, v0, hs = (t.tolist() for t in (W, vb, hb, v0, h0_state))
    def hidden(v):
        return [[_sigmoid(hb[j] + sum(W[j][i] * v[n][i] for i in range(V))) for j in range(H)]
                for n in range(N)]

    h0 = hidden(v0)
    v1 = []
    for n in range(N):
        row = [vb[i] + sum(hs[n][j] * W[j][i] for j in range(H)) for i in range(V)]
        v1.append(row if gaussian else [_sigmoid(a) for a in row])
    h1 = hidden(v1)
    dW = [[sum(h0[n][j] * v0[n][i] - h1[n][j] * v1[n][i] for n in range(N)) / N for i in range(V)]
          for j in range(H)]
    dvb = [sum(v0[n][i] - v1[n][i] for n in range(N)) / N for i in range(V)]
    dhb = [sum(h0[n][j] - h1[n][j] for n in range(N)) / N for j in range(H)]
    err = 0.5 * sum((v1[n][i] - v0[n][i]) ** 2 for n in range(N) for i in range(V)) / N
    as_tensor = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return as_tensor(dW), as_tensor(dvb), as_tensor(dhb), err


@pytest.mark.parametrize("gaussian", [False, True])
def test_cd1_gradients_match_brute_force_given_the_same_sample(gaussian):
    W, vb, hb, v0 = _tiny_rbm(5, 3, seed=11, gaussian=gaussian)
    g = torch.Generator().manual_seed(123)
    replay = torch.Generator()
    replay.set_state(g.get_state())
    dW, dvb, dhb, err = rbm_cd1_gradients(W, vb, hb, v0, gaussian=gaussian, generator=g)
    # The documented sampling rule: h0_state = rand < P(h|v0), the only draw from the generator.
    h0 = torch.sigmoid(v0 @ W.T + hb)
    h0_state = (torch.rand(h0.shape, generator=replay, dtype=torch.float64) < h0).double()
    assert 0 < h0_state.sum() < h0_state.numel()  # a real sample, not all 0s or 1s
    bW, bvb, bhb, berr = _brute_force_cd1(W, vb, hb, v0, h0_state, gaussian)
    torch.testing.assert_close(dW, bW, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dvb, bvb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dhb, bhb, rtol=1e-12, atol=1e-12)
    assert err == pytest.approx(berr, rel=1e-12)


@pytest.mark.parametrize("gaussian", [False, True])
def test_cd1_gradients_average_to_the_exact_expectation_over_h0(gaussian):
    """Repeating one frame N times averages the CD-1 statistics over N samples of h0; the exact
    expectation enumerates all 2^H hidden states with their probabilities."""
    W, vb, hb, v0 = _tiny_rbm(4, 3, seed=5, gaussian=gaussian)
    v = v0[:1]
    n = 40000
    repeated = v.expand(n, -1).contiguous()
    g = torch.Generator().manual_seed(3)
    dW, dvb, dhb, _ = rbm_cd1_gradients(W, vb, hb, repeated, gaussian=gaussian, generator=g)
    p = torch.sigmoid(v @ W.T + hb)[0]
    eW = torch.zeros_like(W)
    evb = torch.zeros_like(vb)
    ehb = torch.zeros_like(hb)
    for bits in itertools.product([0.0, 1.0], repeat=W.shape[0]):
        h = torch.tensor(bits, dtype=torch.float64)
        prob = torch.prod(torch.where(h > 0, p, 1 - p))
        v1 = h @ W + vb
        if not gaussian:
            v1 = torch.sigmoid(v1)
        h1 = torch.sigmoid(v1 @ W.T + hb)
        eW += prob * (torch.outer(p, v[0]) - torch.outer(h1, v1))
        evb += prob * (v[0] - v1)
        ehb += prob * (p - h1)
    # Monte-Carlo error ~ 1/sqrt(n) = 0.005 relative to O(1) terms.
    torch.testing.assert_close(dW, eW, rtol=0, atol=0.03)
    torch.testing.assert_close(dvb, evb, rtol=0, atol=0.03)
    torch.testing.assert_close(dhb, ehb, rtol=0, atol=0.03)
    assert eW.abs().max() > 0.05  # the check is not vacuous


def test_momentum_ramp_follows_kaldi_steps():
    cfg = RBMConfig()  # 40 steps of 500000 frames: 0.5 -> 0.9
    assert momentum_at(0, cfg) == 0.5
    assert momentum_at(499_999, cfg) == 0.5
    assert momentum_at(500_000, cfg) == pytest.approx(0.51)
    assert momentum_at(10_000_000, cfg) == pytest.approx(0.7)
    assert momentum_at(20_000_000, cfg) == pytest.approx(0.9)
    assert momentum_at(10**9, cfg) == 0.9


def _load_real_input(shared_data) -> torch.Tensor:
    """Real 13-dim MFCCs, spliced +/-5 and globally normalised, as pretrain_dbn.sh's feature
    transform (splice + global CMVN) gives the first RBM."""
    feats = dict(kaldiio.load_ark(str(shared_data / "real-utterance" / "mfccs.ark")))["1-1"]
    spliced = splice(feats, 5)
    spliced = (spliced - spliced.mean(axis=0)) / spliced.std(axis=0)
    return torch.from_numpy(spliced.astype(np.float32))


def _epoch_batches(x: torch.Tensor, batch: int = 256):
    def batches_for_epoch(epoch: int):
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(epoch))
        return list(x[perm].split(batch))

    return batches_for_epoch


def _run(gen):
    """Drain pretrain_dbn: (events, trained RBMs)."""
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


def _one_rank() -> InProcCommunicator:
    return InProcCommunicator(InProcGroup(1), 0)


FAST = RBMConfig(epochs=3, momentum_ramp_frames=20_000, momentum_steps=4)


def test_pretrain_dbn_on_real_features(shared_data):
    x = _load_real_input(shared_data)
    assert x.shape == (2672, 143)
    model = DNN(143, 11, ModelConfig(hidden_layers=2, hidden_dim=64))
    initial = [layer.weight.detach().clone() for layer in model.hidden]
    comm = _one_rank()
    events, rbms = _run(
        pretrain_dbn(model, _epoch_batches(x), comm, FAST, average_every=8, device="cpu")
    )
    epoch_ends = [e for e in events if e.divergence is None]
    # Gaussian first layer: twice the epochs; 2672 frames -> 26 whole minibatches of 100.
    expected = [(0, i) for i in range(6)] + [(1, i) for i in range(3)]
    assert [(e.layer, e.epoch) for e in epoch_ends] == expected
    assert [e.step for e in epoch_ends[:6]] == [26 * (i + 1) for i in range(6)]
    for layer in (0, 1):
        errors = [e.recon_error for e in epoch_ends if e.layer == layer]
        assert all(a > b for a, b in zip(errors, errors[1:])), errors
        assert errors[-1] < 0.7 * errors[0], errors
    # Predicting the mean (zero) of unit-variance data costs 0.5 * 143 per frame.
    assert epoch_ends[5].recon_error < 0.6 * 0.5 * 143
    # Rounds: every 8 minibatches, the last round of an epoch partial (26 = 8 + 8 + 8 + 2).
    rounds = [e for e in events if e.divergence is not None]
    assert [e.step for e in rounds if e.layer == 0 and e.epoch == 0] == [8, 16, 24, 26]
    assert all(e.divergence == 0.0 for e in rounds)  # one rank: nothing to average
    # The DNN's sigmoid layers now hold the RBMs' weights and hidden biases.
    for layer, rbm, before in zip(model.hidden, rbms, initial):
        assert torch.equal(layer.weight, rbm.weight)
        assert torch.equal(layer.bias, rbm.hbias)
        assert not torch.allclose(layer.weight, before)
    with torch.no_grad():
        h1 = torch.sigmoid(model.hidden[0](x[:50]))
        torch.testing.assert_close(h1, rbms[0].hidden_probs(x[:50]))
        torch.testing.assert_close(torch.sigmoid(model.hidden[1](h1)), rbms[1].hidden_probs(h1))
    # The Gaussian RBM's visible biases started at zero and stay small on zero-mean data.
    assert 0 < rbms[0].vbias.abs().max() < 0.5
    event = epoch_ends[0].to_dict()
    assert event["type"] == "rbm" and event["layer"] == 0 and event["divergence"] is None
    json.dumps(event)


def test_bernoulli_visible_bias_is_logit_of_mean_activation():
    """With learning switched off the initialisation is all that is left: vbias of layer 1 is
    logit(mean of layer 0's hidden probabilities) (Rbm::InitData, <VisibleBiasCmvnFilename>)."""
    x = torch.randn(1000, 7, generator=torch.Generator().manual_seed(0))
    cfg = RBMConfig(epochs=1, learn_rate=0.0, learn_rate_gaussian=0.0)
    model = DNN(7, 3, ModelConfig(hidden_layers=2, hidden_dim=5))
    gen = pretrain_dbn(model, _epoch_batches(x), _one_rank(), cfg, average_every=4,
                       device="cpu")
    _, rbms = _run(gen)
    p = rbms[0].hidden_probs(x).mean(dim=0)
    torch.testing.assert_close(rbms[1].vbias, torch.log(p / (1 - p)), rtol=1e-5, atol=1e-5)
    assert torch.equal(rbms[0].vbias, torch.zeros(7))
    assert torch.equal(rbms[1].hbias, torch.zeros(5))
    assert 0.07 < rbms[0].weight.std().item() < 0.13  # N(0, 0.1)


def test_safeguard_rescales_a_blown_up_gaussian_rbm():
    cfg = RBMConfig()
    gen = torch.Generator().manual_seed(0)
    v0 = torch.randn(100, 20, generator=gen)
    rbm = RBM(20, 30)
    trainer = CD1Trainer(rbm, gaussian=True, cfg=cfg)
    lr0 = cfg.learn_rate_gaussian * (1 - cfg.momentum)
    for hit in (1, 2):
        with torch.no_grad():
            rbm.weight.normal_(0.0, 3.0, generator=gen)
            rbm.vbias.fill_(0.5)
            rbm.hbias.fill_(-0.2)
        before = [p.detach().clone() for p in rbm.parameters()]
        # Replay the step's own sample to know the factor it must apply.
        g = torch.Generator().manual_seed(hit)
        replay = torch.Generator()
        replay.set_state(g.get_state())
        h0 = rbm.hidden_probs(v0)
        v1 = (torch.rand(h0.shape, generator=replay) < h0).float() @ rbm.weight + rbm.vbias
        scale = reconstruction_runaway(v0, v1)
        assert scale is not None and scale < 0.5
        trainer.step(v0, g)
        assert trainer.safeguard_hits == hit
        # Scaled, not updated: exactly the old parameters times std(v0) / std(v1).
        for p, b in zip(rbm.parameters(), before):
            torch.testing.assert_close(p, b * scale, rtol=1e-6, atol=1e-7)
    # Kaldi quirk kept: the first bunch's momentum step restores the lr, the second hit stays.
    assert trainer.lr == pytest.approx(0.9 * lr0)
    assert all(c.abs().sum() == 0 for c in trainer._corr)
    # After rescaling the reconstruction is no longer runaway.
    h0 = rbm.hidden_probs(v0)
    v1 = (torch.rand(h0.shape, generator=gen) < h0).float() @ rbm.weight + rbm.vbias
    assert reconstruction_runaway(v0, v1) is None
    # A sane RBM never triggers it.
    sane = RBM(20, 30)
    with torch.no_grad():
        sane.weight.normal_(0.0, 0.1, generator=gen)
    sane_trainer = CD1Trainer(sane, gaussian=True, cfg=cfg)
    for _ in range(5):
        sane_trainer.step(v0, gen)
    assert sane_trainer.safeguard_hits == 0


def test_pretrain_dbn_rejects_non_sigmoid_models():
    model = DNN(7, 3, ModelConfig(hidden_layers=1, hidden_dim=5, nonlinearity="relu"))
    with pytest.raises(ValueError, match="sigmoid"):
        next(pretrain_dbn(model, lambda e: [], _one_rank(), RBMConfig(),
                          average_every=1, device="cpu"))


def _rank_fn(comm, shards, cfg, average_every):
    # The DNN's own init from its own generator (threads share the global RNG); the RBMs' come
    # from cfg.seed and rank 0.
    model = DNN(143, 11, ModelConfig(hidden_layers=2, hidden_dim=32),
                generator=torch.Generator().manual_seed(0))
    batches = _epoch_batches(shards[comm.rank])
    events, rbms = _run(
        pretrain_dbn(model, batches, comm, cfg, average_every=average_every, device="cpu")
    )
    return events, [[p.detach().clone() for p in r.parameters()] for r in rbms], model.state_dict()


@pytest.mark.skipif(run_inproc is None, reason="labavg.comm.inproc not available")
def test_two_ranks_end_with_identical_rbms(shared_data):
    x = _load_real_input(shared_data)
    shards = [x[0::2], x[1::2]]  # 1336 frames each: 13 minibatches of 100
    cfg = RBMConfig(epochs=1, momentum_ramp_frames=20_000, momentum_steps=4)
    results = run_inproc(2, _rank_fn, shards, cfg, 5)
    (ev0, rbm0, sd0), (ev1, rbm1, sd1) = results
    for a, b in zip(rbm0, rbm1):
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    # Averaging did work: the ranks had drifted apart (different shards and samples).
    rounds = [e for e in ev0 if e.divergence is not None]
    assert [e.step for e in rounds if e.layer == 0 and e.epoch == 0] == [5, 10, 13]
    assert all(e.divergence > 0 for e in rounds)
    # Epoch-end errors are pooled over ranks: both report the same value.
    ends0 = [e.recon_error for e in ev0 if e.divergence is None]
    ends1 = [e.recon_error for e in ev1 if e.divergence is None]
    assert ends0 == ends1 and len(ends0) == 3
    assert {e.rank for e in ev0} == {0} and {e.rank for e in ev1} == {1}


@pytest.mark.skipif(run_inproc is None, reason="labavg.comm.inproc not available")
def test_two_ranks_with_unequal_shards_fail_together(shared_data):
    x = _load_real_input(shared_data)
    shards = [x[:1300], x[1300:2200]]  # 13 vs 9 minibatches
    cfg = RBMConfig(epochs=1)
    with pytest.raises(RankFailed) as info:
        run_inproc(2, _rank_fn, shards, cfg, 4)
    assert isinstance(info.value.exc, ValueError)
    assert "same number" in str(info.value.exc)
