"""A vision-language model's images from the rollout's samples to the micro-batch (relax_hpc.train.samples, plan,
batch): written once as the image processor's outputs, read back as views, concatenated in sample order."""

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.errors import PermanentError
from relax_hpc.exchange.chunk import Ragged
from relax_hpc.multimodal import encode_ids, load_image, png_base64
from relax_hpc.rollout.driver import RolloutResult
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.tasks import shapes
from relax_hpc.train import plan as P
from relax_hpc.train.batch import make_micro_batch, make_packed_micro_batch
from relax_hpc.rollout.write import write_step

VS, PAD, VE = 6, 9, 7  # make-tiny-model's <|vision_start|>, <|image_pad|>, <|vision_end|>


def _sample(i: int, images: list[str], prompt: list[int], response: list[int]) -> Sample:
    s = Sample(group_index=i, index=i, prompt=f"p{i}", label="r", tokens=list(prompt),
               multimodal_inputs={"images": images} if images else None)
    s.append_response(response, "x", [-0.5] * len(response))
    s.status = SampleStatus.COMPLETED
    return s


def _result(vlm) -> tuple[RolloutResult, list[dict]]:
    """Three samples: one picture; two pictures (and a response holding a vision start and an image pad, as a
    sampled token may); none (failed for its image: its placeholder stays unexpanded)."""
    a, b, c = (png_base64(shapes.picture(0, k)[2]) for k in range(3))
    assert max(map(len, (a, b, c))) > 255  # base64 longer than a file name may be is still read as base64
    raw = [[VS, PAD, VE, 20], [VS, PAD, VE, 21, VS, PAD, VE]]
    encs = [encode_ids(vlm, ids, [load_image(x) for x in imgs]) for ids, imgs in zip(raw, [[a], [b, c]])]
    samples = [_sample(0, [a], encs[0]["input_ids"][0].tolist(), [30]),
               _sample(1, [b, c], encs[1]["input_ids"][0].tolist(), [VS, PAD, 31]),
               _sample(2, [], [VS, PAD, VE, 22], [0])]
    samples[2].status = SampleStatus.FAILED
    samples[2].loss_mask = [0]
    return RolloutResult(samples=samples, raw_rewards=[1.0, 0.2, 0.0], metrics={}, group_size=1), encs


def test_images_travel_as_processor_outputs_and_batch_in_sample_order(tmp_path, tiny_vlm):
    result, encs = _result(tiny_vlm)
    ref = write_step(tmp_path, 1, result, model_dir=tiny_vlm)
    assert {"pixel_values", "image_grid_thw"} <= ref.all_fields
    cols = P.read_train_columns([ref], agree=False)
    assert cols["pixel_values"].lengths()[2] == 0 and cols["image_grid_thw"].lengths().tolist() == [3, 6, 0]
    plan = P.train_plan(cols, AlgorithmConfig(), group_size=1)
    samples = plan.samples
    for s, enc in zip(samples, encs):  # the processor's own numbers, as views of the column's bytes
        assert torch.equal(s.pixel_values, enc["pixel_values"].reshape(-1).float())
        assert torch.equal(s.image_grid_thw, enc["image_grid_thw"].reshape(-1))
        assert np.shares_memory(s.pixel_values.numpy(), cols["pixel_values"].data)
    assert samples[2].pixel_values.numel() == 0

    mb = make_micro_batch(samples, pad_id=0, train=True)
    want = torch.cat([encs[0]["pixel_values"], encs[1]["pixel_values"]]).float()
    assert mb.pixel_values.shape == (16 * 3, 3 * 2 * 14 * 14) and torch.equal(mb.pixel_values, want)
    assert mb.image_grid_thw.tolist() == [[1, 4, 4]] * 3
    # where each row's own image pads end: its response; the failed row has none (its placeholder is a token)
    assert mb.image_limits == [samples[0].response_start, samples[1].response_start, 0]
    image_tokens = sum(int((s.tokens[: lim] == PAD).sum()) for s, lim in zip(samples, mb.image_limits))
    assert image_tokens * 4 == sum(int(g.prod()) for g in mb.image_grid_thw)  # one token per 2x2 merged patches

    fwd = P.logprob_batch(P.read_columns([ref], ("tokens", "response_length", "pixel_values", "image_grid_thw")))
    assert [torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(fwd, samples)] == [True] * 3
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        make_packed_micro_batch(samples, pad_id=0, train=True)


def test_text_chunks_carry_no_image_fields_and_images_need_the_processor(tmp_path, tiny_vlm):
    result, _ = _result(tiny_vlm)
    for s in result.samples:
        s.multimodal_inputs = None
    assert not {"pixel_values", "image_grid_thw"} & write_step(tmp_path, 1, result).all_fields
    result, _ = _result(tiny_vlm)
    with pytest.raises(ValueError, match="model_dir"):
        write_step(tmp_path, 2, result)


def test_bad_image_columns_stop_at_the_trainers_door(tmp_path, tiny_vlm):
    result, _ = _result(tiny_vlm)
    cols = P.read_train_columns([write_step(tmp_path, 1, result, model_dir=tiny_vlm)], agree=False)
    grids = cols["image_grid_thw"].to_list()
    grids[1] = grids[1][:5]
    with pytest.raises(P.UnsoundTrainData, match="image_grid_thw of sample 1 .*3 per image"):
        P.check_train_columns({**cols, "image_grid_thw": Ragged.from_list(grids)})
    pix = cols["pixel_values"].data.copy()
    pix[-1] = np.nan
    with pytest.raises(P.UnsoundTrainData, match="pixel_values of sample 1"):
        P.check_train_columns({**cols, "pixel_values": Ragged(pix, cols["pixel_values"].offsets)})


def test_a_vlm_build_refuses_packed_micro_batches(tiny_vlm):
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.vlm import build_vlm

    for key in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        with pytest.raises(PermanentError, match=f"train.{key} = 256 .*Fix: remove train.{key}"):
            build_vlm(tiny_vlm, TrainConfig(**{key: 256}))
