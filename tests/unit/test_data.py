import numpy as np
import pytest
import torch

from psring.errors import ConfigError
from psring.train import data
from psring.train.models import Inputs

KINDS = [Inputs.vector(16, 5), Inputs.image(3, 8, 5), Inputs.tokens(12, 5)]


@pytest.mark.parametrize("inputs", KINDS, ids=lambda i: i.kind)
def test_synthetic_is_deterministic_shaped_and_held_out(inputs):
    a = data.synthetic(inputs, 512, 128, seed=3)
    b = data.synthetic(inputs, 512, 128, seed=3)
    c = data.synthetic(inputs, 512, 128, seed=4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.held_out.y, b.held_out.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape == (512, *inputs.shape) and len(a.held_out) == 128
    if inputs.kind == "tokens":
        assert a.train.x.dtype == torch.int64 and a.train.y.shape == a.train.x.shape
        # the targets are the inputs shifted by one: the next token at every position
        assert torch.equal(a.train.x[:, 1:], a.train.y[:, :-1])
        # the successor rule holds about 90% of the time: a learnable, not trivial, task
        succ = {}
        for p, n in zip(a.train.x.reshape(-1).tolist(), a.train.y.reshape(-1).tolist()):
            succ.setdefault(p, []).append(n)
        rule = np.mean([max(v.count(t) for t in set(v)) / len(v) for v in succ.values()])
        assert 0.85 < rule < 0.96
    else:
        # every class appears, and the held-out rows are new draws, not copies
        assert len(torch.unique(a.train.y)) == 5
        assert not any(torch.equal(a.held_out.x[0], r) for r in a.train.x)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_worker_slices_compose_the_global_batch(world):
    ds = data.synthetic(Inputs.vector(4, 3), 100, 0, seed=0).train  # batch 3 of 32 wraps
    for index in range(5):
        xs = [data.worker_batch(ds, 32, index, r, world)[0] for r in range(world)]
        whole = data.worker_batch(ds, 32, index, 0, 1)[0]
        assert torch.equal(torch.cat(xs), whole)
        rows = (torch.arange(32) + index * 32) % 100
        assert torch.equal(whole, ds.x[rows])


def test_npz_loading_splitting_and_rejection(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x=np.random.rand(100, 2, 2).astype(np.float32), y=np.arange(100) % 3)
    ds = data.from_npz(str(good))
    assert ds.x.shape == (100, 2, 2) and ds.classes == 3 and ds.features == 4
    # a model taking flat vectors gets the rows flattened; a fifth at most is held out
    split = data.split_file(ds, 1000, Inputs.vector(4, 3), "good.npz", seed=0)
    assert split.train.x.shape == (80, 4) and len(split.held_out) == 20
    rows = ({tuple(r.tolist()) for r in split.train.x}
            | {tuple(r.tolist()) for r in split.held_out.x})
    assert len(rows) == 100  # every row is in exactly one part
    with pytest.raises(ConfigError, match="do not fit the model"):
        data.split_file(ds, 10, Inputs.image(3, 2, 3), "good.npz", seed=0)
    bad = tmp_path / "bad.npz"
    np.savez(bad, features=np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="arrays named 'x' and 'y'"):
        data.from_npz(str(bad))
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(ConfigError, match="not a readable .npz"):
        data.from_npz(str(obj))


def test_npz_token_sequences(tmp_path):
    seqs = np.random.default_rng(0).integers(0, 7, (50, 9))
    path = tmp_path / "text.npz"
    np.savez(path, x=seqs[:, :-1], y=seqs[:, 1:])
    ds = data.from_npz(str(path))
    assert ds.x.dtype == torch.int64 and ds.classes == 7
    from psring.train.models import ModelSettings

    s = data.file_settings(ds, ModelSettings())
    assert s.seq_len == 8 and s.classes == 7


def test_digits_is_scikit_learns_bundled_set():
    pytest.importorskip("sklearn", reason="the [digits] extra (scikit-learn) is not installed")
    ds = data.load_file("digits")
    assert ds.x.shape == (1797, 64) and ds.classes == 10
    assert 0.0 <= float(ds.x.min()) and float(ds.x.max()) <= 1.0
    from psring.config import RunConfig, validate

    assert validate(RunConfig(data="digits", model="cnn")).data == "digits"


@pytest.mark.parametrize("shape, n", [((3, 32, 32), 2100), ((3, 75, 75), 300), ((1, 7, 9), 50)])
def test_images_made_in_pieces_are_the_ones_made_at_once(shape, n):
    """psring.train.data._images makes its patterns and noise in pieces (memory); the values
    are those of the former whole-set code (patterns of every class at once, noise in
    1024-row pieces), at image sizes whose rows are not a multiple of 16 values too."""
    from torch.nn import functional as F

    from psring.train.data import IMAGE_SIGNAL, _images

    classes = 10
    g = torch.Generator().manual_seed(3)
    c, h, w = shape
    low = torch.randn(classes, c, 4, 4, generator=g)
    patterns = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    patterns = patterns / patterns.std() * IMAGE_SIGNAL
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.empty(n, c, h, w)
    for a in range(0, n, 1024):
        b = min(n, a + 1024)
        x[a:b] = patterns[y[a:b]] + torch.randn(b - a, c, h, w, generator=g)
    got_x, got_y = _images(n, shape, classes, torch.Generator().manual_seed(3))
    assert torch.equal(got_y, y)
    assert torch.allclose(got_x, x, rtol=0, atol=1e-6)
