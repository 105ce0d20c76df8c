"""amp_rewrite: trace, annotate, insert casts, recompile; plan_of."""
from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .. import _torch, ops
from .._version import __version__
from ..config import RewriteConfig
from ..errors import FxampError, PolicyError, TraceError, UnsupportedModelError
from ..ir import fix
from ..overrides import Scope, check_matched, check_paths
from ..passes import mask_fill
from ..passes.manager import PassContext, PassManager
from ..plan import Plan, RangeStats
from ..program import DEVICES
from ..result import Rewritten, has_result, one_mode, plan_of, result_of, set_result
from ..structure import Structure, hooked_paths, share_modules
from ..policy import Policy, is_deploy
from ..frontends import STATIC_SHAPES, Children, capture_model, graph_frontend
from ..frontends.checkpointing import layers_off
from ..frontends.common import MODE, as_tuple, nested_header, top_header
from ..frontends.copies import refuse_copies
from ..frontends.custom_functions import plan_reason
from ..frontends.eager import eager_root, submodule_calls
from ..frontends.hooks import check_global_hooks, copy_root_hooks, without_call_hooks
from ..frontends.shadow import Shadow, twin
from ..frontends.modes import reads_training
from ..frontends.state import ModelState, report_side_effects
from .gc_scope import young_objects_only
from .blocks import block_paths, glue_parts, install_blocks
from .glue import mark_regions
from .inplace import install
from .inputs import AutocastOff, check_example_inputs, check_model, check_module
from .modes import OtherMode
from .overlap import check_overlap, parts_off, rewritten_before, undo
from .pass_list import pass_list, plan_lines, plan_nodes
from .state_dict import complete_state
from .stored import planning_in_fp32, restore_stored, store_weights

log = logging.getLogger(__name__)




def _header(policy: Policy, frontend: str, leaves: Sequence[str] = (),
            nested: Optional[Dict[str, Plan]] = None) -> dict:
    header = {"fxamp": __version__, "torch": torch.__version__.split("+")[0],
              "policy": str(policy), "frontend": frontend}
    return nested_header(header, leaves, nested)


def _rewrite_submodules(model: nn.Module, paths: Sequence[str],
                        calls: Dict[str, Tuple[tuple, dict, Any]], config: RewriteConfig,
                        what: str, scope: Scope) -> Dict[str, nn.Module]:
    """Rewrite each submodule in ``paths`` on its own (any front end, the calls captured
    on the example inputs as its inputs) where one takes it; returns them by path. The
    others (``what`` says what becomes of them) are left out."""
    inner = config.for_part()  # values flow on in their dtype
    done: Dict[str, nn.Module] = {}
    for path in paths:
        if path not in calls:
            continue  # never called by forward
        sub_args, sub_kwargs, _ = calls[path]
        try:
            child = scope.child(path)
            done[path] = rewrite(model.get_submodule(path), tuple(sub_args),
                                 inner.replace(example_kwargs=sub_kwargs), scope=child)
            scope.join(child)  # (a failed rewrite's matches do not count)
        except Exception as err:  # noqa: BLE001 - it stays a call under autocast (planned)
            log.info("%s %s: %s: %s", path, what, type(err).__name__,
                     (str(err).splitlines() or [""])[0])
    return done


def _rewrite_leaves(model: nn.Module, src: fx.GraphModule, leaves: Sequence[str],
                    args: tuple, kwargs: Dict[str, Any], config: RewriteConfig,
                    scope: Scope) -> Dict[str, Plan]:
    """Rewrite each untraceable leaf on its own where a front end takes it; the others
    stay runtime calls. Returns the nested plans by leaf path."""
    calls = submodule_calls(model, leaves, args, kwargs)
    nested: Dict[str, Plan] = {}
    for path, sub in _rewrite_submodules(model, leaves, calls, config,
                                         "stays a runtime call", scope).items():
        parent, _, name = path.rpartition(".")
        setattr(src.get_submodule(parent) if parent else src, name, sub)
        nested[path] = plan_of(sub)
    return nested


#: the keywords amp_rewrite took before ``config=`` held them (``RewriteConfig.make``'s)
DEPRECATED_KEYWORDS = ("dtype", "target", "policy", "frontend", "example_kwargs",
                       "calibration_data", "dynamic_shapes", "rules")


def read_config(config: Union[None, str, Policy, RewriteConfig],
                deprecated: Dict[str, Any], who: str = "amp_rewrite",
                call: str = "model, example_inputs",
                taken: Sequence[str] = DEPRECATED_KEYWORDS,
                stacklevel: int = 3) -> RewriteConfig:
    """The RewriteConfig of a ``config`` argument (a ``RewriteConfig``, a ``Policy``, a
    policy text or None) and the deprecated keywords it holds (warned), for ``amp_rewrite``
    and the tools that take a config as it does (``audit``, ``search``,
    ``bisect_baseline``).

    Args:
        config: the ``config`` given.
        deprecated: the other keywords given (the function's ``**deprecated``).
        who: the function's name, for the messages.
        call: its arguments before the config, for the warning's new spelling.
        taken: the deprecated keywords it takes (each one of ``DEPRECATED_KEYWORDS``).
        stacklevel: the ``FutureWarning``'s, counted from here (3: the function's caller,
            when the function calls this itself).

    Raises:
        TypeError: a keyword the function never took.
        FxampError: ``config`` together with deprecated keywords, or of another type.
    """
    unknown = [name for name in deprecated if name not in taken]
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    if deprecated:
        if config is not None:
            raise FxampError(
                f"{who} takes either config= or the keywords it holds, not both: got "
                f"config= and {', '.join(deprecated)}; what to do: config.replace(...), or "
                f"fxamp.RewriteConfig.make({', '.join(deprecated)}=...) alone")
        shown = ", ".join(f"{name}=..." for name in deprecated)
        warnings.warn(
            f"{who}(..., {shown}) is deprecated and will be removed in the next "
            f"release; the config holds them: {who}({call}, "
            f"fxamp.RewriteConfig.make({shown}))", FutureWarning, stacklevel=stacklevel)
        return RewriteConfig.make(**deprecated)
    if config is None or isinstance(config, (str, Policy)):
        return RewriteConfig.make(policy=config)
    if not isinstance(config, RewriteConfig):
        raise FxampError(f"{who}'s config takes a fxamp.RewriteConfig, a fxamp.Policy "
                         f"or a policy's text form, got {type(config).__name__}; what to do: "
                         "fxamp.RewriteConfig.make(...)")
    return config


def amp_rewrite(model: nn.Module, example_inputs: Optional[Union[Sequence[Any], Any]] = None,
                config: Union[None, str, Policy, RewriteConfig] = None, *,
                inplace: bool = False, **deprecated: Any) -> nn.Module:
    """Rewrite ``model`` into an explicit mixed-precision ``GraphModule`` (for the "eager"
    front end, a copy of the model whose children are such modules).

    Each node computes in the dtype ``torch.autocast(target, dtype)`` would give it (or the
    policy's override, or a numerics pass's decision), with explicit casts; Parameters stay
    FP32 and shared with ``model``. When the rewrite fails, the model is run once in FP32 on
    the example inputs: if that fails too, the model's own error is raised
    (``ExampleInputError``). The model is left exactly as it was (see
    ``frontends/state.py``). The config of the rewrite is stored on the result
    (``fxamp.config_of``).

    Args:
        model: the FP32 model to rewrite.
        example_inputs: the forward's positional arguments (a tuple, or one tensor); they
            decide dtypes exactly. Optional with ``inplace=True``, where the model is
            planned on its first call.
        config: how to rewrite: a ``RewriteConfig`` (``RewriteConfig.make(dtype=...,
            target=..., policy=..., frontend=..., example_kwargs=..., calibration_data=...,
            dynamic_shapes=..., rules=...)``, or ``config_of(gm)`` of an earlier
            rewrite), a ``Policy``, or a policy's text form: ``"compute=bf16,target=cpu"``,
            ``"fp32:head.*,off:joins"``, or a recipe name (``fxamp.policy.RECIPES``:
            ``"cuda-fp16"``, ``"cuda-bf16"``, ``"cpu-bf16"``, ``"tensorrt"``), each the
            policy text it names. None: ``RewriteConfig.make()``, float16 for the device
            the model is on when it is planned (its first floating Parameter or buffer,
            else the example inputs'; ``meta`` plans for ``"cuda"``): at the rewrite, or,
            in place without example inputs, at its first call.
        inplace: return ``model`` itself, its forward computing with the rewritten module
            (same object and class: its other methods, wrappers, hooks and ``state_dict``
            keys stay; ``train()``/``eval()`` reach the graph; see
            ``rewriter/inplace.py``). A model with blocks keeps its module tree, each
            block planned on its first call, or on the example now
            (``rewriter/blocks.py``; ``partition="flat"``: one graph of the whole
            model). A call in a mode or of a structure no graph of an in-place model
            covers is planned on that call.
            The inference policy ``weights=stored`` (``rewriter/stored.py``) needs it.
            With ``inplace=False`` and a ``partition`` that keeps the module tree
            (``"blocks"``, a function), the result is a twin of ``model`` rewritten in
            place: new modules of the same classes sharing its Parameters and buffers
            (``frontends/shadow.py``, ``twin``); ``model`` keeps its own forward.
        **deprecated: the keywords the config holds (``dtype``, ``target``, ``policy``,
            ``frontend``, ``example_kwargs``, ``calibration_data``, ``dynamic_shapes``,
            ``rules``), taken for one more release with a ``FutureWarning``: they build
            ``RewriteConfig.make(**deprecated)``.

    Returns:
        The rewritten module (``model`` itself with ``inplace=True``); ``fxamp.plan_of``
        gives its plan.

    Raises:
        PolicyError: a bad policy, or ``weights=stored`` with ``inplace=False``.
        ExampleInputError: the model fails in FP32 on the example inputs too.
        TraceError: no front end can trace the model (the message names the node).
        RuleError: a rule that is no ``DecisionRule``, or a decision that is none.
        FxampError: ``config`` together with the (deprecated) keywords it holds, or a
            ``config`` of another type; the subclass names any other bad input.
        TypeError: a keyword ``amp_rewrite`` does not take.
        InputShapeError: (raised by the result) a call with another size on a static
            dimension of an exported graph.
        CallStructureError: (raised by a returned, not in-place, result) a call structure
            no graph covers. (A call in the training mode its graph was not traced for is
            planned on that call: ``rewriter/modes.py``.)
    """
    config = read_config(config, deprecated)
    if config.policy.weights == "stored" and not inplace:
        raise PolicyError(
            f"policy weights=stored stores the model's own Parameters in low precision (the "
            f"rewritten module shares them), so it is an in-place rewrite: with inplace=False "
            f"the {type(model).__name__} you passed would be changed behind the returned "
            "module and could no longer run as the FP32 reference. what to do: "
            "amp_rewrite(model, ..., 'weights=stored', inplace=True), on a copy "
            "(copy.deepcopy(model)) to keep the FP32 model")
    return _amp_rewrite(model, example_inputs, config, inplace)


def _amp_rewrite(model: nn.Module, example_inputs: Optional[Union[Sequence[Any], Any]],
                 config: RewriteConfig, inplace: bool) -> nn.Module:
    """``amp_rewrite`` with its config made (its target resolved here unless an in-place
    rewrite without example inputs plans it on its first call): a model rewritten before
    (``overlap.rewritten_before``), one planned on its calls (:func:`_planned_on_calls`), or
    one graph planned now (:func:`_planned_now`)."""
    check_module(model)  # (before anything reads it as a module)
    resolved = config.for_model(model, (example_inputs, config.example_kwargs))  # (target)
    check_overlap(model, resolved.policy, inplace)  # (another policy's on a part of it)
    done = rewritten_before(model, example_inputs, config, resolved.policy, inplace,
                            _amp_rewrite, _plan_call)
    if done is not None:
        return done
    keeps_tree = config.partition not in ("auto", "flat")  # (its regions stay modules)
    if keeps_tree and not inplace:  # (a twin, rewritten in place)
        model, inplace = twin(model), True
    if inplace and (keeps_tree or example_inputs is None and not config.example_kwargs
                    or _blocks_by_default(model, config)):
        return _planned_on_calls(model, example_inputs, config)
    return _planned_now(model, example_inputs, resolved, inplace)


def _blocks_by_default(model: nn.Module, config: RewriteConfig) -> bool:
    """Whether an in-place rewrite with example inputs and the default partition keeps the
    model's blocks as regions (the example only an early first call): it does, unless the
    model has no blocks or the config needs one graph of the whole model (calibration
    batches, whose ranges run the whole graph; torch.export's ``dynamic_shapes`` of the
    model's inputs)."""
    return (config.partition == "auto" and config.dynamic_shapes is None
            and (config.calibration is None or isinstance(config.calibration, (Plan, dict)))
            and bool(block_paths(model)))


def _planned_on_calls(model: nn.Module, example_inputs: Any, config: RewriteConfig
                      ) -> nn.Module:
    """An in-place rewrite planned on the model's calls: its regions (``partition``) in
    block mode, or the whole model; with example inputs, the example is the first call,
    made now (:func:`first_call`)."""
    if config.calibration is not None and not isinstance(config.calibration, (Plan, dict)):
        raise FxampError("calibration_data needs a rewrite of the whole model with "
                         "example_inputs (the batches are checked against the "
                         "example's structure); what to do: pass example_inputs (and "
                         "partition='auto'), or calibrate from a Plan's ranges")
    check_paths(model, config.policy)  # (nothing is traced now: a path's typo is refused now)
    paths = regions(model, config.partition)
    if paths:  # (the module tree stays: each block planned on its first call)
        install_blocks(model, paths, _plan_call, config)
    else:
        install(model, None, _plan_call, config)
    if example_inputs is not None or config.example_kwargs:
        try:
            first_call(model, () if example_inputs is None else as_tuple(example_inputs),
                       dict(config.example_kwargs or {}))
        except BaseException:  # (a failed rewrite leaves the model as it was)
            undo(model)
            raise
    return model


def _planned_now(model: nn.Module, example_inputs: Any, config: RewriteConfig,
                 inplace: bool) -> nn.Module:
    """One graph of the whole model planned now on the example (``config`` resolved for
    the model), returned or (``inplace``) installed as the model's forward."""
    if example_inputs is None and not config.example_kwargs:
        raise FxampError("amp_rewrite needs example_inputs (a tuple of the forward's "
                         "arguments) to know which values are floating tensors; what to do: "
                         "pass e.g. (torch.randn(1, 3, 224, 224),), or rewrite with "
                         "inplace=True, which plans the model on its first call")
    args = () if example_inputs is None else as_tuple(example_inputs)
    gm = _rewrite_top(model, args, config)
    if inplace and config.policy.weights == "stored":
        store_weights(model, gm)
    if inplace:
        return install(model, gm, _plan_call)
    if has_result(gm) and result_of(gm).mode is not None:  # (its other mode: on a call)
        set_result(gm, result_of(gm).replace(other_mode=OtherMode(model, config,
                                                                  _plan_mode)))
    return gm


def regions(model: nn.Module, partition: Any) -> List[str]:
    """The paths of the modules an in-place rewrite plans on their own (``partition``, see
    ``RewriteConfig``): the blocks (``"auto"``), the blocks and the glue's modules
    (``"blocks"``: :func:`glue_parts`), none (``"flat"``: the whole model is one), or the
    outermost modules a function picks.

    Args:
        model: the model rewritten.
        partition: ``"auto"``, ``"blocks"``, ``"flat"`` or ``(path, module) -> bool``.
    """
    if partition == "flat":
        return []
    if not callable(partition):
        paths = block_paths(model)
        if not paths or partition != "blocks":
            return paths
        order = {path: i for i, (path, _) in enumerate(model.named_modules())}
        return sorted(paths + glue_parts(model, paths), key=order.__getitem__)
    picked: List[str] = []
    for path, module in model.named_modules():
        if path and not any(path.startswith(p + ".") for p in picked) and partition(
                path, module):
            picked.append(path)
    return picked


def first_call(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
    """Plan an in-place model now, on its example: the example is its first call, made as
    a call of the user's would be (in the model's mode, with grad), so the plan is the
    one the lazy first call on the same batch would make, text for text. The call changes
    nothing: the RNG states are put back, the buffers' values too (a BatchNorm's
    statistics), the Python objects in the arguments are copies (``isolated``) and the
    output is dropped. A failure is the model's or the plan's, raised as on a first call.

    Args:
        model: the in-place rewritten model, planned on its calls.
        args: the example's positional arguments.
        kwargs: the example's keyword arguments.
    """
    args, kwargs = isolated((args, kwargs))
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model(*args, **kwargs)
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _plan_mode(model: nn.Module, mode: bool, args: tuple, kwargs: Dict[str, Any],
               config: RewriteConfig) -> nn.Module:
    """A returned module's graph for ``mode``, planned on a call in it (``OtherMode``): the
    model it was made from planned as ``_plan_call`` plans, traced in ``mode`` (on its
    shadow: the model's flags stay)."""
    return _plan_call(model, args, kwargs, config, None, mode)


def _plan_call(model: nn.Module, args: tuple, kwargs: Dict[str, Any], config: RewriteConfig,
               why: Optional[str], mode: Optional[bool] = None,
               enclosing: Optional[nn.Module] = None) -> nn.Module:
    """An in-place rewritten model planned, with its config, on a call's arguments: its
    first call without example inputs, a mode or call structure no graph covers (``why``
    None), or a structure change since its plan (``why`` says which). Planned with any
    outer autocast off, grad mode on, outside inference mode, with the model's own call
    hooks off (they ran on this call, and run on the next ones, around the new graph), on
    copies of the call's Python objects (``isolated``), and with the RNG states of the
    CPU and the initialised CUDA devices put back after (the user's run is unchanged);
    returns the new rewritten module (the in-place forward keeps it). ``mode``: traced in
    that training mode rather than the model's; ``enclosing``: the whole model, where
    ``model`` is one of its regions (``weights=stored`` keeps a weight tied outside it)."""
    name = type(model).__name__
    if why is None:
        log.info("%s: planning %s on this call (%s mode)", name,
                 "its glue (its own forward around its regions)" if config.regions else "it",
                 "train" if (model.training if mode is None else mode) else "eval")
    else:
        log.warning("%s changed after its in-place rewrite (%s): planning it again on this "
                    "call's inputs", name, why)
    with planning_in_fp32(model) as swaps:  # (weights=stored: planned as the FP32 model)
        try:
            check_model(model, sharded_ok=True, calls=config.regions)
        except UnsupportedModelError as err:
            if why is None or getattr(err, "cause_named", False):
                raise
            raise UnsupportedModelError(f"{name} changed after its in-place rewrite ({why}) "
                                        f"and cannot be planned again: {err}") from None
        args, kwargs = isolated((args, kwargs))
        config = config.replace(example_kwargs=dict(kwargs) or None).for_model(
            model, (args, kwargs))
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with AutocastOff(list(DEVICES)), torch.inference_mode(False), torch.enable_grad(), \
                torch.random.fork_rng(devices=devices), _own_saved_tensors():
            gm = _rewrite_top(model, args, config, on_call=True, mode=mode)
    if config.policy.weights == "stored":  # (a block's weights tied outside it stay)
        restore_stored(model, gm, swaps)
        store_weights(model, gm, enclosing)
    return gm


def _keep(value: Any) -> Any:
    return value


def _own_saved_tensors() -> Any:
    """The tensors planning's runs of the model save for backward kept as they are, out of
    any saved-tensor hooks the call is made under: a block's first call inside a
    non-reentrant ``torch.utils.checkpoint`` (whose hooks count and drop what the forward
    saves, and whose recompute, running the plan alone, must save as many)."""
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def isolated(value: Any) -> Any:
    """A call's arguments for planning on that call: the Python objects in them copied (a
    KV cache the model's code appends to), tensors, modules and functions shared, so the
    runs of the model's code a plan may make (the eager front end's, the FP32 check of a
    failed plan) leave the caller's objects as they were. ``value`` itself when it cannot
    be copied.

    Args:
        value: the call's ``(args, kwargs)``.
    """
    memo: Dict[int, Any] = {}
    seen: set = set()

    def share(v: Any, depth: int) -> None:
        if id(v) in seen or depth > 8:
            return
        seen.add(id(v))
        if isinstance(v, (torch.Tensor, nn.Module, type)) or callable(v) and not hasattr(
                v, "__dict__"):
            memo[id(v)] = v
        elif isinstance(v, (list, tuple, set, frozenset)):
            for x in v:
                share(x, depth + 1)
        elif isinstance(v, dict):
            for x in v.values():
                share(x, depth + 1)
        elif hasattr(v, "__dict__"):
            for x in vars(v).values():
                share(x, depth + 1)

    share(value, 0)
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # noqa: BLE001 - an object that cannot be copied: planned as given
        return value


def _rewrite_top(model: nn.Module, args: tuple, config: RewriteConfig,
                 on_call: bool = False, mode: Optional[bool] = None) -> nn.Module:
    """The top-level rewrite: the model is left exactly as it was, and the FP32 model's own
    error is raised when it fails on the example inputs.

    What is traced is a shadow of the model's module tree (``frontends/shadow.py``: no
    other thread sees the trace swap or set anything on the model's modules); the result
    holds the model's own modules. ``on_call``: an in-place model planned on one of its
    calls (its call hooks run around the new graph, not in it). ``mode``: traced in that
    training mode (the shadow's: the model's flags stay)."""
    with _torch.tracing():  # another thread's rewrite waits (see _torch.TRACE_PATCHES)
        shadow = Shadow(model, on_call)
        for path in config.regions:  # (each traced as a call: run as its class's code)
            shadow.bare(path)
        if mode is not None:  # (flags only: the returned module's train() or eval(), which
            for module in shadow.root.modules():  # reached the model's modules, ran their
                module.training = mode  # own train() there; its shadows copy what it set)
        try:
            with parts_off(shadow.root):  # (the shadow's parts: the model's keep theirs)
                gm = _rewrite_locked(shadow.root, args, config)
            return shadow.to_real(gm)
        finally:
            shadow.release()


def _rewrite_locked(model: nn.Module, args: tuple, config: RewriteConfig) -> nn.Module:
    pol, example_kwargs = config.policy, config.example_kwargs
    check_global_hooks()
    state = ModelState(model, config.regions)
    grad = torch.is_grad_enabled()
    try:
        with state.watch(), young_objects_only():
            try:
                return rewrite(model, args, config)  # (its result holds the config)
            except Exception:
                # when the FP32 model itself fails on the example inputs, that is the cause:
                # report the model's own error, not the tracer's (checked only on failure:
                # one forward costs as much as a rewrite of a large model; not for block
                # mode's glue, whose failed call runs under autocast, raising the model's)
                state.restore()
                if config.regions:
                    raise
                problem = check_example_inputs(model, args, dict(example_kwargs or {}),
                                               pol.compute)
                if problem is None:
                    raise
                raise problem from problem.__cause__
    finally:
        torch.set_grad_enabled(grad)
        state.restore()
        report_side_effects(model, state.restored)


def _kept(config: RewriteConfig, plan: Plan) -> RewriteConfig:
    """The config a top-level result keeps: calibration data replaced by the ranges it gave
    (``plan``'s)."""
    if config.calibration is None or isinstance(config.calibration, dict):
        return config
    return config.replace(calibration=dict(plan.ranges))


def rewrite(model: nn.Module, inputs: tuple, config: RewriteConfig,
            fixed: Optional[Dict[str, Tuple[torch.dtype, str, str]]] = None,
            scope: Optional[Scope] = None) -> fx.GraphModule:
    """The pipeline behind amp_rewrite (one ``Rewrite``). ``fixed`` maps node names to
    (dtype, rule, reason) decisions made outside the passes (the tolerance search).
    ``scope``: the override record of the enclosing rewrite's submodule this one is (none:
    a top-level rewrite, which raises PolicyError when an override matches no node)."""
    with _torch.tracing(), _torch.spelling_names():  # (GraphModules compiled while tracing)
        gm = Rewrite(model, inputs, config, fixed,
                     scope or Scope(elsewhere=frozenset(config.elsewhere))).run()
    _torch.spell_names(gm)  # (and when recompiled, copied or unpickled later)
    return gm


def _assemble(model: nn.Module, inputs: tuple, kwargs: Dict[str, Any],
              config: RewriteConfig, captured: Children, scope: Scope) -> nn.Module:
    """A front end that keeps the model's forward (eager): each child is rewritten on its
    own and the model is assembled from them; when none can be, the front ends' error."""
    # each child is planned for what it gets at run time: its inputs under the root's
    # autocast (a bf16 activation into a dropout stays bf16, as under autocast); where that
    # fails (a kernel without bf16, a submodule run on them outside autocast), the FP32
    # model's inputs, cast to FP32 on entry
    under = submodule_calls(model, captured.paths, inputs, kwargs, config.policy.compute)
    # (an HF layer that checkpoints itself is rewritten without: its rewritten call is
    # checkpointed at run time as the layer's flag then says)
    with layers_off(model.get_submodule(p) for p in captured.paths):
        children = _rewrite_submodules(model, captured.paths, under, config,
                                       "is planned for FP32 inputs instead", scope)
        fp32 = _rewrite_submodules(model, [p for p in captured.paths if p not in children],
                                   captured.calls, config, "stays under autocast", scope)
    children.update(fp32)
    try:
        result = eager_root(model, inputs, kwargs, config.policy,
                            {p: under.get(p, c) if p not in fp32 else c
                             for p, c in captured.calls.items()}, children,
                            _header(config.policy, captured.frontend), fp32_inputs=list(fp32),
                            autocast_calls=under, why=plan_reason(captured.refused),
                            config=config if scope.top else None)
    except FxampError:
        if captured.refused is None:
            raise
        raise captured.refused from None
    if scope.top:
        check_matched(config.policy, scope, plan_lines(plan_of(result).nodes))
    refuse_copies(result, "eager")
    log.warning("%s: no tracer takes its forward; it runs eagerly under torch.autocast "
                "with its children rewritten (%s)", type(model).__name__,
                plan_of(result).header.get("nested", ""))
    return result


class Rewrite:
    """One rewrite of one model, its state in fields and its steps as methods, in order:
    ``capture`` (a front end's graph, or the children of an eager root), ``decide``
    (the pass list: every node's precision), ``build`` (the plan, the result on the
    rewritten module), ``result``."""

    def __init__(self, model: nn.Module, inputs: tuple, config: RewriteConfig,
                 fixed: Optional[Dict[str, Tuple[torch.dtype, str, str]]],
                 scope: Scope) -> None:
        self.model, self.example, self.config = model, inputs, config
        self.kwargs = dict(config.example_kwargs or {})
        self.fixed, self.scope = fixed or {}, scope
        self.state = ModelState(model, config.regions)  # put back after every run of the
        # model's code (not its regions', kept as calls)
        self.nested: Dict[str, Plan] = {}
        self.captured: Any = None
        self.ctx: Optional[PassContext] = None
        self.gm: Optional[fx.GraphModule] = None

    def run(self) -> fx.GraphModule:
        """The steps in order; an eager root is assembled from its rewritten children."""
        self.capture()
        if isinstance(self.captured, Children):
            return _assemble(self.model, self.example, self.kwargs, self.config,
                             self.captured, self.scope)  # type: ignore[return-value]
        # (the passes run the graph's module calls, on fake tensors or calibration batches:
        # with the shadows' hooks off, no hook of the user's sees those runs)
        with without_call_hooks(list(self.captured[0].modules())[1:]):
            self.decide()
        self.build()
        return self.result()

    def capture(self) -> None:
        """The front end's capture; untraceable leaves rewritten on their own."""
        pol, calibration = self.config.policy, self.config.calibration
        if is_deploy(pol.target) and self.model.training and reads_training(self.model):
            log.warning("%s is in train mode: a deployment plan (target=%s) is traced in eval "
                        "mode once, so where the traced code reads `training` the rewritten "
                        "model keeps the eval-mode branch in either mode (export_onnx exports "
                        "in eval mode)", type(self.model).__name__, pol.target)
        try:  # decisions fixed by node name and calibration need one graph of the model
            self.captured = capture_model(
                self.model, self.example, self.kwargs, self.config.frontend, self.state,
                _capture_shapes(self.config),
                whole_graph=_needs_graph(self.fixed, calibration) or is_deploy(pol.target),
                inference=is_deploy(pol.target), compute=pol.compute,
                settled=mask_fill.settles if mask_fill.applies(pol) else None,
                regions=self.config.regions)
        except TraceError:
            self.state.restore()
            raise
        if isinstance(self.captured, Children):
            return
        src, _, _, leaves = self.captured
        front = graph_frontend(self.captured)
        hooked = front.runtime_calls(self.captured)
        mark_regions(src, self.config.regions)
        if hooked:
            log.info("%s: modules with hooks stay calls run under torch.autocast: %s",
                     type(self.model).__name__, ", ".join(hooked))
        if leaves:
            self.nested = _rewrite_leaves(self.model, src, leaves, self.example, self.kwargs,
                                          self.config, self.scope)
        runtime = [leaf for leaf in leaves if leaf not in self.nested]
        if runtime:
            log.warning("%s: torch.fx and torch.export cannot take %s; they run under "
                        "torch.autocast at run time (rule 'runtime')", type(self.model).__name__,
                        ", ".join(runtime))

    def decide(self) -> None:
        """The pass list over the captured graph: every node decided, casts inserted."""
        pol = self.config.policy
        src, _, flat, _ = self.captured
        calibration = self.config.calibration
        if calibration is not None and not isinstance(calibration, (Plan, dict)):
            calibration = graph_frontend(self.captured).calibration(self.captured, calibration)
        if is_deploy(pol.target) and not isinstance(calibration, (Plan, dict)):
            # a deployment plan's ranges: the example inputs, then any calibration batches
            calibration = [tuple(flat)] + list(calibration or [])
        for name, (dtype, rule, reason) in self.fixed.items():
            node = next((n for n in src.graph.nodes if n.name == name), None)
            if node is None:
                raise FxampError(f"no node named {name!r} in the traced graph")
            fix(node, dtype, rule, reason)
        self.ctx = PassContext(pol, flat, calibration=_calibration(calibration),
                               ranges=_given_ranges(calibration), state=self.state,
                               scope=self.scope, nested=self.nested,
                               rules=self.config.rules)
        self.gm = PassManager(pass_list())(src, self.ctx).graph_module  # (compiled)

    def build(self) -> None:
        """The plan and the result on the rewritten module; the model's flags, state,
        hooks and front-end finishing touches."""
        assert self.gm is not None and self.ctx is not None
        pol, model, gm = self.config.policy, self.model, self.gm
        src, taken, _, leaves = self.captured
        nodes = plan_nodes(src, self.nested)
        given = self.ctx.ranges or {}
        stats = {name: r for name, r in given.items() if name in nodes}
        if len(stats) < len(given):  # (a reused plan of an older model, say)
            log.info("%s: ranges for nodes the graph does not have are left out: %s",
                     type(model).__name__, ", ".join(sorted(set(given) - set(stats))))
        header = _header(pol, taken, leaves, self.nested)
        if self.scope.top:
            header = top_header(model, pol, header, nodes)
        plan = Plan(nodes=nodes, header=header, ranges=stats)
        mode = src.meta.get(MODE) if hasattr(src, "meta") else None
        if mode is None:  # (a nested part traced for one mode only makes the graph so)
            mode = one_mode(src.get_submodule(path) for path in self.nested)
        _copy_training_flags(model, gm)
        complete_state(model, gm)
        copy_root_hooks(model, gm)
        entry = graph_frontend(self.captured).finish(gm, self.captured, model, self.example,
                                                     self.kwargs)
        share_modules(gm, model)  # the graph reads the model's own modules
        set_result(gm, Rewritten(plan, pol, ops.module_label(model),
                                 _kept(self.config, plan) if self.scope.top else None,
                                 Structure(model, gm, hooked_paths(gm),
                                           regions=self.config.regions), entry, mode))
        if taken == "export":  # (torch's exported graphs hold local objects: deepcopy works)
            refuse_copies(gm, taken, deepcopy=False)

    def result(self) -> fx.GraphModule:
        """The rewritten module."""
        assert self.gm is not None
        return self.gm


def _capture_shapes(config: RewriteConfig) -> Any:
    """torch.export's ``dynamic_shapes`` for the capture: the user's; else, for a deployment
    plan without calibration batches, every dimension as the example has it (``export_onnx``
    writes the file for the example's shapes, and a static export costs a third to a half
    of one with a symbolic batch and sequence); else None (the front end's default)."""
    if config.dynamic_shapes is not None or not is_deploy(config.policy.target):
        return config.dynamic_shapes
    if config.calibration is None or isinstance(config.calibration, (Plan, dict)):
        return STATIC_SHAPES
    return None  # (calibration batches may have other sizes than the example)


def _needs_graph(fixed: Any, calibration_data: Any) -> bool:
    """Decisions fixed by node name and calibration data need one graph of the whole model
    (the eager front end gives none)."""
    if fixed:
        return True
    if calibration_data is None:
        return False
    try:
        return bool(calibration_data)
    except Exception:  # noqa: BLE001 - no truth value (a tensor, an iterable loader)
        return True


def _given_ranges(data: Any) -> Optional[Dict[str, RangeStats]]:
    """The range statistics given as a Plan or a dict (None: collected from batches)."""
    if data is None:
        return {}
    if isinstance(data, Plan):
        return dict(data.ranges)
    if isinstance(data, dict):
        return dict(data)
    return None


def _calibration(data: Any) -> Any:
    """Calibration batches to collect ranges from (None when statistics were given)."""
    return None if data is None or isinstance(data, (Plan, dict)) else data


def _copy_training_flags(model: nn.Module, gm: fx.GraphModule) -> None:
    """Give gm and the container modules fx made for it the model's training flags,
    leaving the modules it shares with the model (a frozen BatchNorm, say) as they are."""
    shared = {id(m) for m in model.modules()}
    originals = dict(model.named_modules())
    for name, module in gm.named_modules():
        if id(module) not in shared and name in originals:
            module.training = originals[name].training
    gm.training = model.training
