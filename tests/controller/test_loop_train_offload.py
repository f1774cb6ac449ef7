"""train.offload in the training loop, driven by hand (:mod:`loop_sim`): the actor's checkpoint reloads its state
onto the device, so in colocate the engines neither generate nor evaluate until the save is done (they would not
have their memory); without offload the next generate and a due eval go out beside the save, as before."""

from __future__ import annotations

import pytest

from loop_sim import ARITH, drive, sim_loop, sim_recipe, sim_run


@pytest.mark.parametrize("offload", [True, False])
def test_a_checkpoint_goes_before_the_next_generate_and_eval_with_offload(tmp_path, offload):
    over = ["run.steps=4", "checkpoint.interval=1", f"train.offload={str(offload).lower()}",
            "rollout.eval_interval=2", f"data.eval_prompt_data={{arith: {ARITH}}}"]
    recipe = sim_recipe(tmp_path, *over)
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    done = drive(loop, ch)
    ev = ch.events.index
    assert [s for k, s in done if k == "checkpoint"] == ["1", "2", "3", "4"]
    for n in (1, 2, 3, 4):
        # after step n's sync: eval(n) where due (it goes before generate(n+1)), else generate(n+1)
        nxt = ("+", "eval", str(n)) if n % 2 == 0 else ("+", "generate", str(n + 1))
        if offload:
            assert ev(("-", "checkpoint", str(n))) < ev(nxt), (n, ch.events)
        else:  # handed out right after the sync, while the actor saves (the behaviour without offload)
            assert ev(nxt) < ev(("-", "checkpoint", str(n))), (n, ch.events)
    assert [s for k, s in done if k == "eval"] == ["0", "2", "4"]
    loop.finish()
