"""One loader for every user function a recipe names: rewards, TIS functions, policy losses.

A recipe names a function in one of three forms, the same for every key:

- ``package.module.function``: Relax's dotted form (the module part is imported, the last part looked up);
- ``package.module:function``: the same with the split made explicit;
- ``path/to/file.py:function``: a Python file, loaded on its own; a relative path is relative to the
  directory you submit from (the roles' working directory), so a run can carry its own loss or reward
  without making it an installed package.

Why one loader: each key used to parse, import and report errors its own way, so the same typo gave
three different messages, some of them at step 1 after the job had queued. Here every failure is a
:class:`PluginError` whose message names the recipe key, the value and the fix, in one shape:

    algorithm.custom_loss_path = 'my_losses.pg': module 'my_losses' has no attribute 'pg'. Fix: ...

and :func:`load_plugin` is what both the roles (at first use) and the recipe validator (before submit)
call, so what validates is what runs.

Pure standard library: the recipe validator imports this on the login node. Importing the *user's* module
may of course import torch.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

from relax_hpc.errors import PermanentError

FORMS = "'package.module.function', 'package.module:function' or 'path/to/file.py:function'"
"""The accepted forms, as error messages spell them."""

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Kind = Literal["syntax", "module", "dependency", "import", "attribute", "callable", "signature"]


class PluginError(ValueError, PermanentError):
    """A recipe key names a function that cannot be used. ``str(e)`` is ``"key = value: problem. Fix: fix"``.

    ``kind`` says which check failed: ``syntax`` (not one of the three forms), ``module`` (the module or
    file does not exist), ``dependency`` (it exists but imports something missing here), ``import`` (it
    raised while being imported), ``attribute`` (no such name in it), ``callable`` (the name is not a
    function), ``signature`` (it cannot be called the way relax_hpc calls it). A ValueError so that code
    catching the old loaders' errors keeps working; the subclasses add ImportError / TypeError. Permanent
    (:mod:`relax_hpc.errors`): the function loads the same way after a restart, so the run fails at once.
    """

    def __init__(self, key: str, value: Any, problem: str, fix: str, *, kind: Kind) -> None:
        self.key, self.value, self.problem, self.fix, self.kind = key, value, problem, fix, kind
        super().__init__(f"{key} = {value!r}: {self.message}")

    @property
    def message(self) -> str:
        """The message without ``key = value:``, for the recipe validator, which shows those itself."""
        return f"{self.problem}. Fix: {self.fix}"


class PluginImportError(PluginError, ImportError):
    """The module, the file or the name in it cannot be found or imported."""


class PluginTypeError(PluginError, TypeError):
    """The name is found but is not a function relax_hpc can call."""


@dataclass(frozen=True)
class PluginSpec:
    """A parsed function reference: ``module`` a dotted module name, or ``file`` a path as written."""

    kind: Literal["module", "file"]
    target: str
    attr: str


def parse_spec(spec: Any, key: str) -> PluginSpec:
    """The form of ``spec`` without importing anything (the recipe's type pass calls this on every load)."""

    def bad(problem: str) -> PluginError:
        return PluginError(key, spec, problem, f"use {FORMS}, e.g. my_pkg.rewards.reward_func or "
                                               "recipes/examples/custom_loss.py:my_loss", kind="syntax")

    if not isinstance(spec, str) or not spec:
        raise bad("is not a function reference")
    if any(c.isspace() for c in spec):
        raise bad("contains whitespace")
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        if not _IDENT.fullmatch(attr):
            raise bad(f"the part after ':' must be a function name, not {attr!r}")
        if target.endswith(".py") or "/" in target or "\\" in target:
            if not target.endswith(".py"):
                raise bad(f"{target!r} looks like a file path but does not end in .py")
            return PluginSpec("file", target, attr)
        if not _dotted(target):
            raise bad(f"{target!r} before ':' is neither a module name nor a .py file")
        return PluginSpec("module", target, attr)
    if spec.endswith(".py"):
        raise bad("names a file but no function in it (add ':function_name')")
    module, _, attr = spec.rpartition(".")
    if not module or not _dotted(module) or not _IDENT.fullmatch(attr):
        raise bad("is not a dotted path with a module and a function")
    return PluginSpec("module", module, attr)


def load_plugin(spec: str, key: str, *, params: Sequence[str] | None = None, keywords: Sequence[str] = (),
                base: str | Path | None = None) -> Callable[..., Any]:
    """The function ``spec`` names, checked; raises :class:`PluginError` naming ``key``, ``spec`` and the fix.

    ``params`` / ``keywords``: the positional and keyword arguments relax_hpc will pass; when given, the
    function's signature must accept exactly that call (``inspect.signature(fn).bind``), so a function
    written for another contract fails here and not inside a training step. ``base``: the directory a
    relative file path is resolved against and, for a dotted module, put first on ``sys.path`` while
    importing; the validator passes the submit directory, which becomes the roles' working directory
    (``python -m`` puts it on their path). Default: the current directory, ``sys.path`` unchanged.
    """
    p = parse_spec(spec, key)
    if p.kind == "file":
        module, where = _import_file(p, spec, key, base)
    else:
        module, where = _import_module(p, spec, key, base), f"module {p.target!r}"
    fn = getattr(module, p.attr, _ABSENT)
    if fn is _ABSENT:
        raise PluginImportError(key, spec, f"{where} has no attribute {p.attr!r}{_near(module, p.attr)}",
                                "check the name after the last '.' or ':' (a function defined at the top level "
                                "of that module)", kind="attribute")
    if not callable(fn):
        raise PluginTypeError(key, spec, f"{p.attr!r} in {where} is a {type(fn).__name__}, not a function",
                              "name a function (def or async def) or another callable", kind="callable")
    if params is not None or keywords:
        check_signature(fn, spec, key, tuple(params or ()), tuple(keywords))
    return fn


def check_signature(fn: Callable[..., Any], spec: str, key: str, params: tuple[str, ...],
                    keywords: tuple[str, ...] = ()) -> None:
    """Raise :class:`PluginTypeError` if ``fn(*params, **keywords)`` would be a TypeError before it even ran.

    Functions without an introspectable signature (some builtins, C extensions) pass: they are called as is.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*params, **{k: None for k in keywords})
    except TypeError as e:
        want = ", ".join(params) + (", *, " + ", ".join(keywords) if keywords else "")
        name = getattr(fn, "__name__", "fn")
        raise PluginTypeError(key, spec, f"{name}{_bare(sig)} cannot be called as {name}({want}) ({e})",
                              f"define it as def {name}({want}) (extra parameters need defaults; **kwargs is "
                              "fine)", kind="signature") from None


def _bare(sig: inspect.Signature) -> inspect.Signature:
    """The signature without annotations: the parameter list is what the message is about."""
    empty = inspect.Parameter.empty
    return sig.replace(parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)


# --------------------------------------------------------------------------------------------------
# importing
# --------------------------------------------------------------------------------------------------

_ABSENT = object()


def _dotted(name: str) -> bool:
    return all(_IDENT.fullmatch(part) for part in name.split("."))


@contextmanager
def _on_path(base: str | Path | None) -> Iterator[None]:
    """``base`` first on sys.path for the import (as ``python -m`` does for the roles), then removed again."""
    if base is None:
        yield
        return
    entry = str(Path(base).resolve())
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _import_module(p: PluginSpec, spec: str, key: str, base: str | Path | None) -> Any:
    try:
        with _on_path(base):
            return importlib.import_module(p.target)
    except ModuleNotFoundError as e:
        if e.name and _is_prefix(e.name, p.target):
            raise PluginImportError(key, spec, f"cannot import module {p.target!r} ({e})",
                                    "check the spelling, and that the module is importable where the role runs "
                                    "(on PYTHONPATH, or in the directory you submit from); or give a file, "
                                    "'path/to/file.py:function'", kind="module") from e
        raise _dependency_error(key, spec, f"module {p.target!r}", e) from e
    except Exception as e:
        raise _raised_error(key, spec, f"module {p.target!r}", e) from e


def _import_file(p: PluginSpec, spec: str, key: str, base: str | Path | None) -> tuple[Any, str]:
    """Load a .py file as a module named after its absolute path: the same file is one module per process
    (loaded once, however many keys or calls name it), two files with the same name do not collide."""
    root = Path.cwd() if base is None else Path(base)
    path = Path(p.target).expanduser()
    path = (path if path.is_absolute() else root / path).resolve()
    where = f"file {str(path)!r}"
    if not path.is_file():
        raise PluginImportError(key, spec, f"there is no file {str(path)!r} (a relative path is relative to the "
                                f"directory you submit from, {root})",
                                "give an existing .py file, absolute or relative to where you run relax-submit",
                                kind="module")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"relax_hpc_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name], where
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:  # pragma: no cover - a .py file always has a loader
        raise PluginImportError(key, spec, f"{where} cannot be loaded as Python", "give a .py file", kind="import")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        del sys.modules[name]
        raise _dependency_error(key, spec, where, e) from e
    except Exception as e:
        del sys.modules[name]
        raise _raised_error(key, spec, where, e) from e
    return module, where


def _is_prefix(name: str, module: str) -> bool:
    """Whether the missing module ``name`` is ``module`` itself or one of its parent packages."""
    return module == name or module.startswith(name + ".")


def _dependency_error(key: str, spec: str, where: str, e: ModuleNotFoundError) -> PluginImportError:
    fix = f"install {e.name!r} where the role runs, or remove that import"
    if e.name and (e.name == "relax" or e.name.startswith("relax.")):
        fix = ("code written for Relax imports relax.*: change `from relax.utils.types import Sample` to "
               "`from relax_hpc.rollout.sample import Sample` (or drop it: the sample is passed in), and import "
               "other helpers from relax_hpc")
    return PluginImportError(key, spec, f"{where} was found, but importing it failed: {e}", fix, kind="dependency")


def _raised_error(key: str, spec: str, where: str, e: BaseException) -> PluginImportError:
    line = ""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if isinstance(e, SyntaxError) and e.lineno:
        line = f" (line {e.lineno})"
    elif tb is not None:
        line = f" (line {tb.tb_lineno} of {tb.tb_frame.f_code.co_filename})"
    return PluginImportError(key, spec, f"importing {where} raised {type(e).__name__}: {e}{line}",
                             "fix the error in that module", kind="import")


def _near(module: Any, attr: str) -> str:
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
    near = difflib.get_close_matches(attr, names, n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""
