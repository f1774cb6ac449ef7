"""An omni model's audio from the rollout's samples to the micro-batch (relax_hpc.train.samples, plan, batch):
written once as the feature extractor's frames, read back as views, concatenated in sample order, with each row's
audio limit; the forward roles' batch carries them; non-finite features stop at the trainer's door."""

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.audio import encode_audio_ids, load_audio, wav_base64
from relax_hpc.exchange.chunk import Ragged
from relax_hpc.rollout.driver import RolloutResult
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.train import plan as P
from relax_hpc.train.batch import make_micro_batch
from relax_hpc.rollout.write import write_step
from tests.rollout.conftest import _tiny_model_maker

BOS, EOS, PAD = 11, 12, 13  # make-tiny-model's <|audio_bos|>, <|audio_eos|>, <|AUDIO|>


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory):
    return _tiny_model_maker()(tmp_path_factory.mktemp("omni") / "omni", arch="qwen2_5_omni", layers=1)


def _clip(seconds: float, freq: float) -> str:
    t = np.arange(int(16000 * seconds)) / 16000
    return wav_base64((0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 16000)


def _result(omni):
    """Three samples: one clip; two clips (and a response holding an audio pad, as a sampled token may); none
    (failed for its clip: its placeholder stays unexpanded)."""
    a, b, c = _clip(0.4, 300), _clip(0.3, 1000), _clip(0.5, 3000)
    raw = [[BOS, PAD, EOS, 20], [BOS, PAD, EOS, 21, BOS, PAD, EOS]]
    encs = [encode_audio_ids(omni, ids, [load_audio(x, omni) for x in clips]) for ids, clips in zip(raw, [[a], [b, c]])]
    samples = []
    for i, (clips, prompt, response) in enumerate([([a], encs[0]["input_ids"], [30]),
                                                   ([b, c], encs[1]["input_ids"], [PAD, 31]),
                                                   ([], [BOS, PAD, EOS, 22], [0])]):
        s = Sample(group_index=i, index=i, prompt=f"p{i}", label="l", tokens=list(prompt),
                   multimodal_inputs={"audios": clips} if clips else None)
        s.append_response(response, "x", [-0.5] * len(response))
        s.status = SampleStatus.COMPLETED
        samples.append(s)
    samples[2].status = SampleStatus.FAILED
    samples[2].loss_mask = [0]
    return RolloutResult(samples=samples, raw_rewards=[1.0, 0.2, 0.0], metrics={}, group_size=1), encs


def test_audio_travels_as_features_and_batches_in_sample_order(tmp_path, tiny_omni):
    result, encs = _result(tiny_omni)
    ref = write_step(tmp_path, 1, result, model_dir=tiny_omni)
    assert {"input_features", "audio_feature_lens"} <= ref.all_fields
    assert not {"pixel_values", "image_grid_thw"} & ref.all_fields
    cols = P.read_train_columns([ref], agree=False)
    assert [list(x) for x in cols["audio_feature_lens"].to_list()] == [[40], [30, 50], []]
    assert cols["input_features"].lengths()[2] == 0
    samples = P.train_plan(cols, AlgorithmConfig(), group_size=1).samples
    for s, enc in zip(samples, encs):  # the extractor's own frames, as views of the column's bytes
        assert torch.equal(s.input_features, torch.from_numpy(np.concatenate(enc["features"]).reshape(-1)))
        assert np.shares_memory(s.input_features.numpy(), cols["input_features"].data)
    mb = make_micro_batch(samples, pad_id=0, train=True)
    assert mb.input_features.shape == (40 + 30 + 50, 128) and mb.audio_feature_lens == [40, 30, 50]
    assert mb.audio_limits == [samples[0].response_start, samples[1].response_start, 0]
    # the audio pads before each row's limit are its clips' tokens (10, 7 + 12); the sampled one is not
    pads = [int((s.tokens[:lim] == PAD).sum()) for s, lim in zip(samples, mb.audio_limits)]
    assert pads == [10, 19, 0] and int((samples[1].tokens == PAD).sum()) == 20
    fwd = P.logprob_batch(P.read_columns([ref], ("tokens", "response_length", "input_features", "audio_feature_lens")))
    assert [torch.equal(a.input_features, b.input_features) for a, b in zip(fwd, samples)] == [True] * 3


def test_text_chunks_carry_no_audio_and_audio_needs_the_extractor(tmp_path, tiny_omni):
    result, _ = _result(tiny_omni)
    for s in result.samples:
        s.multimodal_inputs = None
    assert not {"input_features", "audio_feature_lens"} & write_step(tmp_path, 1, result).all_fields
    result, _ = _result(tiny_omni)
    with pytest.raises(ValueError, match="model_dir"):
        write_step(tmp_path, 2, result)
    result.samples[0].tokens = [BOS, PAD, EOS, 20, 30]  # its pad not expanded: not what the engine ran
    with pytest.raises(ValueError, match="audio pads are not its clips' expansion"):
        write_step(tmp_path, 3, result, model_dir=tiny_omni)


def test_non_finite_features_stop_at_the_trainers_door(tmp_path, tiny_omni):
    result, _ = _result(tiny_omni)
    cols = P.read_train_columns([write_step(tmp_path, 1, result, model_dir=tiny_omni)], agree=False)
    f = cols["input_features"].data.copy()
    f[-1] = np.inf
    with pytest.raises(P.UnsoundTrainData, match="input_features of sample 1"):
        P.check_train_columns({**cols, "input_features": Ragged(f, cols["input_features"].offsets)})
