"""Loading the model of a command: MODULE:FACTORY or FILE.py:FACTORY, the factory's call,
and the one RewriteConfig every command that rewrites a model builds from its arguments."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any, List, Sequence, Tuple

import torch

from ..errors import FxampError


def _is_file_spec(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def _import_file(path: str, added: List[str]) -> Any:
    """Import the Python file ``path``; the directory it needs on sys.path is appended to
    ``added`` after being put first on sys.path.

    A file inside a package (directories with ``__init__.py``) is imported under its dotted
    name with the package's parent on sys.path, so its relative imports work; any other
    file under its stem, with its own directory on sys.path (as ``python FILE.py`` does)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise FxampError(f"no such file {path!r} (from {os.getcwd()}); what to do: give "
                         "FILE.py:FACTORY with a path to an existing file, or MODULE:FACTORY")
    root, parts = os.path.dirname(full), [os.path.splitext(os.path.basename(full))[0]]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        root, package = os.path.split(root)
        parts.insert(0, package)
    name = ".".join(parts)
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != full:
        if len(parts) > 1:
            raise FxampError(
                f"cannot import {path!r} as {name!r}: a different module of that name is "
                f"already imported ({getattr(loaded, '__file__', None)}); what to do: run "
                "fxamp from another directory or name the module as MODULE:FACTORY")
        name = f"fxamp_user_{parts[0]}"  # a top-level file whose stem is taken
    sys.path.insert(0, root)
    added.append(root)
    if name in sys.modules or len(parts) > 1:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(module_name: str, added: List[str]) -> Any:
    """The module of a MODULE:FACTORY or FILE.py:FACTORY spec (the current directory first
    on sys.path, as ``python -m`` has it)."""
    here = os.path.abspath(".")
    sys.path.insert(0, here)
    added.append(here)
    try:
        if _is_file_spec(module_name):
            return _import_file(module_name, added)
        return importlib.import_module(module_name)
    except (ImportError, SyntaxError) as err:
        raise FxampError(f"cannot import {module_name!r}: {type(err).__name__}: {err}"
                         ) from None
    except TypeError as err:  # "the 'package' argument is required": a relative name
        raise FxampError(f"cannot import {module_name!r}: {err}; what to do: write a module "
                         "name (pkg.module:FACTORY) or a file path (dir/file.py:FACTORY)"
                         ) from None


def load_factory(spec: str, shapes: Sequence[Tuple[int, ...]]) -> Tuple[torch.nn.Module, tuple]:
    """Import MODULE:FACTORY (or FILE.py:FACTORY, a path from the current directory) and
    call the factory; it returns a model or (model, inputs)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise FxampError(f"expected MODULE:FACTORY or FILE.py:FACTORY (e.g. "
                         f"fxamp.demo:small_cnn, examples/audit_demo.py:build), got {spec!r}")
    added: List[str] = []
    try:
        module = _import(module_name, added)
        factory = getattr(module, attr, None)
        if factory is None:
            raise FxampError(f"{module_name!r} has no attribute {attr!r}")
        made: Any = factory()  # it may import lazily from its directory: still on sys.path
    finally:
        for entry in added:
            sys.path.remove(entry)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    else:
        model, inputs = made, None
    if shapes:
        inputs = tuple(torch.randn(*s) for s in shapes)
    if inputs is None:
        raise FxampError(f"{spec} returned only a model; give --input-shape (e.g. "
                         "--input-shape 1,3,224,224) or return (model, example_inputs)")
    return model, inputs


def _config(args: argparse.Namespace) -> Any:
    """The one RewriteConfig of the model arguments (--policy, --dtype, --target,
    --frontend) that every command rewriting a model uses."""
    from ..config import RewriteConfig

    return RewriteConfig.make(args.policy, args.dtype, args.target, args.frontend)


def _rewrite(args: argparse.Namespace) -> Any:
    from .. import amp_rewrite

    model, inputs = load_factory(args.factory, args.input_shape or [])
    config = _config(args)
    return amp_rewrite(model, inputs, config=config)
