"""Loading the model of a command: MODULE:FACTORY or FILE.py:FACTORY, the factory's call,
and the one RewriteConfig every command that rewrites a model builds from its arguments."""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import inspect
import itertools
import logging
import math
import os
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import (FactoryError, FxampError, excerpt, is_library_file, short_path,
                      shorten)
from .refusals import check_input_count

log = logging.getLogger(__name__)


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
        raise FactoryError(f"no such file {path!r} (from {os.getcwd()}); what to do: give "
                         "FILE.py:FACTORY with a path to an existing file, or MODULE:FACTORY")
    root, parts = os.path.dirname(full), [os.path.splitext(os.path.basename(full))[0]]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        root, package = os.path.split(root)
        parts.insert(0, package)
    name = ".".join(parts)
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != full:
        if len(parts) > 1:
            raise FactoryError(
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


_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _is_stdlib(path: str) -> bool:
    full = os.path.abspath(path)
    return full.startswith(_STDLIB) and "-packages" + os.sep not in full


def _where(err: BaseException) -> str:
    """`` (FILE, line N, in FUNC)``: the innermost frame of ``err`` in the user's code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not is_library_file(f.filename) and not _is_stdlib(f.filename)
              and not f.filename.startswith("<")]
    if not frames:
        return ""
    f = frames[-1]
    return f" ({short_path(f.filename)}, line {f.lineno}, in {f.name})"


def _cause(err: BaseException) -> str:
    """``Type: first line of the message`` (cut to a readable length)."""
    text = shorten(str(err).strip().splitlines()[0]) if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


_DEBUG = "run with --debug for the traceback"


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
        raise FactoryError(f"cannot import {module_name!r}: {type(err).__name__}: {err}"
                           ) from err
    except TypeError as err:  # "the 'package' argument is required": a relative name
        if err.__traceback__ is not None and _where(err):
            raise _import_failed(module_name, err) from err
        raise FactoryError(f"cannot import {module_name!r}: {err}; what to do: write a module "
                           "name (pkg.module:FACTORY) or a file path (dir/file.py:FACTORY)"
                           ) from err
    except FxampError:
        raise
    except (Exception, SystemExit) as err:
        raise _import_failed(module_name, err) from err


def _import_failed(module_name: str, err: BaseException) -> FactoryError:
    what = (f"called sys.exit({err.code!r})" if isinstance(err, SystemExit)
            else f"raised {_cause(err)}")
    return FactoryError(f"cannot import {module_name!r}: importing it {what}{_where(err)}; "
                        f"what to do: fix the module so that it imports ({_DEBUG})")


def _call(spec: str, factory: Any) -> Any:
    """``factory()``, every way it can fail an FactoryError naming the cause."""
    if not callable(factory):
        raise FactoryError(f"{spec} is {_a(factory)}, not callable; what to do: name a "
                           "function (or class) that fxamp calls with no arguments and that "
                           f"returns {_ACCEPTED}")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        needed = [n for n, p in inspect.signature(factory).parameters.items()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD,
                                                         p.KEYWORD_ONLY)]
        raise FactoryError(f"{spec} needs arguments ({', '.join(needed)}) and fxamp calls "
                           "it with none; what to do: give them defaults, or name a function "
                           "without arguments that calls it") from None
    except ValueError:  # no signature (some builtins): just call it
        pass
    try:
        return factory()
    except FxampError:
        raise
    except (Exception, SystemExit) as err:
        what = (f"called sys.exit({err.code!r})" if isinstance(err, SystemExit)
                else f"raised {_cause(err)}")
        raise FactoryError(f"{spec} {what}{_where(err)}; what to do: fix the factory so "
                           f"that it returns {_ACCEPTED} ({_DEBUG})") from err


_ACCEPTED = ("a model (an nn.Module, with --input-shape) or a pair (model, example_inputs), "
             "example_inputs a tensor or a tuple of the forward's arguments")


def _a(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _unpack(spec: str, made: Any) -> Tuple[torch.nn.Module, Optional[tuple]]:
    """The (model, inputs) of what the factory returned; inputs None for a model alone."""
    if isinstance(made, torch.nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        return model, inputs if isinstance(inputs, tuple) else (inputs,)
    if isinstance(made, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in made[:5]) + (", ..." if len(made) > 5
                                                                 else "")
        raise FactoryError(f"{spec} returned {_a(made)} of {len(made)} values ({kinds}); "
                           f"what to do: return {_ACCEPTED}")
    raise FactoryError(f"{spec} returned {_a(made)}, not a model; what to do: return "
                       f"{_ACCEPTED}")


def _loaded(spec: str, what: str, call: bool) -> Any:
    """The object MODULE:NAME (or FILE.py:NAME, a path from the current directory) names;
    called (:func:`_call`) when ``call``. ``what`` is NAME's part, for the messages."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(f"expected MODULE:{what} or FILE.py:{what} (e.g. "
                           f"fxamp.demo:small_cnn, examples/audit_demo.py:build), got "
                           f"{excerpt(spec)}")
    added: List[str] = []
    try:
        module = _import(module_name, added)
        found = getattr(module, attr, None)
        if found is None:
            raise FactoryError(f"{module_name!r} has no attribute {attr!r}")
        return _call(spec, found) if call else found  # it may import from its directory
    finally:
        for entry in added:
            sys.path.remove(entry)


def load_model(spec: str) -> Tuple[torch.nn.Module, Optional[tuple]]:
    """Import MODULE:FACTORY (or FILE.py:FACTORY, a path from the current directory) and
    call the factory: its model, and its inputs (None when it returned a model alone)."""
    return _unpack(spec, _loaded(spec, "FACTORY", call=True))


def load_rules(specs: Sequence[str]) -> List[Any]:
    """The user rules of ``--rule`` options: each MODULE:NAME (or FILE.py:NAME) names a
    ``fxamp.DecisionRule`` object, a list of them, or a DecisionRule subclass, made with no
    arguments. What is no rule is refused when the config is made (RuleError)."""
    from ..rules import DecisionRule

    rules: List[Any] = []
    for spec in specs:
        found = _loaded(spec, "RULE", call=False)
        if isinstance(found, type) and issubclass(found, DecisionRule):
            found = _call(spec, found)
        rules.extend(found if isinstance(found, (list, tuple)) else [found])
    return rules


def _no_inputs(spec: str) -> FactoryError:
    return FactoryError(f"{spec} returned only a model; give --input-shape (e.g. "
                        "--input-shape 1,3,224,224) or return (model, example_inputs)")


def load_factory(spec: str, shapes: Sequence[Tuple[int, ...]]
                 ) -> Tuple[torch.nn.Module, tuple]:
    """The model of MODULE:FACTORY and its inputs: the factory's, or random FP32 tensors
    of ``shapes`` (--input-shape) when given."""
    model, inputs = load_model(spec)
    if shapes:
        check_input_count(spec, model, shapes)
        inputs = tuple(random_input(s) for s in shapes)
    if inputs is None:
        raise _no_inputs(spec)
    return model, inputs


#: the most bytes of real random inputs made when planning on meta tensors fails
REAL_FALLBACK_BYTES = 1 << 30


def plan_only(args: argparse.Namespace, run: Callable[[torch.nn.Module, tuple], Any]) -> Any:
    """``run(model, inputs)`` for a command that needs only the plan. With --input-shape
    it runs on device ``meta`` (a copy of the model and inputs without data, so a huge
    shape allocates nothing); a model that does not run there is run on real random inputs
    when they take at most :data:`REAL_FALLBACK_BYTES`."""
    shapes = args.input_shape or []
    model, inputs = load_model(args.factory)
    if not shapes:
        if inputs is None:
            raise _no_inputs(args.factory)
        return run(model, inputs)
    check_input_count(args.factory, model, shapes)
    total = sum(input_bytes(s) for s in shapes)
    inputs = tuple(random_input(s, "meta") for s in shapes)
    try:
        with torch.no_grad():
            meta_copy(model)(*inputs)  # the FP32 model on the shapes: a wrong shape shows
    except Exception as err:  # noqa: BLE001 - a wrong shape, or a model meta cannot run
        if total > REAL_FALLBACK_BYTES:
            text = " ".join(",".join(map(str, s)) for s in shapes)
            raise FactoryError(
                f"{args.factory} fails on FP32 inputs of --input-shape {text} (run on device "
                f"meta, without data): {_cause(err)}{_where(err)}; what to do: give the "
                "shapes the model's forward takes (real inputs of these would take "
                f"{_size(total)}, too many to try)") from err
        log.info("the model does not run on meta tensors (%s): planning on real random "
                 "inputs", _cause(err))
        return _on_shapes(args, run, model, tuple(random_input(s) for s in shapes))
    return _on_shapes(args, run, meta_copy(model), inputs)


def _on_shapes(args: argparse.Namespace, run: Callable[[torch.nn.Module, tuple], Any],
               model: torch.nn.Module, inputs: tuple) -> Any:
    """``run(model, inputs)`` on the random FP32 inputs of --input-shape: a model that
    fails on them (token ids, a mask, several inputs of other kinds) is a FactoryError
    whose advice is the command's, not the Python API's."""
    from ..errors import ExampleInputError

    try:
        return run(model, inputs)
    except ExampleInputError as err:
        cause = str(err).split("\n  what to do:", 1)[0]
        raise FactoryError(
            f"{cause}\n  what to do: --input-shape gives the model random FP32 tensors of "
            f"those shapes; for inputs of another kind (token ids, masks, keyword arguments) "
            f"make {args.factory} return (model, example_inputs) with inputs the model takes, "
            "and leave out --input-shape") from err


def input_bytes(shape: Sequence[int]) -> int:
    """The bytes of a real FP32 tensor of ``shape``."""
    return 4 * math.prod(shape)


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return ""


def random_input(shape: Sequence[int], device: str = "cpu") -> torch.Tensor:
    """A random FP32 input of ``shape`` (``device="meta"``: its shape alone, no data); an
    InputShapeError when it cannot be made (too large to allocate)."""
    text = ",".join(map(str, shape))
    try:
        if device == "meta":
            return torch.empty(*shape, device="meta")
        return torch.randn(*shape)
    except (RuntimeError, MemoryError, OverflowError) as err:
        raise FactoryError(f"cannot make an FP32 input of --input-shape {text} "
                           f"({_size(input_bytes(shape))}): {_cause(err)}; what to do: give "
                           "a smaller --input-shape") from None


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose Parameters and buffers are on device ``meta`` (shapes and
    dtypes, no data; ties kept), made without copying any tensor's data."""
    memo: Dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            moved = t.detach().to("meta")
            if isinstance(t, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
            memo[id(t)] = moved
    return copy.deepcopy(model, memo)


def config_from_args(args: argparse.Namespace) -> Any:
    """The one RewriteConfig of the model arguments (--policy, --dtype, --target,
    --frontend, --rule) that every command rewriting a model uses."""
    from ..config import RewriteConfig

    return RewriteConfig.make(args.policy, args.dtype, args.target, args.frontend,
                              rules=load_rules(getattr(args, "rule", None) or []))


def rewrite_from_args(args: argparse.Namespace, ranges: Any = None) -> Any:
    """The command's model rewritten with its arguments, for a command that needs only the
    plan and the graph (see :func:`plan_only`); ``ranges`` (a Plan's ``@range`` statistics)
    are its calibration data when given."""
    from .. import amp_rewrite

    config = config_from_args(args)
    if ranges:
        config = config.replace(calibration=dict(ranges))
    partition = getattr(args, "partition", "auto")
    if partition == "blocks":  # (the model in block mode, planned on the example now)
        config = config.replace(partition=partition)
        return plan_only(args, lambda model, inputs: amp_rewrite(model, inputs, config=config,
                                                                 inplace=True))
    return plan_only(args, lambda model, inputs: amp_rewrite(model, inputs, config=config))
