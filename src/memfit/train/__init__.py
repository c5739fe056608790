"""train: the data pipeline and the training loop behind `memfit train`.

`memfit.train` is both this package and the public function `memfit.train(cfg)`: importing a
submodule (`memfit.train.loop`) rebinds the name on `memfit` to the package, so the package itself
is callable and runs the loop. Either way `memfit.train(TrainConfig(...))` trains.
"""
from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from memfit.train.loop import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
