"""ResNet, scorer pooling, aggregators and soft-patch combination."""

from __future__ import annotations

import pytest
import torch

from operators.aggregators import AGGREGATORS, build_aggregator, fourier_position_encoding
from operators.resnet import (
    ResNet,
    ResNetConfig,
    RunningStandardise,
    feature_moments,
    running_standardise,
    set_exact_statistics,
)
from operators.scorer import ScorerCNN, ScorerConfig, cell_pool, minmax_normalise
from operators.soft_patches import cap_support, combine_patches, unique_cells

torch.set_num_threads(1)


# ---------------------------------------------------------------- ResNet
@pytest.mark.parametrize("p", [32, 96, 128])
def test_resnet_shapes(p):
    net = ResNet(ResNetConfig(widths=(8, 16, 32), blocks=(1, 2, 1), feature_dim=24))
    out = net(torch.rand(5, 3, p, p))
    assert tuple(out.shape) == (5, 24) and torch.isfinite(out).all()
    assert tuple(net(torch.rand(0, 3, p, p)).shape) == (0, 24)


def test_running_standardise_uses_running_statistics_in_training_and_at_inference():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4, generator=g, dtype=torch.float64) * 3 + 1
    b = torch.randn(5, 4, generator=g, dtype=torch.float64) * 2 - 1
    st = RunningStandardise(4, momentum=0.25).double()
    out = st(a)  # the first training call sets the statistics: the batch comes out standardised
    torch.testing.assert_close(out, (a - a.mean(0)) / (a.var(0) + 1e-5).sqrt())
    out_b = st(b)  # later calls: b is standardised with the statistics moved a quarter of the way to its own
    mean, var = a.mean(0) * 0.75 + b.mean(0) * 0.25, a.var(0) * 0.75 + b.var(0) * 0.25
    torch.testing.assert_close(st.mean, mean)
    torch.testing.assert_close(out_b, running_standardise(b, mean, var))
    torch.testing.assert_close(out_b, (b - mean) / (var + 1e-5).sqrt())
    st.eval()  # inference: the same statistics, not updated
    torch.testing.assert_close(st(b), out_b)
    torch.testing.assert_close(st.mean, mean)
    torch.autograd.gradcheck(lambda t: st(t), (b.clone().requires_grad_(True),))
    st.train()  # training: no gradient through the statistics, the exact Jacobian is diag(1 / std) of the stats used
    x = b.clone().requires_grad_(True)
    weights = torch.randn(5, 4, generator=g, dtype=torch.float64)
    (st(x) * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights / (st.var + 1e-5).sqrt())
    with pytest.raises(ValueError, match="momentum"):
        RunningStandardise(4, momentum=0.0)


def test_running_standardise_takes_its_statistics_from_the_rows_named():
    g = torch.Generator().manual_seed(1)
    bag = torch.randn(4, 3, generator=g, dtype=torch.float64)
    around = torch.randn(6, 3, generator=g, dtype=torch.float64) * 5 + 2  # e.g. the evidence reads
    x = torch.cat([bag, around])
    for rows in (4, torch.arange(10) < 4):
        st = RunningStandardise(3).double()
        out = st(x, rows)  # every row standardised, with the statistics of the first four only
        torch.testing.assert_close(st.mean, bag.mean(0))
        torch.testing.assert_close(st.var, bag.var(0))
        torch.testing.assert_close(out, (x - bag.mean(0)) / (bag.var(0) + 1e-5).sqrt())
    st = RunningStandardise(3).double()
    st(x)
    torch.testing.assert_close(st.mean, x.mean(0))  # without: every row
    for bad in (-1, True, 2.0, torch.ones(3, dtype=torch.bool), torch.arange(10)):
        with pytest.raises(ValueError, match="stats_rows"):
            st(x, bad)


def test_exact_statistics_are_those_of_every_row_seen_and_only_within_the_block():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 5, 3, generator=g, dtype=torch.float64) * 4 + 1  # [M..., D]: rows are every leading index
    b = torch.randn(7, 3, generator=g, dtype=torch.float64) - 3
    st = RunningStandardise(3).double().eval()
    with feature_moments(st) as moments:
        out = st(a)
        st(b)
    st(torch.full((4, 3), 100.0, dtype=torch.float64))  # outside the block: not counted
    rows = torch.cat([a.reshape(-1, 3), b])
    assert moments[-1] == 17 and torch.equal(st.mean, torch.zeros(3, dtype=torch.float64))  # not set yet
    torch.testing.assert_close(out, a / (1 + 1e-5) ** 0.5)  # the block does not change what the module returns
    assert set_exact_statistics(st, moments) == 17
    torch.testing.assert_close(st.mean, rows.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(st.var, rows.var(0), rtol=1e-12, atol=0)
    before = st.mean.clone()
    with feature_moments(st) as one:
        st(b[:1])
    assert set_exact_statistics(st, one) == 1 and torch.equal(st.mean, before)  # one row: nothing to estimate
    with pytest.raises(TypeError, match="RunningStandardise"):
        with feature_moments(torch.nn.Identity()):
            pass
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        set_exact_statistics(st, torch.zeros(6))


def test_standardise_comes_after_any_encoder_and_follows_training_when_the_encoder_is_frozen(tmp_path):
    from operators.config import from_dict
    from operators.model import FoveateModel
    from operators.model_config import ModelConfig

    enc = ResNet(ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=8))  # e.g. a pretrained encoder
    torch.save(enc.state_dict(), tmp_path / "enc.pt")
    feats = {"widths": [8, 16], "blocks": [1, 1], "feature_dim": 8, "standardise": True}
    cfg = {"features": {**feats, "init": str(tmp_path / "enc.pt"), "freeze": True}, "num_classes": 2}
    model = FoveateModel(from_dict(ModelConfig, cfg))  # the file has no standardisation: it loads under it
    x = torch.rand(6, 3, 32, 32)
    torch.testing.assert_close(model.encode(x), enc(x))
    model.train()
    assert not model.features.training and model.feature_norm.training
    out = model.embed(x)  # the first training call sets the statistics: the features come out standardised
    torch.testing.assert_close(out.mean(0), torch.zeros(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.feature_norm.mean, enc(x).mean(0))
    model.eval()
    torch.testing.assert_close(model.embed(x), out)  # the same statistics at inference
    assert all(not p.requires_grad for p in model.features.parameters())
    # a checkpoint of the earlier layout (the statistics inside the ResNet) loads into the new one
    state = model.state_dict()
    old = {
        ("features.standardise." + k[len("feature_norm.") :] if k.startswith("feature_norm.") else k): v
        for k, v in state.items()
    }
    again = FoveateModel(from_dict(ModelConfig, {"features": feats, "num_classes": 2}))
    again.load_state_dict(old)
    again.eval()
    torch.testing.assert_close(again.embed(x), out)
    # and an encoder file of that layout is an init like any other (its statistics are not the encoder's)
    torch.save({**enc.state_dict(), "standardise.mean": torch.ones(8)}, tmp_path / "old.pt")
    loaded = ResNet(ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=8, weights=str(tmp_path / "old.pt")))
    torch.testing.assert_close(loaded(x), enc(x))


def test_resnet_frozen_has_no_param_grads_but_passes_input_grads():
    net = ResNet(ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=8, frozen=True, norm="batch"))
    assert all(not p.requires_grad for p in net.parameters())
    net.train()
    assert not net.training and all(not m.training for m in net.modules())
    x = torch.rand(3, 3, 32, 32, requires_grad=True)
    before = net.stages[0].n1.running_mean.clone()
    net(x).sum().backward()
    assert all(p.grad is None for p in net.parameters())
    assert x.grad is not None and x.grad.abs().sum() > 0  # the scorer still gets gradients through it
    assert torch.equal(before, net.stages[0].n1.running_mean)  # eval mode: BN statistics untouched
    trainable = ResNet(ResNetConfig(widths=(8, 16), blocks=(1, 1), feature_dim=8))
    trainable(torch.rand(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in trainable.parameters())


def test_resnet_weights_file(tmp_path):
    cfg = ResNetConfig(widths=(8,), blocks=(1,), feature_dim=4)
    a = ResNet(cfg)
    torch.save(a.state_dict(), tmp_path / "w.pt")
    b = ResNet(ResNetConfig(widths=(8,), blocks=(1,), feature_dim=4, weights=str(tmp_path / "w.pt")))
    x = torch.rand(2, 3, 16, 16)
    torch.testing.assert_close(a(x), b(x))
    with pytest.raises(ValueError, match="features.weights"):
        ResNet(ResNetConfig(weights=str(tmp_path / "missing.pt")))


def test_resnet_config_validation():
    with pytest.raises(ValueError, match="features.blocks"):
        ResNetConfig(widths=(8, 16), blocks=(1,))
    with pytest.raises(ValueError, match="features.norm"):
        ResNetConfig(norm="layer")
    with pytest.raises(ValueError, match="patches"):
        ResNet()(torch.rand(2, 1, 16, 16))


# ---------------------------------------------------------------- scorer
def _cell_pool_reference(smap, grid_shape, patch, stride, mode):
    b, c, h, w = smap.shape
    gh, gw = grid_shape
    ext_w, ext_h = (gw - 1) * stride + patch, (gh - 1) * stride + patch
    out = torch.empty(b, c, gh * gw, dtype=smap.dtype)
    for r in range(gh):
        for q in range(gw):
            # map pixels whose area overlaps the cell box
            ys = [i for i in range(h) if (i + 1) * ext_h / h > r * stride and i * ext_h / h < r * stride + patch]
            xs = [j for j in range(w) if (j + 1) * ext_w / w > q * stride and j * ext_w / w < q * stride + patch]
            blk = smap[:, :, ys][:, :, :, xs]
            out[:, :, r * gw + q] = blk.mean((2, 3)) if mode == "mean" else blk.amax((2, 3))
    return out


@pytest.mark.parametrize("mode", ["mean", "max"])
@pytest.mark.parametrize("geom", [((4, 5), 16, 16, (8, 10)), ((3, 6), 24, 16, (7, 14)), ((5, 4), 12, 8, (11, 9))])
def test_cell_pool_matches_reference(mode, geom):
    grid_shape, patch, stride, (h, w) = geom
    smap = torch.randn(2, 1, h, w, dtype=torch.float64)
    got = cell_pool(smap, grid_shape, patch, stride, mode=mode)
    torch.testing.assert_close(got, _cell_pool_reference(smap, grid_shape, patch, stride, mode))
    if mode == "mean":
        x = smap.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t: cell_pool(t, grid_shape, patch, stride), (x,))


def test_scorer_and_minmax():
    net = ScorerCNN(ScorerConfig(channels=8, num_layers=4))
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == 4
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in net.modules()) == 1
    assert tuple(net(torch.rand(2, 3, 33, 40)).shape) == (2, 1, 17, 20)
    s = torch.tensor([[3.0, -1.0, 5.0, 100.0], [1.0, 1.0, 2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    cand = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = minmax_normalise(s, cand, eps=0.0)
    assert out[0, :3].tolist() == [4 / 6, 0.0, 1.0] and out[0, 3] == float("-inf")
    assert out[1].tolist() == [0.5, 0.5, 1.0, 0.0]
    out[torch.isfinite(out)].sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad[0, 3] == 0


# ---------------------------------------------------------------- aggregators
@pytest.mark.parametrize("name", AGGREGATORS)
def test_aggregator_permutation(name):
    torch.manual_seed(0)
    agg = build_aggregator(name, 12, 3, hidden=16, layers=2, heads=4).double().eval()
    f = torch.randn(2, 7, 12, dtype=torch.float64)
    pos = torch.rand(2, 7, 2, dtype=torch.float64)
    w = torch.softmax(torch.randn(2, 7, dtype=torch.float64), 1)
    perm = torch.randperm(7)
    for weights in (None, w):
        out = agg(f, pos, weights)
        assert tuple(out.shape) == (2, 3)
        wp = None if weights is None else weights[:, perm]
        torch.testing.assert_close(agg(f[:, perm], pos[:, perm], wp), out)
    if name == "transformer":  # positions matter: permuting them alone changes the output
        assert not torch.allclose(agg(f, pos[:, perm]), agg(f, pos))
    else:
        torch.testing.assert_close(agg(f, pos[:, perm]), agg(f, pos))


@pytest.mark.parametrize("readout", ["mean", "logit_mean", "cls", "gate"])
def test_transformer_readouts_are_permutation_invariant(readout):
    torch.manual_seed(1)
    agg = build_aggregator("transformer", 12, 2, hidden=16, layers=1, heads=2, readout=readout).double().eval()
    f = torch.randn(3, 5, 12, dtype=torch.float64)
    pos = torch.rand(3, 5, 2, dtype=torch.float64)
    perm = torch.randperm(5)
    torch.testing.assert_close(agg(f[:, perm], pos[:, perm]), agg(f, pos))
    if readout == "mean":  # the mean of the encoded tokens, through the final norm and head
        h = agg.inp(f) + agg.pos(fourier_position_encoding(pos, agg.num_frequencies))
        torch.testing.assert_close(agg(f, pos), agg.head(agg.norm(agg.encoder(h).mean(1))))
    if readout == "logit_mean":  # the mean of the tokens' own logits; a bag of one = that token's logits
        h = agg.inp(f) + agg.pos(fourier_position_encoding(pos, agg.num_frequencies))
        per_token = agg.head(agg.norm(agg.encoder(h)))  # [B, K, C]
        torch.testing.assert_close(agg(f, pos), per_token.mean(1))
        one = agg(f[:, :1], pos[:, :1])
        h1 = agg.inp(f[:, :1]) + agg.pos(fourier_position_encoding(pos[:, :1], agg.num_frequencies))
        torch.testing.assert_close(one, agg.head(agg.norm(agg.encoder(h1)))[:, 0])
    if readout == "gate":  # token gates pool the input features (not the tokens); a linear head classifies them
        h = agg.inp(f) + agg.pos(fourier_position_encoding(pos, agg.num_frequencies))
        gate = torch.sigmoid(agg.gate(agg.norm(agg.encoder(h))))  # [B, K, 1]
        att = gate / gate.sum(1, keepdim=True)
        torch.testing.assert_close(agg(f, pos), agg.head((att * f).sum(1)))
        torch.testing.assert_close(agg.last_attention, att[..., 0])
        torch.testing.assert_close(agg.last_attention.sum(1), torch.ones(3, dtype=torch.float64))
        one = agg(f[:, :1], pos[:, :1])  # a bag of one: that patch's features through the linear head
        torch.testing.assert_close(one, agg.head(f[:, 0]))
    with pytest.raises(ValueError, match="readout"):
        build_aggregator("transformer", 12, 2, hidden=16, heads=2, readout="max")


def test_transformer_without_position_encoding_ignores_positions():
    torch.manual_seed(3)
    agg = build_aggregator("transformer", 12, 2, hidden=16, layers=1, heads=2, num_frequencies=0).double().eval()
    assert agg.pos is None
    f = torch.randn(2, 5, 12, dtype=torch.float64)
    pos = torch.rand(2, 5, 2, dtype=torch.float64)
    out = agg(f, pos)
    torch.testing.assert_close(agg(f, torch.rand(2, 5, 2, dtype=torch.float64)), out)
    torch.testing.assert_close(agg(f, None), out)
    torch.testing.assert_close(out, agg.head(agg.norm(agg.encoder(agg.inp(f)).mean(1))))
    with_pos = build_aggregator("transformer", 12, 2, hidden=16, layers=1, heads=2, num_frequencies=2)
    with pytest.raises(ValueError, match="needs positions"):
        with_pos(f.float(), None)
    with pytest.raises(ValueError, match="num_frequencies must be >= 0"):
        build_aggregator("transformer", 12, 2, hidden=16, heads=2, num_frequencies=-1)


def test_aggregator_weights_semantics():
    agg = build_aggregator("mean", 4, 2).double()
    f = torch.randn(1, 3, 4, dtype=torch.float64)
    w = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    lin = agg.head[1]
    torch.testing.assert_close(agg(f, None, w), lin((w[..., None] * f).sum(1)))
    torch.testing.assert_close(agg(f, None, torch.full((1, 3), 1 / 3, dtype=torch.float64)), agg(f, None))
    mx = build_aggregator("max", 4, 2).double()
    torch.testing.assert_close(mx(f, None, torch.full((1, 3), 1 / 3, dtype=torch.float64)), mx(f, None))
    with pytest.raises(ValueError, match="aggregator must be one of"):
        build_aggregator("median", 4, 2)
    with pytest.raises(ValueError, match="weights must be"):
        agg(f, None, w[:, :2])


def test_vote_is_mean_of_patch_probabilities():
    torch.manual_seed(2)
    agg = build_aggregator("vote", 5, 3).double()
    f = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(agg.head(f), -1)  # [B, K, C] per-patch probabilities
    torch.testing.assert_close(agg(f, None).exp(), p.mean(1))
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(agg(f, None, w).exp(), (w[..., None] * p).sum(1))
    # a majority of 3 weak patches outvotes one confident patch, which it does not under the mean of logits
    lin = agg.head[1]
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
        lin.weight[0, 0] = lin.weight[1, 1] = 1.0
    g = torch.zeros(1, 4, 5, dtype=torch.float64)
    g[0, :3, 0] = 1.0  # three patches lean to class 0 (logit 1)
    g[0, 3, 1] = 10.0  # one patch is sure of class 1
    assert int(agg(g, None).argmax()) == 0
    mean = build_aggregator("mean", 5, 3).double()
    mean.head[1].load_state_dict(lin.state_dict())
    assert int(mean(g, None).argmax()) == 1
    # single patch: the bag's log-probabilities are the patch's
    torch.testing.assert_close(agg(f[:, :1], None), torch.log_softmax(agg.head(f[:, :1]), -1)[:, 0])
    assert torch.autograd.gradcheck(lambda x: agg(x, None, w), (f,))


def test_attention_mil_is_ilse():
    torch.manual_seed(1)
    agg = build_aggregator("attention_mil", 6, 2, hidden=5, gated=True).double()
    h = torch.randn(1, 4, 6, dtype=torch.float64)
    a = agg.w(torch.tanh(agg.V(h)) * torch.sigmoid(agg.U(h))).squeeze(-1).softmax(1)
    torch.testing.assert_close(agg(h, None), agg.head((a[..., None] * h).sum(1)))
    torch.testing.assert_close(agg.last_attention, a)


def test_attention_mil_sigmoid_gates_weigh_confident_patches_alike():
    torch.manual_seed(1)
    agg = build_aggregator("attention_mil", 6, 2, hidden=5, gated=True, mil_attention="sigmoid").double()
    h = torch.randn(2, 4, 6, dtype=torch.float64)
    s = agg.w(torch.tanh(agg.V(h)) * torch.sigmoid(agg.U(h))).squeeze(-1)
    a = torch.sigmoid(s) / torch.sigmoid(s).sum(1, keepdim=True)
    torch.testing.assert_close(agg(h, None), agg.head((a[..., None] * h).sum(1)))
    torch.testing.assert_close(agg.last_attention, a)
    # two patches with large logits 4 and 8 and two with -6: the sure ones weigh ~1/2 each (softmax: 0.98 / 0.02)
    logits = torch.tensor([[4.0, 8.0, -6.0, -6.0]], dtype=torch.float64)
    gate = torch.sigmoid(logits) / torch.sigmoid(logits).sum(1, keepdim=True)
    assert abs(float(gate[0, 0] - gate[0, 1])) < 0.01 and float(gate[0, 2:].sum()) < 0.005
    assert float(torch.softmax(logits, 1)[0, 0]) < 0.02
    with pytest.raises(ValueError, match="softmax"):
        build_aggregator("attention_mil", 6, 2, mil_attention="sparsemax")


def test_fourier_encoding():
    e = fourier_position_encoding(torch.tensor([[0.25, 0.5]]), 2)
    assert tuple(e.shape) == (1, 8)
    import math

    want = [
        math.sin(math.pi / 4),
        math.sin(math.pi / 2),
        math.cos(math.pi / 4),
        math.cos(math.pi / 2),
        math.sin(math.pi / 2),
        math.sin(math.pi),
        math.cos(math.pi / 2),
        math.cos(math.pi),
    ]
    torch.testing.assert_close(e[0], torch.tensor(want), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- soft patches
def test_combine_patches_equals_explicit_sum_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    patches = torch.rand(5, 3, 4, 4, dtype=torch.float64, generator=g)
    idx = torch.tensor([[[0, 3, 4], [1, 1, 2]], [[4, 0, 2], [3, 2, 1]]])
    w = torch.rand(2, 2, 3, dtype=torch.float64, generator=g)
    out = combine_patches(patches, idx, w)
    ref = torch.zeros(2, 2, 3, 4, 4, dtype=torch.float64)
    for b in range(2):
        for k in range(2):
            for s in range(3):
                ref[b, k] += w[b, k, s] * patches[idx[b, k, s]]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)
    wr = w.clone().requires_grad_(True)
    pr = patches.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda ww, pp: combine_patches(pp, idx, ww), (wr, pr))
    one = combine_patches(patches, idx[..., :1], w[..., :1])
    torch.testing.assert_close(one, w[..., :1, None, None] * patches[idx[..., 0]])


def test_cap_support_renormalises_and_gradcheck():
    y = torch.tensor([[[0.6, 0.3, 0.1, 0.0, 0.0], [0.0, 0.05, 0.15, 0.5, 0.3]]], dtype=torch.float64)
    idx, w, mass = cap_support(y, 2)
    assert idx.tolist() == [[[0, 1], [3, 4]]]
    torch.testing.assert_close(w, torch.tensor([[[2 / 3, 1 / 3], [0.625, 0.375]]], dtype=torch.float64))
    torch.testing.assert_close(mass, torch.tensor([[0.9, 0.8]], dtype=torch.float64))
    # zero-weight support entries point at the slot's first cell (no extra read)
    idx3, w3, _ = cap_support(torch.tensor([[[0.0, 1.0, 0.0, 0.0]]]), 3)
    assert idx3.tolist() == [[[1, 1, 1]]] and w3.tolist() == [[[1.0, 0.0, 0.0]]]
    cells, inv = unique_cells(idx3)
    assert cells.tolist() == [1] and torch.equal(cells[inv], idx3)
    # no cap: identical to the indicators
    idx5, w5, _ = cap_support(y, 10)
    torch.testing.assert_close(torch.zeros_like(y).scatter_add(-1, idx5, w5), y)
    x = (y + 0.01).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: cap_support(t, 3)[1], (x,))
    with pytest.raises(ValueError, match="max_support"):
        cap_support(y, 0)


@pytest.mark.parametrize("name,readout", [("transformer", "mean"), ("transformer", "gate"), ("attention_mil", "mean")])
def test_mean_skip_starts_as_the_mean_aggregator_and_learns_on_top(name, readout):
    from operators.aggregators import MeanAggregator

    torch.manual_seed(4)
    agg = build_aggregator(
        name, 12, 3, hidden=16, layers=1, heads=2, num_frequencies=0, mean_skip=True, readout=readout
    ).double()
    mean = MeanAggregator(12, 3).double()
    mean.head.load_state_dict(agg.skip.state_dict())
    f = torch.randn(2, 5, 12, dtype=torch.float64)
    w = torch.softmax(torch.randn(2, 5, dtype=torch.float64), 1)
    torch.testing.assert_close(agg(f), mean(f), rtol=0, atol=1e-14)  # the zero-initialised head adds nothing
    torch.testing.assert_close(agg(f, weights=w), mean(f, weights=w), rtol=0, atol=1e-14)
    agg(f).logsumexp(1).sum().backward()
    assert agg.head[1].weight.grad.abs().sum() > 0  # the aggregator's own path gets a gradient from the first step
    torch.manual_seed(5)
    agg.head[1].weight.data.normal_()
    assert (agg(f) - mean(f)).abs().max() > 1e-3  # and then changes the output
    with pytest.raises(ValueError, match="mean_skip applies"):
        build_aggregator("mean", 12, 3, mean_skip=True)
