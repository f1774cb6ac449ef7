"""The real-size omni recipe (recipes/qwen2.5-omni-7b-avqa-8gpu.yaml) and the data tool it starts from.

- ``tools/prepare-data avqa`` on small local files (AVQA's annotation layout, WAV audio tracks): records the data
  path reads with an omni thinker; a row whose WAV is missing or whose answer is no option refused by number, with
  nothing written.
- ``tools/prepare-data omni-thinker``: a whole Qwen2.5-Omni checkpoint (``thinker.*``, ``talker.*``) made of the
  tiny thinker becomes the thinker's own directory again, tensor for tensor, loadable by transformers.
- The memory plan of the recipe at the 7B thinker's shapes counts the frozen audio tower on every actor rank and
  fits an 80 GB card; the recipe passes ``relax-submit --dry-run`` on the 8-GPU dev cluster (``gpu_slurm_cluster``,
  tests/conftest.py): one node, the actor's 8 ranks and two engines of TP 4 on the same GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "prepare-data"
RECIPE = REPO / "recipes" / "qwen2.5-omni-7b-avqa-8gpu.yaml"
# Qwen/Qwen2.5-Omni-7B's thinker_config shapes (its text model is a Qwen2.5-7B; its audio tower Whisper-large's encoder)
TEXT_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768)
AUDIO_7B = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, num_mel_bins=128,
                output_dim=3584)


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> Path:
    from tests.rollout.conftest import _tiny_model_maker

    return _tiny_model_maker()(tmp_path_factory.mktemp("omni") / "thinker", arch="qwen2_5_omni", seed=0)


def avqa_files(d: Path, answers=(1, 3, 0)) -> tuple[Path, Path]:
    """AVQA's layout, small: annotations and one WAV a video (0.5 s tones)."""
    from relax_hpc.audio import wav_bytes

    audio = d / "audio"
    audio.mkdir(parents=True)
    rows = []
    for i, a in enumerate(answers):
        t = np.arange(8000) / 16000
        (audio / f"vid{i}.wav").write_bytes(wav_bytes((0.5 * np.sin(2 * np.pi * 300 * (i + 1) * t)).astype(np.float32),
                                                     16000))
        rows.append({"id": 100 + i, "video_name": f"vid{i}", "video_id": i, "question_text": f"What makes sound {i}?",
                     "multi_choice": ["dog", "car", "piano", "rain"], "answer": a, "question_type": "Which"})
    (d / "train_qa.json").write_text(json.dumps(rows))
    return d / "train_qa.json", audio


def test_prepare_data_avqa(tmp_path, tiny_omni):
    ann, audio = avqa_files(tmp_path / "avqa")
    out = tmp_path / "avqa" / "avqa.jsonl"
    p = prepare("avqa", str(ann), str(out), "--audio-dir", str(audio))
    assert p.returncode == 0, p.stderr
    assert "3 records (3 annotations read)" in p.stdout and "rollout.rm_type=multiple_choice" in p.stdout
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in recs] == ["B", "D", "A"] and recs[0]["audios"] == ["audio/vid0.wav"]
    assert recs[0]["prompt"].startswith("<audio>What makes sound 0?\nA. dog\nB. car\nC. piano\nD. rain\n")
    assert recs[1]["metadata"] == {"id": 101, "question_type": "Which", "video_name": "vid1"}

    from relax_hpc.audio import AUDIO_PAD, token_id
    from relax_hpc.rollout.data import DataKeys, PromptDataset
    from relax_hpc.rollout.rewards.builtin import multiple_choice_reward
    from relax_hpc.rollout.sample import SampleStatus

    ds = PromptDataset(out, keys=DataKeys(input_key="prompt", label_key="label", audio_key="audios"),
                       tokenizer=str(tiny_omni), apply_chat_template=True)
    s = ds[0]
    assert s.status is not SampleStatus.FAILED and s.tokens.count(token_id(tiny_omni, AUDIO_PAD)) == 12  # 0.5 s
    assert multiple_choice_reward("so <answer>B</answer>", s.label) == 1.0
    assert multiple_choice_reward("<answer>C</answer>", s.label) == 0.0

    (audio / "vid1.wav").unlink()  # a missing track: refused by row, nothing written
    p = prepare("avqa", str(ann), str(tmp_path / "bad.jsonl"), "--audio-dir", str(audio))
    assert p.returncode == 1 and f"{ann}: row 2: no audio track" in p.stderr and "ffmpeg" in p.stderr, p.stderr
    assert not list(tmp_path.glob("bad.jsonl*"))
    ann2, audio2 = avqa_files(tmp_path / "avqa2", answers=(1, 4))
    p = prepare("avqa", str(ann2), str(tmp_path / "bad2.jsonl"), "--audio-dir", str(audio2))
    assert p.returncode == 1 and "row 2: answer 4 is not an option's index (0 to 3)" in p.stderr, p.stderr
    p = prepare("avqa", str(ann2), str(tmp_path / "x.jsonl"))
    assert p.returncode == 2 and "--audio-dir" in p.stderr


def test_prepare_data_omni_thinker(tmp_path, tiny_omni):
    import torch
    from safetensors.torch import load_file, save_file

    thinker = load_file(str(tiny_omni / "model.safetensors"))
    whole = tmp_path / "Qwen2.5-Omni"
    whole.mkdir()
    cfg = json.loads((tiny_omni / "config.json").read_text())
    (whole / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni", "architectures":
                                                   ["Qwen2_5OmniModel"], "thinker_config": cfg}))
    tensors = {f"thinker.{k}": v for k, v in thinker.items()}
    save_file(dict(list(tensors.items())[:40]), str(whole / "model-00001-of-00002.safetensors"))
    save_file({**dict(list(tensors.items())[40:]), "talker.model.x": torch.zeros(3),
               "token2wav.y": torch.zeros(2)}, str(whole / "model-00002-of-00002.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        (whole / f).write_bytes((tiny_omni / f).read_bytes())
    out = tmp_path / "thinker"
    p = prepare("omni-thinker", str(whole), str(out))
    assert p.returncode == 0, p.stderr
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(thinker) and all(torch.equal(got[k], thinker[k]) for k in thinker)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    from relax_hpc.audio import is_omni
    from relax_hpc.engines.audio import model_class

    assert is_omni(out) and model_class().from_pretrained(str(out)) is not None
    p = prepare("omni-thinker", str(tiny_omni), str(tmp_path / "again"))  # a thinker already: said so
    assert p.returncode == 1 and "a thinker's directory is model.path as it is" in p.stderr, p.stderr


@pytest.fixture(scope="module")
def omni_7b(tmp_path_factory, tiny_omni) -> Path:
    """A directory with the tiny thinker's tokenizer and processor and the 7B thinker's config.json: what the
    recipe's checks and memory plan read (no weights are read before submit)."""
    d = tmp_path_factory.mktemp("omni-7b") / "Qwen2.5-Omni-7B-thinker"
    d.mkdir()
    for f in tiny_omni.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tiny_omni / "config.json").read_text())
    cfg["text_config"].update(TEXT_7B)
    cfg["audio_config"].update(AUDIO_7B)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_the_memory_plan_counts_the_audio_tower_and_fits(omni_7b):
    from relax_hpc.recipe import load_recipe
    from relax_hpc.recipe import memory_plan as M

    r = load_recipe(RECIPE, [f"model.path={omni_7b}"])
    config = json.loads((omni_7b / "config.json").read_text())
    assert round(M.audio_tower_params(config) / 1e9, 2) == 0.64
    plan, problems = M.plan(r, config)
    assert problems == [], problems
    params = [t for c in plan.cards for p in c.phases for t in p.terms if t.what == "params" and t.role == "actor"]
    assert params and "the audio tower's 0.64B" in params[0].note, params
    peak = plan.peak()
    assert peak is not None and peak[1].total < 80, plan.table()


@pytest.mark.slurm
def test_the_recipe_passes_a_dry_run_on_an_8_gpu_cluster(gpu_slurm_cluster, omni_7b, tmp_path):
    ann, audio = avqa_files(tmp_path / "avqa")
    data = tmp_path / "avqa" / "avqa.jsonl"
    assert prepare("avqa", str(ann), str(data), "--audio-dir", str(audio)).returncode == 0
    p = subprocess.run([str(REPO / ".venv" / "bin" / "relax-submit"), "--dry-run", str(RECIPE),
                        f"model.path={omni_7b}", f"data.path={data}", "slurm.partition=debug",
                        f"run.runs_root={tmp_path / 'runs'}"],
                       capture_output=True, text=True, env=gpu_slurm_cluster, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "#SBATCH --gpus-per-node=8" in out and "nothing submitted" in out and out.count("#SBATCH --nodes=1") == 1
    sruns = [x for x in out.splitlines() if x.startswith("srun ")]
    steps = ["relax_hpc.roles.actor", "relax_hpc.roles.rollout", "relax_hpc.roles.engine", "relax_hpc.roles.engine"]
    assert [next(s for s in steps if s in x) for x in sruns] == steps, sruns
    assert all("--overlap" in x and "--gres=gpu:4" in x for x in sruns[2:]), sruns
    assert not list((tmp_path / "runs").glob("*")), "a dry run creates nothing"
