"""A script written at module level, as short scripts are, whose DataLoader keeps worker
processes (persistent_workers): they are alive when the script ends, and psring launch
must not leave them behind (tests/multiproc/test_script_runs.py)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring

dist = psring.init()
ds = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
loader = DataLoader(ds, batch_sampler=dist.sampler(ds, 32), num_workers=2,
                    persistent_workers=True)
model = nn.Linear(4, 1)
model, opt = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
for x, y in loader:
    with dist.step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
dist.finish()
