"""Components a recipe names: a registered short name or ``package.module:callable``, with keyword
arguments from the recipe (``model: {name: mypkg.nets:MyNet, args: {width: 64}}``).

``check`` validates a component at load time (module, attribute, callable, keyword arguments,
annotated types) and records each mistake as a problem naming the recipe key; ``build`` calls it.
The runner fills in the keyword arguments it knows (``provided``: e.g. ``num_classes``) when the
callable accepts them and the recipe does not set them. A callable with a ``check_args(args)``
attribute also checks the values of its arguments (returning the problems, one per line).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

# kind -> short name -> "module:attribute"; imported only when used
REGISTRY: dict[str, dict[str, str]] = {
    "model": {
        "resnet18_cifar": "distlib.runner.models.vision:resnet18_cifar",
        "small_cnn": "distlib.runner.models.vision:small_cnn",
        "gpt": "distlib.runner.models.gpt:gpt",
        "hf_causal_lm": "distlib.runner.models.hf_causal_lm:hf_causal_lm",
    },
    "data": {
        "image_folder": "distlib.runner.data.images:load_image_set",
        "byte_text": "distlib.runner.data.text:load_byte_text",
        "token_file": "distlib.runner.data.token_files:load_token_file",
        "chat": "distlib.runner.data.chat:load_chat",
    },
    "loss": {
        "cross_entropy": "distlib.runner.tasks.losses:cross_entropy",
    },
}


def is_builtin(kind: str, name: str) -> bool:
    return name in REGISTRY[kind]


def resolve(kind: str, name: str) -> Callable[..., Any]:
    """The callable that ``name`` (short name or ``module:attribute``) stands for; raises
    ValueError saying what is wrong."""
    target = REGISTRY[kind].get(name, name)
    if ":" not in target:
        close = difflib.get_close_matches(name, REGISTRY[kind], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown {kind} {name!r}: expected one of {', '.join(REGISTRY[kind])} or an import path "
            f"'package.module:callable'{hint}"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"module {module_name!r} not found ({e}); is its folder on PYTHONPATH?") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target!r} is a {type(obj).__name__}, not callable")
    return obj


def _type_ok(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits a simple annotation; anything not understood passes."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    return True


def check(
    kind: str,
    key: str,
    name: str,
    args: Mapping[str, Any],
    problems: list[str],
    provided: Mapping[str, Any] = {},
    positional: int = 0,
) -> Callable[..., Any] | None:
    """Resolve ``name`` and check ``args`` (with the runner's ``provided`` ones) against its
    signature; each mistake is appended to ``problems`` naming the recipe ``key``. ``positional``:
    how many leading arguments the runner passes at each call (a loss's outputs and targets).
    Returns the callable, or None when it cannot be used."""
    try:
        fn = resolve(kind, name)
    except ValueError as e:
        problems.append(f"{key}.name: {e}")
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return fn
    try:
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # an annotation that does not evaluate: check names only
        hints = {}
    params = dict(list(sig.parameters.items())[positional:])
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for arg, value in args.items():
        if arg not in params or params[arg].kind not in (params[arg].POSITIONAL_OR_KEYWORD, params[arg].KEYWORD_ONLY):
            if var_kw:
                continue
            close = difflib.get_close_matches(str(arg), named, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{key}.args.{arg}: {name} takes no argument {arg!r} (it takes: {', '.join(named)}){hint}")
            continue
        annotation = hints.get(arg, params[arg].annotation)
        if isinstance(annotation, str) or not _type_ok(value, annotation):
            if not isinstance(annotation, str):
                shown = getattr(annotation, "__name__", str(annotation))
                problems.append(f"{key}.args.{arg}: expected {shown}, got {value!r}")
    for arg, p in params.items():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty:
            if arg not in args and arg not in provided:
                problems.append(f"{key}.args: {name} needs the argument {arg!r}; add {key}.args.{arg}")
    if callable(own := getattr(fn, "check_args", None)):  # its arguments' values, beyond their types
        problems.extend(own(args))
    return fn


def build(kind: str, name: str, args: Mapping[str, Any], provided: Mapping[str, Any] = {}) -> Any:
    """Call the component with the recipe's ``args``, and the ``provided`` ones it accepts that
    the recipe does not set."""
    fn = resolve(kind, name)
    return fn(**{**accepted(fn, provided), **args})


def accepted(fn: Callable[..., Any], provided: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``provided`` that ``fn`` takes as keyword arguments."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    # by name only: a **kwargs callable is not handed arguments it never asked for
    return {k: v for k, v in provided.items() if k in params and params[k].kind is not params[k].VAR_POSITIONAL}
