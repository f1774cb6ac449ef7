"""A Qwen2.5-VL's videos from the rollout's samples to the micro-batch (relax_hpc.train.samples, plan, batch): written
once as the image processor's outputs (``pixel_values_videos``, ``video_grid_thw``, exchange/fields.py's table), read
back as views, concatenated in sample order beside a sample's images; unsound columns stop at the trainer's door."""

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.exchange.chunk import Ragged
from relax_hpc.exchange.fields import BY_NAME, MEDIA_FIELDS, OPTIONAL_ROLLOUT_FIELDS, VIDEO_FIELDS
from relax_hpc.multimodal import encode_media_ids, load_image, png_base64
from relax_hpc.rollout.driver import RolloutResult
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.tasks import dots
from relax_hpc.train import plan as P
from relax_hpc.train.batch import make_micro_batch
from relax_hpc.rollout.write import write_step

VS, VE = 6, 7  # make-tiny-model's <|vision_start|>, <|vision_end|>


def _video(seed: int, i: int) -> list[str]:
    from PIL import Image

    return [png_base64(Image.fromarray(f)) for f in dots.video(seed, i)[1]]


def _result(vlm):
    """Three samples: a video of 4 frames; a video of 2 frames; none (failed for its video: its placeholder stays)."""
    from relax_hpc.multimodal import VIDEO_PAD, token_id

    pad = token_id(vlm, VIDEO_PAD)
    vids = [_video(0, 0), _video(0, 1)[:2]]
    encs = [encode_media_ids(vlm, [VS, pad, VE, 20 + k], videos=[[load_image(f) for f in v]])
            for k, v in enumerate(vids)]
    samples = []
    for i, (v, ids) in enumerate(zip(vids + [None], [e["input_ids"][0].tolist() for e in encs] + [[VS, pad, VE, 22]])):
        s = Sample(group_index=i, index=i, prompt=f"p{i}", label="r", tokens=list(ids),
                   multimodal_inputs={"videos": [v]} if v else None)
        s.append_response([30 + i], "x", [-0.5])
        s.status = SampleStatus.COMPLETED
        samples.append(s)
    samples[2].status, samples[2].loss_mask = SampleStatus.FAILED, [0]
    return RolloutResult(samples=samples, raw_rewards=[1.0, 0.2, 0.0], metrics={}, group_size=1), encs, pad


def test_the_video_fields_are_in_the_one_table():
    assert set(VIDEO_FIELDS) <= set(MEDIA_FIELDS) and set(VIDEO_FIELDS) <= set(OPTIONAL_ROLLOUT_FIELDS)
    assert BY_NAME["pixel_values_videos"].read_by == ("train", "logprobs") and BY_NAME["video_grid_thw"].dtype == "int64"


def test_videos_travel_as_processor_outputs_and_batch_in_sample_order(tmp_path, tiny_vlm):
    result, encs, pad = _result(tiny_vlm)
    ref = write_step(tmp_path, 1, result, model_dir=tiny_vlm)
    assert {"pixel_values_videos", "video_grid_thw"} <= ref.all_fields and "pixel_values" not in ref.all_fields
    cols = P.read_train_columns([ref], agree=False)
    assert cols["video_grid_thw"].lengths().tolist() == [3, 3, 0]
    samples = P.train_plan(cols, AlgorithmConfig(), group_size=1).samples
    for s, enc in zip(samples, encs):  # the processor's own numbers, as views of the column's bytes
        assert torch.equal(s.pixel_values_videos, enc["pixel_values_videos"].reshape(-1))
        assert s.video_grid_thw.tolist() == enc["video_grid_thw"].reshape(-1).tolist()
        assert np.shares_memory(s.pixel_values_videos.numpy(), cols["pixel_values_videos"].data)
    mb = make_micro_batch(samples, pad_id=0, train=True)
    assert mb.video_grid_thw.tolist() == [[2, 4, 4], [1, 4, 4]] and mb.pixel_values is None
    assert torch.equal(mb.pixel_values_videos, torch.cat([e["pixel_values_videos"] for e in encs]))
    # each row's own video pads end at its response; the failed row has none (its placeholder is a token)
    assert mb.image_limits == [samples[0].response_start, samples[1].response_start, 0]
    tokens = sum(int((s.tokens[:lim] == pad).sum()) for s, lim in zip(samples, mb.image_limits))
    assert tokens * 4 == sum(int(g.prod()) for g in mb.video_grid_thw)
    fwd = P.logprob_batch(P.read_columns([ref], ("tokens", "response_length", "pixel_values_videos",
                                                 "video_grid_thw")))
    assert [torch.equal(a.pixel_values_videos, b.pixel_values_videos) for a, b in zip(fwd, samples)] == [True] * 3


def test_bad_video_columns_stop_at_the_trainers_door(tmp_path, tiny_vlm):
    result, _, _ = _result(tiny_vlm)
    cols = P.read_train_columns([write_step(tmp_path, 1, result, model_dir=tiny_vlm)], agree=False)
    grids = cols["video_grid_thw"].to_list()
    grids[1] = grids[1][:2]
    with pytest.raises(P.UnsoundTrainData, match="video_grid_thw of sample 1 .*3 per image or video"):
        P.check_train_columns({**cols, "video_grid_thw": Ragged.from_list(grids)})
    pix = cols["pixel_values_videos"].data.copy()
    pix[-1] = np.inf
    with pytest.raises(P.UnsoundTrainData, match="pixel_values_videos of sample 1"):
        P.check_train_columns({**cols, "pixel_values_videos": Ragged(pix, cols["pixel_values_videos"].offsets)})
    with pytest.raises(ValueError, match="model_dir"):
        write_step(tmp_path, 2, _result(tiny_vlm)[0])
