import numpy as np
import pytest
import torch

from psring import data
from psring.errors import ConfigError


def test_synthetic_is_deterministic_and_learnable_labels():
    a = data.synthetic(512, 16, 5, seed=3)
    b = data.synthetic(512, 16, 5, seed=3)
    c = data.synthetic(512, 16, 5, seed=4)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    # every class appears: the teacher does not collapse onto one label
    assert len(torch.unique(a.y)) == 5


@pytest.mark.parametrize("world", [1, 2, 4])
def test_worker_slices_compose_the_global_batch(world):
    ds = data.synthetic(100, 4, 3, seed=0)  # 100 rows: batch 3 of size 32 wraps around
    for index in range(5):
        xs = [data.worker_batch(ds, 32, index, r, world)[0] for r in range(world)]
        whole = data.worker_batch(ds, 32, index, 0, 1)[0]
        assert torch.equal(torch.cat(xs), whole)
        rows = (torch.arange(32) + index * 32) % 100
        assert torch.equal(whole, ds.x[rows])


def test_npz_loading_and_rejection(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x=np.random.rand(10, 2, 2).astype(np.float32), y=np.arange(10) % 3)
    ds = data.from_npz(str(good))
    assert ds.x.shape == (10, 4) and ds.classes == 3
    bad = tmp_path / "bad.npz"
    np.savez(bad, features=np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="arrays named 'x' and 'y'"):
        data.from_npz(str(bad))
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(ConfigError, match="not a readable .npz"):
        data.from_npz(str(obj))


def test_digits_is_scikit_learns_bundled_set():
    pytest.importorskip("sklearn", reason="the [digits] extra (scikit-learn) is not installed")
    ds = data.load("digits", 0, 0, 0, 0)
    assert ds.x.shape == (1797, 64) and ds.classes == 10
    assert 0.0 <= float(ds.x.min()) and float(ds.x.max()) <= 1.0
    from psring.config import RunConfig

    assert RunConfig(data="digits", model="cnn").data == "digits"
