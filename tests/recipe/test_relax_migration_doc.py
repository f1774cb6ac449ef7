"""docs/migrating-from-relax.md answers for every Relax flag the recipe knows: the same home as the table the
recipe's errors use (relax_hpc/recipe/relax_names.py), so the page and the errors never disagree."""

from pathlib import Path

from relax_hpc.recipe.relax_names import RELAX_NAMES, WHY, cli_flag

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-relax.md"


def test_every_relax_flag_has_its_row_with_the_same_home():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `--") and len(cells) >= 3:
            rows[cells[0].strip("`")] = cells[2]
    for name, key in RELAX_NAMES.items():
        flag = cli_flag(name)
        assert flag in rows, f"{flag} has no row in {DOC.name}"
        want = f"`{key}`" if key is not None else "not needed" if WHY.get(name, "").startswith(
            ("not needed", "always", "relax_hpc")) else "not supported yet"  # as --from-relax-args's header says
        assert rows[flag] == want, (flag, rows[flag], want)
