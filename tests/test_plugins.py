"""The plugin loader: three ways to name a function, one error shape (key, value, fix) for every failure."""

from __future__ import annotations

import sys
import textwrap

import pytest

from relax_hpc.plugins import PluginError, PluginImportError, PluginSpec, PluginTypeError, load_plugin, parse_spec

KEY = "algorithm.custom_loss_path"


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A package ``plugpkg_<n>.mod`` importable from tmp_path, and a file ``losses/my_losses.py`` beside it."""
    name = f"plugpkg_{abs(hash(str(tmp_path))) % 10 ** 8}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(textwrap.dedent("""
        NOT_A_FUNCTION = 3

        def good(batch, cfg):
            return ("good", batch, cfg)

        def loss_fn(batch, cfg, scale=1.0, **kwargs):
            return ("loss_fn", batch, cfg)

        def one_arg(batch):
            return batch

        def tis(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **_):
            return pg_loss
    """))
    (tmp_path / "losses").mkdir()
    (tmp_path / "losses" / "my_losses.py").write_text("def my_loss(batch, cfg):\n    return ('file', batch, cfg)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def assert_names_key_value_and_fix(err: PluginError, value: str) -> None:
    text = str(err)
    assert text.startswith(f"{KEY} = {value!r}: ") and ". Fix: " in text
    assert err.key == KEY and err.value == value and err.fix
    assert err.message == text.split(": ", 1)[1]  # what the recipe validator shows next to key and value


# --- the three forms ------------------------------------------------------------------------------------

def test_dotted_form(pkg):
    fn = load_plugin(f"{pkg}.mod.good", KEY, params=("batch", "cfg"))
    assert fn(1, 2) == ("good", 1, 2)


def test_colon_form(pkg):
    fn = load_plugin(f"{pkg}.mod:good", KEY, params=("batch", "cfg"))
    assert fn(1, 2) == ("good", 1, 2)


def test_file_form_relative_to_the_current_directory(pkg, tmp_path):
    fn = load_plugin("losses/my_losses.py:my_loss", KEY, params=("batch", "cfg"))
    assert fn(1, 2) == ("file", 1, 2)
    # the same file is one module however it is named (relative, absolute, through ..): loaded once
    again = load_plugin(str(tmp_path / "losses" / ".." / "losses" / "my_losses.py") + ":my_loss", KEY)
    assert again is fn
    assert fn.__module__.startswith("relax_hpc_plugin_my_losses_") and sys.modules[fn.__module__]


def test_file_form_relative_to_base(pkg, tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    fn = load_plugin("losses/my_losses.py:my_loss", KEY, base=tmp_path)
    assert fn(0, 0)[0] == "file"


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    for d, value in (("a", 1), ("b", 2)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "loss.py").write_text(f"def f():\n    return {value}\n")
    assert load_plugin(f"{tmp_path}/a/loss.py:f", KEY)() == 1
    assert load_plugin(f"{tmp_path}/b/loss.py:f", KEY)() == 2


def test_base_is_on_sys_path_only_while_importing(tmp_path):
    (tmp_path / "cwd_module_for_base.py").write_text("def f(args, sample):\n    return 7\n")
    assert str(tmp_path) not in sys.path
    try:
        assert load_plugin("cwd_module_for_base.f", "rollout.custom_rm_path", base=tmp_path)(0, 0) == 7
    finally:
        sys.modules.pop("cwd_module_for_base", None)
    assert str(tmp_path) not in sys.path


def test_parse_spec_forms():
    assert parse_spec("a.b.c", KEY) == PluginSpec("module", "a.b", "c")
    assert parse_spec("a.b:c", KEY) == PluginSpec("module", "a.b", "c")
    assert parse_spec("dir/x.py:c", KEY) == PluginSpec("file", "dir/x.py", "c")
    assert parse_spec("x.py:c", KEY) == PluginSpec("file", "x.py", "c")
    assert parse_spec("/abs/dir/x.py:c", KEY) == PluginSpec("file", "/abs/dir/x.py", "c")


@pytest.mark.parametrize("value, text", [
    ("icepop", "not a dotted path"),
    ("pkg.mod.fn ", "whitespace"),
    ("losses.py", "names a file but no function"),
    ("dir/losses:fn", "does not end in .py"),
    ("pkg.mod:", "must be a function name"),
    ("pkg..mod.fn", "not a dotted path"),
    ("", "not a function reference"),
])
def test_bad_forms(value, text):
    with pytest.raises(PluginError) as e:
        load_plugin(value, KEY)
    assert e.value.kind == "syntax" and text in str(e.value)
    assert_names_key_value_and_fix(e.value, value)
    assert "path/to/file.py:function" in e.value.fix


# --- the four failures, one shape ---------------------------------------------------------------------------

def test_missing_module(pkg):
    value = f"{pkg}.nomod.fn"
    with pytest.raises(PluginImportError) as e:
        load_plugin(value, KEY)
    assert e.value.kind == "module" and isinstance(e.value, ImportError) and isinstance(e.value, ValueError)
    assert f"cannot import module '{pkg}.nomod'" in str(e.value) and "PYTHONPATH" in e.value.fix
    assert_names_key_value_and_fix(e.value, value)


def test_missing_file(tmp_path):
    value = f"{tmp_path}/nofile.py:fn"
    with pytest.raises(PluginImportError) as e:
        load_plugin(value, KEY)
    assert e.value.kind == "module" and "there is no file" in str(e.value)
    assert_names_key_value_and_fix(e.value, value)


def test_missing_attribute(pkg):
    value = f"{pkg}.mod:godo"
    with pytest.raises(PluginImportError) as e:
        load_plugin(value, KEY)
    assert e.value.kind == "attribute" and "has no attribute 'godo'" in str(e.value)
    assert "did you mean 'good'?" in str(e.value)
    assert_names_key_value_and_fix(e.value, value)


def test_not_callable(pkg):
    value = f"{pkg}.mod.NOT_A_FUNCTION"
    with pytest.raises(PluginTypeError) as e:
        load_plugin(value, KEY)
    assert e.value.kind == "callable" and isinstance(e.value, TypeError) and "is a int, not a function" in str(e.value)
    assert_names_key_value_and_fix(e.value, value)


def test_wrong_signature(pkg):
    value = f"{pkg}.mod.one_arg"
    with pytest.raises(PluginTypeError) as e:
        load_plugin(value, KEY, params=("batch", "cfg"))
    assert e.value.kind == "signature" and "one_arg(batch) cannot be called as one_arg(batch, cfg)" in str(e.value)
    assert "def one_arg(batch, cfg)" in e.value.fix
    assert_names_key_value_and_fix(e.value, value)


def test_signature_check_accepts_defaults_kwargs_and_keywords(pkg):
    assert load_plugin(f"{pkg}.mod.loss_fn", KEY, params=("batch", "cfg"))
    tis_keywords = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_mask")
    assert load_plugin(f"{pkg}.mod.tis", KEY, params=("cfg",), keywords=tis_keywords)
    with pytest.raises(PluginTypeError, match="missing a required argument: 'pg_loss'"):
        load_plugin(f"{pkg}.mod.tis", KEY, params=("cfg",))  # the keywords are required by that function
    with pytest.raises(PluginTypeError):
        load_plugin(f"{pkg}.mod.good", KEY, params=("cfg",), keywords=tis_keywords)
    assert load_plugin("builtins.print", KEY, params=("a", "b"))  # no signature to check is not an error


# --- a module that is there but does not import -----------------------------------------------------------

def test_missing_dependency_is_its_own_kind(tmp_path):
    (tmp_path / "needs_dep.py").write_text("import surely_not_installed_pkg_xyz\ndef f(batch, cfg):\n    pass\n")
    with pytest.raises(PluginImportError) as e:
        load_plugin(f"{tmp_path}/needs_dep.py:f", KEY)
    assert e.value.kind == "dependency" and "surely_not_installed_pkg_xyz" in e.value.fix


def test_relax_imports_get_the_porting_hint(tmp_path):
    (tmp_path / "relax_reward.py").write_text("from relax.utils.types import Sample\ndef f(args, sample):\n    pass\n")
    with pytest.raises(PluginImportError) as e:
        load_plugin(f"{tmp_path}/relax_reward.py:f", "rollout.custom_rm_path")
    assert "relax_hpc.rollout.sample import Sample" in e.value.fix


def test_a_module_that_raises_on_import(tmp_path):
    (tmp_path / "broken.py").write_text("x = 1\ndef f(:\n")
    with pytest.raises(PluginImportError) as e:
        load_plugin(f"{tmp_path}/broken.py:f", KEY)
    assert e.value.kind == "import" and "SyntaxError" in str(e.value) and "line 2" in str(e.value)
    # nothing half-loaded is left behind: fixing the file and loading again works
    (tmp_path / "broken.py").write_text("def f(batch, cfg):\n    return 1\n")
    assert load_plugin(f"{tmp_path}/broken.py:f", KEY)(0, 0) == 1
