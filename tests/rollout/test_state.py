"""The rollout state (relax_hpc.rollout.state): ``data_state`` on the wire is the data source's cursor dict plus,
with partial rollout, ``partial``: the buffer reference; it reads back into the same typed state and writes the
same dict, a malformed one is refused naming the key, and the buffers a checkpoint names are found."""

from __future__ import annotations

import json

import pytest

from relax_hpc.rollout.data import RolloutDataSource
from relax_hpc.rollout.dynamic import PartialRollout
from relax_hpc.rollout.sample import Sample
from relax_hpc.rollout.state import BufferRef, DataState, DataStateError, buffer_files


def cursor() -> dict:
    data = RolloutDataSource([Sample(prompt=f"p{i}") for i in range(5)], rollout_batch_size=2,
                             n_samples_per_prompt=2, shuffle=True, seed=3)
    data.get_samples(3)
    return data.state_dict()


def test_the_wire_dict_reads_back_typed_and_writes_the_same_dict(tmp_path):
    c = cursor()
    plain = DataState.from_dict(json.loads(json.dumps(c)))
    assert (plain.epoch, plain.offset, plain.sample_group_index, plain.sample_index) == (0, 3, 3, 6)
    assert plain.partial is None and plain.to_dict() == plain.cursor() == c

    buf = PartialRollout(buffer=[[Sample(prompt="b", group_index=2, index=4)]])
    full = DataState.of(c, BufferRef.from_dict(buf.save(tmp_path, 1)))  # as the generator makes it after a step
    wire = json.loads(json.dumps(full.to_dict()))
    assert wire["partial"]["groups"] == 1 and wire["partial"]["file"].startswith("partial_rollout/after_00000001_")
    assert {k: v for k, v in wire.items() if k != "partial"} == c
    assert DataState.from_dict(wire) == full  # the generator's "where it stands already" test compares these
    empty = DataState.of(c, BufferRef.from_dict(PartialRollout().save(tmp_path, 2)))
    assert empty.to_dict()["partial"] == {"groups": 0, "samples": 0}  # an empty buffer: no file
    assert DataState.from_dict({"epoch": 1, "offset": 0}).to_dict() == {  # an older cursor's keys only
        "version": 1, "epoch": 1, "offset": 0, "sample_group_index": 0, "sample_index": 0}


@pytest.mark.parametrize("bad, says", [
    ({"offset": 0}, "data_state: epoch = None is not an integer"),
    ({"epoch": 0, "offset": True}, "data_state: offset = True is not an integer"),
    ({"epoch": 0, "offset": 0, "partial": {"groups": "2"}}, "data_state.partial: groups = '2' is not an integer"),
    ({"epoch": 0, "offset": 0, "partial": ["f"]}, r"data_state.partial = \['f'\] is not a buffer reference"),
    ([1], r"data_state = \[1\] is not the rollout state"),
])
def test_a_malformed_state_is_refused_naming_the_key(bad, says):
    with pytest.raises(DataStateError, match=says):
        DataState.from_dict(bad)


def test_the_buffers_a_checkpoint_names():
    extra = {"data": {"epoch": 0, "partial": {"file": "partial_rollout/a.json"}},
             "kept": {"data": {"partial": {"file": "partial_rollout/b.json"}}}, "other": {"partial": {"groups": 0}}}
    assert sorted(buffer_files(extra)) == ["partial_rollout/a.json", "partial_rollout/b.json"]
    assert buffer_files("pickled") == []
