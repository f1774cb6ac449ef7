"""Streaming within a step, the rollout's side (``rollout.stream_groups``): the driver reports each group as soon as it
is generated and scored (``on_group``), and the rollout role's streamer writes chunk k of the step, groups kG..(k+1)G−1,
named by its place (seq + k), announcing it with ``chunk_ready`` over the real control socket; the groups after the
last whole G are the step's last chunk. A generate given again skips the places already announced."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from relax_hpc.controller import messages as M
from relax_hpc.controller.channel import Channel
from relax_hpc.recipe.schema import ModelConfig, Recipe
from relax_hpc.roles.rollout import ChunkAnnouncer
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.generator import Streamer
from relax_hpc.rundir import create_run_dir, write_json
from relax_hpc.rollout.write import write_step
from relax_hpc.train.samples import read_columns

GROUPS, N, G = 5, 2, 2  # 5 prompt groups of 2 samples, chunks of 2 groups: places 0 and 1 streamed, 2 at the end


@pytest.fixture
def setup(tmp_path, tiny_llama, cpu_engine):
    recipe = Recipe(model=ModelConfig(path=str(tiny_llama)),
                    rollout=RolloutConfig(rm_type="dummy", n_samples_per_prompt=N, rollout_batch_size=GROUPS,
                                          max_response_len=3, stream_groups=G))
    tok = load_tokenizer(tiny_llama)
    driver = RolloutDriver(recipe, {"e0": cpu_engine}, tokenizer=tok)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(GROUPS):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("q", "a"), tokenizer=tok, apply_chat_template=False)
    run = create_run_dir(tmp_path / "runs", "stream")
    channel = Channel(run.token(), "127.0.0.1")  # the controller's end: chunk_ready lands in its queue
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": channel.port, "pid": 0})
    announce = ChunkAnnouncer(run)  # the role's: chunk_ready on a connection of its own
    gen = SimpleNamespace(recipe=recipe, driver=driver, outlets=SimpleNamespace(announce=announce),
                          write=lambda step, result, seq: write_step(run.path, step, result, seq=seq, attrs={},
                                                                     model_dir=str(tok.name_or_path)))
    yield gen, lambda: RolloutDataSource(ds, rollout_batch_size=GROUPS, n_samples_per_prompt=N).get_samples(), channel
    announce.close()
    channel.close()


def stream(gen, groups, task):
    seen: list[int] = []
    s = Streamer(gen, step=task.step, seq=task.seq, task_id=task.id, streamed=task.streamed)

    def on_group(i, group, failures):
        assert all(x.reward is not None for x in group)  # scored before it is reported
        seen.append(i)
        s.on_group(i, group, failures)

    try:
        res = gen.driver.generate_rollout_sync(groups, seed=3, on_group=on_group)
    finally:
        s.close()
    assert sorted(seen) == list(range(GROUPS))  # each group once
    return res, s.finish(res)


def announced(channel: Channel) -> list[dict]:
    """The chunk_ready messages that reached the controller's end of the socket."""
    return [m for _, m in channel.drain(0.5) if m.get("type") == "chunk_ready"]


def test_groups_stream_as_chunks_named_by_their_place(setup):
    gen, groups, channel = setup
    task = M.GenerateTask(id=7, step=1, engines={}, seq=10, data_state=None)
    res, refs = stream(gen, groups(), task)
    assert [(r.name, r.n) for r in refs] == [("chunk_rollout_10", 4), ("chunk_rollout_11", 4), ("chunk_rollout_12", 2)]
    # the chunks in seq order hold the step's samples in group order, whatever order they were written in
    tokens = read_columns(refs, ["tokens"])["tokens"]
    assert [list(t) for t in tokens] == [list(s.tokens) for s in res.samples]
    # the two whole chunks were announced on the control socket, for this task; the last one comes with the result
    got = announced(channel)
    assert sorted(m["chunk"]["path"] for m in got) == sorted(r.path for r in refs[:2])
    assert all(m["task_id"] == 7 and m["role"] == "rollout" for m in got)


def test_a_generate_given_again_writes_only_the_places_not_announced(setup):
    gen, groups, channel = setup
    task = M.GenerateTask(id=8, step=1, engines={}, seq=10, data_state=None, streamed=[0])
    _, refs = stream(gen, groups(), task)
    assert [r.name for r in refs] == ["chunk_rollout_11", "chunk_rollout_12"]
    assert [m["chunk"]["path"] for m in announced(channel)] == [refs[0].path]

