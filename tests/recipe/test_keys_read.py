"""Every recipe key does something: each leaf of the schema (:func:`relax_hpc.recipe.validate.schema_keys`) is read
by the code that runs, or is refused at validation for any value but its default.

How "read" is found, without running anything: an AST scan of ``relax_hpc/`` for ``X.<field>`` (or
``getattr(X, "<field>")``, also through a loop over string constants) where ``X`` is the key's own section: an
attribute of that section's field name (``recipe.rollout.max_turns``, ``g.elastic.initial``), a call of a method
that returns it (``recipe.role(name).nodes``), or a name bound to one of those or annotated with the section's class
(``ro = recipe.rollout``, ``cfg: AlgorithmConfig``); also a call given a section and the field's name
(``positive_seconds(cfg, "reward_timeout_s")``). So ``lengths.max()`` does not count as reading
``roles.rollout.elastic.max``. Not counted: the validator (``relax_hpc/recipe/validate.py``) and the check modules
beside the configs (:data:`NOT_SCANNED`), the schema, the functions the validator calls to judge values
(:data:`VALIDATORS`), values handed on to a user's function as
Relax's ``args`` (:data:`PASS_THROUGH`), and ``dataclasses.asdict`` of a section unless the module reads that
section whole, field by field (:data:`WHOLE_SECTIONS`; ``relax_args`` hands every ``algorithm`` key to a user's
reward function that way, which is not the run using it). A field counts per class: ``RoleGroup.mem`` read for one
role is read for all.

A key added to the schema that nothing reads fails here: read it, or refuse its non-default values at validation
and list it in :data:`REFUSED_UNLESS_DEFAULT` (the test checks that validation does refuse them).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

import pytest

from relax_hpc.recipe import RecipeError, recipe_from_dict
from relax_hpc.recipe.schema import Recipe
from relax_hpc.recipe.validate import schema_keys

PKG = Path(__file__).resolve().parents[2] / "relax_hpc"
# the validator, the schema, and the checks each config owns (what they read judges values, acts on none)
NOT_SCANNED = {"recipe/validate.py", "recipe/schema.py", "rollout/config.py", "rollout/checks.py", "launch/files.py",
               "engines/config.py"}
# functions that judge values for the validator (it imports them) rather than act on them
VALIDATORS = {"algo/config.py": {"check", "_plugin_form", "check_opd"},
              "train/config.py": {"check", "check_batch", "check_train_offload", "check_lora_adapter_mode",
                                  "check_lora_reference"},
              "ops/wandb_log.py": {"check", "credential_problems"}}
# functions that hand recipe values on to a user's function as keyword arguments (Relax's ``args``): a key that only
# reaches ``args`` there does nothing in the run, so those arguments are not reads
PASS_THROUGH = {"rollout/rewards/runner.py": {"relax_args"}}
# sections a module reads whole (``dataclasses.asdict``), field by field into something that acts on each
WHOLE_SECTIONS = {"AttachDefaults": ("launch/attach.py", "relax-scale's sbatch options where it gives none: "
                                                         "AttachOptions.from_dict(asdict(...)) takes every field")}

# key -> (a value that is not the default, why it is kept in the schema at all)
REFUSED_UNLESS_DEFAULT = {
    "algorithm.kl_coef": (0.01, "Relax's flag, which its GRPO family (the estimators relax_hpc has) ignores: "
                                "scripts that pass --kl-coef 0 carry over, any other value is refused"),
    "roles.rollout.elastic.max": (3, "the component's size is roles.rollout.nodes; refused with that fix rather than "
                                     "as an unknown key, whose hint would point at rollout.elastic.autoscale.max"),
}


def _dataclass_of(tp: typing.Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def _leaves() -> dict[str, tuple[type, str]]:
    """Every leaf key of the schema: key -> (the dataclass that holds it, its field name)."""
    out: dict[str, tuple[type, str]] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            sub = _dataclass_of(tp)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = (cls, name)

    walk(Recipe, "")
    return out


def _sections() -> tuple[dict[str, set[type]], dict[str, set[type]], dict[tuple[type, str], type]]:
    """(field name -> the section classes a field of that name holds, method name -> the section classes it
    returns, (section, field) -> the section the field holds), over every dataclass of the schema."""
    fields: dict[str, set[type]] = {}
    methods: dict[str, set[type]] = {}
    types: dict[tuple[type, str], type] = {}
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for name, tp in typing.get_type_hints(cls).items():
            sub = _dataclass_of(tp)
            if sub is not None:
                fields.setdefault(name, set()).add(sub)
                types[cls, name] = sub
                walk(sub)
        for name, fn in vars(cls).items():
            if callable(fn) and not name.startswith("__"):
                ret = _dataclass_of(typing.get_type_hints(fn).get("return"))
                if ret is not None:
                    methods.setdefault(name, set()).add(ret)

    walk(Recipe)
    fields.setdefault("recipe", set()).add(Recipe)  # self.recipe, run.recipe: the whole recipe by its usual name
    return fields, methods, types


class _Scan:
    """The section classes names and attributes may hold, over all of ``relax_hpc/``, then the fields read.

    An attribute of a known section has that field's type (``recipe.rollout.elastic`` is ElasticConfig,
    ``g.elastic`` of a RoleGroup is ElasticNodes). Names (``ro``, ``g``) are bound per module, ``self.<attr>`` per
    class, and other attributes (``driver.cfg``, ``RoleStep.group``) over the whole package, from assignments to
    them and class-body annotations."""

    def __init__(self, trees: dict[str, ast.Module]):
        self.trees = trees
        fields, self.methods, self.types = _sections()
        self.classes = {c.__name__: c for cs in [*fields.values(), *self.methods.values()] for c in cs}
        self.attrs: dict[str, set[type]] = {k: set(v) for k, v in fields.items()}
        self.own: dict[tuple[str, str, str], set[type]] = {}  # (module, class, attr) -> sections of self.<attr>
        self.where: dict[int, str] = {id(n): c.name for m, t in trees.items() for c in ast.walk(t)
                                      if isinstance(c, ast.ClassDef) for n in ast.walk(c)}  # innermost last
        self.names: dict[str, dict[str, set[type]]] = {m: {} for m in trees}
        self.loops: dict[str, dict[str, list[str]]] = {m: _loop_strings(t) for m, t in trees.items()}
        self.whole: dict[str, set[type]] = {m: set() for m in trees}  # dataclasses.asdict(<section>) per module
        changed = True
        while changed:  # to a fixed point: aliases of aliases, across modules
            changed = False
            for m, tree in trees.items():
                for n in ast.walk(tree):
                    changed |= self._binding(m, n)

    def _binding(self, m: str, n: ast.AST) -> bool:
        if isinstance(n, ast.arg):
            return self._bind(m, ast.Name(n.arg), self._annotated(n.annotation))
        if isinstance(n, ast.AnnAssign):
            return self._bind(m, n.target, self._annotated(n.annotation) | self.of(m, n.value))
        if isinstance(n, ast.Assign):
            return any([self._bind(m, t, self.of(m, n.value)) for t in n.targets]
                       + [self._bind(m, t, self.of(m, v)) for t in n.targets if isinstance(t, ast.Tuple)
                          and isinstance(n.value, ast.Tuple) and len(t.elts) == len(n.value.elts)
                          for t, v in zip(t.elts, n.value.elts)])
        if isinstance(n, ast.NamedExpr):
            return self._bind(m, n.target, self.of(m, n.value))
        if isinstance(n, (ast.For, ast.comprehension)):
            return self._bind(m, n.target, self.of(m, n.iter))
        return False

    def _bind(self, m: str, target: ast.AST, kinds: set[type]) -> bool:
        if not kinds:
            return False
        if isinstance(target, ast.Name):
            have = self.names[m].setdefault(target.id, set())
        elif isinstance(target, ast.Attribute):
            have = self.attrs.setdefault(target.attr, set())
            if _is_self(target) and id(target) in self.where:  # and precisely, for self.<attr> in that class
                mine = self.own.setdefault((m, self.where[id(target)], target.attr), set())
                grew = not kinds <= mine
                mine |= kinds
                if grew:
                    have |= kinds
                    return True
        else:
            return False
        if kinds <= have:
            return False
        have |= kinds
        return True

    def _annotated(self, a: ast.AST | None) -> set[type]:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            try:
                a = ast.parse(a.value, mode="eval").body
            except SyntaxError:
                return set()
        if a is None:
            return set()
        return {self.classes[n.id] for n in ast.walk(a) if isinstance(n, ast.Name) and n.id in self.classes}

    def of(self, m: str, e: ast.AST | None) -> set[type]:
        """The section classes expression ``e`` of module ``m`` may be."""
        if isinstance(e, ast.Name):
            return self.names[m].get(e.id, set())
        if isinstance(e, ast.Attribute):
            base = self.of(m, e.value)
            if base:
                return {self.types[c, e.attr] for c in base if (c, e.attr) in self.types}
            if _is_self(e) and (m, self.where.get(id(e)), e.attr) in self.own:
                return self.own[m, self.where[id(e)], e.attr]
            return self.attrs.get(e.attr, set())
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Attribute) and f.attr in self.methods:  # recipe.role(name)
                return self.methods[f.attr]
            if isinstance(f, ast.Name) and f.id == "getattr" and len(e.args) >= 2:
                return set().union(*(self.attrs.get(s, set()) for s in self.strings(m, e.args[1])))
            if _name(f) == "replace" and e.args:  # dataclasses.replace(section, ...)
                return self.of(m, e.args[0])
        if isinstance(e, (ast.Tuple, ast.List)):
            return set().union(*(self.of(m, x) for x in e.elts))
        if isinstance(e, ast.BoolOp):
            return set().union(*(self.of(m, x) for x in e.values))
        if isinstance(e, ast.IfExp):
            return self.of(m, e.body) | self.of(m, e.orelse)
        return set()

    def strings(self, m: str, e: ast.AST) -> list[str]:
        """The strings ``e`` may be: a constant, or a loop variable over a tuple/list of constants."""
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [e.value]
        if isinstance(e, ast.Name):
            return self.loops[m].get(e.id, [])
        return []

    def reads(self) -> set[tuple[type, str]]:
        """(section class, field) for every ``X.field`` on a section, and every call given a section and the
        field's name as a string (``getattr(cfg, "x")``, ``positive_seconds(cfg, "reward_timeout_s")``),
        outside the validators."""
        out: set[tuple[type, str]] = set()
        for m, tree in self.trees.items():
            funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            skip = {id(n) for f in funcs if f.name in VALIDATORS.get(m, ()) for n in ast.walk(f)}
            skip |= {id(n) for f in funcs if f.name in PASS_THROUGH.get(m, ()) for c in ast.walk(f)
                     if isinstance(c, ast.Call) for k in c.keywords for n in ast.walk(k.value)}
            for n in ast.walk(tree):
                if id(n) in skip:
                    continue
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                    out |= {(c, n.attr) for c in self.of(m, n.value)}
                elif isinstance(n, ast.Call):
                    kinds = set().union(*(self.of(m, a) for a in n.args)) if n.args else set()
                    out |= {(c, s) for c in kinds for a in n.args for s in self.strings(m, a)}
                    if _name(n.func) == "asdict" and n.args:
                        self.whole[m] |= self.of(m, n.args[0])
        return out


def _is_self(e: ast.AST) -> bool:
    return isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"


def _name(f: ast.AST) -> str | None:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _loop_strings(tree: ast.Module) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.For, ast.comprehension)) and isinstance(n.target, ast.Name) \
                and isinstance(n.iter, (ast.Tuple, ast.List)):
            out.setdefault(n.target.id, []).extend(
                x.value for x in n.iter.elts if isinstance(x, ast.Constant) and isinstance(x.value, str))
    return out


@functools.cache
def scan() -> _Scan:
    trees = {p.relative_to(PKG).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}
    return _Scan({m: t for m, t in trees.items() if m not in NOT_SCANNED})


def unread_keys() -> set[str]:
    s = scan()
    read = s.reads()
    return {k for k, (cls, name) in _leaves().items()
            if (cls, name) not in read and cls not in s.whole.get(WHOLE_SECTIONS.get(cls.__name__, ("",))[0], set())}


def test_the_scan_covers_every_key_the_validator_knows():
    leaves = _leaves()
    assert set(leaves) <= schema_keys()
    sections = {k for k in schema_keys() if k not in leaves}
    assert all(any(leaf.startswith(s + ".") for leaf in leaves) for s in sections), sections
    for module, funcs in [*VALIDATORS.items(), *PASS_THROUGH.items()]:  # a renamed one would count as acting
        defined = {f.name for f in ast.walk(scan().trees[module]) if isinstance(f, ast.FunctionDef)}
        assert funcs <= defined, (module, funcs - defined)


def test_the_scan_tells_a_section_field_from_a_same_named_attribute():
    """``lengths.max()`` is not ``roles.rollout.elastic.max``; ``recipe.role(n).nodes`` and an alias are reads."""
    tree = ast.parse("def f(recipe: Recipe, lengths):\n"
                     "    lengths.max()\n"
                     "    g = recipe.role('actor')\n"
                     "    ro, el = recipe.rollout, recipe.rollout.elastic\n"
                     "    for key in ('max_turns', 'top_p'):\n"
                     "        getattr(ro, key)\n"
                     "    return g.nodes, el.autoscale.window, positive(ro, 'reward_timeout_s')\n")
    from relax_hpc.recipe.schema import ElasticNodes, RoleGroup
    from relax_hpc.rollout.config import AutoscaleConfig, RolloutConfig

    got = _Scan({"m.py": tree}).reads()
    assert (ElasticNodes, "max") not in got
    want = {(RoleGroup, "nodes"), (AutoscaleConfig, "window"), (RolloutConfig, "max_turns"), (RolloutConfig, "top_p"),
            (RolloutConfig, "reward_timeout_s")}
    assert want <= got


def test_every_recipe_key_is_read_outside_validation():
    dead = sorted(unread_keys() - set(REFUSED_UNLESS_DEFAULT) - _other_roles_elastic())
    assert not dead, (f"recipe keys that validate and do nothing: {dead}. Read each where it acts, or refuse its "
                      "non-default values at validation (naming the key, the value and the fix) and list it in "
                      "REFUSED_UNLESS_DEFAULT")


def _other_roles_elastic() -> set[str]:
    """roles.<not rollout>.elastic.*: RoleGroup is one class for every role; validation refuses the section
    outside rollout (only rollout scales), so these are the same fields as rollout's."""
    return {k for k in _leaves() if k.startswith("roles.") and ".elastic." in k and not k.startswith("roles.rollout.")}


def _nested(key: str, value: object) -> dict:
    data: dict = {}
    node = data
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return data


@pytest.mark.parametrize("key", sorted(REFUSED_UNLESS_DEFAULT))
def test_a_key_kept_only_at_its_default_is_refused_otherwise(key):
    value, _why = REFUSED_UNLESS_DEFAULT[key]
    data = _nested(key, value)
    if key.startswith("roles.rollout.elastic"):
        data["roles"]["rollout"]["nodes"] = value  # equal to nodes: the one value the old rule let through
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    got = {k: m for k, _, m in e.value.problems}
    assert key in got and "Fix:" in got[key] and str(value) in str(e.value), got
    assert key in unread_keys(), f"{key} is read now: take it off REFUSED_UNLESS_DEFAULT"
