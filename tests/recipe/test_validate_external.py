"""rollout.external_engines at validation (relax_hpc/rollout/checks.py): each entry a URL and an absolute key file
of mode 0600, and nothing else; a refusal names the key, the value and the fix."""

from __future__ import annotations

import pytest

from relax_hpc.recipe import RecipeError, recipe_from_dict


def problems(data) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return {k: m for k, _, m in e.value.problems}


def ext(*engines):
    return {"rollout": {"external_engines": list(engines)}}


def test_a_private_absolute_key_file_and_a_url_are_accepted(tmp_path):
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    r = recipe_from_dict(ext({"url": "http://gpu-3:30000", "key_file": str(key)}))
    assert r.rollout.external_engines == [{"url": "http://gpu-3:30000", "key_file": str(key)}]


def test_bad_entries_are_refused_naming_the_fix(tmp_path):
    loose = tmp_path / "loose"
    loose.write_text("s3cret\n")
    loose.chmod(0o644)
    got = problems(ext({"url": "gpu-3:30000", "key_file": "keys/k"},
                       {"url": "http://a:1", "key_file": str(loose)},
                       {"url": "http://a:1/", "key_file": str(tmp_path / "none")},
                       {"url": "http://b:2", "key": "s3cret"}))
    assert "expected http://HOST:PORT" in got["rollout.external_engines[0].url"]
    assert "must be an absolute path" in got["rollout.external_engines[0].key_file"]
    assert f"Fix: chmod 600 {loose}" in got["rollout.external_engines[1].key_file"]
    assert "listed twice" in got["rollout.external_engines[2].url"]
    assert "cannot be read" in got["rollout.external_engines[2].key_file"]
    assert "the key itself never goes in a recipe" in got["rollout.external_engines[3]"]
