"""FT-HSDP training: the user-facing API (ftrun.train.api) and the step driver it runs on.

    import ftrun.train
    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=8)) as ft:
        result = ft.train(model_fn=..., optimizer_fn=..., loss_fn=..., dataset=..., steps=1000)

The API names are loaded on first use, so importing a submodule (ftrun.train.lr, .exchange, ...) does
not pull in the whole runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = ("FTConfig", "FTJob", "Hooks", "TrainResult", "init_from_env", "param_hash")
__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("ftrun.train.api"), name)
    raise AttributeError(f"module 'ftrun.train' has no attribute {name!r}")
