"""FakeTensorMode without importing torch._dynamo (about 1.3 s of a traced estimate's 3).

FakeTensorMode only reads two flags from `torch._dynamo.config`, but `import torch._dynamo.config`
runs the whole `torch._dynamo` package first. Functions torch decorates with `torch._disable_dynamo`
(the optimizer's step, checkpoint's recompute, nn.Embedding's init...) import it on their first call
too, only to wrap themselves in `torch._dynamo.disable`. Neither matters while nothing is compiled.

`no_dynamo()` stands a placeholder package in for `torch._dynamo` while a trace runs: its submodules
(`config`) load from the real folder, `disable(fn)` is `fn` itself, and any other attribute imports
the real package (slow, still correct). On exit the placeholder goes and the functions it handed
themselves back to are reset, so a later `torch.compile` in the same process sees torch as it was.
Nothing happens when torch._dynamo is already imported.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any, Iterator

_NAME = "torch._dynamo"
_MARK = "__dynamo_disable"  # where torch._compile._disable_dynamo caches the wrapped function


class _Bare(types.ModuleType):
    """A package whose submodules load from its real folder, without running its __init__."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations is not None
        self.__spec__ = spec
        self.__path__ = list(spec.submodule_search_locations)
        self.__file__ = spec.origin
        self.__package__ = name


def _bare_import(package: str, sub: str) -> None:
    """Import package.sub without package's __init__ (when neither is imported yet)."""
    if package in sys.modules or f"{package}.{sub}" in sys.modules:
        return
    bare = _Bare(package)
    sys.modules[package] = bare
    try:
        importlib.import_module(f"{package}.{sub}")
    finally:
        if sys.modules.get(package) is bare:
            del sys.modules[package]
            _reattach_later(package)


class _Placeholder(_Bare):
    def __init__(self) -> None:
        super().__init__(_NAME)
        self._handed_back: list[Any] = []
        # ModTracker (the tracker's module stack) asks this in every forward hook; nothing is compiled.
        self.eval_frame = types.SimpleNamespace(_is_in_optimized_module=lambda: False)
        self.graph_break = lambda: None  # the optimizer's step calls it around its body

    def disable(self, fn: Any = None, recursive: bool = True, wrapping: bool = True, **_: Any) -> Any:
        if fn is None:
            return lambda f: self.disable(f, recursive, wrapping)
        self._handed_back.append(fn)
        return fn

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{_NAME}.{name}") is not None:  # a submodule: load just it
            return importlib.import_module(f"{_NAME}.{name}")
        return getattr(_real(), name)


def _real() -> types.ModuleType:
    if isinstance(sys.modules.get(_NAME), _Placeholder):
        del sys.modules[_NAME]
    return importlib.import_module(_NAME)


@contextlib.contextmanager
def no_dynamo() -> Iterator[None]:
    import torch

    # The tracker's ModTracker, without torch.distributed._tools' __init__ (which imports inductor,
    # FSDP and DTensor: a second more).
    _bare_import("torch.distributed._tools", "mod_tracker")
    if _NAME in sys.modules:
        yield
        return
    ph = _Placeholder()
    sys.modules[_NAME] = ph
    try:
        import torch._dynamo.config  # noqa: F401  (from the real folder, into the placeholder)

        ph.config = sys.modules[_NAME + ".config"]

        yield
    finally:
        for fn in ph._handed_back:
            if getattr(fn, _MARK, None) is fn:
                delattr(fn, _MARK)
        if sys.modules.get(_NAME) is ph:
            del sys.modules[_NAME]
            _reattach_later(_NAME)
        if torch.__dict__.get("_dynamo") is ph:
            delattr(torch, "_dynamo")


def _reattach_later(package: str) -> None:
    if not any(isinstance(f, _ReattachSubmodules) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _ReattachSubmodules(package))


class _ReattachSubmodules(importlib.abc.MetaPathFinder):
    """When the real package is imported later, bind the submodules loaded without it as its attributes
    first (an import finds them in sys.modules and would not), so `torch._dynamo.utils` resolves and no
    submodule exists twice."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.package:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            depth = name.count(".") + 1
            for full, sub in list(sys.modules.items()):
                if full.startswith(name + ".") and full.count(".") == depth:
                    setattr(module, full.rsplit(".", 1)[1], sub)
            run(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  (a fresh loader per find_spec)
        return spec
