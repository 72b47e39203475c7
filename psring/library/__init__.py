"""psring inside a user's own training script: the strategies as a library.

    import psring
    dist = psring.init()                                 # psring launch's run, or arguments
    loader = DataLoader(dataset, batch_sampler=dist.sampler(dataset, batch_size=128))
    model, optimizer = dist.wrap(model, optimizer)
    for step, (x, y) in enumerate(loader):
        with dist.step(step):
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()
    dist.finish()

Started by ``psring launch --strategy S --workers N -- python train.py`` (psring.cli),
or torchrun. ``session`` sets the worker up and times its steps, ``wrap`` puts the
strategy around the model and optimizer, ``sampler`` deals out each global batch.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "init": "start", "launched": "start", "ENV": "start",
    "Distributed": "session", "StepScope": "session",
    "GlobalBatchSampler": "sampler",
})
