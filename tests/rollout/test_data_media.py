"""A dataset is untrusted input: the files its rows name (only under the data file's directory and
``data.media_roots``), URLs (only with ``data.allow_media_urls``), the pixel budgets (per image and per prompt, judged
from the headers), and the length the images give a prompt (``rollout.max_prompt_len`` and what ``train.max_seq_len``
leaves). Each bad row fails its own sample, naming the row and the path or the budget, never a file's contents; the
other rows go on."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


from relax_hpc.launch.files import check_files
from relax_hpc.recipe import recipe_from_dict
from relax_hpc.rollout.config import DataConfig, RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, prompt_room
from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.sample import SampleStatus

IMAGE_PAD = 9  # make-tiny-model's <|image_pad|>
KEYS = DataKeys(input_key="prompt", label_key=None, image_key="images")
CANARY = "CANARY-2b7e-contents-of-a-secret"


def png(w: int, h: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), 1 if mode == "1" else (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def error(s) -> str:
    assert s.status is SampleStatus.FAILED and s.loss_mask == [0] and s.multimodal_inputs is None, s
    return s.metadata["image_error"]


def test_a_row_naming_a_file_outside_its_dataset_fails_with_the_path_only(tmp_path, tiny_vlm, caplog):
    ds_dir, secret = tmp_path / "ds", tmp_path / "secret"
    ds_dir.mkdir()
    secret.mkdir()
    (secret / "x.png").write_text(CANARY)  # not an image: the old message quoted its first 8 bytes
    (secret / "real.png").write_bytes(png(56, 56))
    os.symlink(secret / "x.png", ds_dir / "link.png")
    (ds_dir / "ok.png").write_bytes(png(56, 56))
    jsonl(ds_dir / "d.jsonl", [
        {"prompt": "<image>", "images": "ok.png"},  # line 1
        {"prompt": "<image>", "images": "/etc/shadow"},  # line 2
        {"prompt": "<image>", "images": "../secret/x.png"},  # line 3
        {"prompt": "<image>", "images": "link.png"},  # line 4: a symlink leading out
        {"prompt": "<image>", "images": {"bytes": None, "path": str(secret / "real.png")}},  # line 5
    ])
    caplog.set_level(logging.INFO)
    ds = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
    assert ds[0].status is SampleStatus.PENDING and ds[0].tokens.count(IMAGE_PAD) == 4
    for line, path in ((2, "/etc/shadow"), (3, "../secret/x.png"), (4, "link.png"), (5, str(secret / "real.png"))):
        err = error(ds[line - 1])
        assert f"d.jsonl: line {line}: key 'images'" in err and f"{path!r}" in err, err
        assert f"outside the dataset's directory {ds_dir}" in err and "Fix: move the file" in err, err
    assert CANARY not in caplog.text and "root:" not in caplog.text
    # data.media_roots opens a directory: its image is read, and a file there that is no image still is not quoted
    rooted = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, media_roots=[str(secret)])
    assert rooted[4].status is SampleStatus.PENDING and rooted[4].tokens.count(IMAGE_PAD) == 4
    for i in (2, 3):
        err = error(rooted[i])
        assert f"not an image PIL can read ({len(CANARY)} bytes" in err and CANARY[:8] not in err, err
    assert "outside" in error(rooted[1])  # /etc is still not a root
    assert CANARY[:8] not in caplog.text


class _Png(BaseHTTPRequestHandler):
    def do_GET(self):
        body = png(56, 56)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_urls_are_read_only_when_the_recipe_allows(tmp_path, tiny_vlm):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Png)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
        jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>", "images": url},
                                     {"prompt": "<image>", "images": "file:///etc/passwd"}])
        ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
        assert "URLs are not fetched. Fix: set data.allow_media_urls: true" in error(ds[0])
        allowed = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, allow_media_urls=True)
        assert allowed[0].status is SampleStatus.PENDING and allowed[0].tokens.count(IMAGE_PAD) == 4
        assert "a file:// URL" in error(allowed[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_62_megapixel_png_fails_its_sample_with_the_budget(tmp_path, tiny_vlm):
    (tmp_path / "big.png").write_bytes(png(7900, 7900, mode="1"))  # 62.4 Mpx in ~23 kB
    (tmp_path / "mid.png").write_bytes(png(200, 200))  # 40,000 pixels: over the processor's 112²
    (tmp_path / "a.png").write_bytes(png(56, 56))  # 3,136 pixels, 4 tokens
    jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>", "images": "big.png"},
                                 {"prompt": "<image>", "images": "mid.png"},
                                 {"prompt": "<image><image>", "images": ["a.png", "a.png"]}])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
    err = error(ds[0])
    assert "line 1: key 'images' (data.multimodal_keys.image): image 0 ('big.png'): 7900×7900 = 62410000 pixels, " \
           "over the 12544 pixels an image may have (data.max_image_pixels; null: the model processor's " \
           "max_pixels). Fix: a smaller image, or raise data.max_image_pixels" in err, err
    assert "over the 12544 pixels" in error(ds[1])
    assert ds[2].tokens.count(IMAGE_PAD) == 8
    # the budgets are the recipe's to raise or lower: per image, and per prompt (the sum, before decoding the next)
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, max_image_pixels=50_000)
    assert "over the 50000 pixels an image may have (data.max_image_pixels)" in error(ds[0])
    assert ds[1].status is SampleStatus.PENDING and ds[1].tokens.count(IMAGE_PAD) == 16  # the processor shrinks it
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, max_prompt_pixels=5_000)
    assert "image 1 ('a.png'): 56×56: the row's images come to 6272 pixels with it, over the 5000 pixels a prompt's " \
           "images may have (data.max_prompt_pixels). Fix: fewer or smaller images" in error(ds[2])


def test_a_vision_row_longer_than_the_trainer_takes_fails_alone_naming_its_row(tmp_path, tiny_vlm):
    """The vision quickstart's lengths (train.max_seq_len 48, one response token): a row of 4 images of 112×112 is
    64 image tokens, more than the sample may have; it failed the run at the trainer ("a sample has 80 tokens")."""
    (tmp_path / "a.png").write_bytes(png(56, 56))
    (tmp_path / "big.png").write_bytes(png(112, 112))  # 16 tokens
    jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>colour?", "images": "a.png"},
                                 {"prompt": "<image><image><image><image>colours?", "images": ["big.png"] * 4},
                                 {"prompt": "<image>colour?", "images": "a.png"}])
    room = prompt_room(RolloutConfig(max_response_len=1), 48, multiturn=False)
    assert room == 47
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, prompt_room=room)
    err = error(ds[1])
    assert "d.jsonl: line 2: " in err and "(64 of them the images'), more than the 47 a sample's prompt may have " \
           "to fit train.max_seq_len with its response" in err, err
    assert len(ds[1].tokens) <= 48  # what reaches the trainer: the unexpanded prompt and one masked token
    src = RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2)
    assert [[s.status for s in g] for g in src.get_samples()] == \
        [[SampleStatus.PENDING] * 2, [SampleStatus.FAILED] * 2, [SampleStatus.PENDING] * 2]
    # rollout.max_prompt_len counts the image tokens too (the row is short until its images are expanded)
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, max_prompt_len=30)
    assert ds.num_filtered == 0 and ds[0].status is SampleStatus.PENDING
    assert "tokens (64 of them the images'), more than rollout.max_prompt_len = 30" in error(ds[1])


def test_prompt_room():
    assert prompt_room(RolloutConfig(max_response_len=16), 48, multiturn=False) == 32
    assert prompt_room(RolloutConfig(max_response_len=16, max_context_len=40), 48, multiturn=True) == 39
    assert prompt_room(RolloutConfig(max_response_len=64), 48, multiturn=True) == 47
    assert prompt_room(RolloutConfig(custom_generate_function_path="m.f"), 48, multiturn=False) == 47


def test_the_new_keys_are_checked(tmp_path):
    def problems(**kw):
        return {k: m for k, _, m in check_data(DataConfig(multimodal_keys={"image": "images"}, **kw),
                                                 RolloutConfig())}

    assert problems(media_roots=["imgs"], allow_media_urls=True, max_image_pixels=10, max_prompt_pixels=10) == {}
    assert "must be 1 to 64000000 pixels" in problems(max_image_pixels=0)["data.max_image_pixels"]
    assert "must be 1 to 64000000" in problems(max_image_pixels=10 ** 9)["data.max_image_pixels"]
    assert "at least 1 pixel" in problems(max_prompt_pixels=0)["data.max_prompt_pixels"]
    assert "list of directories" in problems(media_roots=[""])["data.media_roots"]
    # without an image column they would do nothing: refused
    plain = {k for k, _, _ in check_data(DataConfig(media_roots=["imgs"], allow_media_urls=True,
                                                      max_image_pixels=10, max_prompt_pixels=10), RolloutConfig())}
    assert plain == {"data.media_roots", "data.allow_media_urls", "data.max_image_pixels", "data.max_prompt_pixels"}
    (tmp_path / "imgs").mkdir()
    found = {k: (v, m) for k, v, m in check_files(recipe_from_dict(
        {"data": {"multimodal_keys": {"image": "images"}, "media_roots": ["imgs", "nope"]}}), tmp_path)}
    assert list(found) == ["data.media_roots[1]"] and "is not a directory" in found["data.media_roots[1]"][1]


def test_base64_and_data_urls_stay_allowed(tmp_path, tiny_vlm):
    b64 = base64.b64encode(png(56, 56)).decode()
    jsonl(tmp_path / "d.jsonl", [{"prompt": "<image><image>", "images": [b64, "data:image/png;base64," + b64]}])
    s = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)[0]
    assert s.status is SampleStatus.PENDING and s.tokens.count(IMAGE_PAD) == 8
